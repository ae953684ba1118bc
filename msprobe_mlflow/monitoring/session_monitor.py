"""What both framework monitors offer on top of their one :class:`ProbeSession`: the options every monitor takes
(:class:`~msprobe_mlflow.MonitorOptions`), and the edge where its sinks are chosen
(:func:`msprobe_mlflow.sinks.choose_sinks`)."""
from __future__ import annotations

import os
from typing import Callable

from msprobe_mlflow.config import GradProbeConfig, load_config
from msprobe_mlflow.levels import Level, recorded_level
from msprobe_mlflow.monitoring import status_lines
from msprobe_mlflow.monitoring.directions_schedule import DirectionsSchedule, directions_sinks
from msprobe_mlflow.notices import Notices
from msprobe_mlflow.monitoring.options import MonitorOptions
from msprobe_mlflow.session import ProbeSession, RankPolicy, RunSink, outcome_of
from msprobe_mlflow.sinks import choose_sinks
from msprobe_mlflow.sinks.baseline import BaselineOptions
from msprobe_mlflow.tracking.aggregate import SummaryGather
from msprobe_mlflow.tracking.options import TrackingOptions
from msprobe_mlflow.tracking.server import tracking_uri_if_imported
from msprobe_mlflow.dump import step_ranges
from msprobe_mlflow.vocabulary import TAG_RANGES_LIMIT, TRACED_STEPS_TAG, TRAINING_ID_TAG, rank_tag


