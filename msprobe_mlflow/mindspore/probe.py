"""The device side of the MindSpore monitor: statistics written into preallocated ``Parameter`` buffers from
inside the optimizer's ``construct``, so the same code runs in PyNative, in GRAPH_MODE and under ``@jit``.

Why not msprobe's ways: a forward pre-hook is compiled into any graph that calls the optimizer (a
``TrainOneStepCell`` in GRAPH_MODE, a ``@jit`` train step), where a hook with side effects fails to compile
("Graph cycle exists") and a hook with host code cannot compile at all; ``TensorDump`` does not run on CPU and
needs a reader process. Instead :func:`install_probe` gives the optimizer a subclass whose ``construct`` first
calls a :class:`GradientProbe`, then the optimizer's own ``construct``. The probe writes the statistics (and the
step they belong to) into its buffers with ``assign``, which works eagerly and compiled; the host reads them
after the step (:meth:`GradientProbe.read`). Nothing is registered on the optimizer: its ``parameters_dict()``
and checkpoints are unchanged.
"""
from __future__ import annotations

import itertools
import math
from typing import Callable

import numpy as np
import mindspore as ms
from mindspore import Parameter, mint, nn, ops

from msprobe_mlflow.mindspore.statistics import (float32_values, gradient_statistics, pack_signs, parameter_norms,
                                                 prepare_extra, propagate_nan)
from msprobe_mlflow.layout import StatisticsLayout
from msprobe_mlflow.notices import Notices
from msprobe_mlflow.statistics_table import float32_bounds

_LAST_STEP = np.iinfo(np.int32).max
_probe_numbers = itertools.count()
_probed_classes: dict[type, type] = {}


