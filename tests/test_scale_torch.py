"""Rank-0 aggregated metrics under torch.distributed: a 2-process gloo job (torchrun) whose rank 1 cannot reach
the tracking server, so rank 1's values are in the run only through rank 0's requests and the gloo all-gather: in
each summary metric's distribution over the ranks."""
from __future__ import annotations

import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

from mlflow.tracking import MlflowClient

from mlflow_server import free_port
from msprobe_mlflow.dump import read_summary, summary_csv_path

WORKER = Path(__file__).with_name("scale_worker_torch.py")


def expected_summary(dump: Path, rank: int, step: int) -> dict[str, float]:
    """The summary metrics of one step, from the rank's local CSV with plain Python."""
    table = read_summary(summary_csv_path(dump, rank, step))
    norms = table.numbers("norm")
    return {"total_norm": math.sqrt(sum(n * n for n in norms)), "max": max(table.numbers("max")),
            "min": min(table.numbers("min"))}


def check_distributions(client: MlflowClient, run_id: str, dump: Path, ranks_at: dict[int, list[int]]) -> None:
    """The run's distributions over the ranks (``grad/ranks/{name} {statistic}``) at each step of ``ranks_at``
    (step -> the ranks whose values it holds) against the ranks' own CSVs; and no key of a rank but rank 0."""
    for name in ("total_norm", "max", "min"):
        values = {step: [expected_summary(dump, rank, step)[name] for rank in ranks]
                  for step, ranks in ranks_at.items()}
        expected = {"min": {s: min(v) for s, v in values.items()}, "max": {s: max(v) for s, v in values.items()},
                    "median": {s: statistics.median(v) for s, v in values.items()},
                    "min rank": {s: ranks_at[s][v.index(min(v))] for s, v in values.items()},
                    "max rank": {s: ranks_at[s][v.index(max(v))] for s, v in values.items()}}
        for statistic, by_step in expected.items():
            history = client.get_metric_history(run_id, f"grad/ranks/{name} {statistic}")
            assert {m.step: m.value for m in history} == by_step, (name, statistic)
    assert not [key for key in client.get_run(run_id).data.metrics if key.startswith("grad/rank1/")]


def torchrun(tmp_path: Path, tracking_uri: str, *worker_args: str) -> tuple[subprocess.CompletedProcess, str]:
    """Runs the worker on 2 ranks, its dump in ``tmp_path``; returns the finished job and the run ID rank 0
    printed."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
               "--master-port", str(free_port()), str(WORKER), "--dump", str(tmp_path / "dump"), "--tracking-uri",
               tracking_uri, *worker_args]
    env = {**os.environ, "MSPROBE_MLFLOW_RANK_WAIT_SECONDS": "1", "MSPROBE_MLFLOW_START_CHECK_SECONDS": "1",
           "MSPROBE_MLFLOW_GATHER_TIMEOUT_SECONDS": "5", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
           "MLFLOW_HTTP_REQUEST_TIMEOUT": "2"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done, next(line.split()[1] for line in done.stdout.splitlines() if line.startswith("RUN_ID "))


def test_rank_0_sends_the_summary_metrics_of_a_rank_that_cannot_reach_the_server(tmp_path, tmp_sqlite_uri):
    done, run_id = torchrun(tmp_path, tmp_sqlite_uri)
    dump = tmp_path / "dump"
    assert done.stdout.count("ERRORS 0") == 2, done.stdout
    client = MlflowClient(tmp_sqlite_uri)
    for name, value in expected_summary(dump, 0, 2).items():  # rank 0's own
        history = client.get_metric_history(run_id, f"grad/rank0/{name}")
        assert [m.step for m in history] == [0, 1, 2], name
        assert history[-1].value == value, name
    check_distributions(client, run_id, dump, {step: [0, 1] for step in range(3)})
    # Rank 1 could send nothing itself: no files of its own, and the run names its steps as unsent. Rank 0 tagged
    # both ranks' statuses, which it had from the end-of-run exchange.
    tags = client.get_run(run_id).data.tags
    assert tags["msprobe_mlflow.rank0.status"] == "finished"
    assert tags["msprobe_mlflow.rank1.status"] == "incomplete"
    assert "msprobe_mlflow.missing_ranks" not in tags and "msprobe_mlflow.rank1.dump_path" not in tags
    assert not client.list_artifacts(run_id, "grad_probe/rank1")
    assert "rank 1" in done.stderr and "msprobe-mlflow upload" in done.stderr


def test_a_rank_that_never_reaches_the_end_of_run_exchange_is_tagged_missing(tmp_path, tmp_sqlite_uri):
    done, run_id = torchrun(tmp_path, tmp_sqlite_uri, "--rank1-leaves")
    assert "ERRORS 0" in done.stdout, done.stdout
    assert "end-of-run exchange of the ranks' statuses failed" in done.stderr
    tags = MlflowClient(tmp_sqlite_uri).get_run(run_id).data.tags
    assert tags["msprobe_mlflow.rank0.status"] == "finished"
    assert tags["msprobe_mlflow.rank1.status"] == "missing"  # running from the start; rank 0 found it never ended
    assert tags["msprobe_mlflow.missing_ranks"] == "1"


def test_an_all_gather_that_times_out_is_counted_and_rank_0_sends_its_own_metrics_again(tmp_path, tmp_sqlite_uri):
    # Rank 1 probes steps 0 and 2, rank 0 every step: rank 0's gather at step 1 pairs with rank 1's at step 2
    # (each vector says its step), rank 0's gather at step 2 finds no partner and times out after 5 s.
    done, run_id = torchrun(tmp_path, tmp_sqlite_uri, "--rank1-steps", "0", "2")
    dump, client = tmp_path / "dump", MlflowClient(tmp_sqlite_uri)
    assert "ERRORS 1" in done.stdout and "ERRORS 0" in done.stdout, done.stdout
    assert "aggregation of summary metrics failed at step 2" in done.stderr
    history = client.get_metric_history(run_id, "grad/rank0/total_norm")
    assert [(m.step, m.value) for m in history] == [(s, expected_summary(dump, 0, s)["total_norm"]) for s in range(3)]
    # rank 0's step 1 and rank 1's step 2 met in one exchange: each is its step's distribution, of one rank
    check_distributions(client, run_id, dump, {0: [0, 1], 1: [0], 2: [1]})
