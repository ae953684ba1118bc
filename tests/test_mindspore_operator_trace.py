"""The MindSpore operator trace (real MindSpore, PyNative, CPU): what it records of a step (mint/ops/Tensor calls and
primitives with their cells, cell entries forward and backward), its statistics and gradients against values numpy
computes here, its checksum against the PyTorch one of the same bytes, that it puts everything back, that GRAPH_MODE
is refused saying why, and the monitor and callback writing step S's trace (its forward and backward only)."""
from __future__ import annotations

import json

import numpy as np
import pytest

ms = pytest.importorskip("mindspore", reason="MindSpore is not installed (the torch-only stage)")
from mindspore import Parameter, Tensor, mint, nn  # noqa: E402

from msprobe_mlflow.mindspore.operator_trace import (MindSporeOperatorTracer,  # noqa: E402
                                                     device_checksum, host_checksum, traced_apis)
from msprobe_mlflow.trace.files import read_trace, trace_folder, write_trace  # noqa: E402
from msprobe_mlflow.trace.recording import checksum_hex  # noqa: E402

rng = np.random.default_rng(3)
X = rng.standard_normal((6, 8)).astype(np.float32)
Y = rng.standard_normal((6, 4)).astype(np.float32)
W1, B1 = rng.standard_normal((16, 8)).astype(np.float32) / 3, rng.standard_normal(16).astype(np.float32) / 3
W2, B2 = rng.standard_normal((4, 16)).astype(np.float32) / 4, rng.standard_normal(4).astype(np.float32) / 4
EPS = 1e-5


class Linear(nn.Cell):
    def __init__(self, weight, bias):
        super().__init__()
        self.weight, self.bias = Parameter(Tensor(weight), name="weight"), Parameter(Tensor(bias), name="bias")

    def construct(self, x):
        return mint.nn.functional.linear(x, self.weight, self.bias)


class LayerNorm(nn.Cell):
    """mint's layer_norm has no CPU kernel: the same arithmetic from mint operators that have one."""

    def __init__(self, size):
        super().__init__()
        self.weight = Parameter(Tensor(np.ones(size, np.float32)), name="weight")
        self.bias = Parameter(Tensor(np.zeros(size, np.float32)), name="bias")

    def construct(self, x):
        centered = mint.sub(x, mint.mean(x, -1, True))
        variance = mint.mean(mint.mul(centered, centered), -1, True)
        return mint.add(mint.mul(mint.mul(centered, mint.rsqrt(mint.add(variance, EPS))), self.weight), self.bias)


class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.fc1, self.ln, self.fc2 = Linear(W1, B1), LayerNorm(16), Linear(W2, B2)

    def construct(self, x):
        return self.fc2(mint.tanh(self.ln(self.fc1(x))))


class WithLoss(nn.Cell):
    def __init__(self, net):
        super().__init__(auto_prefix=False)
        self.net = net

    def construct(self, x, y):
        return mint.mean(mint.square(self.net(x) - y))  # Tensor.__sub__, then mint


def numpy_forward():
    h = X.astype(np.float64) @ W1.T + B1
    centered = h - h.mean(-1, keepdims=True)
    normed = centered / np.sqrt((centered ** 2).mean(-1, keepdims=True) + EPS)
    out = np.tanh(normed) @ W2.T.astype(np.float64) + B2
    return h, out


def traced_step(level="mix", **keywords):
    net = Net()
    step = ms.value_and_grad(lambda x, y: mint.mean(mint.square(net(x) - y)), None, net.trainable_params())
    tracer = MindSporeOperatorTracer(net, level=level, **keywords)
    tracer.start()
    try:
        step(Tensor(X), Tensor(Y))
    finally:
        build = tracer.stop()
    return build()


