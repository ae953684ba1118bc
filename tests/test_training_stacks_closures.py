"""What a step records is what the optimizer applies: with ``optimizer.step(closure)`` the gradients the closure
left (plain SGD, LBFGS), one record per step; with a GradScaler the unscaled gradients; ``record_gradients()``
records them before clipping; a step whose probe fails is counted, tagged on the run and warned about; autolog
monitors a compiled model under its eager names."""
from __future__ import annotations

import mlflow
import numpy as np
import pytest
import torch
from mlflow.tracking import MlflowClient

from msprobe_mlflow import GradProbeConfig
from msprobe_mlflow.dump import read_summary
from msprobe_mlflow.pytorch import GradientMonitor

STEPS = 3


def small_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))


def recorded_norms(dump, step: int) -> list[float]:
    return read_summary(dump / "rank0" / f"grad_summary_{step}.csv").numbers("norm")


def gradient_norms(model: torch.nn.Module) -> list[float]:
    """Measured independently of the monitor, in numpy (float64, then rounded to float32 as the CSV is)."""
    return [float(np.float32(np.linalg.norm(p.grad.numpy().astype(np.float64)))) for p in model.parameters()]


def train_with_closure(optimizer_class, dump, **optimizer_options) -> list[list[float]]:
    """Trains STEPS steps with ``optimizer.step(closure)``; returns the norms of the gradients that each step's
    first closure call left (the ones its update starts from)."""
    model = small_model()
    optimizer = optimizer_class(model.parameters(), **optimizer_options)
    monitor = GradientMonitor(GradProbeConfig(dump_path=str(dump), level="L1"), log_to_mlflow=False)
    monitor.monitor(model, optimizer)
    generator = torch.Generator().manual_seed(3)
    left_by_closure = []
    for _ in range(STEPS):
        x, y = torch.randn(8, 4, generator=generator), torch.randn(8, 2, generator=generator)
        calls = []

        def closure():
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            calls.append(gradient_norms(model))
            return loss

        optimizer.step(closure)
        left_by_closure.append(calls[0])
    monitor.stop()
    assert monitor.errors == []
    return left_by_closure


@pytest.mark.parametrize("optimizer_class, options", [(torch.optim.SGD, {"lr": 0.1}),
                                                      (torch.optim.LBFGS, {"lr": 0.5, "max_iter": 4})])
def test_step_with_closure_records_the_gradients_the_closure_left(tmp_path, optimizer_class, options):
    expected = train_with_closure(optimizer_class, tmp_path / "dump", **options)
    assert sorted(p.name for p in (tmp_path / "dump" / "rank0").glob("*.csv")) == \
        [f"grad_summary_{s}.csv" for s in range(STEPS)]
    for step in range(STEPS):
        np.testing.assert_allclose(recorded_norms(tmp_path / "dump", step), expected[step], rtol=1e-6)


def test_record_gradients_before_clipping_records_the_unclipped_gradients(tmp_path):
    model = small_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = GradientMonitor(GradProbeConfig(dump_path=str(tmp_path / "dump"), level="L1"), log_to_mlflow=False)
    monitor.monitor(model, optimizer)
    x, y = torch.randn(8, 4), 100 * torch.randn(8, 2)  # large errors: clipping changes the gradients
    unclipped, clipped = [], []
    for step in range(2):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        if step == 0:
            unclipped = gradient_norms(model)
            monitor.record_gradients()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
        clipped = gradient_norms(model)
        optimizer.step()
    monitor.stop()
    np.testing.assert_allclose(recorded_norms(tmp_path / "dump", 0), unclipped, rtol=1e-6)
    np.testing.assert_allclose(recorded_norms(tmp_path / "dump", 1), clipped, rtol=1e-6)
    assert np.linalg.norm(clipped) == pytest.approx(0.5, rel=1e-4)
    assert sorted(p.name for p in (tmp_path / "dump" / "rank0").glob("*.csv")) == \
        ["grad_summary_0.csv", "grad_summary_1.csv"]


def test_a_failing_probe_is_counted_tagged_and_warned_about(tmp_path, tmp_experiment):
    """A complex parameter (spectral layers have them): its gradient has no max/min, every probe fails."""
    model = small_model()
    model.spectrum = torch.nn.Parameter(torch.randn(3, dtype=torch.complex64))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with mlflow.start_run() as run:
        with pytest.warns(UserWarning) as warned:
            monitor = GradientMonitor(GradProbeConfig(dump_path=str(tmp_path / "dump"), level="L1"))
            monitor.monitor(model, optimizer)
            for _ in range(STEPS):
                optimizer.zero_grad()
                loss = torch.nn.functional.mse_loss(model(torch.randn(8, 4)), torch.zeros(8, 2))
                (loss + model.spectrum.abs().sum()).backward()
                optimizer.step()
            monitor.stop()
    messages = [str(w.message) for w in warned]
    assert len(monitor.errors) == STEPS
    assert all("spectrum (torch.complex64)" in error for error in monitor.errors)
    assert sum(m.startswith("msprobe-mlflow: probing step") for m in messages) == 1  # one, not one per step
    assert any(f"every probed step ({STEPS}) failed" in m for m in messages)
    tags = MlflowClient().get_run(run.info.run_id).data.tags
    assert tags["msprobe_mlflow.failed_steps"] == f"0-{STEPS - 1}"
    assert not list((tmp_path / "dump" / "rank0").glob("*.csv"))


def test_autolog_monitors_a_compiled_model_under_its_eager_names_without_torchs_global_hook_warning(
        tmp_path, tmp_experiment):
    import warnings

    import msprobe_mlflow

    model = small_model()
    compiled = torch.compile(model, backend="eager")
    optimizer = torch.optim.SGD(compiled.parameters(), lr=0.1)
    msprobe_mlflow.autolog(dump_path=str(tmp_path / "dump"), level="L1")
    try:
        with mlflow.start_run() as run, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            expected = []
            for _ in range(STEPS):
                optimizer.zero_grad()
                compiled(torch.randn(8, 4)).square().mean().backward()
                expected.append(gradient_norms(model))
                optimizer.step()
    finally:
        msprobe_mlflow.autolog(disable=True)
    assert not [w for w in caught if "global hooks" in str(w.message)]
    dump = tmp_path / "dump" / run.info.run_id
    for step in range(STEPS):
        table = read_summary(dump / "rank0" / f"grad_summary_{step}.csv")
        assert table.column("param_name") == ["0.weight", "0.bias", "2.weight", "2.bias"]
        np.testing.assert_allclose(table.numbers("norm"), expected[step], rtol=1e-6)


def test_amp_grad_scaler_steps_record_the_unscaled_gradients(tmp_path):
    model = small_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    monitor = GradientMonitor(GradProbeConfig(dump_path=str(tmp_path / "dump"), level="L1"), log_to_mlflow=False)
    monitor.monitor(model, optimizer)
    generator = torch.Generator().manual_seed(4)
    expected = []
    for _ in range(STEPS):
        x, y = torch.randn(8, 4, generator=generator), torch.randn(8, 2, generator=generator)
        loss = torch.nn.functional.mse_loss(model(x), y)
        unscaled = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
        expected.append([float(np.float32(np.linalg.norm(g.double().numpy()))) for g in unscaled])
        optimizer.zero_grad()
        scaler.scale(loss).backward()  # gradients 1024 times too large until the scaler unscales them
        scaler.step(optimizer)
        scaler.update()
    monitor.stop()
    for step in range(STEPS):
        np.testing.assert_allclose(recorded_norms(tmp_path / "dump", step), expected[step], rtol=1e-5)
