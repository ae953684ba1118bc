"""Which side is wrong: the named call's inputs saved at a second trace of the step (``trace_save``,
``MSPROBE_MLFLOW_TRACE_SAVE``), replayed in float64, each side's output measured against its own replay."""
import pytest
import torch

import msprobe_mlflow
from msprobe_mlflow.config import GradProbeConfig
from msprobe_mlflow.pytorch import GradientMonitor
from msprobe_mlflow.torch_kernels.operator_replay import replay_error, save_call, saved_call_folder, side_error
from msprobe_mlflow.trace.options import TRACE_SAVE_VARIABLE
from tests.tiny_transformer import FaultyKernel, train_monitored


def traced(dump, save=(), fault=None, dtype=torch.float32):
    monitor = GradientMonitor(GradProbeConfig(dump_path=str(dump), level="L1"), log_to_mlflow=False, silent=True,
                              trace_steps=[2], trace_save=list(save))
    train_monitored(monitor, 3, fault, fault_steps={2}, dtype=dtype)
    monitor.stop()
    assert monitor.errors == []
    return dump


@pytest.mark.parametrize("faulty, name", [("B", "Aten.gelu.default.1.forward"), ("A", "Aten.mm.default.3.backward")])
def test_the_side_whose_output_is_off_its_float64_replay_is_named(tmp_path, faulty, name):
    operator, number, phase = name.split(".")[1], int(name.split(".")[3]), name.split(".")[4]
    fault = FaultyKernel(operator, number, phase, error=1e-2)
    clean = traced(tmp_path / "clean", save=[name], dtype=torch.float64 if faulty == "A" else torch.float32)
    broken = traced(tmp_path / "broken", save=[name], fault=fault)
    a, b = (broken, clean) if faulty == "A" else (clean, broken)
    result = msprobe_mlflow.locate(a, b, step=2, log_run=False)
    assert result.localization.pair.a.name == name
    errors = {"A": result.side.error_a, "B": result.side.error_b}
    other = "B" if faulty == "A" else "A"
    assert result.side.wrong == faulty
    assert errors[faulty] == pytest.approx(1e-2, rel=0.05)  # the kernel's 1% error, measured independently of it
    assert errors[other] < 1e-5
    assert f"{faulty}'s {name} in " in result.describe() and "off float64" in result.describe()


def test_without_saved_inputs_locate_says_how_to_save_them(tmp_path):
    clean = traced(tmp_path / "clean")
    broken = traced(tmp_path / "broken", fault=FaultyKernel("gelu", 1, error=1e-2))
    result = msprobe_mlflow.locate(clean, broken, step=2, log_run=False)
    assert result.side is None
    assert result.side_hint == ("which side is wrong: rerun both trainings with MSPROBE_MLFLOW_TRACE_STEPS=2 "
                                f"{TRACE_SAVE_VARIABLE}=Aten.gelu.default.1.forward")


def test_replay_error_of_a_saved_call_against_values_computed_here(tmp_path):
    x = torch.linspace(-3, 3, 101)
    exact = torch.nn.functional.gelu(x.double())
    save_call(tmp_path, "Aten.gelu.default.0.forward", [x], {"approximate": "none"}, exact.float() * 1.03)
    folder = saved_call_folder(tmp_path, "Aten.gelu.default.0.forward")
    assert replay_error(folder) == pytest.approx(0.03, rel=1e-3)


def test_a_side_at_its_own_formats_rounding_is_not_off(tmp_path):
    """float32 against float64, both right: the float32 side is 1e-8 off the float64 replay by rounding alone, the
    float64 side 0. Neither is off; 0.1% is."""
    name = "Aten.gelu.default.0.forward"
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    for folder, inputs, scale in ((tmp_path / "a", x, 1.0), (tmp_path / "b", x.double(), 1.0),
                                  (tmp_path / "off", x, 1.001)):
        save_call(folder, name, [inputs], {"approximate": "none"}, torch.nn.functional.gelu(inputs) * scale)
    right = side_error(tmp_path / "a", name, tmp_path / "b", name, size=1)
    assert 0 < right.error_a < 1e-7 and right.error_b == 0 and right.wrong is None
    assert "each within its format's rounding" in right.describe(name, "")
    assert side_error(tmp_path / "a", name, tmp_path / "b", name).wrong == "A"  # raw errors alone blame float32
    assert side_error(tmp_path / "off", name, tmp_path / "b", name, size=1).wrong == "A"


def test_a_call_with_a_memory_format_replays(tmp_path):
    """The backward's seed, ``ones_like(loss, memory_format=torch.preserve_format)``: the format is saved by name."""
    loss = torch.tensor(2.5)
    save_call(tmp_path, "Aten.ones_like.default.0.forward", [loss], {"memory_format": torch.preserve_format},
              torch.ones_like(loss) * 1.01)
    folder = saved_call_folder(tmp_path, "Aten.ones_like.default.0.forward")
    assert replay_error(folder) == pytest.approx(0.01, rel=1e-3)
    (folder / "call.json").write_text((folder / "call.json").read_text().replace('"preserve_format"', '"load"'))
    with pytest.raises(ValueError, match="'load' is no torch dtype, layout or memory format"):
        replay_error(folder)


