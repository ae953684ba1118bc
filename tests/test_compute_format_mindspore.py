"""The format each step computed in, as the MindSpore monitor records it with the step's directions (real MindSpore
2.10, CPU): the parameters' dtypes, the mixed precision of the network ``Model.train`` trains (PyNative and
GRAPH_MODE), the device's precision mode; none where the step's gradients show a 16-bit format the monitor did not
see; and a MindSpore run against its PyTorch twin judged at the float32 both recorded."""
from __future__ import annotations

import numpy as np
import pytest

ms = pytest.importorskip("mindspore", reason="MindSpore is not installed (the torch-only stage)")
pytest.importorskip("torch")
from mindspore import amp, nn  # noqa: E402
from mindspore.train import Model  # noqa: E402

from mindspore_training import STEPS, batches, custom_loop, dense, numpy_batches  # noqa: E402
from msprobe_mlflow import GradProbeConfig, compare_dumps  # noqa: E402
from msprobe_mlflow.directions import step_compute_format  # noqa: E402
from msprobe_mlflow.dump import step_dir  # noqa: E402
from msprobe_mlflow.mindspore import GradientMonitor, GradProbeCallback  # noqa: E402
from msprobe_mlflow.mindspore import compute_format as formats  # noqa: E402
from msprobe_mlflow.pytorch import GradientMonitor as TorchMonitor  # noqa: E402
from test_cross_framework import BATCHES, MindSporeNet, torch_batches, torch_twin, train_mindspore  # noqa: E402
from tiny_models import sgd, train  # noqa: E402


def recorded(dump, steps: int = STEPS) -> list[str | None]:
    return [step_compute_format(step_dir(dump, 0, step)) for step in range(steps)]


@pytest.mark.parametrize("mode, amp_level, expected", [
    ("pynative", "O0", "float32"), ("graph", "O0", "float32"),
    ("pynative", "O2", "float16"), ("graph", "O2", "float16"),  # cells cast by to_float carry float16
    ("graph", "auto", "float16"),  # its strategy keeps the dtype
], indirect=["mode"])
def test_model_train_records_the_format_its_amp_level_computes_in(mode, amp_level, expected, tmp_path):
    net = dense()
    model = Model(net, loss_fn=nn.MSELoss(), optimizer=nn.SGD(net.trainable_params(), learning_rate=0.0),
                  amp_level=amp_level, loss_scale_manager=None)
    callback = GradProbeCallback(GradProbeConfig(dump_path=str(tmp_path / "dump"), level="L1"), log_to_mlflow=False)
    model.train(1, batches(), callbacks=[callback], dataset_sink_mode=False)
    assert recorded(tmp_path / "dump") == [expected] * STEPS


def train_custom_loop(dump, amp_level: str = "O0", tell_network: bool = False) -> list[str | None]:
    """``value_and_grad`` + ``optimizer(grads)`` in PyNative: the monitor sees the optimizer only, unless told the
    network (``monitor(optimizer, network=)``)."""
    net = dense()
    optimizer = nn.SGD(net.trainable_params(), learning_rate=0.0)
    computing = amp.auto_mixed_precision(net, amp_level)
    monitor = GradientMonitor(GradProbeConfig(dump_path=str(dump), level="L1"), log_to_mlflow=False)
    monitor.monitor(optimizer, network=computing if tell_network else None)
    loss_fn = nn.MSELoss()

    def loss_of(x, y):
        return loss_fn(computing(x).astype(ms.float32), y)

    custom_loop(loss_of, optimizer, numpy_batches())
    monitor.stop()
    return recorded(dump)


def test_a_custom_loop_records_its_parameters_format_and_none_where_its_gradients_show_a_16_bit_one(pynative,
                                                                                                  tmp_path):
    assert train_custom_loop(tmp_path / "float32") == ["float32"] * STEPS
    # MindSpore's AMP on a network the monitor was not told: float32 parameters, float16 weight gradients
    assert train_custom_loop(tmp_path / "unseen", "O2") == [None] * STEPS
    assert train_custom_loop(tmp_path / "told", "O2", tell_network=True) == ["float16"] * STEPS


def test_the_step_format_is_none_where_a_gradients_extremes_have_16_bit_significands():
    from msprobe_mlflow.records import StepRecord

    def record(maximum, minimum):
        return StepRecord(rank=0, step=0, level="L1", bounds=(), names=["w"], shapes=[(2,)],
                          values=np.array([[maximum, minimum, 1.0]], np.float32))

    full, half = 1 + 2.0 ** -20, 1 + 2.0 ** -10  # 21 and 11 significant bits
    assert formats.step_format(record(full, -half), "float32").compute_format == "float32"  # one fine extreme
    assert formats.step_format(record(half, -half), "float32").compute_format is None
    assert formats.step_format(record(half, -half), "float16").compute_format == "float16"
    assert formats.step_format(record(0.0, 0.0), "float32").compute_format == "float32"  # zeros carry no format


