"""Two traces from two frameworks (a MindSpore training against its PyTorch twin): their calls have other names
(``MintFunctional.linear`` is ``Aten.addmm``, ``Tensor.__sub__`` is ``Aten.sub.Tensor``), other granularity (a
MindSpore API may be several aten calls) and MindSpore has no API-level backward. So they are aligned on what both
mean: the forward's calls by the operator's family and output shapes, the module entries by their class's family,
path and output shapes; calls without a twin are no finding (the frameworks split work differently), and neither is
an argument spelled otherwise (a dim list against an axis). The backward pairs per leaf module (a cell's backward
entry against the torch operators that module's backward ran, as one call): the gradient of its output and what its
backward reads back (its forward's input and output) in, the gradient of its input out."""
from __future__ import annotations

import difflib
import re
from dataclasses import replace

from msprobe_mlflow.localization.align import AlignedCall
from msprobe_mlflow.localization.judge import rounding_reach, same_bits
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
    return pairs + _backward_by_module(a, b, paired_modules), share


def _backward_by_module(a: Trace, b: Trace, modules: list[AlignedCall]) -> list[AlignedCall]:
    """The backward of each paired leaf module called once, as one call per side (:class:`_Backward`), in the
    backward's order (the forward's reversed). A module with children is left to them; one called twice has
    backward entries whose numbering neither framework ties to its forward calls."""
    backward_a, backward_b = _Backward(a), _Backward(b)
    pairs = []
    for pair in reversed(modules):
        (call_a, ran_a), (call_b, ran_b) = backward_a.of(pair.a), backward_b.of(pair.b)
        if call_a is not None and call_b is not None:
            pairs.append(AlignedCall(call_a, call_b, rounding_reach(*ran_a, *ran_b) if ran_a or ran_b else None))
    return pairs


class _Backward:
    """One trace's module backward: its backward entries by name, the operators each module ran (its backward's:
    torch names each by the module that created it), which modules have children and which ran twice."""

    def __init__(self, trace: Trace):
        self.entries = {c.name: c for c in trace.calls if c.is_module}
        self.ran: dict[str, list[OperatorCall]] = {}
        for call in trace.calls:
            if not call.is_module and call.parent:
                self.ran.setdefault(call.parent, []).append(call)
        self.parents = {c.parent for c in trace.calls if c.is_module}

    def of(self, module: OperatorCall) -> tuple[OperatorCall | None, list[OperatorCall]]:
        """``module``'s backward as one call (None: not comparable): the gradient of its first output and its
        forward's first input and output in, the gradient of that input out; from its backward entry where the trace
        has one (MindSpore's cells, msprobe's dumps), else from the backward operators it ran (their first tensors of
        those shapes), where one operator of its forward took its input: a module that uses its input twice (a
        LayerNorm written out) has the sum of the two gradients made outside it; with those operators, for their
        rounding."""
        head, _, number = module.name.rpartition(".forward.")
        if number != "0" or f"{head}.forward.1" in self.entries or module.name in self.parents \
                or not module.tensors_in or not module.tensors_out:
            return None, []
        name = f"{head}.backward.{number}"
        entry, ran = self.entries.get(name), self.ran.get(name, [])
        given = module.tensors_in[0]
        if entry is None and sum(any(same_bits(t, given) for t in c.tensors_in)
                                 for c in self.ran.get(module.name, [])) != 1:
            return None, []
        gradients_in = entry.tensors_in if entry is not None else [t for c in ran for t in c.tensors_in]
        gradients_out = entry.tensors_out if entry is not None else [t for c in ran for t in c.tensors_out]
        output = module.tensors_out[0]
        gradient_of_output = next((t for t in gradients_in if t.shape == output.shape), None)
        gradient_of_input = next((t for t in gradients_out if t.shape == given.shape), None)
        if gradient_of_output is None or gradient_of_input is None:
            return None, []
        return OperatorCall(name, [gradient_of_output, given, output], [gradient_of_input], parent=name), ran


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
