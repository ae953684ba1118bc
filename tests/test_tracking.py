"""MLflow tracking of the PyTorch gradient monitor, against a real SQLite store (and a real server)."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import uuid
import warnings
from pathlib import Path

import mlflow
import numpy as np
import pytest
import torch
import torch.optim.optimizer as optimizer_module
from click.testing import CliRunner
from mlflow.tracking import MlflowClient

import msprobe_mlflow
from fresh_interpreter import run_and_read_logged_steps
from gradient_expectations import read_rows
from msprobe_mlflow import GradProbeConfig
from msprobe_mlflow.commands.cli import main
from msprobe_mlflow.directions import read_packed
from msprobe_mlflow.dump import write_csv
from msprobe_mlflow.pytorch import GradientMonitor
from msprobe_mlflow.tracking.upload import upload_dump

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tracking_uri(sqlite_store):
    return sqlite_store[0]


@pytest.fixture
def experiment(sqlite_store):
    """A fresh experiment made the current one (conftest restores the MLFLOW_* variables it exports), its
    artifacts in the store's folder rather than in ./mlruns."""
    name = f"test-{uuid.uuid4().hex[:8]}"
    mlflow.create_experiment(name, artifact_location=str(sqlite_store[1] / "artifacts" / name))
    mlflow.set_experiment(name)
    return name


def small_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))


def train(model, steps: int, captured: list | None = None, optimizer=None):
    """A plain PyTorch loop; ``captured`` receives each step's gradients as numpy arrays, by name."""
    optimizer = optimizer or torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        optimizer.zero_grad()
        x = torch.randn(6, 4, generator=generator)
        torch.nn.functional.mse_loss(model(x), torch.ones(6, 2)).backward()
        if captured is not None:
            captured.append({n: p.grad.detach().numpy().copy() for n, p in model.named_parameters()})
        optimizer.step()
    return optimizer


def expected_summary(grads: dict[str, np.ndarray], bounds=(-1, 0, 1)) -> dict[str, float]:
    """The per-rank summary metrics, computed here from the raw gradients with numpy."""
    values = np.concatenate([g.ravel() for g in grads.values()]).astype(np.float64)
    edges = np.float32(bounds).astype(np.float64)
    at_most = [(values <= b).sum() for b in edges]
    counts = np.diff([0, *at_most, values.size])
    labels = ["1 at most -1", "2 over -1 up to 0", "3 over 0 up to 1", "4 over 1"]  # (-inf, -1], ..., (1, inf)
    shares = "share of gradient elements"
    return {
        "total_norm": math.sqrt(sum(float(np.linalg.norm(g.astype(np.float64))) ** 2 for g in grads.values())),
        "max": values.max(), "min": values.min(), f"{shares}/exactly 0": (values == 0).sum() / values.size,
        **{f"{shares}/{label}": count / values.size for label, count in zip(labels, counts)},
        **{f"formats/{name}": share for name, share in expected_format_shares(values).items()},
    }


FORMATS = {"float16": torch.float16, "bfloat16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn,
           "fp8_e5m2": torch.float8_e5m2}


def expected_format_shares(values: np.ndarray, scale: float = 1.0) -> dict[str, float]:
    """Each narrow format's losses of ``values * scale`` from torch's own conversions and limits: underflow, the
    nonzero values converted to zero; subnormal, the others below the least normal; overflow, those at or above the
    power of two past the largest finite value."""
    scaled = torch.from_numpy(np.asarray(values, np.float32) * np.float32(scale))
    nonzero = (scaled != 0) & scaled.isfinite()
    shares = {}
    for name, dtype in FORMATS.items():
        limits = torch.finfo(dtype)
        underflow = nonzero & (scaled.to(dtype).float() == 0)
        subnormal = nonzero & ~underflow & (scaled.abs() < limits.smallest_normal)
        overflow = nonzero & (scaled.abs() >= 2.0 ** (math.floor(math.log2(limits.max)) + 1))
        shares.update({f"{name} underflow": float(underflow.sum()) / scaled.numel(),
                       f"{name} subnormal": float(subnormal.sum()) / scaled.numel(),
                       f"{name} overflow": float(overflow.sum()) / scaled.numel()})
    return shares