class GradientProbe(nn.Cell):
    """Writes one optimizer step's statistics into Parameter buffers when the step is wanted.

    ``selected`` says, per gradient of the optimizer's gradient tuple (``shapes`` are all of theirs), whether it
    is monitored. A step is wanted when the probe is active, ``rank_wanted`` and the step (counted by
    ``steps_run`` from ``first_step``) is in ``steps`` (empty: every step). After a wanted step, ``probed_step``
    holds its number and the buffers its statistics, sized and laid out by ``layout``: ``statistics`` (float64,
    with the opt-in ``extra`` statistics' section), ``signs`` (packed directions, L1/L2), ``float32_values`` (L0,
    for MD5), given the optimizer's ``weights`` (its parameters, ``statistics=["param_norm"]``) the monitored
    ones' own norms before its update, and given ``loss_scale`` (a loss scaler's ``scale_value``, with exponent
    counts) its value at the optimizer's call: the scale the gradients were unscaled from. The construct is
    compiled (``@jit``) even in PyNative, so both modes run the same kernels.

    The always-on tier: with ``directions_every`` N other than 1, the signs are computed only at steps that are
    multiples of N (none when 0) or up to ``armed_until`` (set from the host by :meth:`arm`), and ``signs_step``
    says which step they belong to; the decision is made in the graph, so it costs no synchronisation.
    """

    def __init__(self, selected: list[bool], shapes: list[tuple[int, ...]], *, level: "str | Level", bounds,
                 steps: tuple[int, ...], rank_wanted: bool, first_step: int = 0, notices: Notices | None = None,
                 directions_every: int = 1, extra: tuple[str, ...] = (), weights: tuple = (),
                 loss_scale: Parameter | None = None):
        super().__init__(auto_prefix=False)
        self.settings = probe_settings(selected, shapes, level=level, bounds=bounds, steps=steps,
                                       rank_wanted=rank_wanted, directions_every=directions_every, extra=extra,
                                       with_parameter_norms=bool(weights), loss_scale=loss_scale)
        tag = f"msprobe_mlflow_{next(_probe_numbers)}"
        numels = [math.prod(shape) for shape, wanted in zip(shapes, selected) if wanted]
        self.layout = StatisticsLayout(level, bounds, numels, extra=extra)
        self.extra = prepare_extra(self.layout.extra)
        self.selected = tuple(bool(s) for s in selected)
        self.has_md5 = self.layout.level.has_md5
        self.has_directions = self.layout.level.has_directions
        self.has_buckets = self.layout.level.has_buckets
        self.has_exponents = self.layout.level.has_exponents
        self.bounds32 = float32_bounds(bounds)
        self.rank_wanted = bool(rank_wanted)
        self.has_parameters = self.layout.count > 0
        self.has_values = sum(numels) > 0
        self.has_step_filter = bool(steps)
        reachable = [s for s in steps if s <= _LAST_STEP]  # the int32 counter never reaches the others
        self.wanted_steps = ms.Tensor(np.array(reachable or [-1], dtype=np.int32))

        def buffer(name, length, dtype):  # at least one element: a Parameter cannot be empty
            return Parameter(ms.Tensor(np.zeros(max(length, 1), dtype=dtype)), name=f"{tag}.{name}",
                             requires_grad=False)

        self.statistics = buffer("statistics", self.layout.statistics_length, np.float64)
        self.signs = buffer("signs", self.layout.signs_length, np.uint8)
        self.float32_values = buffer("float32_values", self.layout.values_length, np.float32)
        self.with_parameter_norms = bool(weights)
        self.weights = ms.ParameterTuple(weights)  # the optimizer's, as it holds the network's: read, never written
        self.parameter_norms = buffer("parameter_norms", self.layout.count if weights else 0, np.float64)
        self.with_loss_scale = loss_scale is not None and self.has_exponents  # what the format losses read
        self.scales = ms.ParameterTuple((loss_scale,) if self.with_loss_scale else ())  # read, never written
        self.loss_scale = buffer("loss_scale", 1, np.float32)
        self.first_step = first_step
        self.steps_run = Parameter(ms.Tensor(np.array(first_step, dtype=np.int32)), name=f"{tag}.steps_run",
                                   requires_grad=False)
        self.probed_step = Parameter(ms.Tensor(np.array(-1, dtype=np.int32)), name=f"{tag}.probed_step",
                                     requires_grad=False)
        self.active = Parameter(ms.Tensor(True), name=f"{tag}.active", requires_grad=False)
        self.directions_every = directions_every
        self.armed_until = Parameter(ms.Tensor(np.array(-1, dtype=np.int32)), name=f"{tag}.armed_until",
                                     requires_grad=False)
        self.signs_step = Parameter(ms.Tensor(np.array(-1, dtype=np.int32)), name=f"{tag}.signs_step",
                                    requires_grad=False)
        self.notices = notices or Notices()

    @ms.jit
    def construct(self, gradients):
        step = self.steps_run * 1
        if self.rank_wanted:
            wanted = self.active
            if self.has_step_filter:
                wanted = mint.logical_and(wanted, mint.any(mint.eq(self.wanted_steps, step)))
            if wanted:
                self._write(gradients, step)
                ops.assign(self.probed_step, step)
        ops.assign_add(self.steps_run, ms.Tensor(1, ms.int32))
        return step

    def _write(self, gradients, step):
        if self.has_parameters:
            ops.assign(self.statistics, gradient_statistics(gradients, self.selected, self.has_buckets,
                                                            self.bounds32, self.extra, self.has_exponents))
            if self.with_parameter_norms:
                ops.assign(self.parameter_norms, parameter_norms(self.weights, self.selected))
            if self.with_loss_scale:
                ops.assign(self.loss_scale, ops.reshape(self.scales[0], (1,)).astype(ms.float32))
            if self.has_values:
                if self.has_md5:
                    ops.assign(self.float32_values, float32_values(gradients, self.selected))
                if self.has_directions and self._signs_wanted(step):
                    ops.assign(self.signs, pack_signs(gradients, self.selected))
                    ops.assign(self.signs_step, step)
        return True

    def _signs_wanted(self, step):
        if self.directions_every == 1:
            return True
        scheduled = step % self.directions_every == 0 if self.directions_every else step < 0
        return mint.logical_or(scheduled, step <= self.armed_until)

    def __call__(self, gradients):
        """Runs only when called eagerly (graphs inline ``construct``): a failing probe must not fail the step."""
        try:
            return super().__call__(gradients)
        except Exception as e:
            self.notices.failure("probe", f"the gradient probe failed ({e!r})")
            return None

    def check_compiles(self, dtypes) -> None:
        """Compiles and runs the statistics once on a small tensor of each gradient dtype, so that an op the device
        cannot run fails here, where the monitor can refuse to start, not inside the training graph."""
        samples = tuple(ms.Tensor(np.linspace(-2.0, 2.0, 9), dtype) for dtype in dict.fromkeys(dtypes))
        if samples:
            _statistics_graph(ms.mutable(samples), (True,) * len(samples), self.has_buckets, self.bounds32,
                              self.extra, self.has_exponents)
            if self.with_parameter_norms:
                _parameter_norms_graph(ms.mutable(samples), (True,) * len(samples))

    def made_with_loss_scale(self, loss_scale: Parameter | None) -> bool:
        """Whether this probe was made with ``loss_scale`` (None: without one); :func:`probe_settings` keeps its
        identity last."""
        return self.settings[-1] == (None if loss_scale is None else id(loss_scale))

    def read_progress(self) -> tuple[int, int]:
        """``(steps_run, probed_step)`` as the last finished step left them."""
        return int(self.steps_run.asnumpy()), int(self.probed_step.asnumpy())

    def read(self, step: int) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None, np.ndarray | None,
                                       float | None]:
        """Copies of the buffers (the next step overwrites them) after probed step ``step``: statistics, signs
        (L1/L2, when computed at that step), float32 values (L0), the parameters' norms and the loss scale (when
        recorded)."""
        layout = self.layout
        statistics = propagate_nan(np.array(self.statistics.asnumpy()[:layout.statistics_length]), layout)
        signs = None
        if self.has_directions and (self.directions_every == 1 or int(self.signs_step.asnumpy()) == step):
            signs = np.array(self.signs.asnumpy()[:layout.signs_length])
        values = np.array(self.float32_values.asnumpy()[:layout.values_length]) if self.has_md5 else None
        norms = np.array(self.parameter_norms.asnumpy()[:layout.count]) if self.with_parameter_norms else None
        scale = float(self.loss_scale.asnumpy()[0]) if self.with_loss_scale else None
        return statistics, signs, values, norms, scale

    def arm(self, until: int) -> None:
        """Signs at every step up to ``until`` (the always-on tier's trigger window), from the next step run.
        ``assign``, not ``set_data``: the probe's compiled graph did not see a value given by ``set_data`` here."""
        ops.assign(self.armed_until, ms.Tensor(np.array(min(until, _LAST_STEP), dtype=np.int32)))

    def deactivate(self) -> None:
        """Graphs compiled with the probe keep calling it; inactive, it only counts steps."""
        self.active.set_data(ms.Tensor(False))

    def restart(self, first_step: int, notices: Notices) -> None:
        """Makes a deactivated probe count from ``first_step`` again, active: the graphs compiled with it (a
        ``Model`` trained again in GRAPH_MODE) then feed the monitor that restarts it."""
        self.first_step = first_step
        # assign, not set_data: a compiled graph keeps reading the Parameter's own memory
        ops.assign(self.steps_run, ms.Tensor(first_step, ms.int32))
        ops.assign(self.probed_step, ms.Tensor(-1, ms.int32))
        ops.assign(self.active, ms.Tensor(True))
        self.notices = notices


