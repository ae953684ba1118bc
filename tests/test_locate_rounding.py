"""What rounding explains in ``locate``'s rule (``localization/judge.py``): each property below is one the rule
gained from the localization benchmark's misses, and each test fails when its property is taken out."""
import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from msprobe_mlflow.formats import UNIT_ROUNDOFF
from msprobe_mlflow.localization import ARGUMENT, DRIFT, NEAR_TIE, OPERATOR, SEQUENCE, locate_traces as locate
from msprobe_mlflow.localization.align import align
from msprobe_mlflow.localization.judge import (AMPLIFICATION, ROUNDING, cancellation, judge, reduction_size,
                                                tensor_difference)
from msprobe_mlflow.torch_kernels.operator_trace import OperatorTracer
from msprobe_mlflow.trace.files import OperatorCall, TensorSummary, write_trace
from tests.test_locate import Recurrent, TRACED, trace, traced_model
from tests.tiny_transformer import FaultyKernel


def traced(root, module, x):
    """One forward and backward of ``module`` on ``x``, traced into ``root/step0/rank0``."""
    tracer = OperatorTracer(module)
    tracer.start()
    module(x.requires_grad_()).square().mean().backward()
    write_trace(root / "step0" / "rank0", tracer.stop()(), level="mix", framework="pytorch")
    return root


class LargestElementOneUlpUp(TorchDispatchMode):
    """Another kernel for ``gelu``: its largest result one ulp higher (a vectorised path that rounds otherwise, as
    torch's own elementwise kernels do on two threads against one), or, with ``error``, every result off by it."""

    def __init__(self, error: float = 0.0):
        super().__init__()
        self.error = error

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        output = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.gelu.default:
            if self.error:
                output.mul_(1 + self.error)
            else:
                flat = output.view(-1)
                index = flat.abs().argmax()
                flat[index] = torch.nextafter(flat[index], flat[index] * 2)
        return output


def spiky_inputs():
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    x[3, 5] = 40.0  # a peak of about 40 times the RMS
    return x


def test_one_rounding_of_the_largest_element_is_explained_by_the_outputs_peak(tmp_path):
    """Equal inputs, the largest output one ulp apart: on the RMS scale that is u times the output's peak, which
    the rounding term must be measured in, or a kernel's rounding is named."""
    module = torch.nn.GELU()
    a = traced(tmp_path / "a", module, spiky_inputs())
    with LargestElementOneUlpUp():
        b = traced(tmp_path / "b", module, spiky_inputs())
    found = locate(a, b, step=0)
    assert found.kind == DRIFT, found.describe()
    pair, judgement = next((p, j) for p, j in found.rows if p.a.operator == "Aten.gelu.default")
    assert judgement.inputs_bit_equal and judgement.output_difference > ROUNDING * UNIT_ROUNDOFF["float32"]
    with LargestElementOneUlpUp(error=1e-3):
        wrong = traced(tmp_path / "wrong", module, spiky_inputs())
    found = locate(a, wrong, step=0)
    assert (found.kind, found.pair.a.operator) == (OPERATOR, "Aten.gelu.default"), found.describe()


def test_a_normalisations_mean_of_a_centred_input_keeps_the_inputs_absolute_rounding(tmp_path):
    """LayerNorm's second output is the mean over the normalised elements: of a centred input, rounding at the
    level of the input's elements. float64 against float32 makes it differ by far more than its own scale."""
    x = spiky_inputs()
    x = x - x.mean(-1, keepdim=True)
    a = traced(tmp_path / "a", torch.nn.LayerNorm(64), x.clone())
    b = traced(tmp_path / "b", torch.nn.LayerNorm(64).double(), x.double())
    found = locate(a, b, step=0)
    assert not found.named, found.describe()
    pair, judgement = next((p, j) for p, j in found.rows if p.a.operator == "Aten.native_layer_norm.default")
    mean_a, mean_b = pair.a.tensors_out[1], pair.b.tensors_out[1]
    assert cancellation(pair.a, mean_a) > 10 * cancellation(pair.a, pair.a.tensors_out[0])
    assert tensor_difference(mean_a, mean_b) > AMPLIFICATION * judgement.input_difference + 1.0