def test_autolog_logs_metrics_csv_tables_and_directions_for_every_step(experiment, tmp_path):
    msprobe_mlflow.autolog(level="L2", dump_path=str(tmp_path / "dump"), statistics=["exponents"])
    try:
        model, captured = small_model(), []
        with mlflow.start_run() as run:
            train(model, 3, captured)
    finally:
        msprobe_mlflow.autolog(disable=True)
    client = MlflowClient()
    data = client.get_run(run.info.run_id).data
    expected_keys = {f"grad/rank0/{k}" for k in expected_summary(captured[0])}
    assert set(data.metrics) == expected_keys
    for key in expected_keys:
        assert [m.step for m in client.get_metric_history(run.info.run_id, key)] == [0, 1, 2]
    for step, grads in enumerate(captured):
        history = {k: {m.step: m.value for m in client.get_metric_history(run.info.run_id, f"grad/rank0/{k}")}[step]
                   for k in expected_summary(grads)}
        for key, value in expected_summary(grads).items():
            assert history[key] == pytest.approx(value, rel=1e-6), key
    assert data.tags["msprobe_mlflow.framework"] == "pytorch"
    assert data.tags["msprobe_mlflow.level"] == "L2"
    assert data.params["grad_probe.level"] == "L2"

    local = tmp_path / "dump" / run.info.run_id / "rank0"
    downloaded = Path(mlflow.artifacts.download_artifacts(run_id=run.info.run_id, artifact_path="grad_probe",
                                                          dst_path=str(tmp_path / "downloaded")))
    assert (downloaded / "config.json").exists()
    for step, grads in enumerate(captured):
        name = f"grad_summary_{step}.csv"
        assert (downloaded / "rank0" / name).read_bytes() == (local / name).read_bytes()
        directions = read_packed(downloaded / "rank0" / f"step{step}" / "directions.npz")
        assert list(directions) == list(grads)
        for param, grad in grads.items():
            shape, bits = directions[param]
            assert shape == grad.shape
            np.testing.assert_array_equal(np.unpackbits(bits, count=grad.size).astype(bool), (grad > 0).ravel())


def test_autolog_disable_removes_the_hook_and_logs_nothing(experiment, tmp_path):
    hooks_before = len(optimizer_module._global_optimizer_pre_hooks)
    msprobe_mlflow.autolog(dump_path=str(tmp_path / "first"))
    msprobe_mlflow.autolog(dump_path=str(tmp_path / "dump"))  # replaces the first call's hook
    assert len(optimizer_module._global_optimizer_pre_hooks) == hooks_before + 1
    msprobe_mlflow.autolog(disable=True)
    assert len(optimizer_module._global_optimizer_pre_hooks) == hooks_before
    with mlflow.start_run() as run:
        train(small_model(), 2)
    assert MlflowClient().get_run(run.info.run_id).data.metrics == {}
    assert not (tmp_path / "dump").exists() and not (tmp_path / "first").exists()


