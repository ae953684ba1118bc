"""The live MLflow sink: each probed step's metrics and files, sent from a thread of its own.

One job per module: ``sender`` (the thread, its queue and rate), ``rounds`` (what a round sends, archives),
``attempts`` (a failed request said once; refused credentials), ``unsent`` (what is retried at ``close()``),
``ranks`` (the ranks' statuses at the end), ``pictures`` (the exponent pictures while training runs); the MLflow
requests are ``tracking.live_run``'s.

Policy when MLflow is slower than training or unreachable: the local dump is always complete (it is written
before the sink sees a step). The sink's queue holds each step's few summary metrics, at most ``max_pending``
steps; it sends at most one round a second, draining everything queued at once (one ``log_batch`` for many
steps); a step that does not fit in the queue or whose request failed is remembered as unsent, and ``close()``
sends the unsent steps with the same idempotent code as ``msprobe-mlflow upload``. What still cannot be sent is
named in a warning with the command that completes it.

Other sinks add their findings (the live verdict, anomaly flags) to the same run through :meth:`MlflowSink.annotate`:
metrics, tags and files of the dump, queued and sent in the worker's next round with the steps, so there is one
client and one rate limit per run; findings whose round failed are retried once at ``close()`` and otherwise stay
in the local dump.

``stop()`` drains for at most ``MSPROBE_MLFLOW_DRAIN_SECONDS`` (300 s): a server that cannot take a large job's
backlog in time does not hold the job's exit. What is left stays in the local dump, the run's tag
``msprobe_mlflow.rank{R}.unsent_steps`` names those steps (``0-9,12``) beside the status ``incomplete``, and
``msprobe-mlflow upload`` sends them later (and marks the rank finished).

``archive_every_n_steps`` K > 1: a rank's files go up as one ``steps_{ranges}.zip`` per K sent steps (the last
one at ``stop()``), which the readers of a run expand (``dump.extract_steps_archive``); their metrics still go up
each round.

Rank-0 aggregation (:mod:`msprobe_mlflow.tracking.aggregate`, given a ``gather`` collective): each summary metric's
distribution over the ranks goes up in rank 0's requests (``grad/ranks/total_norm median``...); each rank still
sends its files and per-parameter metrics. Distributions whose round failed go again in rank 0's next round; the
steps of those still unsent at ``stop()`` are named in the run's tag ``msprobe_mlflow.unsent_distribution_steps``
(every rank's values are in its local dump, which ``upload`` reads).
Rank 0 also tags every rank's status, at the start and at ``stop()`` (an end-of-run exchange), so the other ranks
send no request of their own for the run's bookkeeping, nor a ``rank{R}.dump_path`` tag: each rank's dump is at
the run's ``dump_path`` on its node.

Credentials are checked when the sink starts: the first request (the run's tags) is awaited for up to
``MSPROBE_MLFLOW_START_CHECK_SECONDS`` (10 s), and a 401/403 answer gives one warning at ``monitor()`` naming the
tracking URI and ``MLFLOW_TRACKING_USERNAME``/``MLFLOW_TRACKING_PASSWORD``; the sink then sends nothing more and
training goes on with the local dump only.
"""
from __future__ import annotations

import atexit
from pathlib import Path
from typing import Callable

from msprobe_mlflow.config import GradProbeConfig
from msprobe_mlflow.dump import summary_csv_path
from msprobe_mlflow.metrics import record_metrics
from msprobe_mlflow.notices import Notices
from msprobe_mlflow.records import StepRecord
from msprobe_mlflow.session import RankPolicy
from msprobe_mlflow.sinks.mlflow import settings
from msprobe_mlflow.sinks.mlflow.attempts import Attempts
from msprobe_mlflow.sinks.mlflow.items import Annotation, Drain, QueuedStep
from msprobe_mlflow.sinks.mlflow.pictures import PicturesWhileTraining
from msprobe_mlflow.sinks.mlflow.ranks import RankEnds
from msprobe_mlflow.sinks.mlflow.rounds import Rounds
from msprobe_mlflow.sinks.mlflow.sender import SendLoop
from msprobe_mlflow.sinks.mlflow.unsent import Unsent
from msprobe_mlflow.tracking.aggregate import RankZeroMetrics, SummaryGather, aggregation_wanted
from msprobe_mlflow.tracking.live_run import LiveRun, end_active_run_failed, metric_points
from msprobe_mlflow.tracking.request_process import RoundRequests
from msprobe_mlflow.tracking.options import TrackingOptions
from msprobe_mlflow.vocabulary import RANK_FAILURES