def test_a_saved_call_cannot_reach_outside_its_folder(tmp_path):
    x = torch.ones(3)
    save_call(tmp_path, "Aten.relu.default.0.forward", [x], {}, x)
    folder = saved_call_folder(tmp_path, "Aten.relu.default.0.forward")
    (tmp_path / "secret.npy").write_bytes(b"not an array")
    text = (folder / "call.json").read_text().replace('"tensor_0.npy"', '"../../secret.npy"')
    (folder / "call.json").write_text(text)
    with pytest.raises(FileNotFoundError, match="secret.npy"):  # looked up as a bare name in the call's folder
        replay_error(folder)
    with pytest.raises(ValueError, match=r"trace_save = \['gelu'\] is not accepted; expected call names"):
        GradientMonitor(GradProbeConfig(dump_path=str(tmp_path)), trace_save=["gelu"])


def test_a_damaged_saved_call_is_named_with_its_file(tmp_path):
    x = torch.ones(3)
    save_call(tmp_path, "Aten.relu.default.0.forward", [x], {}, x)
    folder = saved_call_folder(tmp_path, "Aten.relu.default.0.forward")
    tensor_file = folder / "tensor_0.npy"
    tensor_file.write_bytes(tensor_file.read_bytes()[:-4])  # truncated
    with pytest.raises(ValueError, match="tensor_0.npy cannot be read as a saved tensor"):
        replay_error(folder)
    (folder / "call.json").write_text('{"name": "Aten.no_such_op.default.0.forward", "args": [], "kwargs": {}, '
                                      '"output": []}')
    with pytest.raises(ValueError, match="call.json: name 'Aten.no_such_op.default.0.forward' is no operator this torch replays"):
        replay_error(folder)
    (folder / "call.json").write_text("{")
    with pytest.raises(ValueError, match="call.json cannot be read as a saved call"):
        replay_error(folder)


def test_a_side_whose_call_is_not_replayed_is_judged_by_elimination(tmp_path):
    """MindSpore's primitives (Dense's matmul) are not replayed: the other side within what rounding explains of the
    named call is right, so the unreplayed side is off; beyond it, the replayed side is."""
    x = torch.linspace(-3, 3, 101)
    exact = torch.nn.functional.gelu(x.double())
    save_call(tmp_path / "b", "Aten.gelu.default.0.forward", [x], {}, exact.float())
    save_call(tmp_path / "a", "Primitive.gelu.0.forward", [x], {}, exact.float() * 1.03)
    right = side_error(tmp_path / "a", "Primitive.gelu.0.forward", tmp_path / "b", "Aten.gelu.default.0.forward",
                       tolerance=1e-6)
    assert right.error_a is None and right.error_b < 1e-7 and right.wrong == "A"
    assert "A's g in m is off: B's is" in right.describe("g", "m") and "A's call is not replayed" in right.describe("g", "m")
    save_call(tmp_path / "c", "Aten.gelu.default.0.forward", [x], {}, exact.float() * 1.03)
    off = side_error(tmp_path / "a", "Primitive.gelu.0.forward", tmp_path / "c", "Aten.gelu.default.0.forward",
                     tolerance=1e-6)
    assert off.wrong == "B" and off.error_b == pytest.approx(0.03, rel=1e-3)
    assert side_error(tmp_path / "a", "Primitive.gelu.0.forward", tmp_path / "a", "Primitive.gelu.0.forward") is None


def summarised(tensor: torch.Tensor):
    from msprobe_mlflow.trace.files import TensorSummary
    t = tensor.double()
    return TensorSummary(str(tensor.dtype), tuple(tensor.shape), float(t.max()), float(t.min()), float(t.mean()),
                         float(t.norm()))


def test_a_result_small_beside_its_terms_keeps_their_rounding_in_the_side_check(tmp_path):
    """A product whose terms cancel (B's columns nearly orthogonal to A's rows): computed in float32 it is 1e-4 off
    its float64 replay, 25 times float32's rounding of a result of its own size, and right. The cancellation the
    trace's statistics show (``rounding_reach``) widens what the format explains: neither side is blamed, and the
    same product 1% off still is."""
    from msprobe_mlflow.localization.judge import rounding_reach
    from msprobe_mlflow.trace.files import OperatorCall

    g = torch.Generator().manual_seed(0)
    a = torch.randn(16, 256, generator=g, dtype=torch.float64)
    r = torch.randn(256, 8, generator=g, dtype=torch.float64)
    b = r - torch.linalg.pinv(a) @ (a @ r) + 1e-4 * a.T @ torch.randn(16, 8, generator=g, dtype=torch.float64)
    name, a32, b32 = "Aten.mm.default.0.forward", a.float(), b.float()
    save_call(tmp_path / "a", name, [a32, b32], {}, a32 @ b32)
    save_call(tmp_path / "b", name, [a, b], {}, a @ b)
    save_call(tmp_path / "off", name, [a32, b32], {}, (a32 @ b32) * 1.01)
    reach = rounding_reach(OperatorCall(name, [summarised(a32), summarised(b32)], [summarised(a32 @ b32)],
                                        "Module.x.A.forward.0"))
    right = side_error(tmp_path / "a", name, tmp_path / "b", name, 0.0, *reach)
    assert reach[1] > 100 and right.error_a > 10 * 4 * 2 ** -24 * 16 and right.wrong is None
    assert side_error(tmp_path / "a", name, tmp_path / "b", name, 0.0, reach[0]).wrong == "A"  # without: blamed
    assert side_error(tmp_path / "off", name, tmp_path / "b", name, 0.0, *reach).wrong == "A"
