"""A real 2-worker ``msrun`` job (MindSpore's launcher, the CPU's ``mccl`` backend) logs both ranks into rank 0's
MLflow run: the run ID goes over MindSpore's own communication, rank 0 waits for the other rank and names it when
it does not finish. With ``GradientMonitor`` in a loop of the user's (GRAPH_MODE), and with ``Model.train`` and
``GradProbeCallback`` (PyNative), whose rank 0 starts the run itself."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mindspore", reason="MindSpore is not installed (the torch-only stage)")
from mlflow.tracking import MlflowClient  # noqa: E402

from click.testing import CliRunner  # noqa: E402

from mlflow_server import free_port  # noqa: E402
from msprobe_mlflow.commands.cli import main as cli  # noqa: E402

WORKER = Path(__file__).with_name("mindspore_msrun_worker.py")
REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent


def msrun(tmp_path: Path, tracking_uri: str, *worker_args: str, timeout: float = 480,
          succeeds: bool = True) -> tuple[str, str]:
    """Runs tests/mindspore_msrun_worker.py on 2 workers; returns rank 0's and rank 1's log. ``succeeds``: whether
    msrun must exit 0 (else non-zero: a worker failed)."""
    logs = tmp_path / "msrun_logs"
    # msrun starts `python` from PATH: this venv's, with this tree's package first
    env = {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}", "MLFLOW_TRACKING_URI": tracking_uri,
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "MSPROBE_MLFLOW_RANK_WAIT_SECONDS": "5"}
    command = [str(VENV_BIN / "msrun"), "--worker_num=2", "--local_worker_num=2", "--master_addr=127.0.0.1",
               f"--master_port={free_port()}", f"--log_dir={logs}", "--join=True", str(WORKER), *worker_args]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout, cwd=tmp_path)
    worker_logs = [(logs / f"worker_{rank}.log").read_text(errors="replace") for rank in (0, 1)]
    assert (done.returncode == 0) == succeeds, "\n".join([done.stderr[-2000:], *(log[-3000:] for log in worker_logs)])
    return worker_logs[0], worker_logs[1]


def run_id_in(log: str) -> str:
    lines = [line for line in log.splitlines() if line.startswith("RUN_ID ")]
    assert lines, log[-3000:]
    return lines[0].split()[1]


def test_both_msrun_ranks_log_every_step_into_rank_0s_run(tmp_path, tmp_sqlite_uri):
    rank0_log, _ = msrun(tmp_path, tmp_sqlite_uri, "--dump", str(tmp_path / "dump"), "--steps", "3", "--mode", "graph")
    run_id = run_id_in(rank0_log)
    client = MlflowClient(tmp_sqlite_uri)
    tags = client.get_run(run_id).data.tags
    assert (tags["msprobe_mlflow.framework"], tags["msprobe_mlflow.world_size"]) == ("mindspore", "2")
    assert [tags[f"msprobe_mlflow.rank{r}.status"] for r in (0, 1)] == ["finished", "finished"]
    assert "msprobe_mlflow.missing_ranks" not in tags
    assert len(client.search_runs([client.get_run(run_id).info.experiment_id])) == 1  # rank 1 made no run
    for rank in (0, 1):
        assert [m.step for m in client.get_metric_history(run_id, f"grad/rank{rank}/total_norm")] == [0, 1, 2]
        local = sorted(p.name for p in (tmp_path / "dump" / f"rank{rank}").glob("*.csv"))
        assert local == [f"grad_summary_{s}.csv" for s in range(3)]
    # data parallel: the gradients are averaged over the ranks before the optimizer, so both probed the same ones
    assert (tmp_path / "dump/rank0/grad_summary_2.csv").read_bytes() == \
        (tmp_path / "dump/rank1/grad_summary_2.csv").read_bytes()


def test_with_the_callback_rank_0_starts_the_run_and_tags_a_rank_that_has_not_finished(tmp_path, tmp_sqlite_uri):
    rank0_log, _ = msrun(tmp_path, tmp_sqlite_uri, "--dump", str(tmp_path / "dump"), "--steps", "2", "--mode",
                         "pynative", "--level", "L1", "--trainer", "model", "--late-rank", "1")
    run_id = run_id_in(rank0_log)
    client = MlflowClient(tmp_sqlite_uri)
    run = client.get_run(run_id)
    assert (run.data.tags["mlflow.autologging"], run.info.status) == ("msprobe_mlflow", "FINISHED")
    assert len(client.search_runs([run.info.experiment_id])) == 1  # rank 1 started none
    assert run.data.tags["msprobe_mlflow.missing_ranks"] == "1"
    assert "ranks [1] did not finish" in rank0_log
    for rank in (0, 1):  # the late rank's steps are in the run all the same
        assert [m.step for m in client.get_metric_history(run_id, f"grad/rank{rank}/total_norm")] == [0, 1]


def test_a_rank_that_raises_under_msrun_fails_the_run_and_upload_names_the_killed_rank_missing(tmp_path,
                                                                                               tmp_sqlite_uri):
    """Rank 1 raises at step 2; msrun --join=True then SIGKILLs rank 0, which can say nothing: rank 1 tags itself
    failed and ends the run FAILED, and the next upload tags rank 0 missing."""
    rank0_log, rank1_log = msrun(tmp_path, tmp_sqlite_uri, "--dump", str(tmp_path / "dump"), "--steps", "4", "--mode",
                                 "pynative", "--level", "L1", "--trainer", "model", "--raise-at", "1", "2",
                                 succeeds=False)
    assert "training fails at step 2 on purpose" in rank1_log
    client = MlflowClient(tmp_sqlite_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("Default").experiment_id])
    tags = run.data.tags
    assert run.info.status == "FAILED"
    assert (tags["msprobe_mlflow.rank1.status"], tags["msprobe_mlflow.failed_ranks"]) == ("failed", "1")
    assert tags["msprobe_mlflow.rank1.failure"] == "RuntimeError: training fails at step 2 on purpose"
    assert tags["msprobe_mlflow.rank0.status"] == "running"  # SIGKILLed by msrun
    result = CliRunner().invoke(cli, ["upload", str(tmp_path / "dump"), "--run-id", run.info.run_id,
                                      "--tracking-uri", tmp_sqlite_uri])
    assert result.exit_code == 0, result.output
    after = client.get_run(run.info.run_id).data.tags
    assert (after["msprobe_mlflow.rank0.status"], after["msprobe_mlflow.missing_ranks"]) == ("missing", "0")
