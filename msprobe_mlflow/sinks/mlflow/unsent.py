"""What the live MLflow sink could not send while training ran (steps, distributions over the ranks, findings),
kept for one more try at ``close()``; what still fails is named in the run's tags and a warning."""
from __future__ import annotations

import threading

from msprobe_mlflow.dump import findings_dir, step_ranges
from msprobe_mlflow.tracking.live_run import LiveRun, MetricPoint
from msprobe_mlflow.vocabulary import TAG_RANGES_LIMIT, UNSENT_DISTRIBUTION_STEPS_TAG, unsent_steps_tag


class Unsent:
    def __init__(self):
        self.steps: set[int] = set()
        self.gathered: list[MetricPoint] = []  # rank 0: the distributions over the ranks whose round failed
        self._gathered_lock = threading.Lock()  # it grows on the writer thread too (a full queue)
        self.annotations: list = []

    def take_gathered(self) -> list[MetricPoint]:
        with self._gathered_lock:
            taken, self.gathered = self.gathered, []
        return taken

    def keep_gathered(self, metrics: list[MetricPoint]) -> None:
        with self._gathered_lock:
            self.gathered += metrics

    def send_leftovers(self, run: LiveRun, attempt, rounds, drain, dump_path: str, rank: int, options, notices) -> None:
        """At ``close()``: the unsent steps (as ``upload`` sends them), the distributions over the ranks and the
        findings, once more."""
        if self.steps and not drain.over():
            steps = set(self.steps)
            if attempt("send the unsent steps", lambda: run.upload(
                    dump_path, rank, steps, options.param_metrics, options.mlflow_step_offset)):
                self.steps.clear()
        gathered = self.take_gathered()
        if gathered and (drain.over() or not attempt("send the distributions over the ranks",
                                                     lambda: run.log(gathered))):
            self.gathered = gathered
            steps = step_ranges({m.step - options.mlflow_step_offset for m in gathered}, limit=TAG_RANGES_LIMIT)
            attempt("name the steps whose distributions over the ranks are unsent",
                    lambda: run.set_tag(UNSENT_DISTRIBUTION_STEPS_TAG, steps))
            notices.warn(f"rank 0: the distributions over the ranks of steps {steps} are not in MLflow run "
                         f"{run.run_id} (tag {UNSENT_DISTRIBUTION_STEPS_TAG}); every rank's values are in its "
                         f"local dump: where one folder holds every rank's dump (a shared file system), "
                         f"msprobe-mlflow upload {dump_path} --run-id {run.run_id} completes them")
        if self.steps:
            attempt("name the unsent steps", lambda: run.set_tag(
                unsent_steps_tag(rank), step_ranges(self.steps, limit=TAG_RANGES_LIMIT)))
            notices.warn(f"rank {rank}: {len(self.steps)} step(s) are in the local dump but not in MLflow run "
                         f"{run.run_id} (tag {unsent_steps_tag(rank)}); complete it with: "
                         f"msprobe-mlflow upload {dump_path} --run-id {run.run_id}")
        if self.annotations:
            annotations, self.annotations = self.annotations, []
            if not attempt("send the live findings", lambda: rounds.send([], annotations)):
                self.annotations = annotations
                notices.warn(f"rank {rank}: the live findings (live verdict, anomaly flags) of MLflow run "
                             f"{run.run_id} could not all be sent; they are in the local dump, in "
                             f"{findings_dir(dump_path, rank)}; send them with: "
                             f"msprobe-mlflow upload {dump_path} --run-id {run.run_id}")