def test_api_and_cell_calls_with_their_cells_forward_and_backward(pynative):
    calls = traced_step()
    names = [c.name for c in calls]
    by_name = {c.name: c for c in calls}
    assert names[:2] == ["MintFunctional.linear.0.forward", "Cell.fc1.Linear.forward.0"]  # a cell after its calls
    assert by_name["MintFunctional.linear.0.forward"].parent == "Cell.fc1.Linear.forward.0"
    assert by_name["MintFunctional.linear.1.forward"].parent == "Cell.fc2.Linear.forward.0"
    assert by_name["Mint.rsqrt.0.forward"].parent == "Cell.ln.LayerNorm.forward.0"
    assert [n for n in names if n.startswith("Mint.mean.")] == ["Mint.mean.0.forward", "Mint.mean.1.forward",
                                                               "Mint.mean.2.forward"]  # counted per API
    assert by_name["Mint.tanh.0.forward"].parent is None  # in the root cell: outside any cell, as msprobe has it
    assert by_name["Tensor.__sub__.0.forward"].parent is None
    assert any("test_mindspore_operator_trace.py" in line and line.endswith("in construct")
               for line in by_name["Mint.rsqrt.0.forward"].stack)
    # nested calls are the outer call's: mint's linear runs no entry of its own inside
    assert not any(n.startswith(("Functional.", "Primitive.")) for n in names)
    backward = [n for n in names if n.endswith(".backward.0")]
    assert backward[:2] == ["Cell.fc2.Linear.backward.0", "Cell.ln.LayerNorm.backward.0"]
    assert "Cell.fc1.Linear.backward.0" in backward
    assert all(".backward." not in n for n in names[:names.index(backward[0])])  # the forward, then the backward
    scalar = by_name["Mint.add.0.forward"].inputs[1]  # the epsilon, a number argument
    assert (scalar.type, scalar.value) == ("float", EPS)


def test_levels_scope_and_list_as_msprobe(pynative):
    assert {c.name.split(".")[0] for c in traced_step("L0")} == {"Cell"}
    assert "Cell" not in {c.name.split(".")[0] for c in traced_step("L1")}
    assert [c.name for c in traced_step("L1", api_list=("tanh",))] == ["Mint.tanh.0.forward"]
    scoped = traced_step("L1", scope=("Mint.rsqrt.0.forward", "Mint.tanh.0.forward"))
    assert [c.name for c in scoped] == ["Mint.rsqrt.0.forward", "Mint.mul.1.forward", "Mint.mul.2.forward",
                                        "Mint.add.1.forward", "Mint.tanh.0.forward"]


def test_statistics_and_gradients_equal_numpy(pynative):
    calls = traced_step()
    by_name = {c.name: c for c in calls}
    hidden, out = numpy_forward()
    linear = by_name["MintFunctional.linear.0.forward"]
    assert [t.shape for t in linear.tensors_in] == [(6, 8), (16, 8), (16,)]
    assert linear.inputs[0].max == pytest.approx(X.max(), rel=1e-7)  # an input: its float32 values exactly
    second = by_name["MintFunctional.linear.1.forward"]
    for summary, expected in ((linear.outputs[0], hidden), (second.outputs[0], out)):
        assert summary.dtype == "Float32" and summary.shape == expected.shape
        assert summary.max == pytest.approx(expected.max(), rel=1e-5)
        assert summary.min == pytest.approx(expected.min(), rel=1e-5)
        assert summary.mean == pytest.approx(expected.mean(), rel=1e-4, abs=1e-6)
        assert summary.norm == pytest.approx(np.linalg.norm(expected), rel=1e-5)
    # the backward: fc2's input is the loss's gradient with respect to its output, its output that of fc2's input
    fc2 = by_name["Cell.fc2.Linear.backward.0"]
    grad_out = 2 * (out - Y) / Y.size
    grad_in = grad_out @ W2.astype(np.float64)
    assert fc2.inputs[0].norm == pytest.approx(np.linalg.norm(grad_out), rel=1e-5)
    assert fc2.inputs[0].max == pytest.approx(grad_out.max(), rel=1e-5)
    assert fc2.outputs[0].norm == pytest.approx(np.linalg.norm(grad_in), rel=1e-5)
    assert fc2.outputs[0].min == pytest.approx(grad_in.min(), rel=1e-5)


