"""The live verdict and the anomaly flags through the real MindSpore monitor (PyNative, CPU): the options live in
``SessionMonitor``, so the MindSpore monitor takes them as the PyTorch one does."""
from __future__ import annotations

import csv
import json

import pytest

ms = pytest.importorskip("mindspore", reason="MindSpore is not installed (the torch-only stage)")
from mindspore import nn  # noqa: E402

from mindspore_training import MLP, custom_loop, nan_in_the_first_bias_at, sine_batches, squared_error_of  # noqa: E402
from msprobe_mlflow import GradProbeConfig, compare_dumps
from msprobe_mlflow.dump import findings_dir
from msprobe_mlflow.mindspore import GradientMonitor

PERTURBED_FROM = 3


pytestmark = pytest.mark.usefixtures("pynative")  # in a temporary folder (conftest.py): MindSpore writes
# compiler reports (rank_0/om/...) into the current one


def monitored_training(dump, steps: int = 6, perturbed: bool = False, nan_at: int | None = None,
                       **options) -> GradientMonitor:
    """``value_and_grad`` and ``optimizer(grads)`` from Python; ``perturbed``: other inputs from ``PERTURBED_FROM``;
    ``nan_at``: that step's gradients get a NaN (the optimizer is given them, as a diverging run would). Returns
    the monitor, to stop."""
    ms.set_seed(0)
    net = MLP()
    optimizer = nn.SGD(net.trainable_params(), learning_rate=0.1)
    monitor = GradientMonitor(GradProbeConfig(dump_path=str(dump), level="L1"), log_to_mlflow=False,
                              **options).monitor(optimizer)
    custom_loop(squared_error_of(net), optimizer, sine_batches(steps, PERTURBED_FROM if perturbed else None),
                change_gradients=nan_in_the_first_bias_at(nan_at))
    return monitor


def test_the_mindspore_monitor_gives_the_live_verdict_compare_gives_afterwards(tmp_path):
    monitored_training(tmp_path / "baseline").stop()
    calls = []
    with pytest.warns(UserWarning, match=f"step {PERTURBED_FROM} is suspicious against baseline"):
        monitor = monitored_training(tmp_path / "candidate", perturbed=True, baseline=str(tmp_path / "baseline"),
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
        monitor = monitored_training(tmp_path / "nan", nan_at=2)
        monitor.stop()
    with open(findings_dir(tmp_path / "nan", 0) / "anomalies.csv", encoding="utf-8-sig", newline="") as file:
        rows = list(csv.DictReader(file))
    assert (rows[0]["step"], rows[0]["parameter"], rows[0]["kind"]) == ("2", "fc1.bias", "nonfinite")
    assert {row["kind"] for row in rows} == {"nonfinite"}  # after the NaN update every gradient is NaN: no spikes
