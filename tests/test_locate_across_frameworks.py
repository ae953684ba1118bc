"""locate on a MindSpore training against its PyTorch twin (the same model, weights copied, the same batch; real
MindSpore in PyNative, real torch): the module entries align with no mapping file, the benign pair is drift, a
wrong kernel on one side is named with its module, and the side that is off float64 is named across frameworks."""
from __future__ import annotations

import contextlib

import numpy as np
import pytest

ms = pytest.importorskip("mindspore", reason="MindSpore is not installed (the torch-only stage)")
torch = pytest.importorskip("torch")
from mindspore import Tensor, mint, nn  # noqa: E402

import msprobe_mlflow  # noqa: E402
from msprobe_mlflow import GradProbeConfig  # noqa: E402
from msprobe_mlflow.localization import DRIFT, IDENTICAL, OPERATOR  # noqa: E402
from msprobe_mlflow.mindspore import GradientMonitor as MindSporeMonitor  # noqa: E402
from msprobe_mlflow.pytorch import GradientMonitor as TorchMonitor  # noqa: E402
from tiny_models import fixed, normed_mlp, sgd, train  # noqa: E402
from tiny_transformer import FaultyKernel  # noqa: E402

pytestmark = pytest.mark.usefixtures("pynative")
rng = np.random.default_rng(11)
W1, B1 = rng.standard_normal((16, 8)).astype(np.float32) * 0.3, rng.standard_normal(16).astype(np.float32) * 0.1
W2, B2 = rng.standard_normal((2, 16)).astype(np.float32) * 0.3, rng.standard_normal(2).astype(np.float32) * 0.1
X = rng.standard_normal((16, 8)).astype(np.float32)
STEPS, TRACED = 3, 1
MINT_TANH = "Mint.tanh.0.forward"


class Tanh(nn.Cell):
    """tanh through ``mint`` (which the replay maps to torch), named as torch's module is."""

    def construct(self, x):
        return mint.tanh(x)


class MindSporeNet(nn.Cell):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm((8,), epsilon=1e-5)
        self.body = nn.SequentialCell([nn.Dense(8, 16, weight_init=Tensor(W1), bias_init=Tensor(B1)), Tanh(),
                                       nn.Dense(16, 2, weight_init=Tensor(W2), bias_init=Tensor(B2))])

    def construct(self, x):
        return self.body(self.ln(x))


def traced_mindspore(dump, save=()):
    net = MindSporeNet()
    optimizer = nn.SGD(net.trainable_params(), learning_rate=0.05)
    monitor = MindSporeMonitor(GradProbeConfig(dump_path=str(dump)), log_to_mlflow=False, trace_steps=[TRACED],
                               trace_save=list(save))
    monitor.monitor(optimizer, network=net)
    step = ms.value_and_grad(lambda x: mint.mean(mint.square(net(x))), None, net.trainable_params())
    for _ in range(STEPS):
        _, grads = step(Tensor(X))
        optimizer(grads)
    monitor.stop()
    assert monitor.errors == []
    return dump


def traced_torch(dump, fault: FaultyKernel | None = None, save=()):
    net = normed_mlp(8, 16, 2, eps=1e-5)
    with torch.no_grad():
        for layer, (weight, bias) in zip((net.body.fc1, net.body.fc2), ((W1, B1), (W2, B2))):
            layer.weight.copy_(torch.from_numpy(weight))
            layer.bias.copy_(torch.from_numpy(bias))
    monitor = TorchMonitor(GradProbeConfig(dump_path=str(dump)), log_to_mlflow=False, trace_steps=[TRACED],
                           trace_save=list(save))

    def arm(step, model, optimizer):
        if fault is not None:
            fault.armed = step == TRACED

    with fault if fault is not None else contextlib.nullcontext():
        train(net, STEPS, optimizer=sgd(0.05), monitor=monitor, data=fixed(torch.from_numpy(X)), before_step=arm)
    monitor.stop()
    assert monitor.errors == []
    return dump