def test_cells_cast_to_bfloat16_or_an_auto_strategy_in_bfloat16_record_bfloat16_and_o1_nothing(tmp_path,
                                                                                              monkeypatch):
    monkeypatch.chdir(tmp_path)  # O1 writes the network's rewritten code into ./rewritten_network
    float32 = [ms.float32, ms.float32]
    assert formats.compute_format(float32, dense()) == "float32"
    assert formats.compute_format(float32, dense().to_float(ms.bfloat16)) == "bfloat16"
    assert formats.compute_format(float32, amp.auto_mixed_precision(dense(), "auto", ms.bfloat16)) == "bfloat16"
    assert formats.compute_format(float32, amp.auto_mixed_precision(dense(), "O1", ms.bfloat16)) is None
    assert formats.compute_format([ms.float64]) == "float64"
    assert formats.compute_format([ms.float32, ms.float16]) == "float16"


@pytest.mark.parametrize("settings, expected", [
    ({}, None),  # not set: Atlas training products and A2 default differently
    ({"precision_mode": "must_keep_origin_dtype", "conv_allow_hf32": "0"}, "float32"),
    ({"precision_mode": "must_keep_origin_dtype"}, "tf32"),  # CANN's default: convolutions in HF32
    ({"precision_mode": "must_keep_origin_dtype", "conv_allow_hf32": "0", "matmul_allow_hf32": "1"}, "tf32"),
    ({"precision_mode": "force_fp32", "conv_allow_hf32": "0"}, "float16"),  # matrix operators take float16 inputs
    ({"precision_mode": "allow_fp32_to_fp16"}, "float16"),
    ({"precision_mode": "force_fp16"}, "float16"),
    ({"precision_mode": "allow_mix_precision_fp16"}, "float16"),
    ({"precision_mode": "allow_mix_precision"}, "bfloat16"),  # "float16 or bfloat16"
    ({"precision_mode": "allow_fp32_to_bf16"}, "bfloat16"),
    ({"precision_mode": "allow_mix_precision_bf16"}, "bfloat16"),
    ({"precision_mode": "a_mode_of_a_later_cann"}, None),
    ({"precision_mode": "must_keep_origin_dtype", "conv_allow_hf32": "0", "op_precision_mode": "ops.ini"}, None),
])
def test_ascends_precision_mode_gives_the_coarsest_format_float32_operators_may_compute_in(settings, expected,
                                                                                          monkeypatch):
    assert formats.ascend_format(settings) == expected
    monkeypatch.setattr(formats, "device_target", lambda: "Ascend")
    monkeypatch.setattr(formats.compat, "ascend_precision_settings", lambda: settings)
    assert formats.compute_format([ms.float32]) == expected
    assert formats.compute_format([ms.bfloat16]) == "bfloat16"  # the mode lowers float32 operators only


def test_a_cpu_records_float32_unless_onednn_may_drop_it_and_a_gpu_nothing(monkeypatch):
    monkeypatch.delenv("ONEDNN_DEFAULT_FPMATH_MODE", raising=False)
    monkeypatch.delenv("DNNL_DEFAULT_FPMATH_MODE", raising=False)
    assert formats.device_target() == "CPU" and formats.compute_format([ms.float32]) == "float32"
    monkeypatch.setenv("ONEDNN_DEFAULT_FPMATH_MODE", "bf16")
    assert formats.compute_format([ms.float32]) == "bfloat16"
    monkeypatch.setattr(formats, "device_target", lambda: "GPU")
    assert formats.compute_format([ms.float32]) is None and formats.compute_format([ms.float64]) == "float64"


def train_torch(dump) -> None:
    """test_cross_framework's PyTorch twin, called through the monitored model (whose forward the PyTorch monitor
    sees: it records the format only then)."""
    monitor = TorchMonitor(GradProbeConfig(dump_path=str(dump), level="L1"), log_to_mlflow=False)
    train(torch_twin(), len(BATCHES), optimizer=sgd(0.05), monitor=monitor, data=torch_batches)
    monitor.stop()


def test_mindspore_against_its_pytorch_twin_is_judged_at_the_float32_both_recorded(pynative, tmp_path):
    train_torch(tmp_path / "torch")
    train_mindspore(tmp_path / "mindspore")
    assert set(recorded(tmp_path / "mindspore", len(BATCHES))) == {"float32"}
    verdict = compare_dumps(tmp_path / "torch", tmp_path / "mindspore", None, progress=False).verdict
    assert verdict.ranks[0].recorded_precision == "float32"
    assert not verdict.suspicious, verdict.describe()


def test_a_bug_from_step_0_smaller_than_bfloat16_rounding_is_named_at_step_0_across_frameworks(pynative, tmp_path):
    """LayerNorm's epsilon 1e-3 instead of torch's 1e-5 (inputs of variance about 4): the gradients' norms move by
    about 1e-4 of their scale, beyond float32's rounding, within bfloat16's (which judged MindSpore's first steps
    while it recorded no format)."""
    class EpsilonBug(MindSporeNet):
        def __init__(self):
            super().__init__()
            self.ln = nn.LayerNorm((8,), epsilon=1e-3)

    train_mindspore(tmp_path / "mindspore", network=EpsilonBug)
    train_torch(tmp_path / "torch")
    verdict = compare_dumps(tmp_path / "torch", tmp_path / "mindspore", None, progress=False).verdict
    assert verdict.first_suspicious_step == 0, verdict.describe()