class SessionMonitor:
    """Each framework monitor adds ``monitor()``, ``stop()`` (which must close the session) and its way of
    turning gradients into pending steps.

    ``options`` (:class:`~msprobe_mlflow.MonitorOptions`, every option documented there and in
    ``docs/options.md``) or their keywords (``log_every_n_steps=10``; given with ``options``, they change those),
    checked here, before training starts. MLflow: into ``run_id``, else the active run (else ``MLFLOW_RUN_ID``);
    with none, the local dump only.
    """

    def __init__(self, config: GradProbeConfig | str | os.PathLike | dict, *, options: MonitorOptions | None = None,
                 **keywords):
        config = load_config(config)
        self.options = MonitorOptions.of(options, **keywords)
        self.config = self.options.applied_to(config)
        self.directions_schedule = DirectionsSchedule.of(self.config)
        self.notices = Notices(self.options.silent)
        self.step = 0
        self._session: ProbeSession | None = None
        self.training_id: str | None = None  # set by the first session: what its dump records (rank 0's)
        self.traced_steps: list[int] = []  # the steps whose operator trace is written (trace_steps)

    @property
    def recorded_level(self) -> Level:
        """The level recorded: the config's, with the exponent counts where the options ask for them."""
        return recorded_level(self.config.level, self.options.exponent_counts)

    @property
    def tracking(self) -> TrackingOptions | None:
        """How this monitor logs to MLflow (None: ``log_to_mlflow=False``)."""
        return self.options.mlflow

    @property
    def baseline(self) -> BaselineOptions | None:
        """The live verdict's options (None: no baseline)."""
        return self.options.live_verdict

    def _open_session(self, framework: str, ranks: RankPolicy,
                      share_run_id: Callable[[str | None], str | None] = lambda run_id: run_id,
                      summary_gather: Callable[[], SummaryGather] | None = None) -> ProbeSession:
        """The session first (a bad dump_path fails before anything is sent; another training's steps in it are
        set aside, see :class:`ProbeSession`), then its sinks (``share_run_id`` and ``summary_gather``: the
        framework's collectives, see :func:`choose_sinks`; ``share_run_id`` shares the training ID too; each
        gather made is closed once the session's sinks are, its collective group released)."""
        session = ProbeSession(self.config, framework=framework, ranks=ranks, notices=self.notices,
                               training_id=self.training_id, from_rank_zero=share_run_id)
        self.training_id = session.training_id
        anomalies = self.options.anomalies
        trigger = directions_sinks(self.directions_schedule, anomalies.rule, ranks.rank, self.notices)
        if trigger or anomalies.flag_rule:
            session.judge_anomalies(anomalies.rule)
        gathers = []

        def make_gather() -> SummaryGather:
            gathers.append(summary_gather())
            return gathers[-1]

        sinks, run_sink = choose_sinks(self.config, ranks, framework=framework, tracking=self.tracking,
                                       share_run_id=share_run_id, metrics_file=self.options.metrics_file,
                                       notices=self.notices, baseline=self.baseline, spike_rule=anomalies.flag_rule,
                                       lossy=anomalies.lossy, summary_gather=make_gather if summary_gather else None)
        session.add_sinks(trigger + sinks + list(self.options.sinks), run_sink)
        for gather in gathers:  # its group, once the sinks' end-of-run exchange is done
            session.close_after_sinks(gather.close)
        if ranks.owns_run and session.training_id and run_sink is not None:
            run_sink.annotate(tags={TRAINING_ID_TAG: session.training_id})  # `upload --run-id` refuses another's dump
        self._say_start_and_end(session)
        return session

    def _say_start_and_end(self, session: ProbeSession) -> None:
        """The start line now, the end line once the session's sinks are closed (see ``status_lines``)."""
        ranks = session.ranks
        if status_lines.says_start(ranks):
            tracking_uri = (self.tracking.tracking_uri if self.tracking else None) or tracking_uri_if_imported()
            run_id = session.run_sink.run_id if session.run_sink is not None else None
            self.notices.say(status_lines.start_line(self.config, ranks, run_id, tracking_uri, self.baseline))
        if ranks.probes:
            session.close_after_sinks(lambda: self.notices.say(status_lines.end_line(
                self.config.dump_path, ranks, self.options.anomalies.anomaly_flags, self.baseline is not None)))

    @property
    def run_sink(self) -> RunSink | None:
        """The sink of the MLflow run this monitor logs into (None: none), for what adds to the run beside the
        steps (``annotate``), as the trainers' callbacks do."""
        return self._session.run_sink if self._session else None

    def tag_run(self, tags: dict[str, str], step: int = 0) -> None:
        """Sets ``tags`` on the MLflow run this monitor logs into (queued, sent off the training thread)."""
        if self.run_sink is not None:
            self.run_sink.annotate(step=step, tags=tags)

    def trace_written(self, step: int, files: list) -> None:
        """On a trace's writer thread: the trace goes into the run, its step into the run's tag."""
        self.traced_steps.append(step)
        ranks = self._session.ranks
        tag = TRACED_STEPS_TAG if ranks.world_size == 1 else rank_tag(ranks.rank, "traced_steps")
        if self.run_sink is not None:
            self.run_sink.annotate(step=step, tags={tag: step_ranges(self.traced_steps, limit=TAG_RANGES_LIMIT)},
                                   files=files)

    @property
    def run_id(self) -> str | None:
        """The MLflow run this monitor logs into (None: no MLflow sink)."""
        return self.run_sink.run_id if self.run_sink is not None else None

    @property
    def errors(self) -> list[str]:
        """What the writer thread and the sinks could not do (each also logged); still readable after ``stop()``."""
        return self._session.errors if self._session else []

    def flush(self) -> None:
        """Waits until every probed step is on disk and delivered by every sink."""
        if self._session:
            self._session.flush()

    def __enter__(self):
        return self

    def end_as(self, status: str, reason: str = "") -> None:
        """Says how the training ended before ``stop()`` (``failed``, ``killed``), where it cannot be seen: the
        MLflow run then gets this rank's status and, for a failure, ends FAILED (see ``ProbeSession.close``)."""
        if self._session and not self._session.closed:
            self._session.end_as(status, reason)

    @property
    def failed_ranks(self) -> dict[int, str]:
        """After ``stop()``: the ranks of this training that failed or were killed, ``{rank: status}``, as far as
        this rank knows (rank 0 waits for the others); who ends the run ends it FAILED then."""
        return dict(self.run_sink.failed_ranks) if self.run_sink is not None else {}

    def __exit__(self, kind, error, traceback) -> None:
        if kind is not None:  # the with block's exception is its training's end
            self.end_as(*outcome_of(error))
        self.stop()
