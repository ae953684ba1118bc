"""What each narrow format would lose of a step's gradients, read from their exponent counts: against torch's own
conversions and limits, and the float16 run whose loss scale becomes too small, named at that step with the layer
that loses its gradients."""
from __future__ import annotations

import math

import mlflow
import numpy as np
import pytest
import torch

from msprobe_mlflow import GradProbeConfig
from msprobe_mlflow.dump import exponents_path
from msprobe_mlflow.exponents import read_exponents
from msprobe_mlflow.formats import RANGES, LossyFormat, format_losses
from msprobe_mlflow.pytorch import GradientMonitor
from msprobe_mlflow.statistics_table import ExponentCounts, exponent_counts

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn,
          "fp8_e5m2": torch.float8_e5m2}


def torch_losses(values: np.ndarray, scale: float, dtype: torch.dtype) -> list[int]:
    """Underflow (nonzero, converted to zero), subnormal (the others below the least normal) and overflow (at or
    above the power of two past the largest finite value) of ``values * scale``, from torch's conversion and
    ``finfo``."""
    scaled = torch.from_numpy(values.astype(np.float64) * scale)
    nonzero = (scaled != 0) & scaled.isfinite()
    limits = torch.finfo(dtype)
    underflow = nonzero & (scaled.to(dtype).double() == 0)
    subnormal = nonzero & ~underflow & (scaled.abs() < limits.smallest_normal)
    overflow = nonzero & (scaled.abs() >= 2.0 ** (math.floor(math.log2(limits.max)) + 1))
    return [int(underflow.sum()), int(subnormal.sum()), int(overflow.sum())]


def test_every_format_table_entry_is_torchs():
    for name, dtype in DTYPES.items():
        limits = torch.finfo(dtype)
        assert RANGES[name].least_normal == math.log2(limits.smallest_normal)
        assert RANGES[name].least_subnormal == math.log2(limits.smallest_normal * limits.eps)
        assert RANGES[name].overflow == math.floor(math.log2(limits.max)) + 1


@pytest.mark.parametrize("scale", [1.0, 2.0 ** 10, 2.0 ** -3, 2.0 ** 24])
def test_losses_read_from_exponents_equal_torchs_conversions(scale):
    """Values at every exponent float32 holds (-149 to 127; beyond, the counts stop at its edges), each 1.01 to
    1.6 times its power of two (away from the edges where rounding crosses into the next binade), zeros, inf and
    NaN."""
    rng = np.random.default_rng(0)
    exponents = rng.integers(-149, 128, 20_000)
    values = rng.uniform(1.01, 1.6, exponents.size) * np.exp2(exponents.astype(np.float64))
    values *= rng.choice([-1.0, 1.0], values.size)
    values = np.concatenate([values, [0.0, -0.0, np.inf, -np.inf, np.nan]])
    counts = ExponentCounts.of(exponent_counts(values))
    found = format_losses(counts, None if scale == 1.0 else scale)
    for name, dtype in DTYPES.items():
        assert found[name][0].tolist() == torch_losses(values, scale, dtype), name


def test_the_watch_names_the_parameters_beyond_its_share_most_first():
    lossy = LossyFormat("float16", 0.1)
    counts = np.array([exponent_counts(np.array(v, np.float32)) for v in
                       ([1e-9] * 5 + [1.0] * 5, [1e-6] * 9 + [1.0], [1.0] * 10, [70000.0] + [1.0] * 99)])
    share, parameters = lossy.losses(["a", "b", "c", "d"], ExponentCounts.of(counts), None)
    assert share == pytest.approx((5 + 9 + 1) / 130)
    assert parameters == [("b", pytest.approx(0.9)), ("a", pytest.approx(0.5))]  # d's 1% is under 10%
    assert lossy.losses(["c"], ExponentCounts.of(counts[2:3]), None) is None


def test_a_watch_with_the_anomaly_flags_off_is_refused_not_left_silent():
    from msprobe_mlflow import MonitorOptions
    with pytest.raises(ValueError, match="lossy_format = 'float16' is given with anomaly_flags=False"):
        MonitorOptions.of(lossy_format="float16", anomaly_flags=False)


