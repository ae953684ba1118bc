"""The MindSpore gradient monitor: the same config, dump and MLflow run as the PyTorch monitor, in PyNative, in
GRAPH_MODE and under ``@mindspore.jit``.

The optimizer computes each probed step's statistics into buffers (:mod:`msprobe_mlflow.mindspore.probe`); the
monitor reads them after the step and hands them to the shared :class:`ProbeSession` (local dump, MLflow). When the
optimizer is called directly from Python (PyNative, or ``optimizer(grads)`` in GRAPH_MODE) that happens by itself.
When it runs inside a compiled graph (a ``TrainOneStepCell`` in GRAPH_MODE, a ``@jit`` train step), Python sees
the whole step only when the graph returns: call ``monitor.collect()`` after each train step (``stop()`` and
interpreter exit collect the last one), or train with ``Model.train`` and ``GradProbeCallback``, which does.
Unlike msprobe 1.0.3 there is no ``TensorDump`` and no reader process, the step and rank filters work in graph
mode, and the monitor never hangs at exit, with or without ``stop()``.
"""
from __future__ import annotations

import atexit
import functools
import os
import weakref

import mindspore as ms
from mindspore import Parameter, nn

from msprobe_mlflow.config import GradProbeConfig
from msprobe_mlflow.mindspore.compute_format import compute_format, step_format
from msprobe_mlflow.mindspore.distributed import current_rank, shared_run_id, summary_all_gather, world_size
from msprobe_mlflow.mindspore.operator_trace import graph_mode_message
from msprobe_mlflow.mindspore.operator_traces import install_boundary, mindspore_traced_steps, remove_boundary
from msprobe_mlflow.monitoring.traced_steps import TracedSteps
from msprobe_mlflow.mindspore.probe import (GradientProbe, install_probe, installed_probe, probe_settings,
                                           remove_probe)
from msprobe_mlflow.monitoring.options import MonitorOptions
from msprobe_mlflow.monitoring.session_monitor import SessionMonitor
from msprobe_mlflow.records import record_from_statistics, with_loss_scale, with_parameter_norms
from msprobe_mlflow.session import RankPolicy

IDLE_COLLECTIONS_BEFORE_WARNING = 3
# optimizer id -> the monitor probing it, so two monitors never probe one optimizer by accident.
_monitored_optimizers: dict[int, "GradientMonitor"] = {}


