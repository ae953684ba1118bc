"""From a suspicious step to the operator: ``locate_traces(a, b, step=S)`` walks two traces of step S in execution order
and names the first operator whose output differs beyond what its inputs' differences and its format's rounding
explain (:mod:`msprobe_mlflow.localization.judge`); or says that none does, which makes the step's difference drift
(rounding amplified), not a bug. An operator present in one run only, or a numeric argument that differs (an
epsilon, a scale), is the first finding where it comes first."""
from __future__ import annotations

import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from msprobe_mlflow.formats import UNIT_ROUNDOFF
from msprobe_mlflow.localization.align import AlignedCall, align, module_path, operator_calls
from msprobe_mlflow.localization.frameworks import across_frameworks, align_across
from msprobe_mlflow.localization.judge import Judgement, differing_argument, dtype_name, judge, near_tie
from msprobe_mlflow.trace.files import OperatorCall, TraceError, read_trace, trace_folder
from msprobe_mlflow.trace.options import TRACE_STEPS_VARIABLE

OPERATOR, SEQUENCE, ARGUMENT, DRIFT, IDENTICAL = "operator", "sequence", "argument", "drift", "identical"
NEAR_TIE = "near tie"  # a ReLU's backward that passed an element in one run only: no operator named
NAMED = (OPERATOR, SEQUENCE, ARGUMENT)  # findings that name an operator (``locate`` exits 3)
_LIBRARY_PARTS = (f"{os.sep}site-packages{os.sep}", f"{os.sep}lib{os.sep}python", "<frozen")


@dataclass
class Localization:
    kind: str  # one of OPERATOR, SEQUENCE, ARGUMENT, DRIFT, IDENTICAL, NEAR_TIE
    pair: AlignedCall | None = None  # the named call (both sides', or the one side's)
    judgement: Judgement | None = None
    detail: str = ""
    rows: list[tuple[AlignedCall, Judgement | None]] = field(default_factory=list)  # every aligned call, in order
    folders: tuple[str, str] = ("", "")
    module_share: float | None = None  # across frameworks: the share of module entries matched
    across: bool = False  # two frameworks: MindSpore runs its backward's operators below Python, so the backward
    # pairs per leaf module (:mod:`~msprobe_mlflow.localization.frameworks`), and what no leaf module ran is not seen

    @property
    def named(self) -> bool:
        return self.kind in NAMED

    @property
    def module(self) -> str:
        return module_path(self.pair.call.parent) if self.pair else ""

    def describe(self) -> str:
        unseen = "; across frameworks the backward is compared per leaf module, on the gradient of its input " \
            "(MindSpore's autograd runs below Python), so a wrong kernel computing a parameter's gradient, or " \
            "outside the leaf modules it could pair, is not ruled out: the verdict's culprits name such a " \
            "parameter; trace the step on one framework on both devices to compare every operator" \
            if self.across else ""
        if self.kind == IDENTICAL:
            return f"identical: every traced operator's inputs and outputs have equal bits in A and B{unseen}"
        if self.kind == DRIFT:
            return f"drift: every operator's output difference follows from its inputs ({self.detail}){unseen}"
        call = self.pair.call
        where = f"{call.name} in {self.module or 'the model (outside any module)'}"
        site = call_site(call)
        return ("near tie, not a fault: " if self.kind == NEAR_TIE else "") + f"{where}: {self.detail}" + \
            (f"; called at {site}" if site else "")


def locate_traces(a: str | os.PathLike, b: str | os.PathLike, *, step: int | None = None,
                  rank: int | None = None) -> Localization:
    """Compares the traces of ``step`` (of ``rank``) in trace folders ``a`` and ``b``: each a folder with
    ``step{S}/rank{R}/dump.json`` (ours or msprobe's data dump), or one such folder itself."""
    folder_a, folder_b = trace_folder(a, step, rank), trace_folder(b, step, rank)
    trace_a, trace_b = read_trace(folder_a), read_trace(folder_b)
    if across_frameworks(trace_a, trace_b):
        pairs, module_share = align_across(trace_a, trace_b)
        localization = walk(pairs, across=True)
        localization.module_share = module_share
        localization.across = True
    else:
        localization = walk(align(operator_calls(trace_a), operator_calls(trace_b)))
    localization.folders = (str(folder_a), str(folder_b))
    return localization