def _torch_checksum(array: np.ndarray, transposed: bool = False) -> str:
    torch = pytest.importorskip("torch")
    from msprobe_mlflow.torch_kernels.bit_checksum import bit_checksum

    if array.dtype.name == "bfloat16":
        tensor = torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    else:
        tensor = torch.from_numpy(array)
    return checksum_hex(bit_checksum(tensor.t() if transposed else tensor))


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64", "int32", "bool"])
def test_checksum_equals_pytorch_for_the_same_bytes(pynative, dtype):
    values = rng.standard_normal((7, 5)) * 3
    tensor = Tensor(values.astype(np.float32)).astype(getattr(ms, dtype if dtype != "bool" else "bool_"))
    array = tensor.asnumpy()
    ours = checksum_hex(host_checksum(tensor))
    assert ours == checksum_hex(device_checksum(tensor).asnumpy())  # the GPU/NPU way, run here on the CPU
    assert ours == _torch_checksum(array)  # a MindSpore tensor and a PyTorch one of equal bits: equal checksums
    view = mint.transpose(tensor, 0, 1)  # a view: read in memory order, as PyTorch reads its transposed view
    assert not view.is_contiguous()
    assert checksum_hex(host_checksum(view)) == checksum_hex(device_checksum(view).asnumpy()) == \
        _torch_checksum(array, transposed=True) == ours
    if dtype != "bool":  # (all True: every order has the same bytes) a transposed copy is other bytes
        assert checksum_hex(host_checksum(view.contiguous())) != ours


def test_checksum_in_the_trace_changes_with_one_bit(pynative):
    calls = traced_step()
    output = next(c for c in calls if c.name == "MintFunctional.linear.0.forward").outputs[0]
    hidden = mint.nn.functional.linear(Tensor(X), Tensor(W1), Tensor(B1)).asnumpy()
    assert output.checksum == f"bits64:{_torch_checksum(hidden)}"
    flipped = hidden.copy()
    flipped.reshape(-1).view(np.int32)[17] ^= 1
    assert checksum_hex(host_checksum(Tensor(flipped))) != output.checksum.split(":")[1]


def _installed_state(net):
    apis = {(id(owner), name): owner.__dict__.get(name, None) for owner, name, _ in traced_apis()}
    cells = {path: (type(cell), dict(cell.__dict__)) for path, cell in net.cells_and_names()}
    primitives = {id(p): type(p) for _, cell in net.cells_and_names() for p in cell._primitives.values()}
    return apis, cells, primitives


def test_everything_is_put_back_and_untraced_steps_record_nothing(pynative):
    net = WithLoss(nn.SequentialCell([nn.Dense(8, 4), nn.ReLU()]))  # primitives held by cells, too
    step = ms.value_and_grad(net, None, net.trainable_params())
    originals = {name: getattr(mint, name) for name in ("add", "mean", "square")}
    tensor_methods = dict(vars(ms.Tensor))
    step(Tensor(X), Tensor(Y))
    before = _installed_state(net)  # after a step: calling a cell fills in its (empty) hook dictionaries
    tracer = MindSporeOperatorTracer(net)
    tracer.start()
    assert mint.add is not originals["add"]
    step(Tensor(X), Tensor(Y))
    calls = tracer.stop()()
    names = [c.name for c in calls]
    assert {"Primitive.matmul.0.forward", "Primitive.bias_add.0.forward", "Primitive.relu.0.forward",
            "Cell.net.0.Dense.forward.0", "Cell.net.1.ReLU.forward.0", "Cell.net.0.Dense.backward.0"} <= set(names)
    relu = next(c for c in calls if c.name == "Primitive.relu.0.forward")
    assert relu.parent == "Cell.net.1.ReLU.forward.0"
    assert all(getattr(mint, name) is function for name, function in originals.items())
    assert dict(vars(ms.Tensor)) == tensor_methods
    after = _installed_state(net)
    assert after[0] == before[0] and after[2] == before[2]
    for path, (cls, attributes) in before[1].items():
        now_cls, now = after[1][path]
        assert now_cls is cls
        assert {k: v for k, v in now.items() if k.startswith(("_lazy_", "_cell_backward"))} == \
            {k: v for k, v in attributes.items() if k.startswith(("_lazy_", "_cell_backward"))}
        assert set(now["_primitives"]) == set(attributes["_primitives"])
    step(Tensor(X), Tensor(Y))
    assert len(tracer._calls) == len(calls)  # nothing records outside the traced step