class GradientMonitor(SessionMonitor):
    """Probes the gradients an optimizer receives at each of its steps, writes msprobe's dump and logs into MLflow.

    ``options`` (or their keywords): :class:`~msprobe_mlflow.MonitorOptions`. Under ``msrun``
    (``mindspore.communication``), every rank logs into rank 0's run (call ``monitor()`` on every rank). Use as
    ``GradientMonitor(config).monitor(optimizer)`` ... ``stop()``, or as a context manager; in graph mode add
    ``monitor.collect()`` after each train step (``Model.train``: use
    :class:`~msprobe_mlflow.mindspore.callback.GradProbeCallback` instead). ``step`` is the number of optimizer
    steps counted so far (as of the last collection).
    """

    def __init__(self, config: GradProbeConfig | str | os.PathLike | dict, *, options: MonitorOptions | None = None,
                 **keywords):
        super().__init__(config, options=options, **keywords)
        self.config = self.config.for_framework("mindspore")
        if self.config.checksum != "md5":  # the device checksum exists on the PyTorch path only
            raise ValueError(f"{self.config.source}: checksum = {self.config.checksum!r} is not accepted by the "
                             f"MindSpore monitor; expected md5 (mix64 is computed by the PyTorch monitor only)")
        self._optimizer: nn.Cell | None = None
        self._probe: GradientProbe | None = None
        self._names: list[str] = []
        self._shapes: list[tuple[int, ...]] = []
        self._last_probed_step = -1
        self._lost_steps = 0
        self._first_step = 0
        self._idle_collections = 0
        self._exit_hook_registered = False
        self._armed_until = -1
        self._compute_format: str | None = None
        self._traces: TracedSteps | None = None  # trace_steps (PyNative): armed after each optimizer call
        self._trace_errors: list[str] = []  # of traces closed (stop(), another optimizer)

    def monitor(self, optimizer: nn.Cell, network: nn.Cell | None = None, *,
                traced_network: nn.Cell | None = None, loss_scaler=None) -> "GradientMonitor":
        """Starts probing the gradients ``optimizer`` receives, from its next step on.

        Call it after ``mindspore.communication.init()`` (the rank is read here), on every rank: under ``msrun``
        every rank logs into rank 0's run (rank 0's run ID is broadcast here, a collective). Calling it with another
        optimizer re-targets the monitor; the step counter goes on. ``network``: the cell whose gradients the
        optimizer receives (``GradProbeCallback`` gives ``Model.train``'s), whose mixed precision then goes into the
        format each step records (:mod:`msprobe_mlflow.mindspore.compute_format`). ``traced_network``: the cell
        whose cells name the entries of the operator traces (``trace_steps``, PyNative), ``network`` when not given
        (without either, the traces hold the API calls, outside any cell). ``loss_scaler``: the
        ``mindspore.amp`` loss scaler (``DynamicLossScaler``, ``StaticLossScaler``) whose ``unscale`` gives the
        optimizer its gradients; the probe reads its scale at each step, in the graph too, so that the format
        losses count the gradients at the scale they were computed at (``statistics=["exponents"]``).
        """
        _refuse_non_optimizer(optimizer)
        scale = _scale_of(loss_scaler)
        if optimizer is self._optimizer:
            if not self._probe.made_with_loss_scale(scale):
                self.notices.warn("monitor() was called again for the optimizer it probes, with another loss_scaler: "
                                  "the probe keeps the one it was given; call stop(), then monitor() with the new one")
            return self
        self._refuse_monitored_elsewhere(optimizer)
        self._detach()
        if self._session is None or self._session.closed:  # first: a bad dump_path fails before the optimizer changes
            self._session = self._open_session("mindspore", RankPolicy.of(self.config, current_rank(), world_size()),
                                               shared_run_id, summary_all_gather)
        ranks = self._session.ranks
        plan = self.options.trace.plan()
        parameters = list(optimizer.parameters)
        selected = [(i, p) for i, p in enumerate(parameters) if self.config.wants_param(p.name)]
        missing = set(self.config.param_list) - {p.name for p in parameters}
        if missing:  # warned here, not in a helper: the warning names the caller's monitor() line
            self.notices.warn(f"grad_probe.param_list names parameters the optimizer does not have: {sorted(missing)}")
        if (held := float(getattr(optimizer, "loss_scale", 1.0))) != 1.0:  # nn.Optimizer(loss_scale=...)
            self.notices.warn(f"the optimizer divides the gradients it receives by its loss_scale = {held:g} itself "
                              f"(Model's FixedLossScaleManager): the recorded gradients, which are what it receives "
                              f"(as msprobe records them), are {held:g} times the loss's gradients, and so are "
                              f"their statistics and their format losses (read at scale 1: as they are held); "
                              f"compare this run with runs of the same loss scale")
        if scale is not None and not self.recorded_level.has_exponents:
            self.notices.warn("loss_scaler is read for the format losses, which need statistics=['exponents']: "
                              "not read in this run")
        self._names = [p.name for _, p in selected]
        self._shapes = [tuple(p.shape) for _, p in selected]
        self._compute_format = self._format_of(parameters, network)
        probe = self._probe_for(optimizer, parameters, [p.dtype for _, p in selected], ranks, scale)
        if probe is None:
            return self
        self._attach(optimizer, probe, plan, traced_network if traced_network is not None else network)
        return self

    def _probe_for(self, optimizer: nn.Cell, parameters: list, dtypes: list, ranks: RankPolicy,
                   scale) -> "GradientProbe | None":
        """The probe for ``optimizer``: the one a stopped monitor left on it where the settings are the same (graphs
        compiled with it, a Model trained again, feed this monitor too), else a new one; None where it does not
        compile (said as a probe failure: the optimizer stays untouched)."""
        wanted, shapes, settings = self._probe_settings(parameters, ranks)
        stopped_probe = getattr(optimizer, "msprobe_mlflow_probe", None)
        if stopped_probe is not None and stopped_probe.settings == probe_settings(
                wanted, shapes, with_parameter_norms=self.options.parameter_norms, loss_scale=scale, **settings):
            stopped_probe.restart(self.step, self.notices)
            return stopped_probe
        if stopped_probe is not None:
            self.notices.warn("this optimizer was monitored before with other settings; graphs compiled then (a "
                              "TrainOneStepCell in GRAPH_MODE, a @jit train step) keep that stopped probe and do "
                              "not feed this monitor: build the training cell or jit function again")
        probe = GradientProbe(wanted, shapes, first_step=self.step, notices=self.notices,
                              weights=tuple(parameters) if self.options.parameter_norms else (),
                              loss_scale=scale, **settings)
        try:
            probe.check_compiles(dtypes)
        except Exception as e:  # observability must never break training: the optimizer stays untouched
            self.notices.failure("compile", f"the gradient probe does not compile for this optimizer ({e!r}); "
                                            f"gradients are not monitored")
            return None
        return probe

    def _refuse_monitored_elsewhere(self, optimizer: nn.Cell) -> None:
        """Two monitors probing one optimizer would each count the other's steps: refused before anything changes."""
        other = _monitored_optimizers.get(id(optimizer))
        if other is not None and other is not self:
            raise ValueError("this optimizer is already monitored by another GradientMonitor; call its stop() first")
        if installed_probe(optimizer) is not None:
            raise ValueError("this optimizer is already probed (by a monitor that was never stopped)")

    def _format_of(self, parameters, network: nn.Cell | None) -> str | None:
        """The format the steps compute in, from every parameter's dtype (one left out of param_list computes in the
        same step) and ``network``'s mixed precision; None where it cannot be told."""
        try:
            return compute_format([p.dtype for p in parameters], network)
        except Exception as e:  # observability must never break training: the steps record no format
            self.notices.log(f"the format this training computes in is not known ({e!r})")
            return None

    def _probe_settings(self, parameters, ranks) -> tuple[list[bool], list[tuple[int, ...]], dict]:
        """Which of the optimizer's parameters are probed, their shapes, and the probe's other settings: a stopped
        probe with the same ones is restarted instead of replaced."""
        wanted, shapes = [self.config.wants_param(p.name) for p in parameters], [tuple(p.shape) for p in parameters]
        settings = dict(level=self.recorded_level, bounds=self.config.bounds, steps=self.config.step,
                        rank_wanted=ranks.probes, directions_every=self.config.directions_every_n_steps,
                        extra=self.options.gradient_statistics)
        return wanted, shapes, settings

    def _attach(self, optimizer: nn.Cell, probe: GradientProbe, plan, traced_network: nn.Cell | None) -> None:
        """Installs ``probe`` in ``optimizer``, counting on from the monitor's step; the exit hook is registered
        once, after MindSpore's own, so that it runs before MindSpore shuts down."""
        self._probe = probe
        self._optimizer = optimizer
        self._armed_until = -1  # the new probe is armed at its first collection
        self._last_probed_step = self.step - 1
        self._first_step, self._idle_collections = self.step, 0
        _monitored_optimizers[id(optimizer)] = self
        install_probe(optimizer, probe, self._after_optimizer_call if plan.steps else self.collect)
        if plan.steps:
            self._start_traces(plan, optimizer, traced_network)
        if not self._exit_hook_registered:
            atexit.register(_stop_at_exit, weakref.ref(self))
            self._exit_hook_registered = True

    def _start_traces(self, plan, optimizer: nn.Cell, network: nn.Cell | None) -> None:
        """``trace_steps`` in PyNative: each traced step's forward and backward, up to its optimizer call."""
        if ms.get_context("mode") != ms.PYNATIVE_MODE:
            self.notices.warn(f"trace_steps (and MSPROBE_MLFLOW_TRACE_STEPS): {graph_mode_message()}")
            return
        if not self._session.ranks.probes:
            return
        self._traces = mindspore_traced_steps(plan, network, self.config.dump_path, self._session.ranks.rank,
                                              self.notices, self.trace_written)
        install_boundary(optimizer, self._traces.finish)  # the step's gradients are final: its trace ends
        self._traces.arm(self.step)

    def _after_optimizer_call(self) -> None:
        """The update is done (PyNative: the optimizer returned to Python): the step is collected, and the next
        step's trace starts here if it is traced."""
        self.collect()
        if self._traces is not None:
            self._traces.arm(self.step)

    @property
    def errors(self) -> list[str]:
        """Trace failures, then what the writer thread and the sinks could not do."""
        return self._trace_errors + (self._traces.errors if self._traces else []) + super().errors

    def collect(self) -> None:
        """Writes the last optimizer step's statistics if that step was probed; a no-op when nothing new ran.

        Needed once after each train step only when the optimizer runs inside a compiled graph; a probed step that
        a later step overwrote before this call is lost (counted, and warned about once).
        """
        probe = self._probe
        if probe is None:
            return
        try:
            steps_run, probed_step = probe.read_progress()
            if probed_step > self._last_probed_step:
                statistics, signs, values, norms, scale = probe.read(probed_step)
                self._session.submit(functools.partial(
                    _record, norms, self._compute_format, scale, rank=self._session.ranks.rank, step=probed_step,
                    level=self.recorded_level, bounds=self.config.bounds, names=self._names, shapes=self._shapes,
                    statistics=statistics, signs=signs, float32_values=values, directions=signs is not None,
                    extra=self.options.gradient_statistics))
            armed_until = self.directions_schedule.armed_until(steps_run)
            if armed_until != self._armed_until:  # a trigger the writer thread found: the probe's next steps
                probe.arm(armed_until)
                self._armed_until = armed_until
            self._count_lost_steps(steps_run, probed_step)
            self._warn_if_never_run(steps_run)
            self._last_probed_step = max(self._last_probed_step, probed_step)
            self.step = steps_run
        except Exception as e:  # observability must never break training
            self.notices.failure("collect", f"collecting the gradient statistics of step {self.step} failed ({e!r})")

    def _count_lost_steps(self, steps_run: int, probed_step: int) -> None:
        """Steps between the last collection and this one that were wanted but are not the one in the buffers."""
        if not self._session.ranks.probes or steps_run <= self.step:
            return
        new_steps = range(self.step, steps_run)
        wanted = len(new_steps) if not self.config.step else sum(s in new_steps for s in set(self.config.step))
        lost = wanted - (1 if probed_step in new_steps else 0)
        if lost > 0:
            self._lost_steps += lost
            message = (f"{lost} probed step(s) between steps {self.step} and {steps_run - 1} were overwritten before "
                       f"they were collected; when the optimizer runs inside a compiled graph, call "
                       f"monitor.collect() after each train step")
            if self._lost_steps == lost:
                self.notices.warn(message)
            else:
                self.notices.log(message)

    def _warn_if_never_run(self, steps_run: int) -> None:
        """A graph compiled before ``monitor()`` keeps running the optimizer without the probe: say so once."""
        if steps_run != self._first_step:
            return
        self._idle_collections += 1
        if self._idle_collections == IDLE_COLLECTIONS_BEFORE_WARNING:
            self.notices.warn(f"collect() ran {IDLE_COLLECTIONS_BEFORE_WARNING} times and the monitored "
                          f"optimizer has not run a step with the probe; a graph compiled before monitor() (a "
                          f"TrainOneStepCell that already ran, a jit function already called) runs it without the "
                          f"probe: call monitor() before the first train step")

    @property
    def lost_steps(self) -> int:
        """Probed steps overwritten before they were collected (graph mode without ``collect()`` each step)."""
        return self._lost_steps

    def flush(self) -> None:
        """Collects the last step, then waits until every probed step is on disk and delivered by every sink."""
        self.collect()
        super().flush()

    def _detach(self) -> None:
        """Collects the last step, then gives the optimizer its own class back."""
        if self._optimizer is None:
            return
        self.collect()
        if self._traces is not None:
            self._traces.close()
            remove_boundary(self._optimizer)
            self._trace_errors += self._traces.errors
            self._traces = None
        self._probe.deactivate()
        remove_probe(self._optimizer)
        if _monitored_optimizers.get(id(self._optimizer)) is self:
            del _monitored_optimizers[id(self._optimizer)]
        self._optimizer = self._probe = None

    def stop(self) -> None:
        """Collects the last step, unpatches the optimizer, writes what is pending and stops the writer thread.
        Safe to call twice. Graphs compiled while monitored keep an inactive probe that only counts steps, until a
        monitor with the same settings monitors this optimizer again and restarts it."""
        self._detach()
        if self._session:
            self._session.close()


