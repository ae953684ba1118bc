"""Against a real ``mlflow server``: the server dies mid-training, training goes on, and ``upload`` (or ``stop()``,
once the server is back) completes the run; a command finds the live server and reports a missing run as bad input."""
from __future__ import annotations

import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Callable

import pytest
import torch
from mlflow.tracking import MlflowClient

from msprobe_mlflow import GradProbeConfig
from msprobe_mlflow.pytorch import GradientMonitor
from msprobe_mlflow.tracking.upload import upload_dump
from mlflow_server import MlflowServer

pytestmark = pytest.mark.server


def csv_artifact_steps(client: MlflowClient, run_id: str) -> list[int]:
    """Steps of rank 0 whose summary CSV is on the server: the sink uploads it last, so those steps are complete."""
    return sorted(int(i.path.rsplit("_", 1)[1][:-4]) for i in client.list_artifacts(run_id, "grad_probe/rank0")
                  if i.path.endswith(".csv"))


def wait_until_complete(client: MlflowClient, run_id: str, steps: list[int], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while csv_artifact_steps(client, run_id) != steps:
        assert time.monotonic() < deadline, f"steps {steps} never all reached the server"
        time.sleep(0.2)


def count_run(client: MlflowClient, run_id: str) -> tuple[int, int]:
    metrics = sum(len(client.get_metric_history(run_id, k)) for k in client.get_run(run_id).data.metrics)

    def files(path):
        return sum(files(i.path) if i.is_dir else 1 for i in client.list_artifacts(run_id, path))
    return metrics, files("grad_probe")


@pytest.fixture
def server(tmp_path, monkeypatch):
    """A real server; while it is down, a request fails at once instead of after MLflow's retries (minutes)."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    server = MlflowServer(tmp_path / "server").start()
    yield server
    server.stop()


def monitored_training(dump: Path, server: MlflowServer) -> tuple[MlflowClient, str, GradientMonitor, Callable]:
    """A new run on the server, a monitor logging into it, and ``train(steps)``."""
    client = MlflowClient(server.uri)
    run_id = client.create_run(client.get_experiment_by_name("Default").experiment_id).info.run_id
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = GradientMonitor(GradProbeConfig(dump_path=str(dump), level="L1"), run_id=run_id,
                              tracking_uri=server.uri).monitor(model, optimizer)

    def train(steps: int) -> None:
        for _ in range(steps):
            optimizer.zero_grad()
            model(torch.randn(5, 4)).square().mean().backward()
            optimizer.step()
    return client, run_id, monitor, train


COMPLETE_RUN = (6 * 3, 1 + 6 * 2)  # 6 steps: L1's 3 summary scalars each; config.json + CSV and directions each


def test_server_killed_mid_training_then_upload_completes_the_run_once(tmp_path, server):
    client, run_id, monitor, train = monitored_training(tmp_path / "dump", server)
    train(2)
    wait_until_complete(client, run_id, [0, 1])
    server.stop()
    train(4)  # the server is down: training must not notice
    with pytest.warns(UserWarning, match="msprobe-mlflow upload"):
        monitor.stop()
    assert sorted(p.name for p in (tmp_path / "dump/rank0").glob("*.csv")) == \
        sorted(f"grad_summary_{s}.csv" for s in range(6))

    server.start()
    report = upload_dump(tmp_path / "dump", run_id, tracking_uri=server.uri)
    assert report.steps_completed[0] == [2, 3, 4, 5]
    assert count_run(client, run_id) == COMPLETE_RUN
    again = upload_dump(tmp_path / "dump", run_id, tracking_uri=server.uri)
    assert (again.metrics_logged, again.files_uploaded) == (0, 0)
    assert count_run(client, run_id) == COMPLETE_RUN


def test_stop_completes_the_run_when_the_server_is_back_by_then(tmp_path, server):
    client, run_id, monitor, train = monitored_training(tmp_path / "dump", server)
    train(2)
    wait_until_complete(client, run_id, [0, 1])
    server.stop()
    with pytest.warns(UserWarning, match=r"could not log steps 2\.\..*unsent steps are retried at stop"):
        train(4)
        monitor.flush()  # returns once steps 2..5 are remembered as unsent
    server.start()  # same port and stores
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        monitor.stop()
    assert not [w for w in caught if "msprobe-mlflow upload" in str(w.message)]
    assert csv_artifact_steps(client, run_id) == list(range(6))
    assert count_run(client, run_id) == COMPLETE_RUN
    assert client.get_run(run_id).data.tags["msprobe_mlflow.rank0.status"] == "finished"


def test_upload_to_a_run_the_server_does_not_know_exits_2_with_one_line(tmp_path, server):
    """The server check lets a live server through; the missing run is then bad input, not a server failure."""
    (tmp_path / "dump" / "rank0").mkdir(parents=True)
    missing = "0123456789abcdef0123456789abcdef"
    done = subprocess.run([sys.executable, "-m", "msprobe_mlflow", "upload", "dump", "--run-id", missing,
                           "--tracking-uri", server.uri], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("msprobe-mlflow upload: error: RESOURCE_DOES_NOT_EXIST: ") and missing in done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