@pytest.mark.parametrize("mode", ["graph"], indirect=True)
def test_graph_mode_is_refused_saying_what_to_do(mode):
    tracer = MindSporeOperatorTracer(Net())
    with pytest.raises(ValueError, match=r"GRAPH_MODE: the step runs as one compiled graph.*PyNative.*msprobe's "
                                         r"own data dump"):
        tracer.start()
    assert not hasattr(mint.add, "__wrapped__")  # nothing installed


def test_a_jit_function_is_one_entry_compiled_from_the_originals(pynative):
    @ms.jit
    def scaled(x):
        return mint.mul(x, 2.0) + 1.0

    tracer = MindSporeOperatorTracer(None, level="L1")
    tracer.start()
    out = scaled(mint.tanh(Tensor(X)))
    calls = tracer.stop()()
    assert [c.name for c in calls] == ["Mint.tanh.0.forward", "Jit.scaled.0.forward"]
    assert calls[1].outputs[0].max == pytest.approx(float(out.asnumpy().max()))
    assert np.allclose(scaled(Tensor(X)).asnumpy(), 2 * X + 1)  # runs after the trace, with nothing recorded
    assert len(tracer._calls) == 2


@pytest.mark.parametrize("compiled_before", [True, False])
def test_a_jit_train_step_compiles_and_runs_in_the_traced_step(pynative, compiled_before):
    """A graph first compiled in the traced step is compiled without the cells' hooks (which fail to compile)."""
    net = Net()
    step = ms.value_and_grad(WithLoss(net), None, net.trainable_params())

    @ms.jit
    def train_step(x, y):
        return step(x, y)

    if compiled_before:
        train_step(Tensor(X), Tensor(Y))
    tracer = MindSporeOperatorTracer(net)
    tracer.start()
    loss, _ = train_step(Tensor(X), Tensor(Y))
    calls = tracer.stop()()
    assert [c.name for c in calls] == ["Jit.train_step.0.forward"]
    assert calls[0].outputs[0].max == pytest.approx(float(loss.asnumpy()))
    _, out = numpy_forward()
    assert float(train_step(Tensor(X), Tensor(Y))[0].asnumpy()) == pytest.approx(np.mean((out - Y) ** 2), rel=1e-5)
    assert len(tracer._calls) == 1


def test_written_in_msprobe_layout_and_read_back(pynative, tmp_path):
    calls = traced_step()
    folder = write_trace(tmp_path / "step0" / "rank0", calls, level="mix", framework="mindspore")
    dump = json.loads((folder / "dump.json").read_text())
    assert dump["framework"] == "mindspore" and dump["task"] == "statistics"
    entry = dump["data"]["Mint.rsqrt.0.forward"]
    assert entry["output"][0]["dtype"] == "Float32" and len(entry["output"][0]["checksum"]) == 16
    assert json.loads((folder / "construct.json").read_text())["Mint.rsqrt.0.forward"] == \
        "Cell.ln.LayerNorm.forward.0"
    assert "Mint.rsqrt.0.forward" in json.loads((folder / "stack.json").read_text())
    back = read_trace(trace_folder(tmp_path, step=0))
    assert [c.name for c in back.calls] == [c.name for c in calls]
    assert back.calls[0].outputs[0].checksum == calls[0].outputs[0].checksum


# -- the monitor and the callback ------------------------------------------------------------------------------


def _custom_loop(monitor, steps=3):
    net = Net()
    loss_net = WithLoss(net)
    optimizer = mint.optim.SGD(net.trainable_params(), lr=0.0)  # an eager construct: its calls would show
    monitor.monitor(optimizer, network=net)
    step = ms.value_and_grad(loss_net, None, optimizer.parameters)
    for _ in range(steps):
        _, grads = step(Tensor(X), Tensor(Y))
        optimizer(grads)
    monitor.stop()
    return net


