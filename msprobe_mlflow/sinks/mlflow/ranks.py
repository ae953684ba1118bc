"""How the ranks of a run ended, as the live MLflow sink tags it: each rank's status at ``close()`` (under
aggregation, rank 0 tags them all after an end-of-run exchange); a rank that failed or was killed ends the run
FAILED at once; rank 0 waits for the other ranks (``MSPROBE_MLFLOW_RANK_WAIT_SECONDS``), tags those that never
said ``missing`` and sets the run's first-finding tags to the earliest rank's."""
from __future__ import annotations

import time

from msprobe_mlflow.notices import Notices
from msprobe_mlflow.session import RankPolicy
from msprobe_mlflow.sinks.mlflow import settings
from msprobe_mlflow.sinks.mlflow.attempts import Attempts
from msprobe_mlflow.tracking.live_run import LiveRun
from msprobe_mlflow.vocabulary import (FAILED, FINISHED, INCOMPLETE, MISSING, RANK_ENDINGS, RANK_FAILURES, TAG_PREFIX,
                                       earliest_findings, rank_status_tag, rank_statuses)


class RankEnds:
    def __init__(self, run: LiveRun, ranks: RankPolicy, attempt: Attempts, notices: Notices):
        self.run, self.ranks, self.rank, self.attempt, self.notices = run, ranks, ranks.rank, attempt, notices
        self.outcome = (FINISHED, "")  # how this rank's training ended (``training_ended``)
        self.failed_ranks: dict[int, str] = {}  # at close: the ranks known to have failed or been killed

    def close(self, incomplete: bool, aggregation) -> None:
        """Tags this rank's status (``incomplete``: steps left in the local dump only); rank 0 then waits for the
        other ranks. Under ``aggregation`` the statuses go through rank 0."""
        status = self.outcome[0] if self.outcome[0] in RANK_FAILURES else INCOMPLETE if incomplete else FINISHED
        if status in RANK_FAILURES:  # said first: the launcher may kill this process any moment now
            self.say_failed(*self.outcome)
        if aggregation is not None and self._statuses_through_rank_0(aggregation, status) or self.attempt.refused:
            return
        if status not in RANK_FAILURES and self.attempt(f"mark the rank {status}", lambda: self.run.set_tag(
                rank_status_tag(self.rank), status)) and self.ranks.owns_run and self.ranks.world_size > 1:
            self.attempt("check the other ranks", self._wait_for_other_ranks)

    def say_failed(self, status: str, reason: str) -> None:
        """This rank failed or was killed: its status and the reason go into the run, which ends FAILED (one
        rank's failure ends a launcher's whole job, often before the other ranks can say anything), with the
        warning that names them."""
        if self.attempt.refused or self.rank in self.failed_ranks:
            return
        failed: list[int] = []
        if self.attempt(f"mark the rank {status} and end the run FAILED",
                        lambda: failed.extend(self.run.end_failed({self.rank: status}, reason))):
            self.failed_ranks = {**{rank: FAILED for rank in failed}, self.rank: status}
            self.notices.warn(f"rank {self.rank}: training {status} ({reason}); MLflow run {self.run.run_id} is "
                              f"ended FAILED, tagged {rank_status_tag(self.rank)} = {status}")

    def _statuses_through_rank_0(self, aggregation, status: str) -> bool:
        """Under aggregation: the end-of-run exchange of every rank's status, which rank 0 tags in one request.
        False when the collective failed (on every rank alike): each rank then tags its own status."""
        try:
            statuses = aggregation.exchange_statuses(status)
        except Exception as e:
            self.notices.warn(f"rank {self.rank}: the end-of-run exchange of the ranks' statuses failed ({e}); each "
                              f"rank tags its own status in run {self.run.run_id}")
            return False
        if statuses:
            self.attempt("tag every rank's status", lambda: self._tag_statuses(statuses))
        return True

    def _tag_statuses(self, statuses: dict[int, str]) -> None:
        self.run.log(tags={rank_status_tag(r): s for r, s in statuses.items()})
        self._tag_earliest_findings(self.run.tags(), list(statuses))
        self._end_if_ranks_failed({}, statuses)

    def _end_if_ranks_failed(self, news: dict[int, str], known: dict[int, str]) -> None:
        """Rank 0, at the end, knowing the ranks' statuses ``known``: ``news`` (missing ranks) are tagged, and the
        run ends FAILED when a rank failed or was killed, named in a warning."""
        if not news and not any(status in RANK_FAILURES for status in known.values()):
            return
        failed = self.run.end_failed(news)
        statuses = rank_statuses(self.run.tags())
        self.failed_ranks = {rank: statuses[rank] for rank in failed}
        if failed:
            self.notices.warn(f"ranks {failed} of run {self.run.run_id} failed or were killed (tags "
                              f"{TAG_PREFIX}rank{{R}}.status, .failure); the run is ended FAILED")

    def _wait_for_other_ranks(self) -> None:
        """Until every other wanted rank said how it ended, at most ``RANK_WAIT_SECONDS``; those that did not are
        tagged ``missing`` (a late rank that ends later tags itself again)."""
        expected = self.ranks.wanted_ranks()
        deadline = time.monotonic() + settings.RANK_WAIT_SECONDS
        while True:
            tags = self.run.tags()
            missing = [r for r in expected if tags.get(rank_status_tag(r)) not in RANK_ENDINGS]
            if not missing or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        self._tag_earliest_findings(tags, expected)
        self._end_if_ranks_failed({r: MISSING for r in missing}, rank_statuses(tags))
        if missing:
            self.notices.warn(f"ranks {missing} did not finish logging into run {self.run.run_id} within "
                              f"{settings.RANK_WAIT_SECONDS:.0f} s; they are tagged {TAG_PREFIX}rank{{R}}.status = "
                              f"missing, the run {TAG_PREFIX}missing_ranks")

    def _tag_earliest_findings(self, tags: dict[str, str], expected: list[int]) -> None:
        findings = {key: value for key, value in earliest_findings(tags, expected).items() if tags.get(key) != value}
        if findings:  # each rank tagged its own first finding as it came: the run's is the earliest of all ranks
            self.run.log(tags=findings)
