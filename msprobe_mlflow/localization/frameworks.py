"""Two traces from two frameworks (a MindSpore training against its PyTorch twin): their calls have other names
(``MintFunctional.linear`` is ``Aten.addmm``, ``Tensor.__sub__`` is ``Aten.sub.Tensor``), other granularity (a
MindSpore API may be several aten calls) and MindSpore has no API-level backward. So they are aligned on what both
mean: the forward's calls by the operator's family and output shapes, the module entries by their class's family,
path and output shapes; calls without a twin are no finding (the frameworks split work differently), and neither is
an argument spelled otherwise (a dim list against an axis)."""
from __future__ import annotations

import difflib
import re
from dataclasses import replace

from msprobe_mlflow.localization.align import AlignedCall
from msprobe_mlflow.trace.files import MODULE_PREFIXES, OperatorCall, Trace

# An operator's family: the name without framework prefix, overload and dunder, then these (else itself).
_OPERATOR_FAMILIES = {
    "addmm": "linear", "mm": "linear", "matmul": "linear", "dense": "linear", "bmm": "batch_matmul",
    "baddbmm": "batch_matmul", "native_layer_norm": "layer_norm", "_softmax": "softmax", "_log_softmax":
    "log_softmax", "truediv": "div", "true_divide": "div", "square": "square", "pow": "pow", "_to_copy": "cast",
    "to": "cast", "convolution": "conv", "conv2d": "conv", "conv1d": "conv", "native_batch_norm": "batch_norm",
    "_native_batch_norm_legit": "batch_norm", "_native_batch_norm_legit_no_training": "batch_norm",
    "embedding": "embedding", "gather": "embedding", "rsub": "sub",
}
# A module's class family: MindSpore's cell names that are torch's under another name.
_CLASS_FAMILIES = {"dense": "linear", "sequentialcell": "sequential", "celllist": "modulelist",
                   "celldict": "moduledict", "batchnorm1d": "batchnorm", "batchnorm2d": "batchnorm"}
_PREFIX = re.compile(r"^(Aten|Mint|MintFunctional|Functional|Tensor|Torch|Primitive|NPU|VF|Distributed)\.")


def across_frameworks(a: Trace, b: Trace) -> bool:
    """Whether the two traces come from two frameworks (their frameworks say so, or their module entries do)."""
    if a.framework and b.framework:
        return a.framework.lower() != b.framework.lower()
    kinds = [{c.name.split(".", 1)[0] for c in trace.calls if c.is_module} for trace in (a, b)]
    return bool(kinds[0] and kinds[1] and not kinds[0] & kinds[1])


def operator_family(call: OperatorCall) -> str:
    """``Aten.addmm.default`` and ``MintFunctional.linear`` -> ``linear``; ``Tensor.__sub__`` -> ``sub``."""
    name = _PREFIX.sub("", call.operator)
    if call.name.startswith("Aten."):
        name = name.rsplit(".", 1)[0]  # the overload: sub.Tensor is sub
    if name.startswith("__") and name.endswith("__"):
        name = name.strip("_")  # Tensor.__sub__ is sub
    elif name.endswith("_") and not name.startswith("_"):
        name = name[:-1]  # in place: add_ is add
    return _OPERATOR_FAMILIES.get(name, name)


def class_family(call: OperatorCall) -> str:
    """``Cell.fc1.Dense`` and ``Module.fc1.Linear`` -> ``linear``."""
    name = call.operator.rsplit(".", 1)[-1].lower()
    return _CLASS_FAMILIES.get(name, name)


def _shapes(call: OperatorCall) -> tuple:
    return tuple(t.shape for t in call.tensors_out)


def align_across(a: Trace, b: Trace) -> tuple[list[AlignedCall], float]:
    """The forward's calls paired by (family, output shapes), in order; and the share of module entries paired
    (by class family and output shapes, in order): how much of the two models' structure was matched."""
    forward_a = _bias_fused([c for c in a.calls if not c.is_module and c.phase == "forward"])
    forward_b = _bias_fused([c for c in b.calls if not c.is_module and c.phase == "forward"])
    pairs = _matched(forward_a, forward_b, lambda c: (operator_family(c), _shapes(c)))
    modules_a = [c for c in a.calls if c.name.startswith(MODULE_PREFIXES) and c.phase == "forward"]
    modules_b = [c for c in b.calls if c.name.startswith(MODULE_PREFIXES) and c.phase == "forward"]
    paired_modules = _matched(modules_a, modules_b, lambda c: (class_family(c), _shapes(c)))
    share = len(paired_modules) / max(len(modules_a), len(modules_b)) if modules_a or modules_b else 1.0
    return pairs, share


def _bias_fused(calls: list[OperatorCall]) -> list[OperatorCall]:
    """A product followed by the bias add that takes its output (MindSpore's ``Dense``: ``matmul``, ``bias_add``;
    ``Conv2d``: ``conv2d``, ``bias_add``) as one call, the product's, with the bias among its inputs and the sum as
    its output: what torch's ``addmm`` and ``convolution`` are."""
    fused: list[OperatorCall] = []
    for call in calls:
        previous = fused[-1] if fused else None
        if (previous is not None and operator_family(call) == "bias_add" and operator_family(previous) in ("linear", "conv")
                and call.parent == previous.parent and call.tensors_in and previous.tensors_out
                and call.tensors_in[0].shape == previous.tensors_out[0].shape):
            fused[-1] = replace(previous, inputs=previous.inputs + call.inputs[1:], outputs=call.outputs)
        else:
            fused.append(call)
    return fused


def _matched(a: list[OperatorCall], b: list[OperatorCall], key) -> list[AlignedCall]:
    matcher = difflib.SequenceMatcher(None, [key(c) for c in a], [key(c) for c in b], autojunk=False)
    return [AlignedCall(a[i + k], b[j + k]) for i, j, size in matcher.get_matching_blocks() for k in range(size)]
