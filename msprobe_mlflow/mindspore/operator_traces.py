"""The MindSpore monitor's operator traces (``trace_steps``, PyNative): :class:`~msprobe_mlflow.monitoring.
traced_steps.TracedSteps` with the API tracer. The trace of step S stops when the optimizer is called for step S,
before the gradient probe and the update run; the optimizer's ``__call__`` from Python is that boundary: in PyNative,
a training loop's ``optimizer(grads)`` and ``Model.train``'s ``TrainOneStepCell`` both make it
(:func:`install_boundary`)."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from mindspore import nn

from msprobe_mlflow.mindspore.operator_trace import MindSporeOperatorTracer
from msprobe_mlflow.monitoring.traced_steps import TracedSteps
from msprobe_mlflow.notices import Notices
from msprobe_mlflow.trace.options import TracePlan

_bounded_classes: dict[type, type] = {}


def mindspore_traced_steps(plan: TracePlan, network: nn.Cell | None, dump_path: str, rank: int, notices: Notices,
                           on_written: Callable[[int, list[Path]], None]) -> TracedSteps:
    def make_tracer(plan: TracePlan) -> MindSporeOperatorTracer:
        return MindSporeOperatorTracer(network, level=plan.level, api_list=plan.api_list, scope=plan.scope)

    def warn_unmeasured(tracer: MindSporeOperatorTracer, folder: Path, step: int) -> None:
        for what, why in tracer.unmeasured.items():
            notices.warn(f"the trace of step {step} has no {what} (this device has no kernel for them: {why}); "
                         f"their dtype and shape are traced")

    return TracedSteps(plan, make_tracer, "mindspore", dump_path, rank, notices, on_written, warn_unmeasured)


def install_boundary(optimizer: nn.Cell, before: Callable[[], None]) -> None:
    """Makes ``optimizer``'s ``__call__`` from Python run ``before`` first (its class becomes a subclass of the one
    it has, which :func:`remove_boundary` gives back). Inside a compiled graph (GRAPH_MODE, ``@jit``) nothing runs."""
    base = type(optimizer)
    if getattr(base, "msprobe_mlflow_unbounded", None) is not None:
        object.__setattr__(optimizer, "msprobe_mlflow_before_call", before)
        return
    if base not in _bounded_classes:
        def __call__(self, *args, **kwargs):
            self.msprobe_mlflow_before_call()
            return base.__call__(self, *args, **kwargs)

        _bounded_classes[base] = type(base.__name__, (base,), {
            "__call__": __call__, "msprobe_mlflow_unbounded": base, "__module__": base.__module__,
            "__qualname__": base.__qualname__})
    object.__setattr__(optimizer, "msprobe_mlflow_before_call", before)
    optimizer.__class__ = _bounded_classes[base]


def remove_boundary(optimizer: nn.Cell) -> None:
    base = getattr(type(optimizer), "msprobe_mlflow_unbounded", None)
    if base is not None:
        optimizer.__class__ = base
    object.__setattr__(optimizer, "msprobe_mlflow_before_call", lambda: None)