def probe_settings(selected, shapes, *, level: "str | Level", bounds, steps, rank_wanted: bool,
                   directions_every: int = 1, extra=(), with_parameter_norms: bool = False,
                   loss_scale: Parameter | None = None) -> tuple:
    """What a compiled graph keeps of a probe as constants (and the loss scale Parameter it reads, by identity): a
    stopped probe with equal settings can be restarted instead of making a new one, which graphs compiled before
    would never call."""
    return (tuple(bool(s) for s in selected), tuple(tuple(shape) for shape in shapes), level, float32_bounds(bounds),
            tuple(steps), bool(rank_wanted), directions_every, tuple(extra), bool(with_parameter_norms),
            None if loss_scale is None else id(loss_scale))


@ms.jit
def _statistics_graph(grads, selected, has_buckets, bounds32, extra=(), has_exponents=False):
    return (gradient_statistics(grads, selected, has_buckets, bounds32, extra, has_exponents),
            pack_signs(grads, selected),
            float32_values(grads, selected))


@ms.jit
def _parameter_norms_graph(parameters, selected):
    return parameter_norms(parameters, selected)


def _probed_class(base: type) -> type:
    """``base`` with a ``construct`` that runs the probe first, and a ``__call__`` that tells the monitor when
    the optimizer was called directly (eagerly, or as a graph of its own), so no extra user call is needed then."""
    if base not in _probed_classes:
        def construct(self, gradients):
            self.msprobe_mlflow_probe(gradients)
            return self.msprobe_mlflow_base_construct(gradients)

        if getattr(base.construct, "__wrapped_by_jit__", False):
            # A @jit construct (nn.Adam's) compiles ``self.construct``: make that graph ours, or the probe ran twice.
            construct = ms.jit(construct)

        def __call__(self, *args, **kwargs):
            output = base.__call__(self, *args, **kwargs)
            self.msprobe_mlflow_after_call()
            return output

        _probed_classes[base] = type(base.__name__, (base,), {
            "construct": construct, "__call__": __call__, "msprobe_mlflow_base_construct": base.construct,
            "__module__": base.__module__, "__qualname__": base.__qualname__, "msprobe_mlflow_base": base})
    return _probed_classes[base]


def install_probe(optimizer: nn.Cell, probe: GradientProbe, after_call: Callable[[], None]) -> None:
    """Makes ``optimizer`` run ``probe`` on its gradients at every step; ``after_call`` runs after each direct
    ``optimizer(grads)`` from Python."""
    object.__setattr__(optimizer, "msprobe_mlflow_probe", probe)
    object.__setattr__(optimizer, "msprobe_mlflow_after_call", after_call)
    optimizer.__class__ = _probed_class(type(optimizer))


def remove_probe(optimizer: nn.Cell) -> None:
    """Gives ``optimizer`` its own class back. Graphs already compiled keep the (deactivated) probe."""
    base = getattr(type(optimizer), "msprobe_mlflow_base", None)
    if base is not None:
        optimizer.__class__ = base
    object.__setattr__(optimizer, "msprobe_mlflow_after_call", lambda: None)


def installed_probe(optimizer: nn.Cell) -> GradientProbe | None:
    return getattr(optimizer, "msprobe_mlflow_probe", None) if hasattr(type(optimizer), "msprobe_mlflow_base") else None