def test_the_monitor_traces_step_s_forward_and_backward_only(pynative, tmp_path):
    from msprobe_mlflow.config import GradProbeConfig
    from msprobe_mlflow.mindspore import GradientMonitor

    monitor = GradientMonitor(GradProbeConfig(dump_path=str(tmp_path)), log_to_mlflow=False, trace_steps=[1])
    add = mint.add
    _custom_loop(monitor)
    assert monitor.errors == [] and mint.add is add
    root = tmp_path / "rank0" / "trace"
    assert sorted(p.name for p in root.iterdir()) == ["step1"]
    folder = trace_folder(root, step=1)
    assert sorted(p.name for p in folder.iterdir()) == ["construct.json", "dump.json", "stack.json"]
    names = [c.name for c in read_trace(folder).calls]
    assert names[0] == "MintFunctional.linear.0.forward"  # one forward (the loss's mean is the third)
    assert "Mint.mean.2.forward" in names and "Mint.mean.3.forward" not in names
    assert names.count("Cell.fc1.Linear.forward.0") == 1 and "Cell.fc1.Linear.forward.1" not in names
    assert names[-1].startswith("Cell.") and ".backward." in names[-1]  # nothing of the optimizer's after it
    assert not any("foreach" in n or "sgd" in n.lower() for n in names)


def test_the_traced_step_goes_into_the_run_and_training_is_unchanged(pynative, tmp_experiment, tmp_path):
    import mlflow
    from mlflow import MlflowClient

    from msprobe_mlflow.config import GradProbeConfig
    from msprobe_mlflow.mindspore import GradientMonitor

    _custom_loop(GradientMonitor(GradProbeConfig(dump_path=str(tmp_path / "plain")), log_to_mlflow=False))
    with mlflow.start_run() as run:
        monitor = GradientMonitor(GradProbeConfig(dump_path=str(tmp_path / "traced")), trace_steps=[0, 2])
        _custom_loop(monitor)
    assert monitor.errors == []
    for step in range(3):
        name = f"rank0/grad_summary_{step}.csv"
        assert (tmp_path / "plain" / name).read_bytes() == (tmp_path / "traced" / name).read_bytes()
    client = MlflowClient()
    artifacts = [a.path for a in client.list_artifacts(run.info.run_id, "grad_probe/rank0/trace/step2/rank0")]
    assert sorted(artifacts) == [f"grad_probe/rank0/trace/step2/rank0/{f}" for f in
                                 ("construct.json", "dump.json", "stack.json")]
    assert client.get_run(run.info.run_id).data.tags["msprobe_mlflow.traced_steps"] == "0,2"


def test_a_trace_left_unfinished_is_said_and_nothing_is_written(pynative, tmp_path):
    from msprobe_mlflow.config import GradProbeConfig
    from msprobe_mlflow.mindspore import GradientMonitor

    monitor = GradientMonitor(GradProbeConfig(dump_path=str(tmp_path)), log_to_mlflow=False, trace_steps=[0])
    net = Net()
    monitor.monitor(mint.optim.SGD(net.trainable_params(), lr=0.0), network=net)
    net(Tensor(X))
    add = mint.add
    with pytest.warns(UserWarning, match="the trace of step 0 was not written: monitoring stopped before"):
        monitor.stop()
    assert not (tmp_path / "rank0" / "trace").exists() and mint.add is not add  # put back: the original again
    assert not hasattr(mint.add, "__wrapped__")


def test_the_monitor_in_graph_mode_says_what_can_be_traced(tmp_path):
    from msprobe_mlflow.config import GradProbeConfig
    from msprobe_mlflow.mindspore import GradientMonitor

    previous = ms.get_context("mode")
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        network = nn.Dense(3, 2)
        optimizer = nn.SGD(network.trainable_params(), learning_rate=0.1)
        monitor = GradientMonitor(GradProbeConfig(dump_path=str(tmp_path)), log_to_mlflow=False, trace_steps=[1])
        with pytest.warns(UserWarning, match=r"trace_steps .*GRAPH_MODE: the step runs as one compiled graph.*"
                                             r"PyNative.*msprobe's own data dump"):
            monitor.monitor(optimizer, network=network)
        monitor.stop()
    finally:
        ms.set_context(mode=previous)
    assert not (tmp_path / "rank0" / "trace").exists()


