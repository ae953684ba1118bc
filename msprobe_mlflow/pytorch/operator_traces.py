"""The monitor's operator traces (``trace_steps``): the trace of step S starts after the optimizer step before it
(or at ``monitor()``), so it holds S's forward and backward and nothing of the optimizer's update, and stops when S's
gradients are final (S's optimizer step, or its closure's return), before the probe reads them. A thread of its own
writes it into ``{dump_path}/rank{R}/trace/step{S}/rank{R}/`` (msprobe's layout, under the rank folder so that it
moves with it) and hands the files to the run. A failure is counted and reported, never raised into training."""
from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch

from msprobe_mlflow.dump import rank_dir
from msprobe_mlflow.notices import Notices
from msprobe_mlflow.torch_kernels.operator_replay import save_call
from msprobe_mlflow.torch_kernels.operator_trace import OperatorTracer
from msprobe_mlflow.trace.files import write_trace
from msprobe_mlflow.trace.options import TracePlan
from msprobe_mlflow.vocabulary import TRACE_FOLDER

def trace_root(dump_path: str, rank: int) -> Path:
    """The folder ``locate`` takes: ``step{S}/rank{R}/`` below it."""
    return rank_dir(dump_path, rank) / TRACE_FOLDER


class TracedSteps:
    def __init__(self, plan: TracePlan, model: torch.nn.Module, dump_path: str, rank: int, notices: Notices,
                 on_written: Callable[[int, list[Path]], None]):
        self.plan, self.model, self.rank, self.notices = plan, model, rank, notices
        self.root = trace_root(dump_path, rank)
        self.on_written = on_written
        self.errors: list[str] = []
        self._tracer: OperatorTracer | None = None
        self._step: int | None = None
        self._writers: list[threading.Thread] = []

    @property
    def tracing(self) -> bool:
        return self._tracer is not None

    def request(self, step: int) -> None:
        """Adds ``step`` to the plan (from any thread: the live verdict's, after a suspicious step)."""
        self.plan = replace(self.plan, steps=self.plan.steps | {step})

    def arm(self, step: int) -> None:
        """Starts tracing when ``step`` is one of the plan's (its forward comes next)."""
        if step not in self.plan.steps or self._tracer is not None:
            return
        try:
            tracer = OperatorTracer(self.model, level=self.plan.level, api_list=self.plan.api_list,
                                    scope=self.plan.scope, save=self.plan.save)
            tracer.start()
            self._tracer, self._step = tracer, step
        except Exception as error:
            self._fail(step, error)

    def finish(self) -> None:
        """Stops the trace (the step's gradients are final) and writes it on a thread of its own."""
        tracer, step, self._tracer = self._tracer, self._step, None
        if tracer is None:
            return
        try:
            build = tracer.stop()  # the one device-to-host copy
        except Exception as error:
            self._fail(step, error)
            return
        writer = threading.Thread(target=self._write, args=(step, build, tracer.saved), name="msprobe-mlflow-trace",
                                  daemon=True)
        writer.start()
        self._writers.append(writer)

    def _write(self, step: int, build, saved: dict) -> None:
        try:
            folder = self.root / f"step{step}" / f"rank{self.rank}"
            write_trace(folder, build(), level=self.plan.level, framework="pytorch")
            for name, (args, kwargs, output) in saved.items():
                save_call(folder, name, args, kwargs, output)
            missing = sorted(set(self.plan.save) - set(saved))
            if missing:
                self.notices.warn(f"step {step} made no call named {', '.join(missing)}: nothing saved for it "
                                  f"(names as locate prints them, in this training's trace)")
            self.on_written(step, sorted(p for p in folder.rglob("*") if p.is_file()))
        except Exception as error:
            self._fail(step, error)

    def _fail(self, step: int, error: Exception) -> None:
        self.errors.append(f"tracing step {step} failed: {error!r}")
        self.notices.failure("trace", f"tracing step {step} failed ({error!r}); training goes on untraced")

    def close(self) -> None:
        """Ends an unfinished trace (training stopped before the step's optimizer step) and waits for the writes."""
        if self._tracer is not None:
            step = self._step
            self._tracer.stop()
            self._tracer = None
            self.notices.warn(f"the trace of step {step} was not written: monitoring stopped before that step's "
                              f"optimizer step")
        for writer in self._writers:
            writer.join()
        self._writers = []
