"""Pairs the operator calls of two traces of one step: by position when both ran the same sequence, else by
sequence alignment on (phase, operator, module, input shapes), so an operator present in one run only shifts
nothing after it; calls the two runs made in another order pair up too. Dtype conversions that only one run makes
(autocast's casts) are set aside, not findings."""
from __future__ import annotations

import difflib
from dataclasses import dataclass, replace

from msprobe_mlflow.trace.files import OperatorCall, Trace

# Operators that change a tensor's format, place or layout only: present in one run only, they are a format
# difference (autocast, a .double() model: another dtype takes another path), which the verdict's format rule covers,
# not a missing operator.
CONVERSIONS = ("Aten._to_copy.", "Aten.to.", "Aten.copy_.", "Aten.clone.", "Aten._autocast_to_reduced_precision.",
               "Aten._autocast_to_full_precision.", "Aten.contiguous.", "Tensor.to.", "Tensor.float.",
               "Tensor.half.", "Tensor.bfloat16.", "Tensor.double.", "Tensor.type_as.", "Tensor.contiguous.",
               # and operators that move elements without computing (a reshape that copies where strides ask)
               "Aten._unsafe_view.", "Aten._reshape_copy.", "Aten._reshape_alias.")


@dataclass
class AlignedCall:
    a: OperatorCall | None  # None: the call is B's only
    b: OperatorCall | None
    reach: tuple[int, float] | None = None  # a module's backward across frameworks: its operators' rounding reach

    @property
    def one_sided(self) -> bool:
        return self.a is None or self.b is None

    @property
    def call(self) -> OperatorCall:
        return self.a if self.a is not None else self.b


def operator_calls(trace: Trace) -> list[OperatorCall]:
    """The trace's operator calls in the order they ran: the forward's, then the backward's (module entries left
    out: they summarise their operators). In msprobe's dumps an API's backward entry holds only the gradients; its
    forward's inputs (what the backward reads back) are added to its inputs."""
    calls = [c for c in trace.calls if not c.is_module]
    forward = [c for c in calls if c.phase == "forward"]
    backward = [c for c in calls if c.phase == "backward"]
    if not trace.ours:
        inputs = {c.name.removesuffix(".forward"): c.inputs for c in forward}
        backward = [replace(c, inputs=c.inputs + inputs.get(c.name.removesuffix(".backward"), []))
                    for c in backward]
    return forward + backward


def align(a: list[OperatorCall], b: list[OperatorCall]) -> list[AlignedCall]:
    if [c.name for c in a] == [c.name for c in b]:
        return [AlignedCall(x, y) for x, y in zip(a, b)]
    keys_a, keys_b = [_key(c) for c in a], [_key(c) for c in b]
    matcher = difflib.SequenceMatcher(None, keys_a, keys_b, autojunk=False)
    aligned: list[AlignedCall] = []
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            aligned.extend(AlignedCall(x, y) for x, y in zip(a[i1:i2], b[j1:j2]))
            continue
        left, right = [c for c in a[i1:i2] if not _conversion(c)], [c for c in b[j1:j2] if not _conversion(c)]
        # a replaced block of equal length and operators is one operator run differently (other shapes)
        if len(left) == len(right) and all(x.operator == y.operator for x, y in zip(left, right)):
            aligned.extend(AlignedCall(x, y) for x, y in zip(left, right))
        else:
            aligned.extend([AlignedCall(x, None) for x in left] + [AlignedCall(None, y) for y in right])
    return _paired_out_of_order(aligned)


def _paired_out_of_order(aligned: list[AlignedCall]) -> list[AlignedCall]:
    """Calls left to one side that the other side made elsewhere in the same phase (the backward may run two
    branches in another order) pair with them, in order of occurrence, at A's place: only what one run never made
    stays one-sided."""
    waiting: dict[tuple, list[int]] = {}
    for index, pair in enumerate(aligned):
        if pair.a is None:
            waiting.setdefault(_key(pair.b), []).append(index)
    dropped = set()
    for pair in aligned:
        if pair.b is None and waiting.get(_key(pair.a)):
            index = waiting[_key(pair.a)].pop(0)
            pair.b = aligned[index].b
            dropped.add(index)
    return [pair for index, pair in enumerate(aligned) if index not in dropped]


def _conversion(call: OperatorCall) -> bool:
    return call.name.startswith(CONVERSIONS)


def _key(call: OperatorCall) -> tuple:
    return (call.phase, call.operator, module_path(call.parent),
            tuple(t.shape for t in call.tensors_in))


def module_path(parent: str | None) -> str:
    """``Module.h.1.mlp.GELU.forward.0`` -> ``h.1.mlp``: the module's path in the model, without its class, phase
    and call number ("" outside any module)."""
    if not parent:
        return ""
    head = parent.split(".", 1)[1] if "." in parent else parent
    return head.rsplit(".", 3)[0]
