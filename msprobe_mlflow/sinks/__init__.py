"""Where probed steps go after the local dump: the sink protocol, and the one place sinks are chosen.

A sink is any object with ``handle(record)``, ``flush()`` and ``close()`` (the shape of accelerate's trackers and
Lightning's loggers). The session calls ``handle`` on its writer thread once the step is in the local dump (the
source of truth), so a sink may read the dump, and a slow or failing sink costs no data: each owns its queueing
policy, and its exceptions are counted in the monitor's ``errors``. To add an output (TensorBoard, W&B, a CSV),
write one module here with the sink and add one line to :func:`choose_sinks`.

Sinks that find things (``baseline``: the live verdict; ``anomalies``: anomaly flags) keep them in the local dump
and add them to the MLflow run through its sink's ``annotate(step=, metrics=, tags=, files=)``
(:class:`~msprobe_mlflow.session.RunNotes`), so a run has one client and one rate limit. They come before the MLflow
sink in the list: flushed and closed first, what they annotate last is still sent. The MLflow sink is also the
session's ``run_sink`` (:class:`~msprobe_mlflow.session.RunSink`: told how the training ended, asked for the run
and its failed ranks).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Protocol, runtime_checkable

from msprobe_mlflow.config import GradProbeConfig
from msprobe_mlflow.records import StepRecord
from msprobe_mlflow.session import RankPolicy, RunSink

if TYPE_CHECKING:
    from msprobe_mlflow.tracking.aggregate import SummaryGather
    from msprobe_mlflow.anomaly_rule import SpikeRule
    from msprobe_mlflow.formats import LossyFormat
    from msprobe_mlflow.sinks.baseline import BaselineOptions
    from msprobe_mlflow.sinks.mlflow import MlflowSink


@runtime_checkable
class StepSink(Protocol):
    def handle(self, record: StepRecord) -> None:
        """Takes one step (on the writer thread, after the local dump holds it); must not block for long."""

    def flush(self) -> None:
        """Returns once what was handed in is delivered (or known undeliverable and remembered)."""

    def close(self) -> None:
        """Delivers what is pending and releases everything; called once, at the end of monitoring."""


def choose_sinks(config: GradProbeConfig, ranks: RankPolicy, *, framework: str, tracking=None,
                 share_run_id: Callable[[str | None], str | None] = lambda run_id: run_id,
                 metrics_file: bool = False, notices=None, baseline: "BaselineOptions | None" = None,
                 spike_rule: "SpikeRule | None" = None, lossy: "LossyFormat | None" = None,
                 summary_gather: "Callable[[], SummaryGather] | None" = None
                 ) -> tuple[list[StepSink], RunSink | None]:
    """The sinks of a monitor: the live verdict against ``baseline``, the anomaly flags (``spike_rule``; the
    ``lossy`` format watch with them), MLflow
    when ``tracking`` options are given and a run is found (``share_run_id`` is a collective under distributed
    training: every rank calls this; so is ``summary_gather``, the framework's all-gather for rank-0 aggregated
    metrics, see ``tracking.aggregate``), the JSON-lines metrics file if asked; with the MLflow sink on its own
    (None: no run), the session's ``run_sink``."""
    sinks: list[StepSink] = []
    run: MlflowSink | None = None
    if tracking is not None:
        from msprobe_mlflow.sinks.mlflow import open_mlflow_sink

        run = open_mlflow_sink(config, ranks, tracking, framework=framework, share_run_id=share_run_id,
                               notices=notices, summary_gather=summary_gather)
    if baseline is not None and ranks.probes:
        from msprobe_mlflow.sinks.baseline_process import BaselineSink

        sinks.append(BaselineSink(baseline, config, ranks.rank, run=run, notices=notices,
                                  describe_run=ranks.world_size == 1))
    if spike_rule is not None and ranks.probes:
        from msprobe_mlflow.sinks.anomalies import AnomalySink

        sinks.append(AnomalySink(spike_rule, config.dump_path, ranks.rank, run=run, notices=notices,
                                 several_ranks=ranks.world_size > 1, lossy=lossy))
    if run is not None:
        sinks.append(run)
    if metrics_file and ranks.probes:
        from msprobe_mlflow.sinks.jsonl import JsonLinesMetricsSink

        sinks.append(JsonLinesMetricsSink(config.dump_path, tracking.param_metrics if tracking else ()))
    return sinks, run