def open_mlflow_sink(config: GradProbeConfig, ranks: RankPolicy, options: TrackingOptions, *, framework: str,
                     share_run_id: Callable[[str | None], str | None], notices: Notices | None = None,
                     summary_gather: Callable[[], SummaryGather] | None = None) -> "MlflowSink | None":
    """The MLflow sink of this rank (None when no run is found, or this rank does not log).
    ``share_run_id`` turns this process's run ID into rank 0's: a collective, so every rank calls this.
    ``summary_gather`` makes the framework's all-gather (a collective too); it is called when aggregation is on:
    ``options.aggregate_metrics``, and every rank probes (a rank filter leaves ranks out of the collective)."""
    run_id = share_run_id(options.local_run_id())
    if not run_id or not ranks.probes:
        return None
    gather = None
    if summary_gather is not None and not ranks.wanted and aggregation_wanted(options.aggregate_metrics,
                                                                              ranks.world_size):
        gather = summary_gather()
    return MlflowSink(run_id, config, options, ranks, framework=framework, notices=notices, gather=gather)


class MlflowSink:
    """Logs one rank's steps into one run (see the module docstring for the policy): the sink protocol and
    ``session.RunSink`` over its parts, and rank-0 aggregation of the summary metrics, a collective every rank
    takes part in."""

    def __init__(self, run_id: str, config: GradProbeConfig, options: TrackingOptions, ranks: RankPolicy, *,
                 framework: str, notices: Notices | None = None, max_pending: int = 10_000,
                 gather: SummaryGather | None = None):
        self.run_id, self.config, self.options, self.rank = run_id, config, options, ranks.rank
        self.owns_run = ranks.owns_run
        self.notices = notices or Notices()
        self.aggregation = RankZeroMetrics(gather, self.rank) if gather is not None else None
        self.run = LiveRun(run_id, options.tracking_uri)
        self.attempt = Attempts(run_id, self.run.tracking_uri, self.rank, config.dump_path, self.notices)
        self.unsent, drain = Unsent(), Drain()
        self.requests = RoundRequests(self.run, self.notices)
        self.rounds = Rounds(self.requests, config.dump_path, self.rank, options, drain, self.unsent)
        self.ends = RankEnds(self.run, ranks, self.attempt, self.notices)
        self.pictures = PicturesWhileTraining(self.requests, config.dump_path, self.rank,
                                              options.mlflow_step_offset, self.notices)
        self.sender = SendLoop(self.rank, max_pending, self.rounds, self.unsent, self.attempt, drain,
                               self.pictures.between_rounds if self.owns_run else None)
        self._drain, self._closed = drain, False
        every_rank = self.aggregation is not None  # rank 0 tags every rank; the others send nothing here
        self.sender.start(lambda: None if every_rank and not ranks.owns_run else self.run.describe(
            config, ranks, framework, every_rank))
        self.sender.started.wait(settings.START_CHECK_SECONDS)
        self.attempt.tell_refusal()

    @property
    def failed_ranks(self) -> dict[int, str]:
        """At close: the ranks known to have failed or been killed."""
        return self.ends.failed_ranks

    def handle(self, record: StepRecord) -> None:
        if record.step % self.options.log_every_n_steps:
            return
        # Where fast steps moved the requests to a process of their own, it reads the step's metrics from the local
        # dump (written before the sink sees a step), as upload does: this thread shares the interpreter lock with
        # training, and the metrics of 512 parameters cost it 0.3-0.6 ms a step. Aggregation needs them here, and
        # a step the local dump could not write is computed here, or its round's request would fail.
        in_dump = self.aggregation is None and self.requests.process is not None and \
            summary_csv_path(self.config.dump_path, self.rank, record.step).is_file()
        metrics = {} if in_dump else record_metrics(record, self.options.param_metrics)
        others, failure = {}, None
        self.pictures.counted |= record.exponent_counts is not None
        if self.aggregation is not None:  # before the refusal check: every rank must take part in the collective
            try:
                metrics, others = self.aggregation.exchange(record.step, metrics)
            except Exception as e:  # every rank sees it (an all-gather): each sends its own metrics from now on
                self.aggregation, failure = None, e
        if not self.attempt.refused:
            at = self.options.mlflow_step_offset  # MLflow step = training step + at
            item = QueuedStep(record.step, metric_points(metrics, record.step + at),
                              [m for step, values in others.items() for m in metric_points(values, step + at)],
                              in_dump)
            if not self.sender.put(item):
                self.unsent.steps.add(record.step)
                self.unsent.keep_gathered(item.gathered)
        if failure is not None:
            raise RuntimeError(f"rank {self.rank}: the rank-0 aggregation of summary metrics failed at step "
                               f"{record.step}; from now on each rank sends its own metrics") from failure

    def annotate(self, *, step: int = 0, metrics: dict[str, float] | None = None, tags: dict[str, str] | None = None,
                 files=()) -> None:
        """Queues findings for the next round (see :class:`Annotation`); callable from any thread, never waits."""
        if self.attempt.refused:
            return
        annotation = Annotation(step, dict(metrics or {}), dict(tags or {}), tuple(Path(f) for f in files))
        if not self.sender.alive():
            self.notices.log(f"rank {self.rank}: findings handed in after the MLflow sink closed stay in the local "
                             f"dump only: {sorted(annotation.tags) or sorted(annotation.metrics)}")
        elif not self.sender.put(annotation):
            self.unsent.annotations.append(annotation)

    def flush(self) -> None:
        """Waits until the steps handed in so far are sent, or remembered as unsent."""
        self.sender.flush()

    def close(self) -> None:
        """Sends what is queued, retries the unsent steps once, marks this rank's status (:class:`RankEnds`)."""
        if self._closed:
            return
        self._closed = True
        self.sender.close()
        if not self.attempt.refused:
            self.unsent.send_leftovers(self.run, self.attempt, self.rounds, self._drain, self.config.dump_path,
                                       self.rank, self.options, self.notices)
            if self.owns_run and not (self.unsent.steps or self.attempt.failure or self._drain.over()):
                self._send_exponent_pictures()  # not past stop()'s drain time nor to a server that failed: upload
        self.requests.close()
        self.attempt.tell_refusal()
        self.ends.close(bool(self.unsent.steps or self.attempt.refused), self.aggregation)
        if self.ends.outcome[0] in RANK_FAILURES:
            # the run is ended FAILED, its exception maybe still on its way up: should the run still be the active
            # one at exit, MLflow's exit handler would end it FINISHED; this one, registered later, runs first
            atexit.register(end_active_run_failed, {self.run_id})

    def _send_exponent_pictures(self) -> None:
        """The run owner's exponent pictures, drawn from its local dump once training is over (``tracking/
        exponent_images.py``), where every step went up in time (else ``upload``, which the unsent steps' warning
        names, draws them); a failure is said with the command that draws them later."""
        try:
            self.run.send_exponent_pictures(self.config.dump_path, self.rank, self.options.mlflow_step_offset)
        except Exception as e:
            self.notices.warn(f"rank {self.rank}: the exponent pictures could not be logged into run {self.run_id} "
                              f"({e}); the exponent counts are in the local dump, and `msprobe-mlflow upload "
                              f"{self.config.dump_path} --run-id {self.run_id}` draws them")

    def training_ended(self, status: str, reason: str = "") -> None:
        """How this rank's training ended (``vocabulary.RANK_ENDINGS``), told by the session before ``close()``."""
        self.ends.outcome = (status, reason)

    def process_dies(self, status: str, reason: str) -> None:
        """Says at once that this rank failed or was killed, unless closed; the active run, when it is this one,
        ends FAILED (MLflow's exit handler would end it FINISHED)."""
        if not self._closed:
            self.ends.say_failed(status, reason)
        end_active_run_failed({self.run_id})