def _refuse_non_optimizer(optimizer) -> None:
    """Only a MindSpore optimizer (a Cell with ``parameters``) has the steps the probe counts."""
    if not isinstance(optimizer, nn.Cell) or not hasattr(optimizer, "parameters"):
        raise TypeError(f"monitor() takes a MindSpore optimizer (mindspore.nn.Optimizer, mindspore.mint.optim), "
                        f"got {type(optimizer).__name__}")


def _stop_at_exit(monitor_ref: "weakref.ref[GradientMonitor]") -> None:
    monitor = monitor_ref()
    if monitor is not None:
        monitor.stop()


class PrecisionDebugger:
    """Drop-in for ``msprobe.mindspore.PrecisionDebugger(config_path).monitor(optimizer)`` (task ``grad_probe``).

    ``step()`` (msprobe's per-step call) collects the last step: the one line graph mode needs. Each instance
    uses its own config; a second debugger on the same optimizer is refused, not silently ignored.
    """

    def __init__(self, config_path: str | os.PathLike, **overrides):
        self.monitor_ = GradientMonitor(GradProbeConfig.from_json(config_path, **overrides))
        self.config = self.monitor_.config

    def monitor(self, optimizer: nn.Cell) -> GradientMonitor:
        return self.monitor_.monitor(optimizer)

    def step(self) -> None:
        self.monitor_.collect()

    def stop(self) -> None:
        self.monitor_.stop()


def _record(parameter_norms, found_format: str | None, loss_scale: float | None, **statistics):
    """The step's record (on the writer thread), with the parameters' norms and the loss scale where the probe
    recorded them, and the format its step computed in (``found_format`` unless its gradients show a 16-bit format:
    ``step_format``)."""
    record = record_from_statistics(**statistics)
    if parameter_norms is not None:
        record = with_parameter_norms(record, parameter_norms)
    if loss_scale is not None:
        record = with_loss_scale(record, loss_scale)
    return step_format(record, found_format)


def _scale_of(loss_scaler) -> Parameter | None:
    """The ``scale_value`` Parameter of a ``mindspore.amp`` loss scaler (None: none given); anything else refused,
    naming what is accepted."""
    if loss_scaler is None:
        return None
    scale = getattr(loss_scaler, "scale_value", None)
    if not isinstance(scale, Parameter) or scale.size != 1:
        raise TypeError(f"loss_scaler = {loss_scaler!r} is not accepted; expected a mindspore.amp loss scaler "
                        f"(DynamicLossScaler, StaticLossScaler), whose one-element scale_value the probe reads")
    return scale
