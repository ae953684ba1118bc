"""msprobe's rule made exact: the first operator whose inputs agree and whose output does not.

Each tensor pair's difference is measured on the scale of the tensor: the largest gap in max, min, mean or RMS
(the norm over the square root of the size), over the larger RMS of the two; zero when the checksums say the bits
are equal. An operator's output difference is *explained* when it is at most

    AMPLIFICATION x (its inputs' difference)  +  ROUNDING x r x (its peak)

where r is the rounding the call adds (:func:`~msprobe_mlflow.formats.added_rounding`: u x sqrt(K), u the unit
roundoff of the coarser of the two runs' output formats and K how many input elements feed one output element, 1
for elementwise operators, the inner size of a matmul, everything for a full sum; a half-precision result adds its
one rounding to float32's accumulation), and the peak is the output's largest magnitude over its RMS, as one rounding of the largest element
moves the max by that much on this scale. The first operator in execution order (the forward, then the backward)
whose output difference is not explained is named; when none is, the step's differences are rounding carried
forward ("drift").

Each output's tolerance is that times its cancellation (:func:`cancellation`: an output small beside what made it,
such as a bias gradient before BatchNorm, zero in exact arithmetic, or a normalisation's mean of a centred input,
keeps its inputs' absolute rounding); an RNN kernel's workspace (:func:`scratch`) is not judged.

Statistics only bound a difference from below: inputs whose bits differ may differ in every element by the
rounding of the coarsest format whose differences reached them (a bfloat16 pair's: 2^-8 of each element), which
their max, min, mean and RMS barely show. So the output may differ by up to CARRIED times that format's unit
roundoff on the inputs' scale (their peak over their RMS); the walk carries that format along.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from msprobe_mlflow.formats import UNIT_ROUNDOFF, added_rounding
from msprobe_mlflow.localization.align import AlignedCall
from msprobe_mlflow.trace.files import OperatorCall, Scalar, TensorSummary

AMPLIFICATION = 10.0  # how much larger than its inputs' difference an operator's may grow from rounding carried in
ROUNDING = 8.0  # the rounding an operator adds on top, in units of added_rounding() times the output's peak
CARRIED = 3.0  # how much larger than its inputs' elementwise rounding (the floor below) an output may differ
SCALAR_TOLERANCE = 1e-3  # a numeric argument this much apart (relative) is a different argument, not noise
_TINY = 1e-30
_PRODUCTS = ("mm", "matmul", "linear", "mv", "dot", "conv", "attention", "einsum", "bmm", "addbmm")
# The operators whose outputs may cancel (:func:`cancellation`), by their short name.
_PRODUCT_SUMS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "mv", "dot", "einsum", "convolution",
                 "convolution_backward", "conv2d", "conv1d", "conv3d", "dense"}
_SUMS = {"sum", "embedding_dense_backward", "native_group_norm_backward", "native_batch_norm_backward",
         "native_layer_norm_backward"}
_DIFFERENCES = {"add", "sub", "rsub"}
_GRADIENT_DIFFERENCES = {"_log_softmax_backward_data"}  # the incoming gradient less the probabilities times its
# sum: (p - one-hot) / N under a cross-entropy loss, near zero where p is near one
_SWITCHES = {"threshold_backward", "hardtanh_backward", "leaky_relu_backward"}  # an activation's backward: each
# gradient element passed (or scaled) by which side of a threshold its input lies on
_NORMALIZATIONS = {"native_layer_norm", "native_batch_norm", "native_group_norm", "_native_batch_norm_legit",
                   "_native_batch_norm_legit_no_training", "layer_norm", "batch_norm", "group_norm"}


@dataclass
class Judgement:
    """One aligned call: its inputs' and output's differences, what rounding explains, and whether it is beyond."""
    input_difference: float
    output_difference: float
    tolerance: float
    format: str
    beyond: bool
    inputs_bit_equal: bool


def tensor_difference(a: TensorSummary, b: TensorSummary) -> float:
    """The pair's difference on the tensor's scale (0 when the bits are equal, inf when shapes differ)."""
    if a.shape != b.shape:
        return math.inf
    if same_bits(a, b):
        return 0.0
    if None in a.statistics() or None in b.statistics():
        return 0.0 if a.statistics() == b.statistics() else math.inf
    size = math.sqrt(max(a.numel, 1))
    rms_a, rms_b = a.norm / size, b.norm / size
    scale = _scale(a, b)
    if scale < _TINY:
        return 0.0
    gap = max(abs(a.max - b.max), abs(a.min - b.min), abs(a.mean - b.mean), abs(rms_a - rms_b))
    return gap / scale


def _scale(a: TensorSummary, b: TensorSummary) -> float:
    """What a pair's gaps are measured against: the larger RMS, or, both nearly zero, the largest magnitude."""
    rms = max(abs(a.norm), abs(b.norm)) / math.sqrt(max(a.numel, 1))
    return rms if rms >= _TINY else max(rms, abs(a.max), abs(b.max), abs(a.min), abs(b.min))


