"""A user who switches framework sees the same files and the same MLflow run: the same gradients given to the
PyTorch monitor and to the MindSpore monitor give byte-identical dumps and the same metrics and artifacts."""
from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import mlflow
import numpy as np
import pytest
import torch
from mlflow.tracking import MlflowClient

ms = pytest.importorskip("mindspore", reason="MindSpore is not installed (the torch-only stage)")
from mindspore import Tensor, nn  # noqa: E402

from mlflow_stores import sqlite_uri
from msprobe_mlflow.config import GradProbeConfig
from msprobe_mlflow.dump import read_summary
from msprobe_mlflow.mindspore import GradientMonitor as MindSporeMonitor
from msprobe_mlflow.pytorch import GradientMonitor as TorchMonitor

SHARED_BOUNDS = (-1, 0, 1)  # the frameworks' defaults differ (msprobe's): both get the same bounds to compare
MS_DTYPES = {"float32": ms.float32, "float16": ms.float16, "bfloat16": ms.bfloat16, "float64": ms.float64}
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                "float64": torch.float64}


@pytest.fixture(autouse=True)
def in_tmp_path(tmp_path, monkeypatch):
    """MindSpore writes compiler reports (rank_0/om/...) into the current folder."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture(params=["pynative", "graph"])
def mode(request):
    previous = ms.get_context("mode")
    ms.set_context(mode=ms.PYNATIVE_MODE if request.param == "pynative" else ms.GRAPH_MODE)
    yield request.param
    ms.set_context(mode=previous)


class TorchNet(torch.nn.Module):  # its own model: the twin of MindSporeNet below, name for name
    def __init__(self, dtype, hidden=(20, 30)):
        super().__init__()
        self.fc1 = torch.nn.Linear(hidden[0], hidden[1], dtype=dtype)
        self.head = torch.nn.Linear(hidden[1], 1, dtype=dtype)

    def forward(self, x):
        return self.head(self.fc1(x))


class MindSporeNet(nn.Cell):
    """The same parameter names, shapes and order as :class:`TorchNet` (Dense weights are [out, in] too)."""

    def __init__(self, dtype, hidden=(20, 30)):
        super().__init__()
        self.fc1 = nn.Dense(hidden[0], hidden[1], dtype=dtype)
        self.head = nn.Dense(hidden[1], 1, dtype=dtype)


class KeepParameters(nn.Optimizer):
    """An optimizer that leaves the parameters as they are: MindSpore's CPU SGD kernel rejects bfloat16, and the
    monitor only needs the gradients the optimizer receives."""

    def construct(self, gradients):
        return True


def gradients_for(dtype: str, seed: int, hidden=(20, 30)) -> dict[str, np.ndarray]:
    """Random gradients exactly representable in ``dtype`` (so both frameworks hold the same values), with NaN,
    ±inf, ±0 and the bucket bounds -1, 0, 1 themselves (right-closed buckets) placed by hand; in float64 also
    1e-50, which is positive although its float32 value is 0."""
    rng = np.random.default_rng(seed)
    shapes = {"fc1.weight": (hidden[1], hidden[0]), "fc1.bias": (hidden[1],), "head.weight": (1, hidden[1]),
              "head.bias": (1,)}
    grads = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}
    grads["fc1.weight"][0, :6] = [-1.0, 0.0, 1.0, -0.0, 0.0, 1.0]
    grads["fc1.bias"][:3] = [np.inf, -np.inf, 0.0]
    if seed % 2:
        grads["head.weight"][0, 0] = np.nan
    for name, grad in grads.items():
        if dtype == "float16":
            grads[name] = grad.astype(np.float16)
        elif dtype == "bfloat16":  # keep the top 16 bits: a bfloat16 value
            grads[name] = (grad.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
        elif dtype == "float64":
            grads[name] = grad.astype(np.float64)
    if dtype == "float64":
        grads["fc1.bias"][5] = 1e-50
    return grads


def torch_dump(path: Path, level: str, dtype: str, steps: list[dict], log_to_mlflow=False) -> str | None:
    """Runs the PyTorch monitor on ``steps``; returns the MLflow run it logged into."""
    model = TorchNet(TORCH_DTYPES[dtype])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    monitor = TorchMonitor(GradProbeConfig(dump_path=str(path), level=level, bounds=SHARED_BOUNDS),
                           log_to_mlflow=log_to_mlflow).monitor(model, optimizer)
    for grads in steps:
        with torch.no_grad():  # a forward the monitor sees: it records the step's format, as MindSpore's does
            model(torch.zeros(1, model.fc1.in_features, dtype=TORCH_DTYPES[dtype]))
        for name, parameter in model.named_parameters():
            parameter.grad = torch.from_numpy(grads[name]).to(TORCH_DTYPES[dtype])
        optimizer.step()
    run_id = monitor.run_id
    monitor.stop()
    return run_id


def mindspore_dump(path: Path, level: str, dtype: str, steps: list[dict], log_to_mlflow=False) -> str | None:
    """Runs the MindSpore monitor on ``steps``; returns the MLflow run it logged into."""
    net = MindSporeNet(MS_DTYPES[dtype])
    optimizer = KeepParameters(0.0, net.trainable_params())
    monitor = MindSporeMonitor(GradProbeConfig(dump_path=str(path), level=level, bounds=SHARED_BOUNDS),
                               log_to_mlflow=log_to_mlflow).monitor(optimizer)
    for grads in steps:
        # mutable: in GRAPH_MODE a tuple of tensors from Python is otherwise a compile-time constant, which the
        # compiler folds with host code whose float32 sums may round differently (1 ulp in a norm)
        optimizer(ms.mutable(tuple(Tensor(grads[p.name]).astype(MS_DTYPES[dtype]) for p in optimizer.parameters)))
    run_id = monitor.run_id
    monitor.stop()
    return run_id


def ulp(value: float, dtype: str) -> float:
    """The spacing of representable ``dtype`` values at ``value`` (bfloat16 keeps 8 of float32's 24 bits)."""
    if dtype == "float16":
        return float(np.spacing(np.float16(value)))
    return float(np.spacing(np.float32(value))) * (2 ** 16 if dtype == "bfloat16" else 1)


def assert_same_dump(torch_path: Path, mindspore_path: Path, dtype: str, steps: int, has_directions: bool) -> None:
    """Direction files byte for byte; CSV text cell for cell, except each norm, which may differ by one rounding
    in ``dtype``: torch's CPU ``_foreach_norm`` sums float32 squares lane by lane, MindSpore's CPU sum rounds
    correctly, so for some gradients (even 30 elements) the last bit differs."""
    for step in range(steps):
        torch_table = read_summary(torch_path / "rank0" / f"grad_summary_{step}.csv")
        mindspore_table = read_summary(mindspore_path / "rank0" / f"grad_summary_{step}.csv")
        assert mindspore_table.header == torch_table.header
        norm = torch_table.header.index("norm")
        assert len(mindspore_table.rows) == len(torch_table.rows) == 4
        for torch_row, mindspore_row in zip(torch_table.rows, mindspore_table.rows):
            assert mindspore_row[:norm] + mindspore_row[norm + 1:] == torch_row[:norm] + torch_row[norm + 1:]
            torch_norm, mindspore_norm = float(torch_row[norm]), float(mindspore_row[norm])
            if np.isfinite(torch_norm):
                assert abs(mindspore_norm - torch_norm) <= ulp(torch_norm, dtype), torch_row[0]
            else:
                assert mindspore_row[norm] == torch_row[norm]
        directions = f"rank0/step{step}/directions.npz"
        assert (mindspore_path / directions).exists() == (torch_path / directions).exists() == has_directions
        if has_directions:
            assert (mindspore_path / directions).read_bytes() == (torch_path / directions).read_bytes()


@pytest.mark.parametrize("level, dtype", [("L0", "float32"), ("L1", "float32"), ("L2", "float32"),
                                          ("L2", "float16"), ("L2", "bfloat16"), ("L2", "float64")])
def test_same_gradients_give_the_same_dump_in_both_frameworks(mode, tmp_path, level, dtype):
    """max, min, buckets, ``=0``, MD5, shapes and directions are exact; norms agree to one rounding."""
    steps = [gradients_for(dtype, seed) for seed in (1, 2)]
    torch_dump(tmp_path / "torch", level, dtype, steps)
    mindspore_dump(tmp_path / "mindspore", level, dtype, steps)
    assert_same_dump(tmp_path / "torch", tmp_path / "mindspore", dtype, 2, has_directions=level != "L0")
    row = read_summary(tmp_path / "mindspore" / "rank0" / "grad_summary_0.csv").rows[2]
    assert row[0] == "head.weight" and "nan" in row  # the NaN gradient of step 0 (seed 1)


def test_norms_of_a_large_gradient_agree_to_float32_accumulation_error(tmp_path):
    """On 100 000 elements every column is still identical except the norm: MindSpore's is the float64 norm
    rounded to float32, torch's CPU ``_foreach_norm`` drifts by float32 accumulation (relative 1e-5 here)."""
    hidden = (200, 500)
    steps = [gradients_for("float32", 2, hidden)]
    model = TorchNet(torch.float32, hidden)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    monitor = TorchMonitor(GradProbeConfig(dump_path=str(tmp_path / "torch"), level="L2", bounds=SHARED_BOUNDS),
                           log_to_mlflow=False).monitor(model, optimizer)
    for name, parameter in model.named_parameters():
        parameter.grad = torch.from_numpy(steps[0][name])
    optimizer.step()
    monitor.stop()
    ms_optimizer = KeepParameters(0.0, MindSporeNet(ms.float32, hidden).trainable_params())
    ms_monitor = MindSporeMonitor(GradProbeConfig(dump_path=str(tmp_path / "mindspore"), level="L2",
                                                  bounds=SHARED_BOUNDS),
                                  log_to_mlflow=False).monitor(ms_optimizer)
    ms_optimizer(ms.mutable(tuple(Tensor(steps[0][p.name]) for p in ms_optimizer.parameters)))
    ms_monitor.stop()
    torch_rows = read_summary(tmp_path / "torch" / "rank0" / "grad_summary_0.csv").rows
    mindspore_rows = read_summary(tmp_path / "mindspore" / "rank0" / "grad_summary_0.csv").rows
    norm_column = 8
    for torch_row, mindspore_row, grad in zip(torch_rows, mindspore_rows, steps[0].values()):
        assert mindspore_row[:norm_column] + mindspore_row[norm_column + 1:] == \
            torch_row[:norm_column] + torch_row[norm_column + 1:]
        if np.isfinite(grad).all():
            exact = np.sqrt(np.sum(grad.astype(np.float64) ** 2))
            assert float(mindspore_row[norm_column]) == pytest.approx(exact, rel=1e-6)
            assert float(torch_row[norm_column]) == pytest.approx(exact, rel=1e-5)


@pytest.fixture(scope="module")
def tracking_uri(sqlite_store):
    return sqlite_store[0]


def artifact_paths(client: MlflowClient, run_id: str, path: str = "") -> set[str]:
    found = set()
    for item in client.list_artifacts(run_id, path):
        found |= artifact_paths(client, run_id, item.path) if item.is_dir else {item.path}
    return found


def test_under_an_active_run_both_frameworks_log_the_same_metrics_and_artifacts(mode, tracking_uri, tmp_path):
    mlflow.set_experiment(f"mindspore-{uuid.uuid4().hex[:8]}")
    steps = [gradients_for("float32", seed) for seed in (2, 4, 6)]
    runs = {}
    for framework, dump in (("pytorch", torch_dump), ("mindspore", mindspore_dump)):
        with mlflow.start_run() as run:
            assert dump(tmp_path / framework, "L2", "float32", steps, log_to_mlflow=True) == run.info.run_id
        runs[framework] = run.info.run_id
    client = MlflowClient()
    torch_run, mindspore_run = (client.get_run(runs[f]).data for f in ("pytorch", "mindspore"))
    assert mindspore_run.tags["msprobe_mlflow.framework"] == "mindspore"
    assert torch_run.tags["msprobe_mlflow.framework"] == "pytorch"
    assert mindspore_run.tags["msprobe_mlflow.level"] == "L2"
    assert mindspore_run.tags["msprobe_mlflow.dump_path"] == str((tmp_path / "mindspore").resolve())
    assert mindspore_run.params == torch_run.params
    assert set(mindspore_run.metrics) == set(torch_run.metrics) and mindspore_run.metrics
    for key in torch_run.metrics:
        torch_history = sorted((m.step, m.value) for m in client.get_metric_history(runs["pytorch"], key))
        mindspore_history = sorted((m.step, m.value) for m in client.get_metric_history(runs["mindspore"], key))
        assert [s for s, _ in mindspore_history] == [s for s, _ in torch_history] == [0, 1, 2], key
        assert [v for _, v in mindspore_history] == pytest.approx([v for _, v in torch_history], rel=1e-6,
                                                                  nan_ok=True), key
    expected = {"grad_probe/config.json"} | {f"grad_probe/rank0/grad_summary_{s}.csv" for s in range(3)} | {
        f"grad_probe/rank0/step{s}/directions.npz" for s in range(3)} | {
        "grad_probe/rank0/findings/anomalies.csv"}  # the anomaly flags of fc1.bias's infinities
    assert artifact_paths(client, runs["mindspore"]) == artifact_paths(client, runs["pytorch"]) == expected


def test_the_example_trains_in_both_modes_and_logs_two_complete_runs(tmp_path):
    example = Path(__file__).resolve().parents[1] / "examples" / "mindspore_monitor.py"
    result = subprocess.run([sys.executable, str(example), "--output", str(tmp_path / "out"), "--steps", "2",
                             "--level", "L1"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    client = MlflowClient(sqlite_uri(tmp_path / "out"))  # where the example's --output puts its store
    experiment = client.get_experiment_by_name("msprobe-mlflow-mindspore-example")
    runs = {run.info.run_name: run for run in client.search_runs([experiment.experiment_id])}
    assert set(runs) == {"mindspore-pynative", "mindspore-graph"}
    expected = {"grad_probe/config.json"} | {f"grad_probe/rank0/grad_summary_{s}.csv" for s in range(2)} | {
        f"grad_probe/rank0/step{s}/directions.npz" for s in range(2)}
    for run in runs.values():
        assert run.data.tags["msprobe_mlflow.framework"] == "mindspore"
        assert artifact_paths(client, run.info.run_id) == expected
        assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [0, 1]