def walk(aligned: list[AlignedCall], across: bool = False) -> Localization:
    """``across``: two frameworks' calls (:mod:`~msprobe_mlflow.localization.frameworks`): their arguments are
    spelled otherwise, so only outputs are judged."""
    rows: list[tuple[AlignedCall, Judgement | None]] = []
    found: Localization | None = None
    noise = 0.0  # the unit roundoff of the coarsest format whose outputs have differed so far
    substituted = _substituted(aligned)
    for index, pair in enumerate(aligned):
        judgement = None if pair.one_sided else judge(pair, noise, across)
        rows.append((pair, judgement))
        if index in substituted:
            continue
        if judgement is not None and judgement.output_difference > 0:
            noise = max(noise, UNIT_ROUNDOFF[judgement.format])
        if found is not None:
            continue
        if pair.one_sided:
            side, order = ("A", pair.a) if pair.a is not None else ("B", pair.b)
            found = Localization(SEQUENCE, pair, detail=f"it ran in {side} only ({order.phase})")
        elif not across and (argument := differing_argument(pair)) is not None:
            index, x, y = argument
            found = Localization(ARGUMENT, pair, judgement,
                                 f"its argument {index + 1} ({x.type}) is {x.value!r} in A and {y.value!r} in B")
        elif near_tie(pair, judgement):
            found = Localization(NEAR_TIE, pair, judgement,
                                 f"its output's mean and RMS differ by {judgement.output_difference:.2g} of its scale, "
                                 f"its max and min within the {judgement.tolerance:.2g} rounding explains, where "
                                 f"the input it compares with its threshold differs in bits: an element that sat on "
                                 f"the threshold passed its gradient in one run and not in the other. The operators "
                                 f"before it follow from their inputs; those after it carry the switch, so a fault "
                                 f"there would not be named")
        elif judgement.beyond:
            inputs = "its inputs have equal bits" if judgement.inputs_bit_equal else \
                f"its inputs differ by {judgement.input_difference:.2g}" if judgement.input_difference else \
                "its inputs differ in bits below what their statistics show"
            whole = "its backward, compared as a whole across frameworks (the gradient of its input): " \
                if pair.call.is_module else ""
            found = Localization(OPERATOR, pair, judgement,
                                 f"{whole}output differs by {judgement.output_difference:.2g} of its scale where "
                                 f"{inputs} (rounding explains up to {judgement.tolerance:.2g} in {judgement.format})")
    if found is None:
        judged = [(pair, j) for pair, j in rows if j is not None and j.output_difference > 0]
        if not judged:
            found = Localization(IDENTICAL)
        else:
            pair, largest = max(judged, key=lambda row: row[1].output_difference / max(row[1].tolerance, 1e-300))
            found = Localization(DRIFT, detail=f"closest to unexplained: {pair.call.name} in "
                                               f"{module_path(pair.call.parent) or 'the model'}, output "
                                               f"{largest.output_difference:.2g} against {largest.tolerance:.2g}")
    found.rows = rows
    return found


def _substituted(aligned: list[AlignedCall]) -> set[int]:
    """The places of one-sided calls in stretches where each run made calls of its own in formats the other's do
    not share: another dtype took another kernel (float64's LSTM is a chain of products, float32's one mkldnn call),
    which the calls after the stretch judge through their inputs; not a missing operator."""
    marked: set[int] = set()
    start = None
    for index in range(len(aligned) + 1):
        if index < len(aligned) and aligned[index].one_sided:
            start = index if start is None else start
            continue
        if start is not None:
            stretch = aligned[start:index]
            formats_a = {dtype_name(t.dtype) for p in stretch if p.a is not None for t in p.a.tensors_out}
            formats_b = {dtype_name(t.dtype) for p in stretch if p.b is not None for t in p.b.tensors_out}
            if formats_a and formats_b and formats_a != formats_b:
                marked.update(range(start, index))
            start = None
    return marked


def call_site(call: OperatorCall) -> str:
    """The innermost frame of the call's stack outside Python's and installed libraries: the user's code."""
    for line in call.stack:
        if not any(part in line for part in _LIBRARY_PARTS):
            parts = line.removeprefix("File ").split(", ")
            if len(parts) >= 3:
                return f"{Path(parts[0]).name}:{parts[1].removeprefix('line ')} in {parts[2].removeprefix('in ')}"
            return line
    return ""


def locate_hint(a: str, b: str, verdict, no_mlflow: bool = False) -> str | None:
    """After a verdict (:class:`~msprobe_mlflow.compare.verdict.Verdict`) on A and B (run IDs or dumps), the next
    command: ``locate`` at the first suspicious step (and rank), and, unless both sides are dumps that traced that
    step, how to trace it; None where nothing is suspicious. ``compare`` prints it, the comparison run's
    description holds it."""
    step = verdict.first_suspicious_step
    if step is None:
        return None
    rank = next(r.rank for r in verdict.ranks if r.suspicious and r.first_suspicious_step == step)
    options = f" --step {step}" + (f" --rank {rank}" if len(verdict.ranks) > 1 else "") + \
        (" --no-mlflow" if no_mlflow else "")
    lines = [f"next, the operator: msprobe-mlflow locate {shlex.quote(a)} {shlex.quote(b)}{options}"]
    rerun = f"with {TRACE_STEPS_VARIABLE}={step} (or trace_steps=[{step}])"
    if not all(Path(side).exists() for side in (a, b)):  # a run: its traced steps are in the run
        lines.append(f"  a training whose run has no trace of step {step} is rerun {rerun}")
    elif not _traced(a, b, step, rank):
        lines.append(f"  it needs a trace of step {step} from both trainings: rerun each {rerun}")
    lines += ["  it names the first operator whose output its inputs do not explain, and how to tell which side is",
              "  off; or says \"near tie\" (a ReLU switched in one run) or \"drift\" (rounding carried forward)"]
    return "\n".join(lines)


def _traced(a: str, b: str, step: int, rank: int) -> bool:
    try:
        return all(trace_folder(side, step, rank) for side in (a, b))
    except (TraceError, OSError):
        return False