def same_bits(a: TensorSummary, b: TensorSummary) -> bool:
    """Equal bits, where both checksums are of one kind; otherwise equal dtype and statistics."""
    if a.checksum and b.checksum and a.checksum.split(":")[0] == b.checksum.split(":")[0]:
        return a.checksum == b.checksum and dtype_name(a.dtype) == dtype_name(b.dtype)
    return dtype_name(a.dtype) == dtype_name(b.dtype) and a.statistics() == b.statistics() and \
        None not in a.statistics()


def dtype_name(dtype: str) -> str:
    """``torch.float32``, MindSpore's ``Float32`` and ``mindspore.float32`` -> ``float32``."""
    return dtype.lower().removeprefix("torch.").removeprefix("mindspore.")


def output_format(call: OperatorCall) -> str:
    """The format name of a call's first floating output (``float32`` for ``torch.float32`` or ``Float32``)."""
    for tensor in call.tensors_out:
        name = dtype_name(tensor.dtype)
        if name in UNIT_ROUNDOFF:
            return name
    return "float32"


def reduction_size(call: OperatorCall) -> int:
    """How many input elements feed one output element, at most: 1 for elementwise operators, the input's size
    over the output's for reductions, the inner size for products (bounded above by the inputs' longest last
    dimension; a convolution's by its weight's size per output channel)."""
    inputs = call.tensors_in
    outputs = [t.numel for t in call.tensors_out if t.numel] or [1]
    size = max([t.numel for t in inputs if t.numel] or [1]) // max(1, min(outputs))
    name = call.operator.rsplit(".", 2)[-2] if call.operator.count(".") >= 2 else call.operator
    if any(word in name for word in _PRODUCTS):
        size = max([size] + [t.shape[-1] for t in inputs if len(t.shape) >= 2])
        if "conv" in name:
            size = max([size] + [t.numel // t.shape[0] for t in inputs if len(t.shape) >= 3 and t.shape[0]])
        if "attention" in name:  # a product over keys, then one over the head's dimension
            size = max([size] + [t.shape[-1] * t.shape[-2] for t in inputs if len(t.shape) >= 2])
    return max(1, size)


def judge(pair: AlignedCall, noise: float = 0.0, across: bool = False) -> Judgement:
    """``noise``: the unit roundoff of the coarsest format whose differences reached this call (see above). Each
    output is judged against its own tolerance, widened by its cancellation (:func:`cancellation`); the output
    furthest beyond (or nearest to) its tolerance speaks for the call. ``across`` frameworks, only the first output
    is judged: the call's result; the others are what each framework keeps for its backward, defined otherwise
    (MindSpore's LayerNorm returns the variance where torch's returns its reciprocal square root). A module's
    backward (``pair.reach``) adds the rounding of its operators: their largest reduction size and cancellation."""
    a, b = pair.a, pair.b
    outputs = zip(a.tensors_out[:1], b.tensors_out[:1]) if across else zip(a.tensors_out, b.tensors_out)
    paired = _same_tensors(a.tensors_in, b.tensors_in) if across else list(zip(a.tensors_in, b.tensors_in))
    inputs = [tensor_difference(x, y) for x, y in paired]
    input_difference = max(inputs, default=0.0)
    carried = AMPLIFICATION * input_difference
    if input_difference > 0.0:
        peaks = [_peak(x) for x, d in zip(a.tensors_in, inputs) if d > 0.0]
        floor = noise * max(peaks, default=1.0)
        input_difference = max(input_difference, floor)
        carried = max(carried, CARRIED * floor)
    fmt = max(output_format(a), output_format(b), key=UNIT_ROUNDOFF.__getitem__)
    size, cancelled = pair.reach or (max(reduction_size(a), reduction_size(b)), None)
    rounding = ROUNDING * added_rounding(fmt, size)
    judged = [(tensor_difference(x, y), (carried + rounding * max(_peak(x), _peak(y))) *
               (cancelled or max(cancellation(a, x), cancellation(b, y)))) for x, y in outputs if not scratch(a, x)]
    output_difference, tolerance = max(judged, key=lambda j: j[0] / j[1] if j[1] > 0 else math.inf * j[0],
                                       default=(0.0, carried + rounding))
    return Judgement(input_difference, output_difference, tolerance, fmt, output_difference > tolerance,
                     all(same_bits(x, y) for x, y in paired))


def near_tie(pair: AlignedCall, judgement: Judgement) -> bool:
    """A piecewise activation's backward (ReLU's ``threshold_backward``) beyond what its inputs explain in its mean
    and RMS only, its max and min within the tolerance, and the input it compares with the threshold differing in
    bits: an element of that input that sat on the threshold within the runs' rounding passed its gradient in one run
    and not in the other (a near tie). That moves the output's sum and RMS and seldom its extremes; a faulty kernel
    moves the extremes with the rest."""
    a, b = pair.a, pair.b
    if not judgement.beyond or _short_name(a) not in _SWITCHES or min(len(a.tensors_in), len(b.tensors_in)) < 2 \
            or same_bits(a.tensors_in[1], b.tensors_in[1]) or not a.tensors_out or not b.tensors_out:
        return False
    x, y = a.tensors_out[0], b.tensors_out[0]
    scale = _scale(x, y) if None not in (*x.statistics(), *y.statistics()) else 0.0
    return scale >= _TINY and max(abs(x.max - y.max), abs(x.min - y.min)) / scale <= judgement.tolerance


def rounding_reach(*calls: OperatorCall) -> tuple[int, float]:
    """How far a call's own rounding reaches in its result, for the side check (the larger over ``calls``, a call
    as each side made it): how many input elements feed one output element (:func:`reduction_size`) and how much
    the result's cancellation magnifies their rounding (:func:`cancellation`)."""
    return (max(reduction_size(call) for call in calls),
            max(cancellation(call, call.tensors_out[0]) if call.tensors_out else 1.0 for call in calls))


def _same_tensors(a: list[TensorSummary], b: list[TensorSummary]) -> list[tuple[TensorSummary, TensorSummary]]:
    """Across frameworks, the inputs paired by their elements, not their places: each of A's with the first unpaired
    one of B's of its shape or its transpose's (``addmm`` takes the bias first and the weight transposed; the
    statistics do not see a transposition); an input without a twin is not compared. None paired: the inputs
    cannot be compared, the call is not judged (its difference is infinite)."""
    unused, paired = list(b), []
    for x in a:
        twin = next((y for y in unused if y.shape in (x.shape, x.shape[::-1])), None)
        if twin is not None:
            unused.remove(twin)
            paired.append((x, replace(twin, shape=x.shape)))
    if a and b and not paired:
        return [(a[0], b[0])]  # shapes differ: an infinite difference
    return paired


def scratch(call: OperatorCall, output: TensorSummary) -> bool:
    """An output of raw bytes from an operator that reads none (an RNN kernel's workspace): memory the kernel
    reserves for its backward, whose bytes are not a result and may be left uninitialised."""
    raw = ("uint8", "int8")
    return dtype_name(output.dtype) in raw and not any(dtype_name(t.dtype) in raw for t in call.tensors_in)


def cancellation(call: OperatorCall, output: TensorSummary) -> float:
    """How much larger than its inputs' an output's relative difference may be because the output is small beside
    what made it (at least 1): a sum or product over K terms against the scale its terms would give it, sqrt(K)
    times theirs (a bias gradient summed over a batch before BatchNorm is zero in exact arithmetic); a difference
    against its inputs' scale, as is a log-softmax's backward (near 0 at the targets of a model that is sure)
    against its incoming gradient's; a normalisation against its input's spread (a mean-dominated input loses
    digits)."""
    name = _short_name(call)
    terms = sorted((t for t in call.tensors_in if _rms(t) is not None), key=lambda t: t.numel, reverse=True)
    rms = _rms(output)
    if not terms or not rms:
        return 1.0
    if name in _NORMALIZATIONS:
        x = terms[0]
        if len(call.tensors_out) > 1 and output is call.tensors_out[1]:  # the mean: a sum over x's elements
            return max(1.0, _rms(x) / rms)
        spread = math.sqrt(max(_rms(x) ** 2 - (x.mean or 0.0) ** 2, 0.0))
        return max(1.0, _rms(x) / spread) if spread > 0 else 1.0
    if name in _PRODUCT_SUMS:
        scale = _rms(terms[0]) * (_rms(terms[1]) if len(terms) > 1 else 1.0) * \
            math.sqrt(max(1, terms[0].numel // max(output.numel, 1)))
    elif name in _SUMS:
        scale = _rms(terms[0]) * math.sqrt(max(1, terms[0].numel // max(output.numel, 1)))
    elif name in _DIFFERENCES:
        scale = max(_rms(t) for t in terms)
    elif name in _GRADIENT_DIFFERENCES:
        scale = _rms(call.tensors_in[0]) or 0.0
    else:
        return 1.0
    return max(1.0, scale / rms)


def _rms(tensor: TensorSummary) -> float | None:
    return abs(tensor.norm) / math.sqrt(tensor.numel) if tensor.norm is not None and tensor.numel else None


def _short_name(call: OperatorCall) -> str:
    """``Aten.add_.Tensor`` -> ``add``; ``Functional.linear`` -> ``linear``; ``Tensor.__sub__`` -> ``sub``."""
    parts = call.operator.split(".")
    name = parts[1] if len(parts) > 1 else parts[0]
    return name.strip("_") if name.startswith("__") else name.rstrip("_") if not name.startswith("_") else name


def _peak(tensor: TensorSummary) -> float:
    """The largest magnitude over the RMS (1 where not known): how far an element's rounding reaches in the
    difference measure."""
    if None in tensor.statistics() or not tensor.norm:
        return 1.0
    return max(abs(tensor.max), abs(tensor.min)) / (abs(tensor.norm) / math.sqrt(max(tensor.numel, 1)))


def differing_argument(pair: AlignedCall) -> tuple[int, Scalar, Scalar] | None:
    """The first numeric argument (an epsilon, a scale) that differs between the two calls, with its position."""
    scalars_a = [s for s in pair.a.inputs if isinstance(s, Scalar)]
    scalars_b = [s for s in pair.b.inputs if isinstance(s, Scalar)]
    formats = output_format(pair.a), output_format(pair.b)
    for index, (x, y) in enumerate(zip(scalars_a, scalars_b)):
        if _numeric(x.value) and _numeric(y.value):
            scale = max(abs(float(x.value)), abs(float(y.value)), _TINY)
            if abs(float(x.value) - float(y.value)) > SCALAR_TOLERANCE * scale and \
                    not _machine_epsilons((x, y), formats):
                return index, x, y
    return None


def _machine_epsilons(values: tuple[Scalar, Scalar], formats: tuple[str, str]) -> bool:
    """Each value its own run's format's machine epsilon (2u): a default taken from the dtype (torch's RMSNorm
    without ``eps``), which differs because the formats do, as the verdict's format rule already says."""
    return formats[0] != formats[1] and all(
        math.isclose(float(value.value), 2 * UNIT_ROUNDOFF[fmt], rel_tol=1e-6) for value, fmt in zip(values, formats))


def _numeric(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(float(value))
