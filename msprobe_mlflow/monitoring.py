"""What both framework monitors offer on top of their one :class:`ProbeSession`: the options every monitor takes,
and the edge where its sinks are chosen (:func:`msprobe_mlflow.sinks.choose_sinks`)."""
from __future__ import annotations

import os
from typing import Callable

from msprobe_mlflow.compare.verdict import (DEFAULT_DROP_THRESHOLD, DEFAULT_FIRST_THRESHOLD, DEFAULT_RULE,
                                            RuleSettings)
from msprobe_mlflow.config import GradProbeConfig, load_config
from msprobe_mlflow.directions_schedule import DirectionsSchedule, directions_sinks
from msprobe_mlflow.notices import Notices
from msprobe_mlflow.session import ProbeSession, RankPolicy, outcome_of
from msprobe_mlflow.sinks import StepSink, choose_sinks
from msprobe_mlflow.sinks.anomalies import SpikeRule
from msprobe_mlflow.sinks.baseline import BaselineOptions, SuspiciousCallback
from msprobe_mlflow.tracking.aggregate import SummaryGather
from msprobe_mlflow.tracking.options import TrackingOptions


class SessionMonitor:
    """Each framework monitor adds ``monitor()``, ``stop()`` (which must close the session) and its way of
    turning gradients into pending steps.

    MLflow: into ``run_id``, else the active run (else ``MLFLOW_RUN_ID``); with none, the local dump only;
    ``log_to_mlflow=False`` turns it off. ``metrics_file=True`` also appends each step's summary metrics to
    ``{dump_path}/rank{R}/metrics.jsonl``. ``aggregate_metrics``: rank 0 sends every rank's summary metrics in its
    own requests, gathered by one small collective per step (None, the default: from 64 ranks; see
    ``msprobe_mlflow.tracking.aggregate``). ``archive_every_n_steps``: each rank's files go up as one archive per
    this many sent steps (1, the default: two files per step). ``sinks``: more outputs (objects with
    ``handle(record)``, ``flush()``, ``close()``), fed on the writer thread after the local dump. ``silent``:
    problems go to the ``msprobe_mlflow`` logger only, no warnings.

    Live verdicts (``msprobe_mlflow.sinks.baseline``, ``msprobe_mlflow.sinks.anomalies``): ``baseline`` (a dump
    folder or an MLflow run ID, looked up in ``tracking_uri``) compares each step's directions with the baseline's
    as the step lands, and ``on_suspicious(verdict)`` is called once when the comparator's ``rule`` (``"noise"``,
    the default; ``"msprobe"`` with ``first_threshold``, ``drop_threshold``) first finds a step suspicious.
    ``anomaly_flags`` (on by default) flags non-finite
    gradients and gradient-norm spikes (``spike_threshold``, ``spike_window``: see ``SpikeRule``).

    The always-on tier (:mod:`msprobe_mlflow.directions_schedule`): ``directions_every_n_steps``,
    ``directions_on_anomaly`` and ``directions_steps_after_anomaly``, when given, override the config's
    ``grad_probe`` keys of the same names; statistics stay at every probed step, directions only where chosen.
    """

    def __init__(self, config: GradProbeConfig | str | os.PathLike | dict, *, run_id: str | None = None,
                 tracking_uri: str | None = None, log_every_n_steps: int = 1, param_metrics=(),
                 log_to_mlflow: bool = True, silent: bool = False, metrics_file: bool = False,
                 sinks: list[StepSink] = (), baseline: str | os.PathLike | None = None,
                 on_suspicious: SuspiciousCallback | None = None, first_threshold: float = DEFAULT_FIRST_THRESHOLD,
                 drop_threshold: float = DEFAULT_DROP_THRESHOLD, rule: str = DEFAULT_RULE,
                 anomaly_flags: bool = True,
                 spike_threshold: float = SpikeRule.threshold, spike_window: int = SpikeRule.window,
                 directions_every_n_steps: int | None = None, directions_on_anomaly: bool | None = None,
                 directions_steps_after_anomaly: int | None = None, aggregate_metrics: bool | None = None,
                 archive_every_n_steps: int = 1):
        self.config = load_config(config)
        tier = dict(directions_every_n_steps=directions_every_n_steps, directions_on_anomaly=directions_on_anomaly,
                    directions_steps_after_anomaly=directions_steps_after_anomaly)
        if any(value is not None for value in tier.values()):
            self.config = self.config.replace(**{k: v for k, v in tier.items() if v is not None},
                                              source="monitor options")
        self.directions_schedule = DirectionsSchedule.of(self.config)
        self.tracking = TrackingOptions(run_id, tracking_uri, log_every_n_steps, param_metrics, aggregate_metrics,
                                        archive_every_n_steps) \
            if log_to_mlflow else None
        self.baseline = live_baseline(self.config, baseline, on_suspicious, first_threshold, drop_threshold,
                                      tracking_uri, rule)
        if not isinstance(anomaly_flags, bool):
            raise ValueError(f"anomaly_flags = {anomaly_flags!r} is not accepted; expected True or False")
        self.trigger_rule = SpikeRule(spike_threshold, spike_window)
        self.spike_rule = self.trigger_rule if anomaly_flags else None
        self.notices = Notices(silent)
        self.metrics_file = metrics_file
        self.step = 0
        self._extra_sinks = list(sinks)
        self._session: ProbeSession | None = None
        self.training_id: str | None = None  # set by the first session: what its dump records (rank 0's)

    def _open_session(self, framework: str, ranks: RankPolicy,
                      share_run_id: Callable[[str | None], str | None] = lambda run_id: run_id,
                      summary_gather: Callable[[], SummaryGather] | None = None) -> ProbeSession:
        """The session first (a bad dump_path fails before anything is sent; another training's steps in it are
        set aside, see :class:`ProbeSession`), then its sinks (``share_run_id`` and ``summary_gather``: the
        framework's collectives, see :func:`choose_sinks`; ``share_run_id`` shares the training ID too)."""
        session = ProbeSession(self.config, framework=framework, ranks=ranks, notices=self.notices,
                               training_id=self.training_id, from_rank_zero=share_run_id)
        self.training_id = session.training_id
        trigger = directions_sinks(self.directions_schedule, self.trigger_rule, ranks.rank, self.notices)
        session.add_sinks(trigger + choose_sinks(self.config, ranks, framework=framework, tracking=self.tracking,
                                                 share_run_id=share_run_id, metrics_file=self.metrics_file,
                                                 notices=self.notices, baseline=self.baseline,
                                                 spike_rule=self.spike_rule, summary_gather=summary_gather)
                          + self._extra_sinks)
        return session

    @property
    def run_id(self) -> str | None:
        """The MLflow run this monitor logs into (None: no MLflow sink)."""
        sinks = self._session.sinks if self._session else []
        return next((sink.run_id for sink in sinks if getattr(sink, "run_id", None)), None)

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
        sinks = self._session.sinks if self._session else []
        return {rank: status for sink in sinks for rank, status in getattr(sink, "failed_ranks", {}).items()}

    def __exit__(self, kind, error, traceback) -> None:
        if kind is not None:  # the with block's exception is its training's end
            self.end_as(*outcome_of(error))
        self.stop()


def live_baseline(config: GradProbeConfig, baseline, on_suspicious, first_threshold: float, drop_threshold: float,
                  tracking_uri: str | None, rule: str = DEFAULT_RULE) -> BaselineOptions | None:
    """The live verdict's options, refused before training starts when they cannot work."""
    RuleSettings(rule, first_threshold, drop_threshold)
    if baseline is None:
        if on_suspicious is not None:
            raise ValueError("on_suspicious is given without baseline=; it is called when a step is suspicious "
                             "against a baseline run: pass baseline=RUN_ID_OR_DUMP_FOLDER too")
        return None
    options = BaselineOptions(baseline, on_suspicious, first_threshold, drop_threshold, tracking_uri, rule)
    if not config.has_directions:
        raise ValueError(f"baseline = {options.baseline!r} needs gradient directions, which grad_probe.grad_level "
                         f"{config.level!r} does not record; use grad_level L1 or L2")
    return options
