"""Rank-0 aggregated metrics: one small collective per step instead of one metrics request per rank.

Every rank turns its step's summary metrics (``grad/rank{R}/total_norm``, ``max``, ``min``, ... : the fixed keys of
:func:`msprobe_mlflow.metrics.step_metrics`, a few floats) into a vector ``[step, value, ...]``; the framework's
all-gather (passed in as a callable, like ``share_run_id``) hands every rank every vector, and only rank 0 sends,
in its one ``log_batch`` per round, its own values and each metric's distribution over the ranks
(:func:`rank_distribution`: ``grad/ranks/total_norm min``, ``median``, ``max``, and the ranks that hold the
extremes, ``min rank``, ``max rank``). So neither the requests nor the values per step grow with the number of
ranks (at 1,024 ranks every rank's own values were 5,120 a step, more than one server takes in time, and as many
keys in the MLflow UI); each rank's own values stay in its dump and its steps' files in the run, which ``compare``
reads. Files and per-parameter metrics (``param_metrics``) are still sent by each rank.

An all-gather rather than a gather, so that a failure is seen by every rank alike: when one rank misses a step (its
probe failed) the others time out in the collective (the framework's timeout), every rank counts the failure, and
from then on each rank sends its own metrics again; nothing is lost, the run only costs more requests. Each vector
carries its step: rank 0 takes each distribution over the ranks at the same step.

The run's bookkeeping follows the same rule, so that no request grows with the number of ranks except the files:
at the start rank 0 tags every rank ``running``, and at ``stop()`` one last exchange (step field ``END_OF_RUN``; under
torch.distributed through the rendezvous store, see ``pytorch.distributed``) hands rank 0 every rank's status,
which it tags in one ``log_batch``. A rank that does not arrive in time fails that exchange on every rank; each
rank then tags its own status and rank 0 waits for them as without aggregation.
"""
from __future__ import annotations

import os
from typing import Callable

import numpy as np

from msprobe_mlflow.vocabulary import RANK_DISTRIBUTION, RANK_ENDINGS, distribution_key, grad_key

# From the load test (benchmarks/results/load_test.md): at 64 ranks, one server worker no longer kept up with every
# rank sending its own metrics, while the collective costs a few floats per rank.
AGGREGATE_FROM_RANKS = 64
# How long a rank waits in the all-gather for a rank that missed a step before aggregation is given up.
GATHER_TIMEOUT_SECONDS = float(os.environ.get("MSPROBE_MLFLOW_GATHER_TIMEOUT_SECONDS", "300"))

END_OF_RUN = -1.0  # the step field of the last exchange, at stop(): [END_OF_RUN, index in RANK_STATUSES]
RANK_STATUSES = RANK_ENDINGS  # what a rank says of its own end (``tracking.RANK_ENDINGS``)

SummaryGather = Callable[[np.ndarray], np.ndarray]
"""A collective every rank calls with its 1-D float64 vector (equal lengths); returns the ``(world_size, length)``
matrix of every rank's vector, in rank order."""


def aggregation_wanted(option: bool | None, world_size: int) -> bool:
    """``option`` True/False forces it; None (the default) turns it on from ``AGGREGATE_FROM_RANKS`` ranks."""
    return world_size >= AGGREGATE_FROM_RANKS if option is None else option and world_size > 1


def _suffix(key: str, rank: int) -> str:
    return key[len(grad_key(rank)):]


def is_summary_key(key: str, rank: int) -> bool:
    """A fixed per-rank key (gathered), not a per-parameter one (``grad/rank{R}/param/...``, sent by the rank)."""
    return key.startswith(grad_key(rank)) and not _suffix(key, rank).startswith("param/")


def rank_distribution(suffixes: list[str], ranks: np.ndarray, values: np.ndarray) -> dict[str, float]:
    """Each summary metric's distribution over ``ranks`` (``values``: a row per rank, a column per suffix): min,
    median and max over the ranks whose value is finite, and the ranks holding the min and the max (the lowest such
    rank); NaN where no rank's value is finite (the anomaly flags name non-finite gradients)."""
    metrics = {}
    for suffix, column in zip(suffixes, values.T):
        finite = np.isfinite(column)
        if finite.any():
            low, high = np.argmin(np.where(finite, column, np.inf)), np.argmax(np.where(finite, column, -np.inf))
            found = (column[low], np.median(column[finite]), column[high], ranks[low], ranks[high])
        else:
            found = (np.nan,) * len(RANK_DISTRIBUTION)
        metrics.update({distribution_key(suffix, name): float(value) for name, value in zip(RANK_DISTRIBUTION, found)})
    return metrics


class RankZeroMetrics:
    """The exchange of one rank's summary metrics; the suffixes (``total_norm``, ...) are sorted, so every rank
    running the same config lays its vector out alike."""

    def __init__(self, gather: SummaryGather, rank: int):
        self.gather = gather
        self.rank = rank
        self.length = 2  # of the vectors exchanged so far: the end-of-run one has the same (a collective's sizes agree)

    def exchange(self, step: int, metrics: dict[str, float]) -> tuple[dict[str, float], dict[int, dict[str, float]]]:
        """Gathers the summary metrics of every rank (a collective: every rank calls it once per sent step).

        Returns what this rank sends at ``step``: all of its metrics on rank 0, its per-parameter ones elsewhere;
        and on rank 0 the distributions over the ranks (:func:`rank_distribution`) by step, ``{step: {key: value}}``
        (one step unless a rank has missed one; empty elsewhere)."""
        suffixes = sorted(_suffix(k, self.rank) for k in metrics if is_summary_key(k, self.rank))
        vector = np.array([step, *(metrics[grad_key(self.rank, s)] for s in suffixes)], dtype=np.float64)
        self.length = len(vector)
        matrix = np.asarray(self.gather(vector), dtype=np.float64)
        if self.rank != 0:
            return {k: v for k, v in metrics.items() if not is_summary_key(k, self.rank)}, {}
        if matrix.ndim != 2 or matrix.shape[1] != len(vector):
            raise ValueError(f"the gathered summary vectors have shape {matrix.shape}; expected (world_size, "
                             f"{len(vector)}): do all ranks run the same grad_probe config?")
        if (ended := np.flatnonzero(matrix[:, 0] == END_OF_RUN)).size:
            raise ValueError(f"ranks {ended.tolist()} stopped monitoring while rank 0 probed step {step}")
        steps = matrix[:, 0].astype(np.int64)
        return metrics, {int(at): rank_distribution(suffixes, np.flatnonzero(steps == at), matrix[steps == at, 1:])
                         for at in np.unique(steps)}

    def exchange_statuses(self, status: str) -> dict[int, str]:
        """The last collective, at ``stop()``: every rank's status (one of ``RANK_STATUSES``), returned on rank 0 as
        ``{rank: status}`` (empty elsewhere), so the other ranks need send no request to end the run."""
        vector = np.zeros(self.length)
        vector[:2] = END_OF_RUN, RANK_STATUSES.index(status)
        matrix = np.asarray(self.gather(vector), dtype=np.float64)
        if matrix.ndim != 2 or (matrix[:, 0] != END_OF_RUN).any():
            steps = matrix[:, 0].tolist() if matrix.ndim == 2 else matrix
            raise ValueError(f"the end-of-run exchange met other ranks still exchanging steps {steps}: did every rank "
                             f"probe the same steps?")
        return {rank: RANK_STATUSES[int(code)] for rank, code in enumerate(matrix[:, 1])} if self.rank == 0 else {}