def test_a_ten_percent_wrong_product_is_named_under_bfloat16_autocast(tmp_path):
    """A half-precision product accumulates in float32 and rounds once: its rounding is not bfloat16's times the
    square root of the inner size, which hid a product 10% off (``h.0.mlp.2``, 128 terms a result)."""
    baseline = trace(tmp_path / "a")
    faulty = trace(tmp_path / "b", fault=FaultyKernel("addmm", 2, error=0.1), autocast=True)
    found = locate(baseline, faulty, step=TRACED)
    assert (found.kind, found.pair.a.name, found.module) == (OPERATOR, "Aten.addmm.default.2.forward", "h.0.mlp.2"), \
        found.describe()
    judgement = found.judgement
    assert judgement.format == "bfloat16" and reduction_size(found.pair.a) == 128
    rounding_in_bfloat16 = ROUNDING * UNIT_ROUNDOFF["bfloat16"] * 128 ** 0.5
    assert judgement.output_difference < AMPLIFICATION * judgement.input_difference + rounding_in_bfloat16


def call(name: str, shape: tuple, dtype: str = "torch.float32") -> OperatorCall:
    tensor = TensorSummary(dtype, shape, 1.0, 0.0, 0.5, 1.0)
    return OperatorCall(name, [tensor], [tensor], "Module.x.A.forward.0")


def test_a_reshape_made_in_one_run_only_is_set_aside_and_pairs_what_follows():
    """Autocast's bfloat16 product takes its input as it is where float32's reshapes it first: the copy computes
    nothing, and the products pair."""
    a = [call("Aten.sum.dim_IntList.0.backward", (4, 8)), call("Aten._unsafe_view.default.0.backward", (32, 8)),
         call("Aten.mm.default.0.backward", (32, 8)), call("Aten.sum.dim_IntList.1.backward", (8,))]
    b = [call("Aten.sum.dim_IntList.0.backward", (4, 8)), call("Aten.mm.default.0.backward", (4, 8), "torch.bfloat16"),
         call("Aten.sum.dim_IntList.1.backward", (8,))]
    pairs = align(a, b)
    assert [(p.a.name, p.b.name) for p in pairs] == [(x.name, x.name) for x in b]


def test_another_kernel_taken_for_another_dtype_is_not_a_missing_operator(tmp_path):
    """float64's LSTM on the CPU is a chain of products where float32's is one mkldnn call: each run made calls of
    its own, in its own format, judged through what follows them; drift, not an operator in one run only."""
    tokens = torch.randint(16, (4, 5), generator=torch.Generator().manual_seed(2))
    labels = torch.randint(3, (4,), generator=torch.Generator().manual_seed(3))
    a = traced_model(tmp_path / "a", Recurrent, tokens, labels)
    b = traced_model(tmp_path / "b", Recurrent, tokens, labels, dtype=torch.float64)
    found = locate(a, b, step=1)
    one_sided = [p for p, _ in found.rows if p.one_sided]
    if not any(p.a is not None for p in one_sided) or not any(p.b is not None for p in one_sided):
        pytest.skip("this torch runs float32's and float64's LSTM through the same operators")
    assert found.kind == DRIFT, found.describe()


def test_an_operator_one_run_adds_in_the_same_format_is_still_named():
    """The stretch above needs both runs' own calls in formats the other's do not share: one extra call is named."""
    from msprobe_mlflow.localization import walk

    a = [call("Aten.mm.default.0.forward", (4, 8)), call("Aten.sum.dim_IntList.0.forward", (8,))]
    b = a[:1] + [call("Aten.mul.Tensor.0.forward", (4, 8))] + a[1:]
    found = walk(align(a, b))
    assert (found.kind, found.pair.b.name) == (SEQUENCE, "Aten.mul.Tensor.0.forward")
    assert judge(align(a, a)[0]).output_difference == 0.0


@pytest.mark.parametrize("eps, named", [(None, False), (1e-6, True)])
def test_an_epsilon_taken_from_each_runs_dtype_is_no_differing_argument(tmp_path, eps, named):
    """torch's RMSNorm without ``eps`` takes its dtype's machine epsilon: 1.2e-7 in float32 and 2.2e-16 in float64,
    a difference the formats make. One given in one run only is still named."""
    x = spiky_inputs()
    a = traced(tmp_path / "a", torch.nn.RMSNorm(64, eps=eps), x.clone())
    b = traced(tmp_path / "b", torch.nn.RMSNorm(64).double(), x.double())
    found = locate(a, b, step=0)
    assert (found.kind == ARGUMENT) == named, found.describe()
    values = sorted(s.value for p, _ in found.rows if p.a.operator == "Aten.add_.Scalar"
                    for s in p.a.inputs + p.b.inputs if hasattr(s, "value") and isinstance(s.value, float))
    assert values[0] == torch.finfo(torch.float64).eps


