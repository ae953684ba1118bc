"""What one round of the live MLflow sink sends: the steps' metrics and the findings' metrics and tags in one
batch, then the steps' files, in two requests (directions, then CSVs) or, with ``archive_every_n_steps`` K > 1, as
one archive per K steps.
The requests go through :class:`~msprobe_mlflow.tracking.request_process.RoundRequests`, which the send loop may
move to a process of their own."""
from __future__ import annotations

from msprobe_mlflow.sinks.mlflow import settings
from msprobe_mlflow.sinks.mlflow.items import Annotation, Drain, QueuedStep
from msprobe_mlflow.sinks.mlflow.unsent import Unsent
from msprobe_mlflow.tracking.live_run import DumpSteps, MetricPoint, metric_points
from msprobe_mlflow.tracking.request_process import RoundRequests
from msprobe_mlflow.tracking.upload import STEPS_PER_REQUEST


class Rounds:
    def __init__(self, requests: RoundRequests, dump_path: str, rank: int, options, drain: Drain, unsent: Unsent):
        self.requests, self.dump_path, self.rank, self.options = requests, dump_path, rank, options
        self.drain, self.unsent = drain, unsent
        self.unarchived: list[int] = []  # steps whose metrics were sent and whose files wait for their archive

    def send(self, steps: list[QueuedStep], annotations: list[Annotation] = (),
             retry: list[MetricPoint] = ()) -> None:
        """One round: the steps' metrics (and ``retry``, distributions of failed rounds), then their files."""
        metrics = [*retry, *(m for item in steps for m in (*item.metrics, *item.gathered))]
        metrics += [m for a in annotations for m in metric_points(a.metrics, a.step + self.options.mlflow_step_offset)]
        tags = {key: value for a in annotations for key, value in a.tags.items()}  # the latest value of a key wins
        in_dump = [item.step for item in steps if item.in_dump]
        read = DumpSteps(self.dump_path, self.rank, in_dump, self.options.mlflow_step_offset,
                         self.options.param_metrics) if in_dump else None
        self.requests.log(metrics, tags, read)
        every = self.options.archive_every_n_steps
        if every > 1:
            self.unarchived += [item.step for item in steps]
            while len(self.unarchived) >= every:
                self.send_archive(every)
        else:
            numbers = [item.step for item in steps]
            for first in range(0, len(numbers), STEPS_PER_REQUEST):
                if self.drain.over():
                    raise TimeoutError(f"stop() drained for MSPROBE_MLFLOW_DRAIN_SECONDS = "
                                       f"{settings.DRAIN_SECONDS:g} s")
                self.requests.send_step_files(self.dump_path, self.rank, numbers[first:first + STEPS_PER_REQUEST])
        for path in dict.fromkeys(path for a in annotations for path in a.files):
            self.requests.send_dump_file(self.dump_path, path)

    def send_archive(self, count: int | None = None) -> None:
        """One archive of the first ``count`` (default: all) steps waiting for it; on failure they are unsent."""
        count = count or len(self.unarchived)
        steps, self.unarchived = self.unarchived[:count], self.unarchived[count:]
        try:
            self.requests.send_archive(self.dump_path, self.rank, steps)
        except Exception:
            self.unsent.steps.update(steps)
            raise
