"""The PyTorch monitor's operator traces: :class:`~msprobe_mlflow.monitoring.traced_steps.TracedSteps` with the
dispatch-level tracer, and the calls ``trace_save`` names written beside each trace (which side is wrong)."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from msprobe_mlflow.monitoring.traced_steps import TracedSteps
from msprobe_mlflow.notices import Notices
from msprobe_mlflow.torch_kernels.operator_replay import save_call
from msprobe_mlflow.torch_kernels.operator_trace import OperatorTracer
from msprobe_mlflow.trace.options import TracePlan
from msprobe_mlflow.trace.saved_calls import say_unsaved


def pytorch_traced_steps(plan: TracePlan, model: torch.nn.Module, dump_path: str, rank: int, notices: Notices,
                         on_written: Callable[[int, list[Path]], None]) -> TracedSteps:
    def make_tracer(plan: TracePlan) -> OperatorTracer:
        return OperatorTracer(model, level=plan.level, api_list=plan.api_list, scope=plan.scope, save=plan.save)

    def write_saved_calls(tracer: OperatorTracer, folder: Path, step: int) -> None:
        for name, (args, kwargs, output) in tracer.saved.items():
            save_call(folder, name, args, kwargs, output)
        say_unsaved(notices, step, tracer.save, tracer.saved)

    return TracedSteps(plan, make_tracer, "pytorch", dump_path, rank, notices, on_written, write_saved_calls)
