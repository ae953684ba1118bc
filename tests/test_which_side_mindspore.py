"""Which side is wrong, with MindSpore on one side: a ``mint`` call saved by the MindSpore trace (``trace_save``)
replays in float64 through torch, as the API accuracy checker maps it, and is written as msprobe's tensor dump, so
that the checker replays it too (real MindSpore, PyNative, CPU; values checked against numpy)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

ms = pytest.importorskip("mindspore", reason="MindSpore is not installed (the torch-only stage)")
torch = pytest.importorskip("torch")
from mindspore import Parameter, Tensor, mint, nn  # noqa: E402

from msprobe_mlflow.api_check import check_api_accuracy  # noqa: E402
from msprobe_mlflow.mindspore.operator_trace import MindSporeOperatorTracer  # noqa: E402
from msprobe_mlflow.mindspore.operator_traces import write_saved_mindspore_call  # noqa: E402
from msprobe_mlflow.torch_kernels.operator_replay import (replay_error, save_call, saved_call_folder,  # noqa: E402
                                                          side_error)

rng = np.random.default_rng(5)
X = rng.standard_normal((6, 8)).astype(np.float32)
W, B = rng.standard_normal((4, 8)).astype(np.float32) / 3, rng.standard_normal(4).astype(np.float32) / 3
LINEAR = "MintFunctional.linear.0.forward"


class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.weight, self.bias = Parameter(Tensor(W), name="weight"), Parameter(Tensor(B), name="bias")

    def construct(self, x):
        return mint.tanh(mint.nn.functional.linear(x, self.weight, self.bias))


def saved_linear(folder) -> Path:
    net = Net()
    step = ms.value_and_grad(lambda x: mint.mean(mint.square(net(x))), None, net.trainable_params())
    tracer = MindSporeOperatorTracer(net, level="L1", save=(LINEAR,))
    tracer.start()
    try:
        step(Tensor(X))
    finally:
        tracer.stop()
    assert set(tracer.saved) == {LINEAR}
    write_saved_mindspore_call(folder, LINEAR, *tracer.saved[LINEAR])
    return saved_call_folder(folder, LINEAR)


def relative_error(observed: np.ndarray) -> float:
    reference = X.astype(np.float64) @ W.T.astype(np.float64) + B
    return float(np.linalg.norm(observed - reference) / np.linalg.norm(reference))


def scale_saved_output(folder, factor: float) -> None:
    output = folder / json.loads((folder / "call.json").read_text())["output"][0]["tensor"]
    np.save(output, np.load(output) * np.float32(factor), allow_pickle=False)


def test_a_saved_mint_call_replays_in_float64_and_its_error_is_the_outputs(pynative, tmp_path):
    folder = saved_linear(tmp_path)
    output = np.load(folder / json.loads((folder / "call.json").read_text())["output"][0]["tensor"])
    assert replay_error(folder) == pytest.approx(relative_error(output), rel=1e-6, abs=1e-12)
    assert replay_error(folder) < 1e-6  # MindSpore's float32 linear, at float32 rounding
    scale_saved_output(folder, 1.03)
    assert replay_error(folder) == pytest.approx(0.03, rel=1e-3)


def test_the_saved_call_is_the_api_checkers_input_and_fails_it_once_its_output_is_off(pynative, tmp_path):
    folder = saved_linear(tmp_path)
    report = check_api_accuracy(folder / "dump.json", output_dir=tmp_path / "check", log_to_mlflow=False)
    assert [(result.name, result.status) for result in report.results] == [("MintFunctional.linear.0", "pass")]
    scale_saved_output(folder, 1.03)
    report = check_api_accuracy(folder / "dump.json", output_dir=tmp_path / "again", log_to_mlflow=False)
    assert [result.status for result in report.results] == ["error"]


def test_the_side_off_float64_is_named_across_mindspore_and_pytorch(pynative, tmp_path):
    """A MindSpore run (A) against its PyTorch twin (B): the side whose saved output is off is the one named."""
    saved_linear(tmp_path / "a")
    x, w, b = (torch.from_numpy(v) for v in (X, W, B))
    aten = "Aten.linear.default.0.forward"
    save_call(tmp_path / "b", aten, [x, w, b], {}, torch.nn.functional.linear(x, w, b))
    assert side_error(tmp_path / "a", LINEAR, tmp_path / "b", aten).wrong is None
    scale_saved_output(saved_call_folder(tmp_path / "a", LINEAR), 1.01)
    side = side_error(tmp_path / "a", LINEAR, tmp_path / "b", aten)
    assert side.wrong == "A" and side.error_a == pytest.approx(0.01, rel=1e-3) and side.error_b < 1e-6


def test_the_monitor_saves_the_calls_the_environment_names_beside_the_trace(pynative, tmp_path, monkeypatch):
    from msprobe_mlflow.config import GradProbeConfig
    from msprobe_mlflow.mindspore import GradientMonitor
    from msprobe_mlflow.trace.files import trace_folder

    monkeypatch.setenv("MSPROBE_MLFLOW_TRACE_SAVE", f"{LINEAR},Mint.no_such.0.forward")
    monitor = GradientMonitor(GradProbeConfig(dump_path=str(tmp_path)), log_to_mlflow=False, trace_steps=[1])
    net = Net()
    optimizer = mint.optim.SGD(net.trainable_params(), lr=0.1)
    monitor.monitor(optimizer, network=net)
    step = ms.value_and_grad(lambda x: mint.mean(mint.square(net(x))), None, net.trainable_params())
    with pytest.warns(UserWarning, match="step 1 made no call named Mint.no_such.0.forward: nothing saved"):
        for _ in range(3):
            _, grads = step(Tensor(X))
            optimizer(grads)
        monitor.stop()
    assert monitor.errors == []
    saved = saved_call_folder(trace_folder(tmp_path / "rank0" / "trace", step=1), LINEAR)
    assert sorted(p.suffix for p in saved.iterdir()) == [".json", ".json", ".npy", ".npy", ".npy", ".npy"]
    assert replay_error(saved) < 1e-6  # step 1's own weights: replayed from what was saved, not from W and B
