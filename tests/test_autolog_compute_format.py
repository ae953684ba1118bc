"""autolog() attaches at the first optimizer step, after that step's forward: its step 0 record still carries the
format the step computed in, so its archives equal the explicit monitor's byte for byte (issue 47)."""
from __future__ import annotations

from pathlib import Path

import mlflow
import pytest
import torch

import msprobe_mlflow
from msprobe_mlflow import GradProbeConfig
from msprobe_mlflow.directions import step_compute_format
from msprobe_mlflow.dump import step_dir
from msprobe_mlflow.pytorch import GradientMonitor
from tiny_models import gaussian, mlp, train

STEPS = 3


def forward_in(autocast: bool):
    def forward(model, x):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            return model(x)
    return forward


def trained(autocast: bool, monitor=None) -> None:
    train(mlp(8, 8, 2, activation=torch.nn.ReLU), STEPS, monitor=monitor, forward=forward_in(autocast),
          data=gaussian(4, 8), loss=lambda out, _: out.float().square().mean())


@pytest.mark.parametrize("autocast, expected", [(False, "float32"), (True, "bfloat16")])
def test_autologs_first_step_records_its_format_and_its_archives_equal_the_explicit_monitors(
        tmp_experiment, tmp_path, autocast, expected):
    explicit = tmp_path / "explicit"
    monitor = GradientMonitor(GradProbeConfig(dump_path=str(explicit), level="L1"), log_to_mlflow=False)
    trained(autocast, monitor)
    monitor.stop()
    msprobe_mlflow.autolog(level="L1", dump_path=str(tmp_path / "autolog"))
    try:
        with mlflow.start_run() as run:
            trained(autocast)
    finally:
        msprobe_mlflow.autolog(disable=True)
    autologged = tmp_path / "autolog" / run.info.run_id
    assert [step_compute_format(step_dir(autologged, 0, s)) for s in range(STEPS)] == [expected] * STEPS
    for step in range(STEPS):
        archive = Path("directions.npz")
        assert (step_dir(autologged, 0, step) / archive).read_bytes() == (step_dir(explicit, 0, step) / archive).read_bytes()
