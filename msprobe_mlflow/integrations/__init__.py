"""Callbacks for the trainers most users run (optional extras: ``pip install "msprobe-mlflow[lightning]"`` or
``[transformers]``): one line in the trainer's callbacks, the run of the trainer's own MLflow logging. This module
imports neither trainer."""
from __future__ import annotations

import dataclasses
import functools
import inspect
import threading
from typing import TYPE_CHECKING

from msprobe_mlflow.config import DEFAULT_BOUNDS, GradProbeConfig, load_config
from msprobe_mlflow.metrics import NORM_BEFORE_CLIPPING, norm_before_clipping_key
from msprobe_mlflow.records import StepRecord
from msprobe_mlflow.vocabulary import RECORDED_TAG, run_dump_folder

if TYPE_CHECKING:
    import torch

    from msprobe_mlflow.monitoring.options import MonitorOptions


def checked_callback_config(config, options: "MonitorOptions | None", keywords: dict,
                            source: str) -> tuple[GradProbeConfig | None, "MonitorOptions"]:
    """The callback's ``config`` loaded, and the monitor's options made and checked, when the callback is made: a
    mistake found at ``on_train_begin`` would come after the trainer opened its MLflow run, leaving an empty one."""
    from msprobe_mlflow.pytorch.monitor import GradientMonitor  # torch: the callbacks' own dependency

    loaded = None if config is None else load_config(config)
    monitor = GradientMonitor(callback_config(loaded, None, source), options=options, **keywords)  # opens no run
    return loaded, monitor.options


def callback_config(config, run_id: str | None, source: str) -> GradProbeConfig:
    """The callback's ``config`` (as :class:`GradProbeConfig` takes it), or autolog's default: L1, bounds
    ``[-1, 0, 1]``, dump in ``./msprobe_dump/{run_id}``."""
    if config is not None:
        return load_config(config)
    return GradProbeConfig(dump_path=run_dump_folder("msprobe_dump", run_id), bounds=DEFAULT_BOUNDS,
                           source=source)


class NormsBeforeClipping:
    """Logs each probed step's ``total_norm_before_clipping`` into the monitor's run, beside its ``total_norm``: a
    trainer that clips by norm leaves the recorded (applied) gradients' norm flat at the clip value, so that chart
    alone would not show the training's gradient norm.

    While the trainer trains (:meth:`watch` ... :meth:`close`), ``clipped_by.clip_grad_norm_`` is wrapped: the
    function the trainer itself calls (``torch.nn.utils`` for Lightning, ``accelerate.Accelerator`` for Trainer),
    whatever it clips with underneath (accelerate called ``torch.nn.utils.clip_grad_norm_`` up to 1.15,
    ``get_total_norm`` from 1.16). The norm it returns for the monitored model's parameters is the norm before
    clipping (Trainer logs it as ``grad_norm``). It is kept as a tensor, so the training thread never waits for the
    device, and read here, a sink of the monitor, when its step's record reaches the writer thread; it goes to MLflow
    only (the dump keeps msprobe's files). The first one logged carries ``tag``, the run's
    :data:`~msprobe_mlflow.vocabulary.RECORDED_TAG` that announces it: a run where none was logged is never tagged so,
    and :meth:`close` warns. ``clips_inside_step``: the trainer clips inside ``optimizer.step(closure)``
    (Lightning), after the monitor counted the step, not before ``step()`` (Trainer).
    """

    def __init__(self, clips_inside_step: bool, clipped_by, tag: str):
        self.clips_inside_step, self.clipped_by, self.tag = clips_inside_step, clipped_by, tag
        self.monitor = None
        self._run = None
        self._norms: dict[int, "torch.Tensor | float"] = {}
        self._lock = threading.Lock()  # noted on the training thread, read on the writer thread
        self._undo = None
        self._expected = self._tagged = False  # a probed step was due in MLflow; the tag went with a norm

    def watch(self, monitor, model: "torch.nn.Module") -> None:
        """From now on, notes the norms ``clipped_by.clip_grad_norm_`` returns for ``model``'s parameters for
        ``monitor``'s run (nothing without one)."""
        import torch

        self.monitor = monitor
        self._run = monitor.run_sink
        if self._run is None or self._undo is not None:
            return
        watched = {id(p) for p in model.parameters()}
        owner, original = self.clipped_by, self.clipped_by.clip_grad_norm_
        signature = inspect.signature(original)  # a method's ``self`` included: ``parameters`` found by name

        @functools.wraps(original)
        def clip_grad_norm_(*args, **kwargs):
            call = signature.bind(*args, **kwargs)
            parameters = call.arguments["parameters"]
            parameters = call.arguments["parameters"] = (
                [parameters] if isinstance(parameters, torch.Tensor) else list(parameters))
            norm = original(*call.args, **call.kwargs)
            # not FSDP2's DTensor norm: reading it would be a collective on the writer thread; DeepSpeed: a float
            if (type(norm) is torch.Tensor or isinstance(norm, float)) and any(id(p) in watched for p in parameters):
                self._note(norm)
            return norm

        def undo():
            if owner.clip_grad_norm_ is clip_grad_norm_:  # another wrapper on top stays, and calls ours
                owner.clip_grad_norm_ = original

        owner.clip_grad_norm_, self._undo = clip_grad_norm_, undo

    def _note(self, norm: "torch.Tensor | float") -> None:
        step = self.monitor.step - 1 if self.clips_inside_step else self.monitor.step
        if self.monitor.config.wants_step(step):
            with self._lock:
                self._norms[step] = norm.detach() if hasattr(norm, "detach") else norm

    def handle(self, record: StepRecord) -> None:
        with self._lock:
            norm = self._norms.pop(record.step, None)
            for step in [s for s in self._norms if s < record.step]:  # clipped, but not probed (a failed probe)
                del self._norms[step]
        if self._run is None or record.step % self.monitor.tracking.log_every_n_steps:
            return
        self._expected = True
        if norm is not None:
            tags = {} if self._tagged else {RECORDED_TAG: self.tag}  # in the same batch as the metric
            self._run.annotate(step=record.step, metrics={norm_before_clipping_key(record.rank): float(norm)},
                               tags=tags)
            self._tagged = True

    def flush(self) -> None:
        pass

    def close(self) -> None:
        """Gives ``clip_grad_norm_`` back (the monitor's ``stop()`` calls it); warns when no norm was logged."""
        if self._undo is not None:
            self._undo()
            self._undo = None
        if self._expected and not self._tagged:
            where = getattr(self.clipped_by, "__qualname__", self.clipped_by.__name__)
            self.monitor.notices.warn(f"{NORM_BEFORE_CLIPPING} was not logged (nor announced in the run's tag): no "
                                      f"{where}.clip_grad_norm_ call returned a norm for the model's parameters")


def with_sink(options: "MonitorOptions", sink) -> "MonitorOptions":
    """The monitor's ``options`` with ``sink`` added to the user's ``sinks`` (None: as they are)."""
    return options if sink is None else dataclasses.replace(options, sinks=(*options.sinks, sink))