@pytest.mark.parametrize("fields, problem", [({"format": "fp4"}, "lossy_format = 'fp4'"),
                                             ({"format": "float16", "share": 1.5}, "lossy_share = 1.5")])
def test_a_bad_watch_is_refused_naming_what_is_accepted(fields, problem):
    with pytest.raises(ValueError, match=problem):
        LossyFormat(**fields)


class TinyLayer(torch.nn.Module):
    """``head(tiny(x) * 1e-4)``: the tiny layer's gradients are 1e-4 times the head's, subnormal in float16
    unless the loss scale lifts them."""

    def __init__(self):
        super().__init__()
        self.tiny, self.head = torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.tiny(x) * 1e-4)


def test_a_float16_run_whose_loss_scale_falls_is_named_at_that_step_with_its_layer(tmp_experiment, tmp_path):
    torch.manual_seed(0)
    model = TinyLayer()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 14, growth_interval=10_000)
    config = GradProbeConfig(level="L2", bounds=[-1, 0, 1], dump_path=str(tmp_path / "dump"))
    captured = []
    with mlflow.start_run() as run:
        monitor = GradientMonitor(config, lossy_format="float16", lossy_share=0.05).monitor(model, optimizer)
        for step in range(6):
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(16, 8)).float().pow(2).mean()
            scale = scaler.get_scale()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            captured.append((scale, {n: p.grad.detach().numpy().copy() for n, p in model.named_parameters()}))
            scaler.update(1.0 if step == 2 else None)  # from step 3 on, a scale too small for float16
        monitor.stop()
    expected = None  # the first step at which float16 holds more than 5% outside its normal range, by torch
    for step, (scale, grads) in enumerate(captured):
        values = np.concatenate([g.ravel() for g in grads.values()])
        if sum(torch_losses(values, scale, torch.float16)) > 0.05 * values.size:
            shares = {n: sum(torch_losses(g.ravel(), scale, torch.float16)) / g.size for n, g in grads.items()}
            expected = step, max(shares, key=shares.get)
            break
    assert expected is not None and expected[0] == 3
    tags = mlflow.get_run(run.info.run_id).data.tags
    assert tags["msprobe_mlflow.first_lossy_step"] == "3"
    assert tags["msprobe_mlflow.lossy_parameters"].split(" (")[0] == expected[1]
    history = {m.step: m.value for m in mlflow.MlflowClient().get_metric_history(
        run.info.run_id, "grad/rank0/formats/float16 subnormal")}
    assert history[2] < 0.05 < history[3]


def test_the_scalers_unscale_is_wrapped_only_while_a_monitor_counts_exponents_and_each_steps_scale_is_kept(tmp_path):
    original = torch.amp.GradScaler.__dict__["unscale_"]
    model = TinyLayer()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    plain = GradientMonitor(GradProbeConfig(level="L2", dump_path=str(tmp_path / "plain")),
                            log_to_mlflow=False).monitor(model, optimizer)
    assert torch.amp.GradScaler.__dict__["unscale_"] is original  # no exponent counts: nothing wrapped
    plain.stop()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1)  # doubles after every step
    monitor = GradientMonitor(GradProbeConfig(level="L1", dump_path=str(tmp_path / "dump")), log_to_mlflow=False,
                              statistics=["exponents"]).monitor(model, optimizer)
    assert torch.amp.GradScaler.__dict__["unscale_"] is not original
    scales = []
    for _ in range(3):
        optimizer.zero_grad()
        scales.append(scaler.get_scale())
        scaler.scale(model(torch.randn(4, 8)).pow(2).mean()).backward()
        scaler.step(optimizer)
        scaler.update()
    monitor.stop()
    assert torch.amp.GradScaler.__dict__["unscale_"] is original
    assert scales == [1024.0, 2048.0, 4096.0]
    assert [read_exponents(exponents_path(tmp_path / "dump", 0, step))[2] for step in range(3)] == scales
