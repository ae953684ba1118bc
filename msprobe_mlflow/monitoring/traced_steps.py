"""A monitor's operator traces (``trace_steps``), for either framework: the trace of step S starts when the
optimizer step before it is done (or at ``monitor()``), so it holds S's forward and backward and nothing of the
update, and stops when S's gradients are final, before the probe reads them (each monitor says when: PyTorch at the
optimizer's step or its closure's return, MindSpore when the optimizer is called). A thread of its own writes it
into ``{dump_path}/rank{R}/trace/step{S}/rank{R}/`` (msprobe's layout, under the rank folder so that it moves with
it) and hands the files to the run. A failure is counted and reported, never raised into training."""
from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path
from typing import Callable, Protocol

from msprobe_mlflow.dump import rank_dir
from msprobe_mlflow.notices import Notices
from msprobe_mlflow.trace.files import OperatorCall, write_trace
from msprobe_mlflow.trace.options import TracePlan
from msprobe_mlflow.vocabulary import TRACE_FOLDER


class Tracer(Protocol):
    def start(self) -> None: ...

    def stop(self) -> Callable[[], list[OperatorCall]]:
        """Puts everything back; the callable builds the calls (after the one device-to-host copy)."""


class TracedSteps:
    """``make_tracer(plan)`` makes the framework's tracer for a step; ``after_write(tracer, folder, step)`` adds what
    it kept beside the trace (PyTorch: the saved calls) on the writer thread; ``on_written(step, files)`` hands the
    files to the run."""

    def __init__(self, plan: TracePlan, make_tracer: Callable[[TracePlan], Tracer], framework: str, dump_path: str,
                 rank: int, notices: Notices, on_written: Callable[[int, list[Path]], None],
                 after_write: Callable[[Tracer, Path, int], None] = lambda tracer, folder, step: None):
        self.plan, self.make_tracer, self.framework, self.rank, self.notices = plan, make_tracer, framework, rank, \
            notices
        self.root = rank_dir(dump_path, rank) / TRACE_FOLDER  # step{S}/rank{R}/ below it
        self.on_written, self.after_write = on_written, after_write
        self.errors: list[str] = []
        self._tracer: Tracer | None = None
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
            tracer = self.make_tracer(self.plan)
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
            build = tracer.stop()  # everything put back, then the one device-to-host copy
        except Exception as error:
            self._fail(step, error)
            return
        writer = threading.Thread(target=self._write, args=(tracer, step, build), name="msprobe-mlflow-trace",
                                  daemon=True)
        writer.start()
        self._writers.append(writer)

    def _write(self, tracer: Tracer, step: int, build) -> None:
        try:
            folder = self.root / f"step{step}" / f"rank{self.rank}"
            write_trace(folder, build(), level=self.plan.level, framework=self.framework)
            self.after_write(tracer, folder, step)
            self.on_written(step, sorted(p for p in folder.rglob("*") if p.is_file()))
        except Exception as error:
            self._fail(step, error)

    def _fail(self, step: int, error: Exception) -> None:
        self.errors.append(f"tracing step {step} failed: {error!r}")
        self.notices.failure("trace", f"tracing step {step} failed ({error!r}); training goes on untraced")

    def close(self) -> None:
        """Ends an unfinished trace (training stopped before the step's optimizer step) and waits for the writes."""
        if self._tracer is not None:
            step, tracer, self._tracer = self._step, self._tracer, None
            try:
                tracer.stop()
            except Exception as error:
                self._fail(step, error)
            self.notices.warn(f"the trace of step {step} was not written: monitoring stopped before that step's "
                              f"optimizer step")
        for writer in self._writers:
            writer.join()
        self._writers = []
