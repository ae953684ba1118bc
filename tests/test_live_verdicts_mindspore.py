"""The live verdict and the anomaly flags through the real MindSpore monitor (PyNative, CPU): the options live in
``SessionMonitor``, so the MindSpore monitor takes them as the PyTorch one does."""
from __future__ import annotations

import csv
import json

import numpy as np
import pytest

ms = pytest.importorskip("mindspore", reason="MindSpore is not installed (the torch-only stage)")
from mindspore import Tensor, nn, ops  # noqa: E402

from msprobe_mlflow import GradProbeConfig, compare_dumps
from msprobe_mlflow.dump import findings_dir
from msprobe_mlflow.mindspore import GradientMonitor

PERTURBED_FROM = 3


pytestmark = pytest.mark.usefixtures("pynative")  # in a temporary folder (conftest.py): MindSpore writes
# compiler reports (rank_0/om/...) into the current one


class MLP(nn.Cell):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Dense(4, 16)
        self.fc2 = nn.Dense(16, 2)

    def construct(self, x):
        return self.fc2(ops.tanh(self.fc1(x)))


def train(dump, steps: int = 6, perturbed: bool = False, nan_at: int | None = None, **options) -> GradientMonitor:
    """``value_and_grad`` and ``optimizer(grads)`` from Python; ``perturbed``: other inputs from ``PERTURBED_FROM``;
    ``nan_at``: that step's gradients get a NaN (the optimizer is given them, as a diverging run would)."""
    ms.set_seed(0)
    net = MLP()
    optimizer = nn.SGD(net.trainable_params(), learning_rate=0.1)
    monitor = GradientMonitor(GradProbeConfig(dump_path=str(dump), level="L1"), log_to_mlflow=False,
                              **options).monitor(optimizer)
    loss_fn = nn.MSELoss()
    grad_fn = ms.value_and_grad(lambda x, y: loss_fn(net(x), y), None, optimizer.parameters)
    data, other_data = np.random.default_rng(1), np.random.default_rng(2)
    for step in range(steps):
        x = data.standard_normal((8, 4)).astype(np.float32)
        if perturbed and step >= PERTURBED_FROM:
            x = other_data.standard_normal((8, 4)).astype(np.float32)
        _, grads = grad_fn(Tensor(x), Tensor(np.sin(x[:, :2])))
        if step == nan_at:
            bias = grads[1].asnumpy().copy()
            bias[0] = np.nan
            grads = (grads[0], Tensor(bias), *grads[2:])
        optimizer(grads)
    return monitor


def test_the_mindspore_monitor_gives_the_live_verdict_compare_gives_afterwards(tmp_path):
    train(tmp_path / "baseline").stop()
    calls = []
    with pytest.warns(UserWarning, match=f"step {PERTURBED_FROM} is suspicious against baseline"):
        monitor = train(tmp_path / "candidate", perturbed=True, baseline=str(tmp_path / "baseline"),
                        on_suspicious=calls.append)
        monitor.flush()
        assert len(calls) == 1  # judged while the monitor still runs
        monitor.stop()
    afterwards = compare_dumps(tmp_path / "baseline", tmp_path / "candidate", None)
    assert afterwards.verdict.first_suspicious_step == PERTURBED_FROM
    assert calls == [afterwards.verdict.ranks[0]]
    saved = json.loads((findings_dir(tmp_path / "candidate", 0) / "verdict.json").read_text())
    assert saved["verdict"] == afterwards.verdict.to_dict()
    assert saved["compared_steps"] == list(range(6))


def test_the_mindspore_monitor_flags_a_nan_gradient_at_its_step(tmp_path):
    with pytest.warns(UserWarning, match="non-finite gradients at step 2: fc1.bias"):
        monitor = train(tmp_path / "nan", nan_at=2)
        monitor.stop()
    with open(findings_dir(tmp_path / "nan", 0) / "anomalies.csv", encoding="utf-8-sig", newline="") as file:
        rows = list(csv.DictReader(file))
    assert (rows[0]["step"], rows[0]["parameter"], rows[0]["kind"]) == ("2", "fc1.bias", "nonfinite")
    assert {row["kind"] for row in rows} == {"nonfinite"}  # after the NaN update every gradient is NaN: no spikes