def test_the_callback_traces_model_train_with_the_users_cells(pynative, tmp_path):
    from mindspore import dataset
    from mindspore.train import Model

    from msprobe_mlflow.mindspore import GradProbeCallback

    net = Net()
    data = dataset.NumpySlicesDataset({"x": np.tile(X, (3, 1)), "y": np.tile(Y, (3, 1))}, shuffle=False).batch(6)
    callback = GradProbeCallback({"task": "grad_probe", "dump_path": str(tmp_path)}, log_to_mlflow=False,
                                 trace_steps=[1])
    model = Model(net, loss_fn=nn.MSELoss(), optimizer=nn.SGD(net.trainable_params(), learning_rate=0.0))
    model.train(1, data, callbacks=[callback], dataset_sink_mode=False)
    assert callback.monitor.errors == []
    calls = read_trace(trace_folder(tmp_path / "rank0" / "trace", step=1)).calls
    names = [c.name for c in calls]
    assert "Cell.fc1.Linear.forward.0" in names and "Cell.fc1.Linear.backward.0" in names
    linear = next(c for c in calls if c.name == "MintFunctional.linear.0.forward")
    assert linear.parent == "Cell.fc1.Linear.forward.0"
    assert linear.inputs[0].max == pytest.approx(X.max(), rel=1e-7)


# -- across frameworks ---------------------------------------------------------------------------------------------


def torch_twin_trace(folder):
    """The same network and weights in PyTorch (torch's classes named as MindSpore's), traced at step 0."""
    torch = pytest.importorskip("torch")
    from msprobe_mlflow.torch_kernels.operator_trace import OperatorTracer

    class LayerNorm(torch.nn.Module):
        def __init__(self, size):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(size))
            self.bias = torch.nn.Parameter(torch.zeros(size))

        def forward(self, x):
            centered = x - x.mean(-1, keepdim=True)
            variance = (centered * centered).mean(-1, keepdim=True)
            return centered * torch.rsqrt(variance + EPS) * self.weight + self.bias

    class TorchNet(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.ln, self.fc2 = torch.nn.Linear(8, 16), LayerNorm(16), torch.nn.Linear(16, 4)
            for layer, (w, b) in ((self.fc1, (W1, B1)), (self.fc2, (W2, B2))):
                layer.weight.data, layer.bias.data = torch.from_numpy(w.copy()), torch.from_numpy(b.copy())

        def forward(self, x):
            return self.fc2(torch.tanh(self.ln(self.fc1(x))))

    model = TorchNet()
    tracer = OperatorTracer(model)
    tracer.start()
    torch.mean(torch.square(model(torch.from_numpy(X)) - torch.from_numpy(Y))).backward()
    write_trace(folder / "step0" / "rank0", tracer.stop()(), level="mix", framework="pytorch")
    return folder


def test_a_mindspore_twin_of_a_pytorch_model_aligns_and_is_drift(pynative, tmp_path):
    """Across frameworks: calls pair by what they compute (MintFunctional.linear is Aten.addmm), the checksums
    agree where the bits do (through the hand-built LayerNorm), tanh's last bits are the first difference, and every
    module entry pairs."""
    from msprobe_mlflow.localization import DRIFT, locate_traces

    write_trace(tmp_path / "mindspore" / "step0" / "rank0", traced_step(), level="mix", framework="mindspore")
    found = locate_traces(torch_twin_trace(tmp_path / "torch"), tmp_path / "mindspore", step=0)
    assert found.kind == DRIFT, found.describe()
    assert found.module_share == 1.0
    pairs = [(pair.a.operator, pair.b.operator, j.output_difference) for pair, j in found.rows]
    assert pairs[0][:2] == ("Aten.addmm.default", "MintFunctional.linear")
    first = next(i for i, (_, _, difference) in enumerate(pairs) if difference > 0)
    assert pairs[first][:2] == ("Aten.tanh.default", "Mint.tanh") and first >= 10  # bit-equal up to tanh


def test_a_faulty_mindspore_kernel_is_named_against_the_pytorch_twin(pynative, tmp_path, monkeypatch):
    from msprobe_mlflow.localization import OPERATOR, locate_traces

    exact_tanh = mint.tanh
    monkeypatch.setattr(mint, "tanh", lambda x: mint.mul(exact_tanh(x), 1.01))  # the device's kernel, 1% off
    write_trace(tmp_path / "mindspore" / "step0" / "rank0", traced_step(), level="mix", framework="mindspore")
    found = locate_traces(torch_twin_trace(tmp_path / "torch"), tmp_path / "mindspore", step=0)
    assert found.kind == OPERATOR, found.describe()
    assert (found.pair.a.operator, found.pair.b.operator) == ("Aten.tanh.default", "Mint.tanh")
