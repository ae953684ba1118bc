"""The MindSpore monitor's operator traces (``trace_steps``, PyNative): :class:`~msprobe_mlflow.monitoring.
traced_steps.TracedSteps` with the API tracer. The trace of step S stops when the optimizer is called for step S,
before the gradient probe and the update run; the optimizer's ``__call__`` from Python is that boundary: in PyNative,
a training loop's ``optimizer(grads)`` and ``Model.train``'s ``TrainOneStepCell`` both make it
(:func:`install_boundary`)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import mindspore as ms
from mindspore import nn

from msprobe_mlflow.mindspore.operator_trace import HostTensor, MindSporeOperatorTracer
from msprobe_mlflow.monitoring.traced_steps import TracedSteps
from msprobe_mlflow.notices import Notices
from msprobe_mlflow.trace.options import TracePlan
from msprobe_mlflow.trace.saved_calls import saved_call_path, say_unsaved, write_saved_call

_bounded_classes: dict[type, type] = {}


def mindspore_traced_steps(plan: TracePlan, network: nn.Cell | None, dump_path: str, rank: int, notices: Notices,
                           on_written: Callable[[int, list[Path]], None]) -> TracedSteps:
    def make_tracer(plan: TracePlan) -> MindSporeOperatorTracer:
        return MindSporeOperatorTracer(network, level=plan.level, api_list=plan.api_list, scope=plan.scope,
                                       save=plan.save)

    def after_write(tracer: MindSporeOperatorTracer, folder: Path, step: int) -> None:
        for what, why in tracer.unmeasured.items():
            notices.warn(f"the trace of step {step} has no {what} (this device has no kernel for them: {why}); "
                         f"their dtype and shape are traced")
        for name, (args, kwargs, output) in tracer.saved.items():
            write_saved_mindspore_call(folder, name, args, kwargs, output)
        say_unsaved(notices, step, tracer.save, tracer.saved)

    return TracedSteps(plan, make_tracer, "mindspore", dump_path, rank, notices, on_written, after_write)


def write_saved_mindspore_call(folder: Path, name: str, args, kwargs, output) -> None:
    """The call as every saved call is (:mod:`msprobe_mlflow.trace.saved_calls`), and beside it msprobe's tensor dump
    of it (``dump.json``, task ``tensor``, the same ``.npy`` files): the API accuracy checker's input, so that
    ``msprobe-mlflow api-check saved/<call>/dump.json`` replays it against PyTorch, forward."""
    call = write_saved_call(folder, name, args, kwargs, output,
                            lambda v: (v.values, v.dtype.lower()) if isinstance(v, HostTensor) else None,
                            lambda v: str(v).lower() if isinstance(v, ms.dtype.Type) else None)
    names = {str(t).lower(): str(t) for t in vars(ms.dtype).values() if isinstance(t, ms.dtype.Type)}

    def entry(value):
        if isinstance(value, list):
            return [entry(v) for v in value]
        if isinstance(value, dict) and "tensor" in value:
            return {"type": "mindspore.Tensor", "dtype": names.get(value["dtype"], value["dtype"]),
                    "shape": value["shape"], "data_name": value["tensor"]}
        if isinstance(value, dict) and "dtype" in value:
            return {"type": "mindspore.dtype", "value": names.get(value["dtype"], value["dtype"])}
        if value is None or isinstance(value, dict):  # an argument that cannot be replayed: the checker says so
            return value
        return {"type": type(value).__name__, "value": value}

    dump = {"task": "tensor", "level": "L1", "framework": "mindspore", "dump_data_dir": ".",
            "data": {name: {"input_args": entry(call["args"]), "input_kwargs": {k: entry(v) for k, v in
                                                                               call["kwargs"].items()},
                            "output": entry(call["output"])}}}
    (saved_call_path(folder, name) / "dump.json").write_text(json.dumps(dump, indent=1), encoding="utf-8")


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