def test_autolog_called_before_torch_is_imported_probes_the_model_once_it_is(tmp_path):
    """``msprobe_mlflow.autolog()`` imports no framework: PyTorch's hook goes in when torch is imported."""
    script = tmp_path / "autolog_first.py"
    script.write_text(f"""
import sys
sys.path.insert(0, {str(Path(__file__).parent.parent)!r})
import mlflow, msprobe_mlflow
mlflow.set_tracking_uri({f"sqlite:///{tmp_path / 'mlflow.db'}"!r})
msprobe_mlflow.autolog(dump_path={str(tmp_path / "dump")!r})
assert "torch" not in sys.modules, "autolog() imported torch"
import torch
model = torch.nn.Linear(3, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
with mlflow.start_run() as run:
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.ones(4, 3)).sum().backward()
        optimizer.step()
print(run.info.run_id)
""")
    run_id, logged_steps = run_and_read_logged_steps(script, f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert logged_steps == [0, 1, 2]
    assert sorted(p.name for p in (tmp_path / "dump" / run_id / "rank0").glob("grad_summary_*.csv")) == [
        f"grad_summary_{step}.csv" for step in range(3)]


def test_autolog_disabled_before_torch_is_imported_leaves_no_hook_for_it(tmp_path):
    """What ``autolog()`` kept for PyTorch until torch is imported is released by ``disable=True``."""
    script = tmp_path / "autolog_disabled_first.py"
    script.write_text(f"""
import sys
sys.path.insert(0, {str(Path(__file__).parent.parent)!r})
import mlflow, msprobe_mlflow
mlflow.set_tracking_uri({f"sqlite:///{tmp_path / 'mlflow.db'}"!r})
msprobe_mlflow.autolog(dump_path={str(tmp_path / "dump")!r})
msprobe_mlflow.autolog(disable=True)
import torch
model = torch.nn.Linear(3, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
with mlflow.start_run() as run:
    optimizer.zero_grad()
    model(torch.ones(4, 3)).sum().backward()
    optimizer.step()
print(run.info.run_id)
""")
    _, logged_steps = run_and_read_logged_steps(script, f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert logged_steps == []
    assert not (tmp_path / "dump").exists()


def _train_into_deleted_run(tmp_path, silent: bool):
    """The run is deleted after the first step, so every later request of the sink fails for real."""
    monitor = GradientMonitor(GradProbeConfig(dump_path=str(tmp_path / "dump"), level="L1"), silent=silent)
    model = small_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with mlflow.start_run() as run:
        monitor.monitor(model, optimizer)
        train(model, 1, optimizer=optimizer)
        monitor.flush()
        MlflowClient().delete_run(run.info.run_id)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            train(model, 3, optimizer=optimizer)
            monitor.stop()
        MlflowClient().restore_run(run.info.run_id)  # so that leaving the block can end it
    return caught


@pytest.mark.parametrize("silent", [False, True])
def test_tracking_failure_keeps_training_and_the_dump_and_warns_unless_silent(experiment, tmp_path, silent):
    caught = _train_into_deleted_run(tmp_path, silent)
    ours = [w for w in caught if "msprobe-mlflow" in str(w.message)]
    assert bool(ours) is not silent
    if not silent:
        assert any("msprobe-mlflow upload" in str(w.message) for w in ours)
    assert sorted(p.name for p in (tmp_path / "dump" / "rank0").glob("*.csv")) == [
        f"grad_summary_{s}.csv" for s in range(4)]


def test_monitor_without_active_run_writes_only_the_local_dump(experiment, tmp_path):
    model = small_model()
    runs_before = len(mlflow.search_runs(experiment_names=[experiment]))
    with GradientMonitor(GradProbeConfig(dump_path=str(tmp_path / "dump"))) as monitor:
        monitor.monitor(model)
        train(model, 2)
        assert monitor.run_id is None
    assert len(mlflow.search_runs(experiment_names=[experiment])) == runs_before
    assert len(list((tmp_path / "dump" / "rank0").glob("*.csv"))) == 2


def test_monitor_with_run_id_logs_into_that_run_not_the_active_one(experiment, tmp_path):
    target = MlflowClient().create_run(mlflow.get_experiment_by_name(experiment).experiment_id)
    model = small_model()
    with mlflow.start_run() as active:
        with GradientMonitor(GradProbeConfig(dump_path=str(tmp_path / "dump")), run_id=target.info.run_id) as m:
            m.monitor(model)
            train(model, 2)
    client = MlflowClient()
    assert len(client.get_metric_history(target.info.run_id, "grad/rank0/total_norm")) == 2
    assert client.get_run(active.info.run_id).data.metrics == {}


def _metric_and_file_counts(run_id: str) -> tuple[int, int]:
    client = MlflowClient()
    metrics = sum(len(client.get_metric_history(run_id, key)) for key in client.get_run(run_id).data.metrics)

    def count(path):
        return sum(count(i.path) if i.is_dir else 1 for i in client.list_artifacts(run_id, path))
    return metrics, count("grad_probe")


def test_upload_completes_a_run_and_a_second_upload_adds_nothing(experiment, tmp_path):
    model = small_model()
    with GradientMonitor(GradProbeConfig(dump_path=str(tmp_path / "dump"), level="L2"), log_to_mlflow=False,
                         statistics=["exponents"]) as m:
        m.monitor(model)
        train(model, 3)
    run = MlflowClient().create_run(mlflow.get_experiment_by_name(experiment).experiment_id)
    first = upload_dump(tmp_path / "dump", run.info.run_id)
    assert first.steps_completed == {0: [0, 1, 2]}
    metrics, files = _metric_and_file_counts(run.info.run_id)
    assert metrics == 3 * (8 + 12)  # (L2, bounds [-1, 0, 1]: total_norm, max, min, 5 shares, 4 formats x 3) x 3 steps
    assert files == 1 + 3 * 3 + 1  # config.json + (CSV, directions, exponent counts) per step + exponent pictures
    second = upload_dump(tmp_path / "dump", run.info.run_id)
    assert (second.metrics_logged, second.files_uploaded) == (0, 0)
    assert _metric_and_file_counts(run.info.run_id) == (metrics, files)


def write_msprobe_1_0_3_dump(folder: Path, grads_per_step: list[dict[str, np.ndarray]]) -> None:
    """What msprobe 1.0.3's MindSpore graph mode writes: capitalised L1 header, boolean .npy directions."""
    for step, grads in enumerate(grads_per_step):
        rows = [["Param_name", "Max", "Min", "Norm", "Shape"]]
        for name, grad in grads.items():
            rows.append([name, float(grad.max()), float(grad.min()), float(np.linalg.norm(grad)), list(grad.shape)])
            (folder / "rank0" / f"step{step}").mkdir(parents=True, exist_ok=True)
            np.save(folder / "rank0" / f"step{step}" / f"{name}.npy", grad > 0)
        write_csv(folder / "rank0" / f"grad_summary_{step}.csv", rows)


def test_upload_imports_an_msprobe_1_0_3_dump_into_a_new_run(experiment, tmp_path):
    rng = np.random.default_rng(3)
    grads = [{"fc.weight": rng.standard_normal((3, 5)).astype(np.float32),
              "fc.bias": rng.standard_normal(3).astype(np.float32)} for _ in range(2)]
    write_msprobe_1_0_3_dump(tmp_path / "old", grads)
    report = upload_dump(tmp_path / "old", experiment=experiment)
    client = MlflowClient()
    run = client.get_run(report.run_id)
    assert run.info.experiment_id == mlflow.get_experiment_by_name(experiment).experiment_id
    assert run.data.tags["msprobe_mlflow.level"] == "L1"
    history = client.get_metric_history(report.run_id, "grad/rank0/total_norm")
    assert [m.step for m in history] == [0, 1]
    for step, metric in enumerate(history):
        norms = [np.linalg.norm(g.astype(np.float64)) for g in grads[step].values()]
        assert metric.value == pytest.approx(math.sqrt(sum(n * n for n in norms)), rel=1e-6)
    downloaded = Path(mlflow.artifacts.download_artifacts(
        run_id=report.run_id, artifact_path="grad_probe/rank0/step1/directions.npz", dst_path=str(tmp_path / "d")))
    directions = read_packed(downloaded)
    for name, grad in grads[1].items():
        np.testing.assert_array_equal(directions[name][1], np.packbits((grad > 0).ravel()))


def test_cli_upload_prints_the_run_and_rejects_a_folder_that_is_not_a_dump(tracking_uri, experiment, tmp_path):
    model = small_model()
    with GradientMonitor(GradProbeConfig(dump_path=str(tmp_path / "dump")), log_to_mlflow=False) as m:
        m.monitor(model)
        train(model, 2)
    env = {**os.environ, "MLFLOW_TRACKING_URI": tracking_uri}
    command = [sys.executable, "-m", "msprobe_mlflow", "upload", str(tmp_path / "dump"), "--experiment", experiment]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    run_id = done.stdout.split()[1].rstrip(":")
    assert len(MlflowClient().get_metric_history(run_id, "grad/rank0/total_norm")) == 2
    (tmp_path / "empty").mkdir()
    bad = subprocess.run([*command[:4], str(tmp_path / "empty")], capture_output=True, text=True, env=env, timeout=300)
    assert bad.returncode == 2
    assert bad.stderr.startswith(f"msprobe-mlflow upload: error: DUMP_PATH = {str(tmp_path / 'empty')!r} holds no "
                                 "rank<N> folders")


def metric_values(client: MlflowClient, run_id: str, key: str) -> dict[int, float]:
    """MLflow step -> value of one metric."""
    return {m.step: m.value for m in client.get_metric_history(run_id, key)}


def test_param_metrics_log_norm_max_min_of_the_matching_parameters_only(experiment, tmp_path):
    model, captured = small_model(), []
    with mlflow.start_run() as run:
        with GradientMonitor(GradProbeConfig(dump_path=str(tmp_path / "dump")), param_metrics=["0.*"]) as monitor:
            monitor.monitor(model)
            train(model, 2, captured)
    client = MlflowClient()
    logged = {key for key in client.get_run(run.info.run_id).data.metrics if "/param/" in key}
    assert logged == {f"grad/rank0/param/0.{name}/{statistic}" for name in ("weight", "bias")
                      for statistic in ("norm", "max", "min")}
    for name in ("0.weight", "0.bias"):
        for statistic, compute in (("norm", lambda g: np.linalg.norm(g.astype(np.float64))), ("max", np.max),
                                   ("min", np.min)):
            values = metric_values(client, run.info.run_id, f"grad/rank0/param/{name}/{statistic}")
            assert values == {step: pytest.approx(float(compute(grads[name])), rel=1e-6)
                              for step, grads in enumerate(captured)}, (name, statistic)


def test_log_every_n_steps_sends_every_nth_step_and_the_local_dump_keeps_all(experiment, tmp_path):
    model = small_model()
    with mlflow.start_run() as run:
        with GradientMonitor(GradProbeConfig(dump_path=str(tmp_path / "dump")), log_every_n_steps=2) as monitor:
            monitor.monitor(model)
            train(model, 5)
    client = MlflowClient()
    assert [m.step for m in client.get_metric_history(run.info.run_id, "grad/rank0/total_norm")] == [0, 2, 4]
    csv_artifacts = [i.path for i in client.list_artifacts(run.info.run_id, "grad_probe/rank0") if not i.is_dir]
    assert csv_artifacts == [f"grad_probe/rank0/grad_summary_{s}.csv" for s in (0, 2, 4)]
    assert sorted(p.name for p in (tmp_path / "dump" / "rank0").glob("*.csv")) == \
        [f"grad_summary_{s}.csv" for s in range(5)]


def test_without_an_active_run_MLFLOW_RUN_ID_names_the_run(experiment, tmp_path, monkeypatch):
    target = MlflowClient().create_run(mlflow.get_experiment_by_name(experiment).experiment_id).info.run_id
    monkeypatch.setenv("MLFLOW_RUN_ID", target)
    model = small_model()
    with GradientMonitor(GradProbeConfig(dump_path=str(tmp_path / "dump"))) as monitor:
        monitor.monitor(model)
        train(model, 2)
        assert monitor.run_id == target
    assert mlflow.active_run() is None
    assert [m.step for m in MlflowClient().get_metric_history(target, "grad/rank0/total_norm")] == [0, 1]


def test_the_run_holds_the_config_as_grad_probe_config_json_and_grad_probe_params(experiment, tmp_path):
    config = GradProbeConfig(dump_path=str(tmp_path / "dump"), level="L2", bounds=(-0.5, 0, 0.5),
                             param_list=("0.weight", "2.weight"), rank=(0,), step=(0, 1, 2))
    model = small_model()
    with mlflow.start_run() as run:
        with GradientMonitor(config) as monitor:
            monitor.monitor(model)
            train(model, 1)
    assert mlflow.artifacts.load_dict(f"runs:/{run.info.run_id}/grad_probe/config.json") == {
        "task": "grad_probe", "dump_path": str(tmp_path / "dump"), "rank": [0], "step": [0, 1, 2],
        "grad_probe": {"grad_level": "L2", "param_list": ["0.weight", "2.weight"], "bounds": [-0.5, 0, 0.5]},
        "direction_format": "packed"}
    assert MlflowClient().get_run(run.info.run_id).data.params == {
        "grad_probe.level": "L2", "grad_probe.bounds": "[-0.5, 0, 0.5]",
        "grad_probe.param_list": '["0.weight", "2.weight"]', "grad_probe.rank": "[0]",
        "grad_probe.step": "[0, 1, 2]", "grad_probe.direction_format": "packed"}


def test_nonfinite_gradients_are_counted_by_the_anomaly_flags_not_by_a_flat_metric(experiment, tmp_path):
    """``params`` and ``nonfinite_params`` drew a flat line on every run: the count of parameters is the CSV's rows,
    and non-finite gradients are flagged at the steps that have them."""
    model = small_model()  # 0.weight, 0.bias, 2.weight, 2.bias
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    layers = dict(model.named_parameters())
    steps = [  # the gradients of each step, by hand, and (probed, non-finite) parameters counted here
        ({"0.weight": math.nan, "0.bias": 1.0, "2.weight": math.inf, "2.bias": -2.0}, (4, 2)),
        ({"0.weight": 1.0, "0.bias": -math.inf, "2.weight": None, "2.bias": 0.5}, (3, 1)),  # None: not probed
        ({"0.weight": 1.0, "0.bias": 1.0, "2.weight": 1.0, "2.bias": 1.0}, (4, 0)),
    ]
    with mlflow.start_run() as run:
        with GradientMonitor(GradProbeConfig(dump_path=str(tmp_path / "dump")), silent=True) as monitor:
            monitor.monitor(model, optimizer)
            for grads, _ in steps:
                for name, value in grads.items():
                    parameter = layers[name]
                    parameter.grad = None if value is None else torch.ones_like(parameter)
                    if value is not None:
                        parameter.grad.view(-1)[0] = value  # one element carries the value
                optimizer.step()
    client = MlflowClient()
    metrics = client.get_run(run.info.run_id).data.metrics
    assert "grad/rank0/params" not in metrics and "grad/rank0/nonfinite_params" not in metrics
    assert metric_values(client, run.info.run_id, "anomalies/rank0/flagged_params") == {
        step: float(counts[1]) for step, (_, counts) in enumerate(steps) if counts[1]}
    assert [len(read_rows(tmp_path / "dump" / "rank0" / f"grad_summary_{step}.csv")[1])
            for step in range(len(steps))] == [counts[0] for _, counts in steps]


def test_autolog_reads_msprobes_config_json(experiment, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"task": "grad_probe", "dump_path": str(tmp_path / "from_config"), "rank": [],
                                "step": [], "grad_probe": {"grad_level": "L2", "param_list": ["2.weight"],
                                                           "bounds": [-0.5, 0, 0.5]}}), encoding="utf-8")
    msprobe_mlflow.autolog(str(path))
    try:
        with mlflow.start_run() as run:
            train(small_model(), 2)
    finally:
        msprobe_mlflow.autolog(disable=True)
    rank0 = tmp_path / "from_config" / run.info.run_id / "rank0"
    assert sorted(p.name for p in rank0.glob("*.csv")) == ["grad_summary_0.csv", "grad_summary_1.csv"]
    header, rows = read_rows(rank0 / "grad_summary_0.csv")
    assert header[1:5] == ["(-inf, -0.5]", "(-0.5, 0]", "(0, 0.5]", "(0.5, inf)"]  # L2, the file's bounds
    assert list(rows) == ["2.weight"]  # the file's param_list
    params = MlflowClient().get_run(run.info.run_id).data.params
    assert (params["grad_probe.level"], params["grad_probe.bounds"], params["grad_probe.param_list"]) == \
        ("L2", "[-0.5, 0, 0.5]", '["2.weight"]')