def test_the_twins_modules_align_and_the_benign_pair_is_drift(tmp_path):
    found = msprobe_mlflow.locate(traced_mindspore(tmp_path / "ms"), traced_torch(tmp_path / "pt"), step=TRACED,
                                  log_run=False).localization
    assert found.kind in (DRIFT, IDENTICAL), found.describe()
    assert found.module_share >= 0.95, found.module_share
    assert not any(pair.one_sided for pair, _ in found.rows)  # every forward call has its twin
    # MindSpore's Dense (matmul, then bias_add) is one call beside torch's addmm; each pair judged on comparable
    # inputs, so its tolerance is finite
    assert [(pair.a.operator, pair.b.operator) for pair, _ in found.rows] == [
        ("Primitive.layer_norm", "Aten.native_layer_norm.default"), ("Primitive.matmul", "Aten.addmm.default"),
        ("Mint.tanh", "Aten.tanh.default"), ("Primitive.matmul", "Aten.addmm.default"), ("Mint.mean", "Aten.mean.default"),
        # the backward per leaf module (MindSpore's LayerNorm gives no gradient of the network's input)
        ("Cell.body.2.Dense", "Module.body.fc2.Linear"), ("Cell.body.1.Tanh", "Module.body.act.Tanh"),
        ("Cell.body.0.Dense", "Module.body.fc1.Linear")]
    assert all(judgement.tolerance < 1e-4 for _, judgement in found.rows)


def test_a_wrong_kernel_in_the_pytorch_twin_is_named_and_its_side_too(tmp_path):
    fault = FaultyKernel("tanh", 0, error=1e-2)
    aten_tanh = "Aten.tanh.default.0.forward"
    result = msprobe_mlflow.locate(traced_mindspore(tmp_path / "ms", save=[MINT_TANH]),
                                   traced_torch(tmp_path / "pt", fault, save=[aten_tanh]), step=TRACED, log_run=False)
    found = result.localization
    assert fault.injected == 1
    assert found.kind == OPERATOR, found.describe()
    assert (found.pair.a.name, found.pair.b.name) == (MINT_TANH, aten_tanh)
    assert found.module == "body.1"
    assert result.side.wrong == "B"
    assert result.side.error_b == pytest.approx(1e-2, rel=0.05) and result.side.error_a < 1e-6


@pytest.mark.parametrize("operator, number, cell, module", [("tanh_backward", 0, "body.1.Tanh", "body.act.Tanh"),
                                                            ("mm", 0, "body.2.Dense", "body.fc2.Linear")])
def test_a_wrong_backward_kernel_across_frameworks_is_named_by_its_module(tmp_path, operator, number, cell, module):
    """MindSpore runs its backward's operators below Python; its trace has each cell's gradients. A PyTorch backward
    kernel 1% off (tanh's; the product that gives fc2's input its gradient) is named by the module whose backward
    ran it, compared as a whole: the gradient of its output and what it reads back in, that of its input out."""
    fault = FaultyKernel(operator, number, phase="backward", error=1e-2)
    result = msprobe_mlflow.locate(traced_mindspore(tmp_path / "ms"), traced_torch(tmp_path / "pt", fault),
                                   step=TRACED, log_run=False)
    found = result.localization
    assert fault.injected == 1
    assert found.kind == OPERATOR, found.describe()
    assert (found.pair.a.name, found.pair.b.name) == (f"Cell.{cell}.backward.0", f"Module.{module}.backward.0")
    assert found.module == cell.rsplit(".", 1)[0] and "compared as a whole across frameworks" in found.describe()
    assert result.side is None and "a module's backward across frameworks is not replayed" in result.side_hint


def test_across_frameworks_a_quiet_step_says_what_of_the_backward_it_did_not_compare(tmp_path):
    """A wrong kernel that computes a parameter's gradient (fc2's weight, 1% off) changes no module's input
    gradient: locate finds nothing, and says that such a kernel is not ruled out. One framework against itself
    says no such thing."""
    fault = FaultyKernel("mm", 1, phase="backward", error=1e-2)
    mindspore_run = traced_mindspore(tmp_path / "ms")
    found = msprobe_mlflow.locate(mindspore_run, traced_torch(tmp_path / "pt", fault), step=TRACED,
                                  log_run=False).localization
    assert fault.injected == 1
    assert found.kind == DRIFT and found.across, found.describe()
    assert "a wrong kernel computing a parameter's gradient, or outside the leaf modules it could pair, is not " \
        "ruled out" in found.describe()
    alone = msprobe_mlflow.locate(mindspore_run, mindspore_run, step=TRACED, log_run=False).localization
    assert not alone.across and "backward" not in alone.describe(), alone.describe()
