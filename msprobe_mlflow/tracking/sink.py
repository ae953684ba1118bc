"""The live MLflow sink: each probed step's metrics and files, sent from a thread of its own.

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

Rank-0 aggregation (:mod:`msprobe_mlflow.tracking.aggregate`, given a ``gather`` collective): every rank's summary
metrics go up in rank 0's requests; each rank still sends its files and per-parameter metrics. Other ranks' values
whose round failed go again in rank 0's next round; those still unsent at ``stop()`` are in their ranks' local
dumps, and the run's tag ``msprobe_mlflow.unsent_summary_ranks`` (``3-7,12``) names the ranks to ``upload``.
Rank 0 also tags every rank's status, at the start and at ``stop()`` (an end-of-run exchange), so the other ranks
send no request of their own for the run's bookkeeping, nor a ``rank{R}.dump_path`` tag: each rank's dump is at
the run's ``dump_path`` on its node.

Credentials are checked when the sink starts: the first request (the run's tags) is awaited for up to
``MSPROBE_MLFLOW_START_CHECK_SECONDS`` (10 s), and a 401/403 answer gives one warning at ``monitor()`` naming the
tracking URI and ``MLFLOW_TRACKING_USERNAME``/``MLFLOW_TRACKING_PASSWORD``; the sink then sends nothing more and
training goes on with the local dump only.
"""
from __future__ import annotations

import json
import os
import queue
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import mlflow
from mlflow.entities import Metric
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from msprobe_mlflow import __version__
from msprobe_mlflow.config import GradProbeConfig
from msprobe_mlflow.dump import findings_dir, relative_rank_dir, step_ranges, write_steps_archive
from msprobe_mlflow.metrics import record_metrics
from msprobe_mlflow.notices import Notices
from msprobe_mlflow.records import StepRecord
from msprobe_mlflow.session import RankPolicy, on_fatal_end
from msprobe_mlflow.tracking import (ARTIFACT_ROOT, RANK_ENDINGS, RANK_FAILURES, TAG_PREFIX, TAG_RANGES_LIMIT,
                                     earliest_findings)
from msprobe_mlflow.tracking.aggregate import RankZeroMetrics, SummaryGather, aggregation_wanted
from msprobe_mlflow.tracking.options import TrackingOptions
from msprobe_mlflow.tracking.runs import log_batched, now_ms, param, tag
from msprobe_mlflow.tracking.upload import (UNSENT_SUMMARY_RANKS_TAG, end_run_failed, metric_entities,
                                            packed_directions_file, rank_status_tag, rank_statuses, unsent_steps_tag,
                                            upload_dump, upload_step_files)

RANK_WAIT_SECONDS = float(os.environ.get("MSPROBE_MLFLOW_RANK_WAIT_SECONDS", "120"))
START_CHECK_SECONDS = float(os.environ.get("MSPROBE_MLFLOW_START_CHECK_SECONDS", "10"))
DRAIN_SECONDS = float(os.environ.get("MSPROBE_MLFLOW_DRAIN_SECONDS", "300"))
# Each round of requests costs the tracking store a commit (10-15 ms of CPU with SQLite): with fast steps, one
# round per step costs more than the step itself (benchmarks/), so steps are gathered for up to a second.
SEND_INTERVAL_SECONDS = 1.0
REFUSED_CREDENTIALS = ("UNAUTHENTICATED", "PERMISSION_DENIED")  # MLflow's error codes for HTTP 401 and 403
_CLOSE, _FLUSH = object(), object()


@dataclass(frozen=True)
class QueuedStep:
    """One step of this rank (its files follow its ``metrics``) and, on rank 0 under aggregation, the other ranks'
    summary metrics that came with it (``gathered``)."""

    step: int
    metrics: list[Metric]
    gathered: list[Metric]


@dataclass(frozen=True)
class Annotation:
    """Findings another sink adds to the run: ``metrics`` at MLflow step ``step``, ``tags``, and ``files`` inside the
    dump folder, sent as the ``grad_probe/`` artifacts that mirror them (read when sent: the latest content)."""

    step: int
    metrics: dict[str, float]
    tags: dict[str, str]
    files: tuple[Path, ...]


