"""Rank-0 aggregated metrics under MindSpore's communication package: a 2-worker msrun job (CPU) whose rank 1
cannot reach the tracking server, so rank 1's values are in the run only through rank 0's requests: in each
summary metric's distribution over the ranks."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from mlflow_server import free_port
from test_scale_torch import check_distributions, expected_summary

pytest.importorskip("mindspore", reason="MindSpore is not installed (the torch-only stage)")
WORKER = Path(__file__).with_name("scale_worker_mindspore.py")


def test_rank_0_sends_the_summary_metrics_of_a_mindspore_rank_that_cannot_reach_the_server(tmp_path, tmp_sqlite_uri):
    client = MlflowClient(tmp_sqlite_uri)
    run_id = client.create_run(client.create_experiment("aggregated")).info.run_id
    dump, logs = tmp_path / "dump", tmp_path / "logs"
    bin_dir = str(Path(sys.executable).parent)
    msrun = shutil.which("msrun", path=bin_dir)
    assert msrun, f"msrun is not in {bin_dir}"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ.get('PATH', '')}", "MLFLOW_RUN_ID": run_id,
           "MSPROBE_MLFLOW_RANK_WAIT_SECONDS": "1", "MSPROBE_MLFLOW_START_CHECK_SECONDS": "1",
           "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "2"}
    command = [msrun, "--worker_num=2", "--local_worker_num=2", f"--master_port={free_port()}",
               f"--log_dir={logs}", "--join=True", str(WORKER), "--dump", str(dump), "--tracking-uri", tmp_sqlite_uri]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    output = "".join(path.read_text(errors="replace") for path in sorted(logs.glob("worker_*.log")))
    assert done.returncode == 0, (done.stdout + done.stderr)[-2000:] + output[-3000:]
    assert "RANK 0 ERRORS 0" in output and "RANK 1 ERRORS 0" in output, output[-3000:]
    for name, value in expected_summary(dump, 0, 2).items():  # rank 0's own
        history = client.get_metric_history(run_id, f"grad/rank0/{name}")
        assert [m.step for m in history] == [0, 1, 2], name
        assert history[-1].value == value, name
    check_distributions(client, run_id, dump, {step: [0, 1] for step in range(3)})
    assert not client.list_artifacts(run_id, "grad_probe/rank1")
    tags = client.get_run(run_id).data.tags  # rank 0 tagged both ranks' statuses from the end-of-run exchange
    assert (tags["msprobe_mlflow.rank0.status"], tags["msprobe_mlflow.rank1.status"]) == ("finished", "incomplete")
    assert "msprobe_mlflow.missing_ranks" not in tags
