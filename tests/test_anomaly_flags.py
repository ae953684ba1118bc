"""Anomaly flags (on by default): non-finite gradients and norm spikes, from the per-parameter statistics alone.

The rule is checked against an independent numpy computation; a real torch training gets injected faults at known
steps (a NaN, an inf, a tenfold gradient, a zeroed layer), which must be flagged there and nowhere else, and a clean
run of 220 steps must get no flag at all.
"""
from __future__ import annotations

import csv
import importlib.util
import math
from pathlib import Path

import mlflow
import numpy as np
import pytest
import torch
from mlflow.tracking import MlflowClient

from msprobe_mlflow import GradProbeConfig
from msprobe_mlflow.anomaly_rule import AnomalyFlags, SpikeRule, robust_bands
from msprobe_mlflow.dump import findings_dir
from msprobe_mlflow.pytorch import GradientMonitor
from msprobe_mlflow.records import StepRecord
from msprobe_mlflow.sinks.anomalies import ANOMALIES_FILE_NAME
from msprobe_mlflow.tracking.upload import upload_dump


def test_robust_bands_are_each_rows_median_and_scaled_mad_ignoring_gaps():
    rng = np.random.default_rng(0)
    logs = rng.standard_normal((6, 9))
    logs[rng.random(logs.shape) < 0.3] = np.nan
    logs[5] = np.nan  # a series with no value yet
    median, spread, count = robust_bands(logs)
    for row in range(5):
        values = logs[row][np.isfinite(logs[row])]
        assert count[row] == values.size
        assert median[row] == pytest.approx(np.median(values))
        assert spread[row] == pytest.approx(1.4826 * np.median(np.abs(values - np.median(values))))
    assert count[5] == 0


def record(step: int, norms: list[float], numels: list[int] | None = None) -> StepRecord:
    """A step whose parameters have these norms (max and min of the same sign and size as the norm)."""
    norms = np.asarray(norms, dtype=np.float32)
    values = np.column_stack([norms, -norms, norms])
    names = [f"p{i}" for i in range(len(norms))]
    shapes = [(n,) for n in (numels or [4] * len(norms))]
    return StepRecord(0, step, "L1", (-1, 0, 1), names, shapes, values)


def flags_over(series: np.ndarray, rule=SpikeRule(), numels=None) -> list[tuple[int, str | None, str]]:
    """(step, parameter, kind) of every flag over a steps x parameters array of norms."""
    flagger = AnomalyFlags(rule)
    return [(f.step, f.parameter, f.kind) for step, norms in enumerate(series)
            for f in flagger.step_flags(record(step, list(norms), numels))]


def steady(steps: int, parameters: int, seed: int = 0) -> np.ndarray:
    """Norms that wobble by about 5 % around 1 (log-normal)."""
    return np.exp(0.05 * np.random.default_rng(seed).standard_normal((steps, parameters)))


def test_a_steady_series_is_never_flagged_and_its_faults_are_each_flagged_once():
    norms = steady(60, 3)
    assert flags_over(norms) == []
    norms[40, 0] *= 10.0  # explosion
    norms[45, 1] = 0.0  # collapse to zero
    norms[50, 2] = np.nan  # non-finite: that flag, not a spike
    norms[55, 1] *= 0.1  # a tenfold fall
    per_parameter = [flag for flag in flags_over(norms) if flag[1] is not None]
    assert per_parameter == [(40, "p0", "explosion"), (45, "p1", "collapse"), (50, "p2", "nonfinite"),
                             (55, "p1", "collapse")]


def test_the_band_matches_a_direct_computation_and_waits_for_half_a_window():
    rule = SpikeRule(threshold=3.0, window=10)
    norms = steady(30, 1, seed=3)[:, 0]
    expected = []
    for step in range(len(norms)):
        history = np.log(norms[max(0, step - 10):step])
        if len(history) >= 5:
            middle = np.median(history)
            half_width = 3.0 * max(1.4826 * np.median(np.abs(history - middle)), 0.01)
            if abs(math.log(norms[step]) - middle) > half_width:
                expected.append(step)
    found = [step for step, parameter, _ in flags_over(norms[:, None], rule) if parameter == "p0"]
    assert expected and found == expected  # threshold 3 on a 5 % wobble: a few flags, at the same steps


