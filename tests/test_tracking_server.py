"""Against a real ``mlflow server``: the server dies mid-training, training goes on, ``upload`` completes the run."""
from __future__ import annotations

import time

import mlflow
import pytest
import torch
from mlflow.tracking import MlflowClient

from msprobe_mlflow import GradProbeConfig
from msprobe_mlflow.pytorch import GradientMonitor
from msprobe_mlflow.tracking.upload import upload_dump
from mlflow_server import MlflowServer

pytestmark = pytest.mark.server


def wait_for_metric_steps(client: MlflowClient, run_id: str, key: str, count: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while len(client.get_metric_history(run_id, key)) < count:
        assert time.monotonic() < deadline, f"{key} never reached {count} values"
        time.sleep(0.2)


def count_run(client: MlflowClient, run_id: str) -> tuple[int, int]:
    metrics = sum(len(client.get_metric_history(run_id, k)) for k in client.get_run(run_id).data.metrics)

    def files(path):
        return sum(files(i.path) if i.is_dir else 1 for i in client.list_artifacts(run_id, path))
    return metrics, files("grad_probe")


def test_server_killed_mid_training_then_upload_completes_the_run_once(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    server = MlflowServer(tmp_path / "server").start()
    try:
        client = MlflowClient(server.uri)
        run_id = client.create_run(client.get_experiment_by_name("Default").experiment_id).info.run_id
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        monitor = GradientMonitor(GradProbeConfig(dump_path=str(tmp_path / "dump"), level="L1"), run_id=run_id,
                                  tracking_uri=server.uri).monitor(model, optimizer)

        def train(steps):
            for _ in range(steps):
                optimizer.zero_grad()
                model(torch.randn(5, 4)).square().mean().backward()
                optimizer.step()

        train(2)
        wait_for_metric_steps(client, run_id, "grad/rank0/total_norm", 2)
        server.stop()
        train(4)  # the server is down: training must not notice
        with pytest.warns(UserWarning, match="msprobe-mlflow upload"):
            monitor.stop()
        assert sorted(p.name for p in (tmp_path / "dump/rank0").glob("*.csv")) == \
            sorted(f"grad_summary_{s}.csv" for s in range(6))

        server.start()
        report = upload_dump(tmp_path / "dump", run_id, tracking_uri=server.uri)
        assert report.steps_completed[0] == [2, 3, 4, 5]
        metrics, files = count_run(client, run_id)
        assert metrics == 6 * 5  # L1: 5 summary scalars per step
        assert files == 1 + 6 * 2  # config.json + CSV and directions per step
        again = upload_dump(tmp_path / "dump", run_id, tracking_uri=server.uri)
        assert (again.metrics_logged, again.files_uploaded) == (0, 0)
        assert count_run(client, run_id) == (metrics, files)
    finally:
        server.stop()