def test_upload_param_metrics_option_adds_the_matching_parameters_metrics(tracking_uri, experiment, tmp_path):
    model, captured = small_model(), []
    with GradientMonitor(GradProbeConfig(dump_path=str(tmp_path / "dump")), log_to_mlflow=False) as monitor:
        monitor.monitor(model)
        train(model, 1, captured)
    result = CliRunner().invoke(main, ["upload", str(tmp_path / "dump"), "--experiment", experiment,
                                       "--param-metrics", "0.*", "--param-metrics", "2.bias",
                                       "--tracking-uri", tracking_uri])
    assert result.exit_code == 0, result.output
    metrics = MlflowClient().get_run(result.stdout.split()[1].rstrip(":")).data.metrics
    assert {key for key in metrics if "/param/" in key} == {
        f"grad/rank0/param/{name}/{statistic}" for name in ("0.weight", "0.bias", "2.bias")
        for statistic in ("norm", "max", "min")}
    bias = captured[0]["2.bias"]
    assert metrics["grad/rank0/param/2.bias/norm"] == pytest.approx(np.linalg.norm(bias.astype(np.float64)), rel=1e-6)
    assert (metrics["grad/rank0/param/2.bias/max"], metrics["grad/rank0/param/2.bias/min"]) == \
        (pytest.approx(float(bias.max())), pytest.approx(float(bias.min())))