def open_mlflow_sink(config: GradProbeConfig, ranks: RankPolicy, options: TrackingOptions, *, framework: str,
                     share_run_id: Callable[[str | None], str | None], notices: Notices | None = None,
                     summary_gather: Callable[[], SummaryGather] | None = None) -> list["MlflowSink"]:
    """The MLflow sink of this rank, in a list (empty when no run is found, or this rank does not log).
    ``share_run_id`` turns this process's run ID into rank 0's: a collective, so every rank calls this.
    ``summary_gather`` makes the framework's all-gather (a collective too); it is called when aggregation is on:
    ``options.aggregate_metrics``, and every rank probes (a rank filter leaves ranks out of the collective)."""
    run_id = share_run_id(options.local_run_id())
    if not run_id or not ranks.probes:
        return []
    gather = None
    if summary_gather is not None and not ranks.wanted and aggregation_wanted(options.aggregate_metrics,
                                                                              ranks.world_size):
        gather = summary_gather()
    return [MlflowSink(run_id, config, options, ranks, framework=framework, notices=notices, gather=gather)]


class MlflowSink:
    """Logs one rank's steps into one run (see the module docstring for the policy)."""

    def __init__(self, run_id: str, config: GradProbeConfig, options: TrackingOptions, ranks: RankPolicy, *,
                 framework: str, notices: Notices | None = None, max_pending: int = 10_000,
                 gather: SummaryGather | None = None):
        self.run_id = run_id
        self.config = config
        self.options = options
        self.ranks = ranks
        self.rank = ranks.rank
        self.framework = framework
        self.notices = notices or Notices()
        self.client = MlflowClient(options.tracking_uri)
        self.aggregation = RankZeroMetrics(gather, self.rank) if gather is not None else None
        self.unsent_steps: set[int] = set()
        self.unsent_gathered: list[Metric] = []  # rank 0: other ranks' summary metrics whose round failed
        self._gathered_lock = threading.Lock()  # unsent_gathered grows on the writer thread too (a full queue)
        self.unsent_annotations: list[Annotation] = []
        self._drain_deadline: float | None = None
        self._unarchived: list[int] = []  # steps whose metrics were sent and whose files wait for their archive
        self._failure: str | None = None
        self._refused: str | None = None  # set when the server refused the credentials: nothing more is sent
        self._refusal_told = False
        self._closed = False
        self._outcome = ("finished", "")  # how this rank's training ended (training_ended)
        self.failed_ranks: dict[int, str] = {}  # at close: the ranks known to have failed or been killed
        self._start_checked = threading.Event()
        self._closing = threading.Event()
        self._wake = threading.Event()  # ends the wait between rounds early: flush() and close()
        self._queue: queue.Queue = queue.Queue(maxsize=max_pending)
        self._thread = threading.Thread(target=self._work, name=f"msprobe-mlflow-sink-rank{self.rank}",
                                        daemon=True)
        self._thread.start()
        self._start_checked.wait(START_CHECK_SECONDS)
        self._tell_refusal()
        _sinks_of_this_process.add(self)
        _runs_of_this_process.add(run_id)

    def handle(self, record: StepRecord) -> None:
        if record.step % self.options.log_every_n_steps:
            return
        metrics, others, failure = record_metrics(record, self.options.param_metrics), {}, None
        if self.aggregation is not None:  # before the refusal check: every rank must take part in the collective
            try:
                metrics, others = self.aggregation.exchange(record.step, metrics)
            except Exception as e:  # every rank sees it (an all-gather): each sends its own metrics from now on
                self.aggregation, failure = None, e
        if not self._refused:
            timestamp = now_ms()
            at = self.options.mlflow_step_offset  # MLflow step = training step + at
            item = QueuedStep(record.step, metric_entities(metrics, record.step + at, timestamp),
                              [m for step, values in others.items() for m in metric_entities(values, step + at,
                                                                                              timestamp)])
            try:
                self._queue.put_nowait(item)
            except queue.Full:
                self.unsent_steps.add(record.step)
                self._keep_unsent_gathered(item.gathered)
        if failure is not None:
            raise RuntimeError(f"rank {self.rank}: the rank-0 aggregation of summary metrics failed at step "
                               f"{record.step}; from now on each rank sends its own metrics") from failure

    def annotate(self, *, step: int = 0, metrics: dict[str, float] | None = None, tags: dict[str, str] | None = None,
                 files=()) -> None:
        """Queues findings for the next round (see :class:`Annotation`); callable from any thread, never waits."""
        if self._refused:
            return
        annotation = Annotation(step, dict(metrics or {}), dict(tags or {}), tuple(Path(f) for f in files))
        if not self._thread.is_alive():
            self.notices.log(f"rank {self.rank}: findings handed in after the MLflow sink closed stay in the local "
                             f"dump only: {sorted(annotation.tags) or sorted(annotation.metrics)}")
            return
        try:
            self._queue.put_nowait(annotation)
        except queue.Full:
            self.unsent_annotations.append(annotation)

    def flush(self) -> None:
        """Waits until the steps handed in so far are sent, or remembered as unsent."""
        if self._thread.is_alive():
            self._queue.put(_FLUSH)
            self._wake.set()
            self._queue.join()

    # --- worker thread -------------------------------------------------------------------------------
    def _work(self) -> None:
        self._attempt("describe the run", self._describe_run)
        self._start_checked.set()
        if self._refused:
            return
        last_round = 0.0
        while True:
            items = [self._queue.get()]
            if items[0] not in (_CLOSE, _FLUSH):  # at most one round of requests a second, unless asked
                self._wake.wait(max(0.0, last_round + SEND_INTERVAL_SECONDS - time.monotonic()))
            self._wake.clear()
            last_round = time.monotonic()
            while True:  # coalesce everything queued meanwhile into one round of requests
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            steps = [item for item in items if isinstance(item, QueuedStep)]
            annotations = [item for item in items if isinstance(item, Annotation)]
            if steps or annotations:
                numbers = [item.step for item in steps]
                what = f"log steps {numbers[0]}..{numbers[-1]}" if steps else "log the live findings"
                retry = self._take_unsent_gathered()
                if (self._closing.is_set() and (self._failure or self._out_of_time())  # no waiting at exit
                        or not self._attempt(what, lambda: self._send(steps, annotations, retry))):
                    self.unsent_steps.update(numbers)
                    self._keep_unsent_gathered(retry + [m for item in steps for m in item.gathered])
                    self.unsent_annotations += annotations
            if _CLOSE in items and self._unarchived and not (self._failure or self._out_of_time()):
                self._attempt("send the last archive of step files", self._send_archive)
            for _ in items:
                self._queue.task_done()
            if _CLOSE in items:
                self.unsent_steps.update(self._unarchived)
                return

    def _attempt(self, what: str, action) -> bool:
        try:
            action()
        except Exception as e:
            if isinstance(e, MlflowException) and e.error_code in REFUSED_CREDENTIALS:
                self._refused = self._refusal_message(e)
                self.notices.log(self._refused)
                return False
            first = self._failure is None
            self._failure = f"could not {what} in run {self.run_id}: {e}"
            self.notices.log(self._failure)
            if first:
                self.notices.warn(f"{self._failure}. Training goes on and the local dump stays complete; "
                                  f"unsent steps are retried at stop().")
            return False
        self._failure = None
        return True

    def _refusal_message(self, error: MlflowException) -> str:
        status = "401 not authenticated" if error.error_code == "UNAUTHENTICATED" else "403 permission denied"
        return (f"rank {self.rank}: the MLflow tracking server at {self.client.tracking_uri} refused the "
                f"credentials ({status}) for run {self.run_id}; set MLFLOW_TRACKING_USERNAME and "
                f"MLFLOW_TRACKING_PASSWORD to an account that may edit this run's experiment. Nothing is sent to "
                f"MLflow; training goes on with the local dump in {self.config.dump_path}; once the credentials "
                f"are right, send it with: msprobe-mlflow upload {self.config.dump_path} --run-id {self.run_id}")

    def _tell_refusal(self) -> None:
        """Warns once (at start, or at close when the answer came later) that the credentials were refused."""
        if self._refused and not self._refusal_told:
            self._refusal_told = True
            self.notices.warn(self._refused)

    def _describe_run(self) -> None:
        dump_path = os.path.abspath(self.config.dump_path)
        if self.aggregation is None:
            tags = [tag(rank_status_tag(self.rank), "running"),
                    tag(f"{TAG_PREFIX}rank{self.rank}.dump_path", dump_path)]
        elif self.ranks.owns_run:  # rank 0 tags every rank; the others send nothing here
            tags = [tag(rank_status_tag(rank), "running") for rank in range(self.ranks.world_size)]
        else:
            return
        params = []
        if self.ranks.owns_run:
            tags += [tag(f"{TAG_PREFIX}{key}", value) for key, value in (
                ("framework", self.framework), ("level", self.config.level), ("version", __version__),
                ("world_size", self.ranks.world_size), ("dump_path", dump_path))]
            config = self.config.to_msprobe_dict()
            params = [param(f"grad_probe.{key}", value if isinstance(value, str) else json.dumps(value))
                      for key, value in (
                ("level", self.config.level), ("bounds", config["grad_probe"]["bounds"]),
                ("param_list", config["grad_probe"]["param_list"]), ("rank", config["rank"]),
                ("step", config["step"]), ("direction_format", self.config.direction_format),
                *self.config.tier_options().items())]
        log_batched(self.client, self.run_id, params=params, tags=tags)
        if self.ranks.owns_run:
            with tempfile.TemporaryDirectory() as scratch:
                path = Path(scratch) / "config.json"
                path.write_text(json.dumps(config, indent=2), encoding="utf-8")
                self.client.log_artifact(self.run_id, str(path), ARTIFACT_ROOT)

    def _out_of_time(self) -> bool:
        return self._drain_deadline is not None and time.monotonic() > self._drain_deadline

    def _take_unsent_gathered(self) -> list[Metric]:
        with self._gathered_lock:
            taken, self.unsent_gathered = self.unsent_gathered, []
        return taken

    def _keep_unsent_gathered(self, metrics: list[Metric]) -> None:
        with self._gathered_lock:
            self.unsent_gathered += metrics

    def _send(self, steps: list[QueuedStep], annotations: list[Annotation] = (), retry: list[Metric] = ()) -> None:
        """One round: the steps' metrics (and ``retry``, other ranks' values of failed rounds), then their files."""
        timestamp = now_ms()
        metrics = [*retry, *(m for item in steps for m in (*item.metrics, *item.gathered))]
        metrics += [m for a in annotations
                    for m in metric_entities(a.metrics, a.step + self.options.mlflow_step_offset, timestamp)]
        tags = {key: value for a in annotations for key, value in a.tags.items()}  # the latest value of a key wins
        log_batched(self.client, self.run_id, metrics=metrics, tags=[tag(key, value) for key, value in tags.items()])
        every = self.options.archive_every_n_steps
        if every > 1:
            self._unarchived += [item.step for item in steps]
            while len(self._unarchived) >= every:
                self._send_archive(every)
        else:
            for item in steps:
                if self._out_of_time():
                    raise TimeoutError(f"stop() drained for MSPROBE_MLFLOW_DRAIN_SECONDS = {DRAIN_SECONDS:g} s")
                upload_step_files(self.client, self.run_id, self.config.dump_path, self.rank, item.step)
        for path in dict.fromkeys(path for a in annotations for path in a.files):
            self.client.log_artifact(self.run_id, str(path), self._artifact_folder(path))

    def _send_archive(self, count: int | None = None) -> None:
        """One archive of the first ``count`` (default: all) steps waiting for it; on failure they are unsent."""
        count = count or len(self._unarchived)
        steps, self._unarchived = self._unarchived[:count], self._unarchived[count:]
        try:
            with tempfile.TemporaryDirectory() as scratch:
                archive = write_steps_archive(self.config.dump_path, self.rank, steps, Path(scratch),
                                              packed_directions_file)
                self.client.log_artifact(self.run_id, str(archive), f"{ARTIFACT_ROOT}/{relative_rank_dir(self.rank)}")
        except Exception:
            self.unsent_steps.update(steps)
            raise

    def _artifact_folder(self, path: Path) -> str:
        """The ``grad_probe/`` folder mirroring the dump folder that holds ``path``."""
        relative = path.resolve().parent.relative_to(Path(self.config.dump_path).resolve())
        return "/".join((ARTIFACT_ROOT, *relative.parts))

    # --- end of monitoring ---------------------------------------------------------------------------
    def close(self) -> None:
        """Sends what is queued, retries the unsent steps once, marks this rank finished (under aggregation: hands
        its status to rank 0); rank 0 then waits (``MSPROBE_MLFLOW_RANK_WAIT_SECONDS``, or the end-of-run exchange)
        for the other ranks, tags the run with any that never finished, and sets the run's first-finding tags to the
        earliest rank's."""
        if self._closed:
            return
        self._closed = True
        if self._thread.is_alive():
            self._drain_deadline = time.monotonic() + DRAIN_SECONDS
            self._closing.set()
            self._queue.put(_CLOSE)
            self._wake.set()
            self._thread.join()
        if not self._refused:
            self._send_leftovers()
        self._tell_refusal()
        status = self._outcome[0] if self._outcome[0] in RANK_FAILURES else \
            "incomplete" if self.unsent_steps or self._refused else "finished"
        if status in RANK_FAILURES:  # said first: the launcher may kill this process any moment now
            self.say_failed(*self._outcome)
        if self.aggregation is not None and self._statuses_through_rank_0(status) or self._refused:
            return
        if status not in RANK_FAILURES and self._attempt(f"mark the rank {status}", lambda: self.client.set_tag(
                self.run_id, rank_status_tag(self.rank), status)) and self.ranks.owns_run and self.ranks.world_size > 1:
            self._attempt("check the other ranks", self._wait_for_other_ranks)

    def training_ended(self, status: str, reason: str = "") -> None:
        """How this rank's training ended (``tracking.RANK_ENDINGS``), told by the session before ``close()``."""
        self._outcome = (status, reason)

    def say_failed(self, status: str, reason: str) -> None:
        """This rank failed or was killed: its status and the reason go into the run, which ends FAILED (one
        rank's failure ends a launcher's whole job, often before the other ranks can say anything), with the
        warning that names them."""
        if self._refused or self.rank in self.failed_ranks:
            return
        failed: list[int] = []
        if self._attempt(f"mark the rank {status} and end the run FAILED", lambda: failed.extend(end_run_failed(
                self.client, self.run_id, {self.rank: status}, reason))):
            self.failed_ranks = {**{rank: "failed" for rank in failed}, self.rank: status}
            self.notices.warn(f"rank {self.rank}: training {status} ({reason}); MLflow run {self.run_id} is ended "
                              f"FAILED, tagged {TAG_PREFIX}rank{self.rank}.status = {status}")

    def _send_leftovers(self) -> None:
        """At ``close()``: the unsent steps, other ranks' unsent summary metrics and the findings, once more; what
        still fails is named in the run's tags and a warning."""
        if self.unsent_steps and not self._out_of_time():
            steps = set(self.unsent_steps)
            if self._attempt("send the unsent steps", lambda: upload_dump(
                    self.config.dump_path, self.run_id, tracking_uri=self.options.tracking_uri, ranks=[self.rank],
                    steps=steps, param_patterns=self.options.param_metrics,
                    mlflow_step_offset=self.options.mlflow_step_offset)):
                self.unsent_steps.clear()
        gathered = self._take_unsent_gathered()
        if gathered and (self._out_of_time() or not self._attempt(
                "send the other ranks' summary metrics", lambda: log_batched(self.client, self.run_id,
                                                                           metrics=gathered))):
            self.unsent_gathered = gathered
            ranks = step_ranges({int(m.key.split("/")[1][len("rank"):]) for m in gathered},
                                limit=TAG_RANGES_LIMIT)
            self._attempt("name the ranks whose summary metrics are unsent", lambda: self.client.set_tag(
                self.run_id, UNSENT_SUMMARY_RANKS_TAG, ranks))
            self.notices.warn(f"rank 0: {len(gathered)} summary metric value(s) of ranks {ranks} are not in MLflow "
                              f"run {self.run_id} (tag {UNSENT_SUMMARY_RANKS_TAG}); they are in those ranks' local "
                              f"dumps: complete it with msprobe-mlflow upload {self.config.dump_path} --run-id "
                              f"{self.run_id} on their nodes")
        if self.unsent_steps:
            self._attempt("name the unsent steps", lambda: self.client.set_tag(
                self.run_id, unsent_steps_tag(self.rank),
                step_ranges(self.unsent_steps, limit=TAG_RANGES_LIMIT)))
            self.notices.warn(f"rank {self.rank}: {len(self.unsent_steps)} step(s) are in the local dump but not "
                              f"in MLflow run {self.run_id} (tag {unsent_steps_tag(self.rank)}); complete it with: "
                              f"msprobe-mlflow upload {self.config.dump_path} --run-id {self.run_id}")
        if self.unsent_annotations:
            annotations, self.unsent_annotations = self.unsent_annotations, []
            if not self._attempt("send the live findings", lambda: self._send([], annotations)):
                self.unsent_annotations = annotations
                self.notices.warn(f"rank {self.rank}: the live findings (live verdict, anomaly flags) of MLflow run "
                                  f"{self.run_id} could not all be sent; they are in the local dump, in "
                                  f"{findings_dir(self.config.dump_path, self.rank)}; send them with: "
                                  f"msprobe-mlflow upload {self.config.dump_path} --run-id {self.run_id}")

    def _statuses_through_rank_0(self, status: str) -> bool:
        """Under aggregation: the end-of-run exchange of every rank's status, which rank 0 tags in one request.
        False when the collective failed (on every rank alike): each rank then tags its own status."""
        try:
            statuses = self.aggregation.exchange_statuses(status)
        except Exception as e:
            self.notices.warn(f"rank {self.rank}: the end-of-run exchange of the ranks' statuses failed ({e}); each "
                              f"rank tags its own status in run {self.run_id}")
            return False
        if statuses:
            self._attempt("tag every rank's status", lambda: self._tag_statuses(statuses))
        return True

    def _tag_statuses(self, statuses: dict[int, str]) -> None:
        log_batched(self.client, self.run_id, tags=[tag(rank_status_tag(r), s) for r, s in statuses.items()])
        self._tag_earliest_findings(self.client.get_run(self.run_id).data.tags, list(statuses))
        self._end_if_ranks_failed({}, statuses)

    def _end_if_ranks_failed(self, news: dict[int, str], known: dict[int, str]) -> None:
        """Rank 0, at the end, knowing the ranks' statuses ``known``: ``news`` (missing ranks) are tagged, and the
        run ends FAILED when a rank failed or was killed, named in a warning."""
        if not news and not any(status in RANK_FAILURES for status in known.values()):
            return
        failed = end_run_failed(self.client, self.run_id, news)
        statuses = rank_statuses(self.client.get_run(self.run_id).data.tags)
        self.failed_ranks = {rank: statuses[rank] for rank in failed}
        if failed:
            self.notices.warn(f"ranks {failed} of run {self.run_id} failed or were killed (tags "
                              f"{TAG_PREFIX}rank{{R}}.status, .failure); the run is ended FAILED")

    def _wait_for_other_ranks(self) -> None:
        """Until every other wanted rank said how it ended, at most ``RANK_WAIT_SECONDS``; those that did not are
        tagged ``missing`` (a late rank that ends later tags itself again)."""
        expected = self.ranks.wanted_ranks()
        deadline = time.monotonic() + RANK_WAIT_SECONDS
        while True:
            tags = self.client.get_run(self.run_id).data.tags
            missing = [r for r in expected if tags.get(rank_status_tag(r)) not in RANK_ENDINGS]
            if not missing or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        self._tag_earliest_findings(tags, expected)
        self._end_if_ranks_failed({r: "missing" for r in missing}, rank_statuses(tags))
        if missing:
            self.notices.warn(f"ranks {missing} did not finish logging into run {self.run_id} within "
                              f"{RANK_WAIT_SECONDS:.0f} s; they are tagged {TAG_PREFIX}rank{{R}}.status = missing, "
                              f"the run {TAG_PREFIX}missing_ranks")

    def _tag_earliest_findings(self, tags: dict[str, str], expected: list[int]) -> None:
        findings = {key: value for key, value in earliest_findings(tags, expected).items() if tags.get(key) != value}
        if findings:  # each rank tagged its own first finding as it came: the run's is the earliest of all ranks
            log_batched(self.client, self.run_id, tags=[tag(key, value) for key, value in findings.items()])


_sinks_of_this_process: "weakref.WeakSet[MlflowSink]" = weakref.WeakSet()
_runs_of_this_process: set[str] = set()


def _report_fatal_end(status: str, reason: str) -> None:
    """The process dies (``session.on_fatal_end``): each open sink says so at once, and the active run, when this
    process logged into it, ends FAILED (MLflow's own exit handler would end it FINISHED)."""
    for sink in list(_sinks_of_this_process):
        if not sink._closed:
            sink.say_failed(status, reason)
    active = mlflow.active_run()
    if active is not None and active.info.run_id in _runs_of_this_process:
        mlflow.end_run("FAILED")


on_fatal_end(_report_fatal_end)
