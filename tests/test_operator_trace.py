"""The PyTorch operator trace: what it records of a step (forward and backward aten calls, their modules), its
statistics against values computed here independently, its checksum, and that it leaves nothing installed."""
import json

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from msprobe_mlflow.trace.recording import checksum_hex
from msprobe_mlflow.torch_kernels.operator_trace import OperatorTracer
from msprobe_mlflow.trace.files import TraceError, read_trace, trace_folder, write_trace
from tests.tiny_transformer import TinyGPT, batches


def traced_step(model, level="mix", **keywords):
    tracer = OperatorTracer(model, level=level, **keywords)
    batch = batches(1)[0]
    tracer.start()
    logits = model(batch[:, :-1])
    torch.nn.functional.cross_entropy(logits.reshape(-1, 64), batch[:, 1:].reshape(-1)).backward()
    return tracer.stop()()


def test_forward_and_backward_operators_with_their_modules():
    torch.manual_seed(0)
    calls = traced_step(TinyGPT())
    names = [c.name for c in calls]
    gelu = next(c for c in calls if c.name == "Aten.gelu.default.1.forward")
    assert gelu.parent == "Module.h.1.mlp.1.GELU.forward.0"
    gelu_backward = next(c for c in calls if c.name.startswith("Aten.gelu_backward.default.0.backward"))
    assert gelu_backward.parent == "Module.h.1.mlp.1.GELU.backward.0"  # the backward runs the last layer first
    assert any(line.endswith("in forward") and "tiny_transformer.py" in line for line in gelu.stack)
    assert "Module.h.0.ln_1.LayerNorm.forward.0" in names  # mix: module entries too
    assert names.index("Aten.gelu.default.0.forward") < names.index("Aten.gelu.default.1.forward") < \
        names.index("Aten.gelu_backward.default.0.backward")
    assert not any(".t.default" in n or ".view.default" in n or "detach" in n for n in names)  # same bits


def test_statistics_and_checksums_match_independent_values():
    torch.manual_seed(0)
    model = TinyGPT()
    captured = {}
    model.h[0].mlp[1].register_forward_hook(lambda m, args, out: captured.setdefault("gelu", out.detach().clone()))
    calls = traced_step(model)
    output = next(c for c in calls if c.name == "Aten.gelu.default.0.forward").outputs[0]
    expected = captured["gelu"].double().numpy()
    assert output.shape == expected.shape and output.dtype == "torch.float32"
    assert output.max == pytest.approx(expected.max(), rel=1e-6)
    assert output.min == pytest.approx(expected.min(), rel=1e-6)
    assert output.mean == pytest.approx(expected.mean(), rel=1e-5, abs=1e-7)
    assert output.norm == pytest.approx(np.linalg.norm(expected), rel=1e-5)
    # the same input, the same checksum; one bit flipped anywhere, another
    tracer = OperatorTracer(model)
    tensor = captured["gelu"]
    flipped = tensor.clone()
    flipped.view(-1).view(torch.int32)[1234] ^= 1
    for each in (tensor, tensor.clone(), flipped, tensor.flip(-1), tensor.transpose(0, 1),
                 tensor.transpose(0, 1).contiguous()):
        tracer._launch(each)
    sums = [checksum_hex(pair) for pair in tracer._checksums]
    assert sums[0] == sums[1] != sums[2]
    assert sums[3] != sums[0]  # the same bits in another order
    assert sums[4] == sums[0] != sums[5]  # a transposed view: its memory, as its base's, read without a copy


def test_only_modules_at_l0_only_operators_at_l1_and_msprobe_list():
    torch.manual_seed(0)
    l0 = traced_step(TinyGPT(), level="L0")
    l1 = traced_step(TinyGPT(), level="L1")
    assert l0 and all(c.name.startswith("Module.") for c in l0)
    assert l1 and not any(c.name.startswith("Module.") for c in l1)
    only_gelu = traced_step(TinyGPT(), level="L1", api_list=("gelu",))
    assert {c.operator for c in only_gelu} == {"Aten.gelu.default", "Aten.gelu_backward.default"}
    with pytest.raises(ValueError, match="'L3'.*L0"):
        OperatorTracer(TinyGPT(), level="L3")


def test_nothing_stays_installed_after_stop():
    model = TinyGPT()
    traced_step(model)
    assert _get_current_dispatch_mode_stack() == []
    assert torch._C._len_torch_function_stack() == 0
    assert not torch.nn.modules.module._global_forward_pre_hooks and \
        not torch.nn.modules.module._global_forward_hooks


def test_written_trace_reads_back_as_msprobe_lays_it_out(tmp_path):
    torch.manual_seed(0)
    calls = traced_step(TinyGPT())
    write_trace(tmp_path / "step3" / "rank0", calls, level="mix", framework="pytorch")
    dump = json.loads((tmp_path / "step3" / "rank0" / "dump.json").read_text())
    assert dump["task"] == "statistics" and dump["level"] == "mix"
    entry = dump["data"]["Aten.gelu.default.0.forward"]
    assert set(entry) == {"input_args", "input_kwargs", "output"}
    assert {"type", "dtype", "shape", "Max", "Min", "Mean", "Norm", "requires_grad"} <= set(entry["output"][0])
    assert set(dump["data"]["Aten.gelu_backward.default.0.backward"]) == {"input", "output"}
    construct = json.loads((tmp_path / "step3" / "rank0" / "construct.json").read_text())
    assert construct["Aten.gelu.default.0.forward"] == "Module.h.0.mlp.1.GELU.forward.0"
    trace = read_trace(trace_folder(tmp_path, step=3, rank=0))
    assert [c.name for c in trace.calls] == [c.name for c in calls]
    assert trace.calls[5].outputs == calls[5].outputs


def test_unreadable_traces_name_the_file_and_field(tmp_path):
    with pytest.raises(TraceError, match="holds no trace"):
        trace_folder(tmp_path)
    folder = tmp_path / "step1" / "rank0"
    folder.mkdir(parents=True)
    (folder / "dump.json").write_text(json.dumps({"data": {"Aten.mm.default.0.forward": {
        "input_args": [{"type": "torch.Tensor", "dtype": "torch.float32", "shape": "2x3"}], "output": []}}}))
    with pytest.raises(TraceError, match=r"dump.json: data.Aten.mm.default.0.forward.input\[0\].shape is '2x3'"):
        read_trace(trace_folder(tmp_path, step=1))
    with pytest.raises(TraceError, match="no trace of step 2; its traced steps: \\[1\\]"):
        trace_folder(tmp_path, step=2)


def test_an_operator_writing_into_its_input_is_recorded_as_it_read_and_wrote():
    """``b.add_(1)``: its input as it was (max 2), its output as it became (max 3), not the cached old values."""
    tracer = OperatorTracer(torch.nn.Linear(1, 1), level="L1")
    a = torch.ones(4)
    tracer.start()
    b = a * 2
    b.add_(1)
    c = b * 1
    calls = {c.name: c for c in tracer.stop()()}
    added = calls["Aten.add_.Tensor.0.forward"]
    assert (added.inputs[0].max, added.outputs[0].max) == (2.0, 3.0)
    assert calls["Aten.mul.Tensor.1.forward"].inputs[0].max == 3.0 and c.max() == 3.0