class ScaledThresholdBackward(TorchDispatchMode):
    """A faulty kernel for ReLU's backward: every gradient it passes 0.1% too large."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        output = func(*args, **(kwargs or {}))
        return output.mul_(1.001) if func is torch.ops.aten.threshold_backward.default else output


def near_tie_model(first_bias: float) -> torch.nn.Module:
    """Linear -> ReLU -> Linear whose first unit's input is ``first_bias`` for the first sample (its inputs are
    zeros): a bias of +-1e-9, as two devices' rounding can leave it, puts that ReLU on either side of its tie."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    with torch.no_grad():
        model[0].bias[0] = first_bias
    return model


def near_tie_inputs():
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(1))
    x[0] = 0.0
    return x


def test_a_relu_switched_at_a_near_tie_is_no_operator_named_a_faulty_relu_is(tmp_path):
    """One ReLU input that sits on its threshold within the runs' rounding passes a gradient element in one run and
    zeroes it in the other: the backward's max and min agree, its mean and RMS do not, which no faulty kernel does
    (it moves the extremes too). locate says "near tie", not an operator; the same ReLU 0.1% off is named."""
    a = traced(tmp_path / "a", near_tie_model(1e-9), near_tie_inputs())
    b = traced(tmp_path / "b", near_tie_model(-1e-9), near_tie_inputs())
    found = locate(a, b, step=0)
    assert found.kind == NEAR_TIE, found.describe()
    assert found.pair.a.operator == "Aten.threshold_backward.default" and not found.named
    assert "near tie" in found.describe() and "threshold_backward" in found.describe()
    with ScaledThresholdBackward():
        faulty = traced(tmp_path / "faulty", near_tie_model(-1e-9), near_tie_inputs())
    found = locate(a, faulty, step=0)
    assert (found.kind, found.pair.a.operator) == (OPERATOR, "Aten.threshold_backward.default"), found.describe()
    assert not found.judgement.inputs_bit_equal and "below what their statistics show" in found.describe()


def traced_sure_classifier(root, sure: float, jitter: float = 0.0, fault: FaultyKernel | None = None):
    """A linear classifier sure of every row (weights ``sure`` times their initial size; each row's label its
    largest logit), its cross-entropy's forward and backward traced; ``jitter``: the weights perturbed by that
    relative amount, a pair whose trajectories parted, each logit differing more than its tensor's statistics show."""
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 10)
    x = torch.randn(32, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model.weight.mul_(sure * (1 + jitter * torch.randn(model.weight.shape,
                                                           generator=torch.Generator().manual_seed(5))))
        labels = model(x).argmax(1)
    with fault or contextlib.nullcontext():  # beneath the tracer, which records the faulty result
        tracer = OperatorTracer(model)
        tracer.start()
        if fault is not None:
            fault.armed = True
        torch.nn.functional.cross_entropy(model(x), labels).backward()
        write_trace(root / "step0" / "rank0", tracer.stop()(), level="mix", framework="pytorch")
    assert fault is None or fault.injected, "the fault was never injected"
    return root


@pytest.mark.parametrize("sure", [24, 32])
def test_a_log_softmax_backward_near_zero_at_sure_targets_keeps_its_incoming_gradients_absolute_rounding(tmp_path,
                                                                                                         sure):
    """A classifier sure of its answers: log-softmax's backward under its cross-entropy is (p - one-hot) / N, near 0
    at each row's target beside the incoming gradient (-1/N there). Weights 0.1% apart (a pair whose trajectories
    parted, as resnet-bn's two-thread pair at step 61 of the divergence benchmark) move each probability further
    than the log-probabilities' statistics show; on its own scale the backward differs by far more than its inputs.
    Judged against the incoming gradient's scale, it is drift; the same call 10% off is still named."""
    baseline = traced_sure_classifier(tmp_path / "a", sure)
    found = locate(baseline, traced_sure_classifier(tmp_path / "b", sure, jitter=1e-3), step=0)
    assert found.kind == DRIFT, found.describe()
    pair, judgement = next((p, j) for p, j in found.rows if p.a.operator == "Aten._log_softmax_backward_data.default")
    assert judgement.output_difference > judgement.tolerance / cancellation(pair.a, pair.a.tensors_out[0])
    wrong = traced_sure_classifier(tmp_path / "wrong", sure, jitter=1e-3,
                                   fault=FaultyKernel("_log_softmax_backward_data", 0, "backward", error=0.1))
    found = locate(baseline, wrong, step=0)
    assert (found.kind, found.pair.a.operator) == (OPERATOR, "Aten._log_softmax_backward_data.default"), \
        found.describe()
