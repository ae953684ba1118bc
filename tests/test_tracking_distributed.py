"""A 2-process torch.distributed (gloo) job logs both ranks into one MLflow run, nothing lost."""
from __future__ import annotations

import csv
import math
import os
import subprocess
import sys
from pathlib import Path

from mlflow.tracking import MlflowClient

from mlflow_server import free_port

WORKER = Path(__file__).with_name("distributed_worker.py")


def child_environment(tracking_uri: str, **extra: str) -> dict[str, str]:
    """This process's environment (a test's MLFLOW_EXPERIMENT_ID included: the topology tests set theirs) for
    the job's processes, pointed at ``tracking_uri``."""
    return {**os.environ, "MLFLOW_TRACKING_URI": tracking_uri, **extra}


def torchrun(tracking_uri: str, *worker_args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Runs tests/distributed_worker.py on 2 ranks; returns the finished process (stdout holds RUN_ID)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
               "127.0.0.1", "--master-port", str(free_port()), str(WORKER), *worker_args]
    env = child_environment(tracking_uri, MSPROBE_MLFLOW_RANK_WAIT_SECONDS="20")
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout)


def launch_ranks_separately(tracking_uri: str, *worker_args: str,
                            timeout: float = 300) -> list[subprocess.CompletedProcess]:
    """Each rank its own launcher (as on separate nodes), so one rank dying does not kill the other."""
    port = str(free_port())
    processes = []
    for rank in (0, 1):
        env = child_environment(tracking_uri, MSPROBE_MLFLOW_RANK_WAIT_SECONDS="10", RANK=str(rank),
                                LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        processes.append(subprocess.Popen([sys.executable, str(WORKER), *worker_args], env=env, text=True,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    finished = []
    for process in processes:  # communicate() drains the pipes while waiting: a rank printing a lot cannot block
        stdout, stderr = process.communicate(timeout=timeout)
        finished.append(subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr))
    return finished


def run_id_of(done: subprocess.CompletedProcess) -> str:
    lines = [line for line in done.stdout.splitlines() if line.startswith("RUN_ID ")]
    assert lines, done.stdout + done.stderr
    return lines[0].split()[1]


def artifact_files(client: MlflowClient, run_id: str, path: str) -> list[str]:
    found = []
    for info in client.list_artifacts(run_id, path):
        found += artifact_files(client, run_id, info.path) if info.is_dir else [info.path]
    return found


def test_two_ranks_log_into_one_run_with_every_metric_and_file(tmp_path, tmp_sqlite_uri):
    done = torchrun(tmp_sqlite_uri, "--dump", str(tmp_path / "dump"), "--steps", "4")
    assert done.returncode == 0, done.stderr[-3000:]
    run_id = run_id_of(done)
    client = MlflowClient(tmp_sqlite_uri)
    run = client.get_run(run_id)
    assert run.data.tags["msprobe_mlflow.world_size"] == "2"
    assert [run.data.tags[f"msprobe_mlflow.rank{r}.status"] for r in (0, 1)] == ["finished", "finished"]
    assert "msprobe_mlflow.missing_ranks" not in run.data.tags
    for rank in (0, 1):
        keys = [k for k in run.data.metrics if k.startswith(f"grad/rank{rank}/")]
        assert len(keys) == 8  # L2 with bounds [-1, 0, 1]: total_norm, max, min + 4 buckets + exactly 0
        for key in keys:
            assert [m.step for m in client.get_metric_history(run_id, key)] == [0, 1, 2, 3]
        files = artifact_files(client, run_id, f"grad_probe/rank{rank}")
        assert sorted(files) == sorted([f"grad_probe/rank{rank}/grad_summary_{s}.csv" for s in range(4)]
                                       + [f"grad_probe/rank{rank}/step{s}/directions.npz" for s in range(4)])
        local = sorted(p.name for p in (tmp_path / "dump" / f"rank{rank}").glob("*.csv"))
        assert local == [f"grad_summary_{s}.csv" for s in range(4)]
    # DDP all-reduces the gradients: both ranks saw the same ones.
    assert (tmp_path / "dump/rank0/grad_summary_3.csv").read_bytes() == \
        (tmp_path / "dump/rank1/grad_summary_3.csv").read_bytes()


def test_a_rank_that_dies_is_named_in_the_run_and_the_other_rank_is_complete(tmp_path, tmp_sqlite_uri):
    rank0, rank1 = launch_ranks_separately(tmp_sqlite_uri, "--dump", str(tmp_path / "dump"), "--steps", "4",
                                           "--die-at", "2")
    assert (rank0.returncode, rank1.returncode) == (0, 17), rank0.stderr[-3000:]
    run_id = run_id_of(rank0)
    run = MlflowClient(tmp_sqlite_uri).get_run(run_id)
    assert run.data.tags["msprobe_mlflow.missing_ranks"] == "1"
    assert run.data.tags["msprobe_mlflow.rank1.status"] == "missing"  # it never said how it ended
    assert "msprobe_mlflow.failed_ranks" not in run.data.tags  # nothing says it failed: it may only be late
    assert "ranks [1] did not finish" in rank0.stderr
    history = MlflowClient(tmp_sqlite_uri).get_metric_history(run_id, "grad/rank0/total_norm")
    assert [m.step for m in history] == [0, 1, 2, 3]


def test_the_configs_rank_filter_decides_which_ranks_log_into_the_run(tmp_path, tmp_sqlite_uri):
    done = torchrun(tmp_sqlite_uri, "--dump", str(tmp_path / "dump"), "--steps", "2", "--level", "L1", "--ranks", "1")
    assert done.returncode == 0, done.stderr[-3000:]
    run_id = run_id_of(done)
    client = MlflowClient(tmp_sqlite_uri)
    run = client.get_run(run_id)
    assert {key.split("/")[1] for key in run.data.metrics} == {"rank1"}
    assert [m.step for m in client.get_metric_history(run_id, "grad/rank1/total_norm")] == [0, 1]
    assert sorted(artifact_files(client, run_id, "grad_probe")) == sorted(
        [f"grad_probe/rank1/grad_summary_{s}.csv" for s in range(2)]
        + [f"grad_probe/rank1/step{s}/directions.npz" for s in range(2)])
    assert sorted(p.name for p in (tmp_path / "dump").glob("rank*")) == ["rank1"]


def first_nonfinite_step(rank_folder: Path) -> int:
    """From the dump's CSVs: the first step with a non-finite max, min or norm."""
    for step in range(len(list(rank_folder.glob("grad_summary_*.csv")))):
        with open(rank_folder / f"grad_summary_{step}.csv", encoding="utf-8-sig") as file:
            rows = list(csv.DictReader(file))
        if not all(math.isfinite(float(row[column])) for row in rows for column in ("max", "min", "norm")):
            return step
    raise AssertionError(f"no non-finite gradient in {rank_folder}")


def test_the_runs_first_finding_is_the_earliest_of_all_ranks_whichever_rank_tagged_last(tmp_path, tmp_sqlite_uri):
    done = torchrun(tmp_sqlite_uri, "--dump", str(tmp_path / "dump"), "--steps", "4", "--level", "L1",
                    "--nan-at", "1", "1")
    assert done.returncode == 0, done.stderr[-3000:]
    tags = MlflowClient(tmp_sqlite_uri).get_run(run_id_of(done)).data.tags
    first = {rank: first_nonfinite_step(tmp_path / "dump" / f"rank{rank}") for rank in (0, 1)}
    assert first[1] == 1 and first[0] > 1  # rank 0 sees NaN only once rank 1's NaN weights reach the all-reduce
    for rank in (0, 1):
        assert tags[f"msprobe_mlflow.rank{rank}.first_nonfinite_step"] == str(first[rank])
    assert tags["msprobe_mlflow.first_nonfinite_step"] == "1"
    assert tags["msprobe_mlflow.nonfinite_parameters"] == tags["msprobe_mlflow.rank1.nonfinite_parameters"]