def test_an_empty_parameter_is_not_non_finite_and_the_total_norm_spikes_too():
    norms = steady(40, 2)
    norms[:, 1] = 0.0  # an empty parameter: norm 0, max and min NaN, never flagged
    norms[30, 0] *= 100.0
    found = flags_over(norms, numels=[4, 0])
    assert found == [(30, "p0", "explosion"), (30, None, "explosion")]


@pytest.mark.parametrize("options, message", [
    ({"spike_threshold": 0}, r"spike_threshold = 0 is not accepted; expected a positive number"),
    ({"spike_threshold": "7"}, r"spike_threshold = '7' is not accepted"),
    ({"spike_window": 3}, r"spike_window = 3 is not accepted; expected an integer >= 4"),
    ({"spike_window": True}, r"spike_window = True is not accepted"),
    ({"anomaly_flags": "yes"}, r"anomaly_flags = 'yes' is not accepted; expected True or False"),
])
def test_bad_anomaly_options_are_refused(tmp_path, options, message):
    with pytest.raises(ValueError, match=message):
        GradientMonitor(GradProbeConfig(dump_path=str(tmp_path)), **options)


# --- a real training -------------------------------------------------------------------------------------------
def benchmark_module(name: str):
    """A script of ``benchmarks/``, loaded without touching ``sys.path``."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


RATES = benchmark_module("anomaly_rates")  # the trainings behind SpikeRule's defaults


FAULTS = {  # step -> (kind, parameters)
    60: ("nan", ["encoder.layers.0.linear1.weight"]),
    90: ("inf", ["out.bias"]),
    120: ("tenfold", ["encoder.layers.1.linear2.weight"]),
    150: ("zero", ["encoder.layers.0.self_attn.out_proj.weight", "encoder.layers.0.self_attn.out_proj.bias"]),
}
EXPECTED_KIND = {"nan": "nonfinite", "inf": "nonfinite", "tenfold": "explosion", "zero": "collapse"}


def train_transformer(dump, steps: int, faults: dict, **options) -> GradientMonitor:
    """AdamW on a fixed token task. ``faults`` corrupt the gradients the monitor reads at their step, and an
    optimizer pre-hook registered after the monitor's restores them, so the training itself stays clean: each fault
    shows at its own step only."""
    torch.manual_seed(0)
    model, batch, loss_fn = RATES.transformer()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    monitor = GradientMonitor(GradProbeConfig(dump_path=str(dump), level="L1"), **options).monitor(model, optimizer)
    parameters = dict(model.named_parameters())
    saved = {}

    def restore(*_):
        for name, grad in saved.items():
            parameters[name].grad.copy_(grad)
        saved.clear()

    optimizer.register_step_pre_hook(restore)
    data = torch.Generator().manual_seed(1)
    for step in range(steps):
        tokens, target = batch(data)
        optimizer.zero_grad()
        loss_fn(model(tokens), target).backward()
        kind, names = faults.get(step, (None, []))
        for name in names:
            grad = parameters[name].grad
            saved[name] = grad.clone()
            if kind in ("nan", "inf"):
                grad.view(-1)[0] = math.nan if kind == "nan" else math.inf
            else:
                grad.mul_(10.0 if kind == "tenfold" else 0.0)
        optimizer.step()
    return monitor


def csv_flags(dump) -> list[dict]:
    path = findings_dir(dump, 0) / ANOMALIES_FILE_NAME
    if not path.exists():
        return []
    with open(path, encoding="utf-8-sig", newline="") as file:
        return list(csv.DictReader(file))


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Two OpenMP threads on a small shared machine stall whenever another process holds a CPU (tenfold slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_a_clean_220_step_training_gets_no_flag(tmp_path):
    monitor = train_transformer(tmp_path / "clean", 220, {}, log_to_mlflow=False)
    monitor.stop()
    assert monitor.errors == []
    assert csv_flags(tmp_path / "clean") == []


def test_injected_faults_are_flagged_at_their_steps_and_nowhere_else(tmp_experiment, tmp_path):
    with mlflow.start_run() as run:
        with pytest.warns(UserWarning) as caught:
            monitor = train_transformer(tmp_path / "faults", 220, FAULTS)
            monitor.stop()
    flags = csv_flags(tmp_path / "faults")
    found = {(int(f["step"]), f["parameter"], f["kind"]) for f in flags if f["scope"] == "parameter"}
    injected = {(step, name, EXPECTED_KIND[kind]) for step, (kind, names) in FAULTS.items() for name in names}
    assert found == injected  # recall 5/5 parameter faults, no false flag
    assert {int(f["step"]) for f in flags if f["scope"] == "total"} <= set(FAULTS)
    nan_row = next(f for f in flags if f["step"] == "60")
    assert nan_row["norm"] == "nan" and nan_row["band_low"] == ""
    tenfold = next(f for f in flags if f["step"] == "120" and f["scope"] == "parameter")
    assert float(tenfold["norm"]) > float(tenfold["band_high"]) > float(tenfold["median_norm"])

    client = MlflowClient()
    tags = client.get_run(run.info.run_id).data.tags
    assert tags["msprobe_mlflow.first_nonfinite_step"] == "60"
    assert not any(key.startswith("msprobe_mlflow.rank0.first_") for key in tags)  # per-rank copies: several ranks only
    assert tags["msprobe_mlflow.nonfinite_parameters"] == "encoder.layers.0.linear1.weight"
    assert tags["msprobe_mlflow.first_spike_step"] == "120"
    assert tags["msprobe_mlflow.spike_parameters"].startswith("encoder.layers.1.linear2.weight (explosion: ")
    history = client.get_metric_history(run.info.run_id, "anomalies/rank0/flagged_params")
    assert sorted((m.step, m.value) for m in history) == [(60, 1.0), (90, 1.0), (120, 1.0), (150, 2.0)]
    logged = client.list_artifacts(run.info.run_id, "grad_probe/rank0/findings")
    assert [a.path for a in logged] == ["grad_probe/rank0/findings/anomalies.csv"]
    warnings = [str(w.message) for w in caught if "msprobe-mlflow" in str(w.message)]
    assert len(warnings) == 2  # the first non-finite step and the first spike, once each
    assert "non-finite gradients at step 60: encoder.layers.0.linear1.weight" in warnings[0]
    assert "gradient-norm spikes at step 120" in warnings[1]


def test_anomaly_flags_can_be_switched_off(tmp_path):
    monitor = train_transformer(tmp_path / "off", 3, {1: ("nan", ["out.bias"])}, log_to_mlflow=False,
                                anomaly_flags=False)
    monitor.stop()
    assert csv_flags(tmp_path / "off") == [] and not findings_dir(tmp_path / "off", 0).exists()


def test_findings_mlflow_cannot_take_stay_in_the_local_dump_with_a_warning(tmp_experiment, tmp_path):
    """The run is deleted after the first step, so the flag's metric and tags cannot be sent, even at stop()."""
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    with mlflow.start_run() as run:
        monitor = GradientMonitor(GradProbeConfig(dump_path=str(tmp_path / "dump"), level="L1")).monitor(model,
                                                                                                        optimizer)
        model.weight.grad, model.bias.grad = torch.ones(2, 3), torch.ones(2)
        optimizer.step()
        monitor.flush()
        MlflowClient().delete_run(run.info.run_id)
        model.bias.grad = torch.tensor([1.0, math.inf])
        with pytest.warns(UserWarning) as caught:
            optimizer.step()
            monitor.stop()
        MlflowClient().restore_run(run.info.run_id)  # so that leaving the block can end it
    messages = [str(w.message) for w in caught]
    assert any("the live findings (live verdict, anomaly flags) of MLflow run" in m
               and str(findings_dir(tmp_path / "dump", 0)) in m for m in messages), messages
    flags = [(f["step"], f["parameter"], f["kind"]) for f in csv_flags(tmp_path / "dump")]
    assert flags == [("1", "bias", "nonfinite")]
    assert "msprobe_mlflow.first_nonfinite_step" not in MlflowClient().get_run(run.info.run_id).data.tags

    local = findings_dir(tmp_path / "dump", 0) / ANOMALIES_FILE_NAME
    assert upload_dump(tmp_path / "dump", run.info.run_id).files_uploaded >= 1
    sent = Path(mlflow.artifacts.download_artifacts(run_id=run.info.run_id, dst_path=str(tmp_path / "sent"),
                                                    artifact_path=f"grad_probe/rank0/findings/{ANOMALIES_FILE_NAME}"))
    assert sent.read_bytes() == local.read_bytes()
    assert upload_dump(tmp_path / "dump", run.info.run_id).files_uploaded == 0  # nothing twice
