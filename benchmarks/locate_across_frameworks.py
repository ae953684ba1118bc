"""Localization across frameworks (issue 49, item 5's MindSpore-against-PyTorch row): does ``locate`` name a wrong
kernel between a MindSpore training and its PyTorch twin, with its module and its side, and stay quiet when the two
differ only in the frameworks' rounding? With no mapping file.

Families, each the same model in both frameworks (PyTorch's initial weights copied into MindSpore; the same batches,
a function of (seed, step); SGD at 0.05; MindSpore in PyNative on the CPU, torch on one thread; the real monitors
with ``trace_steps``):

- ``mlp-ln``: LayerNorm(16), Linear 16 -> 32, Tanh, LayerNorm(32), Linear 32 -> 10 (MindSpore's ``nn.LayerNorm``,
  ``nn.Dense`` in an ``nn.SequentialCell``). In sample: the cross-framework alignment's last changes (a ``Dense``
  as one call beside ``addmm``, first outputs only, inputs by elements) were written looking at a twin of this shape.
- ``cnn-bn``: Conv2d 3 -> 8 (3x3, padding 1), BatchNorm2d, ReLU, Flatten, Linear 512 -> 10. **Held out**: declared
  here, in the commit that adds this benchmark, before it was ever measured; nothing was tuned on it.
- ``resmlp``: Linear 16 -> 32, four residual blocks (LayerNorm, Linear 32 -> 64, ReLU, Linear 64 -> 32, added to the
  block's input; a class ``Block`` in each framework), LayerNorm, Linear 32 -> 10: the deeper family, **held out**,
  declared (2026-12-07) before it was measured.

Per family and seed: a benign pair (MindSpore against PyTorch, no fault) traced at each of ``BENIGN_STEPS``; at
``FAULT_STEP``, a wrong kernel in one PyTorch forward call at a time (every call that has a MindSpore twin in the
benign pair's alignment), its output scaled by 1 + d for d in 1e-3, 1e-2, 1e-1, as a faulty device kernel is (both
runs call the same operators; one result is off). Both sides save their twin calls (``trace_save``), so the side is
judged too. Counted: *exact* (the named pair's PyTorch call is the faulty one), *module* (the named call's PyTorch
module is the faulty call's), *side* (B, the PyTorch run, named as the side off float64), *quiet* (a benign pair
names no operator), the module entries aligned (``module_share``). A fault whose output difference at its own call is
not above the benign pair's there is a row of its own, not counted. The same, a wrong kernel in one MindSpore call at
a time (``MindSporeWrongKernel``: a primitive of a cell, a ``mint`` function, a ``Tensor`` method), side A: added at
stop 55 and measured then for the first time, on both families, with no change to ``locate`` (MindSpore's primitives
are not replayed, so its side is found by elimination). And, added at stop 63 with the backward's comparison per
leaf module (MindSpore's backward is per cell), a wrong kernel in one PyTorch backward call at a time, each call a
paired leaf module's backward ran: counted *module* (that module's backward named), where the fault reaches the
module's gradient of its input beyond the benign pair's difference there (a kernel computing a parameter's gradient,
or summing two paths' gradients, does not: a row of its own, not counted). Measured for the first time at that stop,
no constant added.

    .venv/bin/python benchmarks/locate_across_frameworks.py [--seeds 3] [--out benchmarks/results]
    .venv/bin/python benchmarks/locate_across_frameworks.py --quick --out DIR   # one seed, one step: the harness

Needs MindSpore beside torch (the dev virtualenv, numpy < 2), so it is not part of ``benchmarks/run-locate``, whose
environment holds msprobe 1.0.3 with numpy 2. MindSpore writes compiler reports into the current folder: the script
runs in a temporary one.
"""
from __future__ import annotations

import os

os.environ.setdefault("GLOG_v", "3")  # MindSpore's C++ warnings

import argparse
import contextlib
import datetime
import json
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import mindspore as ms  # noqa: E402
from mindspore import Tensor, mint, nn as msnn  # noqa: E402

import msprobe_mlflow  # noqa: E402
from msprobe_mlflow import GradProbeConfig  # noqa: E402
from msprobe_mlflow.localization import NAMED, OPERATOR  # noqa: E402
from msprobe_mlflow.localization.align import module_path  # noqa: E402
from msprobe_mlflow.mindspore import GradientMonitor as MindSporeMonitor  # noqa: E402
from msprobe_mlflow.mindspore.operator_trace import MindSporeOperatorTracer  # noqa: E402
from msprobe_mlflow.pytorch import GradientMonitor as TorchMonitor  # noqa: E402
from msprobe_mlflow.trace.files import read_trace, trace_folder  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
FAULT_STEP, BENIGN_STEPS, ERRORS = 2, (1, 2, 4, 6, 9), (1e-3, 1e-2, 1e-1)
HELD_OUT = ("cnn-bn", "resmlp")
FAMILIES = ("mlp-ln", *HELD_OUT)
TRACED_CALL = MindSporeOperatorTracer._traced_call.__code__  # where the trace makes a traced call


# ---------------------------------------------------------------- the twins

def torch_block() -> torch.nn.Module:
    class Block(torch.nn.Module):  # the same class name in both frameworks, as a user's twin has
        def __init__(self):
            super().__init__()
            self.norm, self.fc1 = torch.nn.LayerNorm(32), torch.nn.Linear(32, 64)
            self.act, self.fc2 = torch.nn.ReLU(), torch.nn.Linear(64, 32)

        def forward(self, x):
            return x + self.fc2(self.act(self.fc1(self.norm(x))))
    return Block()


def mindspore_block() -> msnn.Cell:
    class Block(msnn.Cell):
        def __init__(self):
            super().__init__()
            self.norm, self.fc1 = msnn.LayerNorm((32,), epsilon=1e-5), msnn.Dense(32, 64)
            self.act, self.fc2 = msnn.ReLU(), msnn.Dense(64, 32)

        def construct(self, x):
            return x + self.fc2(self.act(self.fc1(self.norm(x))))
    return Block()


def torch_model(family: str, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    if family == "mlp-ln":
        return torch.nn.Sequential(torch.nn.LayerNorm(16), torch.nn.Linear(16, 32), torch.nn.Tanh(),
                                   torch.nn.LayerNorm(32), torch.nn.Linear(32, 10))
    if family == "resmlp":
        return torch.nn.Sequential(torch.nn.Linear(16, 32), *[torch_block() for _ in range(4)],
                                   torch.nn.LayerNorm(32), torch.nn.Linear(32, 10))
    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                               torch.nn.Flatten(), torch.nn.Linear(512, 10))


def mindspore_model(family: str, seed: int) -> msnn.Cell:
    if family == "mlp-ln":
        net = msnn.SequentialCell([msnn.LayerNorm((16,), epsilon=1e-5), msnn.Dense(16, 32), msnn.Tanh(),
                                   msnn.LayerNorm((32,), epsilon=1e-5), msnn.Dense(32, 10)])
    elif family == "resmlp":
        net = msnn.SequentialCell([msnn.Dense(16, 32), *[mindspore_block() for _ in range(4)],
                                   msnn.LayerNorm((32,), epsilon=1e-5), msnn.Dense(32, 10)])
    else:
        net = msnn.SequentialCell([msnn.Conv2d(3, 8, 3, pad_mode="pad", padding=1, has_bias=True),
                                   msnn.BatchNorm2d(8, eps=1e-5), msnn.ReLU(), msnn.Flatten(), msnn.Dense(512, 10)])
    weights = [p.detach().numpy() for p in torch_model(family, seed).parameters()]
    for parameter, values in zip(net.trainable_params(), weights, strict=True):
        parameter.set_data(Tensor(values.copy()))
    net.set_train(True)
    return net


def batch(family: str, seed: int, step: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng([seed, step])
    shape = (8, 3, 8, 8) if family == "cnn-bn" else (16, 16)
    x = rng.standard_normal(shape).astype(np.float32)
    return x, rng.standard_normal((shape[0], 10)).astype(np.float32)


def train_mindspore(family: str, seed: int, dump: Path, step: int, save=(),
                    fault: "MindSporeWrongKernel | None" = None) -> Path:
    net = mindspore_model(family, seed)
    optimizer = msnn.SGD(net.trainable_params(), learning_rate=0.05)
    if fault is not None:
        fault.install(net)  # under the trace: it wraps what it finds, the fault included
    monitor = MindSporeMonitor(GradProbeConfig(dump_path=str(dump)), log_to_mlflow=False, silent=True,
                               trace_steps=[step], trace_save=list(save))
    monitor.monitor(optimizer, network=net)
    grad = ms.value_and_grad(lambda x, y: mint.mean(mint.square(net(x) - y)), None, net.trainable_params())
    try:
        for s in range(step + 1):
            if fault is not None:
                fault.armed = s == step
            _, grads = grad(*(Tensor(v) for v in batch(family, seed, s)))
            optimizer(grads)
        monitor.stop()
    finally:
        if fault is not None:
            fault.uninstall()
    if monitor.errors:
        raise RuntimeError(f"MindSpore monitor: {monitor.errors}")
    return dump


class WrongKernel(TorchDispatchMode):
    """The ``number``-th call of aten ``operator`` in ``phase`` returns its first output times 1 + ``error`` while
    ``armed``. Entered before the trace starts, so below the tracer's mode (the trace records the wrong result); the
    tracer's own statistics are not counted (benchmark only: ``traces`` is the monitor's, read while it traces)."""

    def __init__(self, operator: str, number: int, error: float, phase: str = "forward"):
        super().__init__()
        self.operator, self.number, self.error, self.phase = operator, number, error, phase
        self.armed, self.calls, self.injected, self.traces = False, 0, 0, None

    def _measuring(self) -> bool:
        tracer = self.traces._tracer if self.traces is not None else None
        return tracer is not None and tracer._measuring

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        output = func(*args, **(kwargs or {}))
        backward = torch._C._current_autograd_node() is not None
        if self.armed and str(func) == self.operator and backward == (self.phase == "backward") and \
                not self._measuring():
            if self.calls == self.number:
                (output[0] if isinstance(output, tuple) else output).mul_(1 + self.error)
                self.injected += 1
            self.calls += 1
        return output


class MindSporeWrongKernel:
    """The ``number``-th forward call of the traced MindSpore ``operator`` (``Primitive.<attribute>`` of the network's
    cells, ``Mint.<function>``, ``Tensor.<method>``) returns its first output times 1 + ``error`` while ``armed``.
    Installed before the trace starts, so the trace wraps the faulty call and records its wrong result, as a faulty
    device kernel gives it (its gradient is scaled too: MindSpore's autograd sees the multiplication)."""

    def __init__(self, operator: str, number: int, error: float):
        self.kind, self.name = operator.split(".", 1)
        self.number, self.error = number, error
        self.armed, self.calls, self.injected = False, 0, 0
        self._undo: list = []

    def _output(self, output, caller):
        """``output``, wrong where due; counted only for the model's calls, which the trace makes (its statistics'
        own ``mint.mean``... come through its wrappers from elsewhere)."""
        if self.armed and caller.f_code is TRACED_CALL:
            if self.calls == self.number:  # the first output, as WrongKernel's
                output = (output[0] * (1 + self.error), *output[1:]) if isinstance(output, tuple) else \
                    output * (1 + self.error)
                self.injected += 1
            self.calls += 1
        return output

    def install(self, net: msnn.Cell) -> None:
        fault = self
        if self.kind == "Primitive":
            for _, cell in net.cells_and_names():
                primitive = (cell.__dict__.get("_primitives") or {}).get(self.name)
                if primitive is None or any(p is primitive for p, _ in self._undo):
                    continue
                original = type(primitive)

                def __call__(instance, *args, _original=original, **kwargs):
                    return fault._output(_original.__call__(instance, *args, **kwargs), sys._getframe(1))
                primitive.__class__ = type(original.__name__, (original,), {
                    "__call__": __call__, "__module__": original.__module__, "__qualname__": original.__qualname__})
                self._undo.append((primitive, original))
            return
        owner = {"Mint": mint, "Tensor": Tensor}[self.kind]
        original = getattr(owner, self.name)

        def faulty(*args, **kwargs):
            return fault._output(original(*args, **kwargs), sys._getframe(1))
        self._undo.append((owner, owner.__dict__.get(self.name)))
        setattr(owner, self.name, faulty)

    def uninstall(self) -> None:
        for target, before in reversed(self._undo):
            if self.kind == "Primitive":
                target.__class__ = before
            elif before is None:
                delattr(target, self.name)
            else:
                setattr(target, self.name, before)
        self._undo = []


def train_torch(family: str, seed: int, dump: Path, step: int, save=(), fault: WrongKernel | None = None) -> Path:
    model = torch_model(family, seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    monitor = TorchMonitor(GradProbeConfig(dump_path=str(dump)), log_to_mlflow=False, silent=True,
                           trace_steps=[step], trace_save=list(save))
    monitor.monitor(model, optimizer)
    if fault is not None:
        fault.traces = monitor._traces
    with fault if fault is not None else contextlib.nullcontext():
        for s in range(step + 1):
            if fault is not None:
                fault.armed = s == step
            x, y = (torch.from_numpy(v) for v in batch(family, seed, s))
            optimizer.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
            optimizer.step()
    monitor.stop()
    if monitor.errors:
        raise RuntimeError(f"PyTorch monitor: {monitor.errors}")
    return dump


# ---------------------------------------------------------------- the cases

@dataclass
class Outcome:
    family: str
    seed: int
    step: int
    fault: str | None  # the faulty PyTorch call, None for a benign pair
    error: float
    kind: str
    named: str  # the named pair as "MindSpore call | PyTorch call"
    exact: bool
    module: bool
    side: str | None  # "A", "B" or None (neither, or not replayed)
    below_noise: bool
    module_share: float | None
    faulty_side: str | None = None  # "B": the fault is in a PyTorch call, "A": in a MindSpore call; None: benign


def locate(a: Path, b: Path, step: int):
    return msprobe_mlflow.locate(a, b, step=step, log_run=False)


def benign_cases(family: str, seed: int, work: Path, steps) -> tuple[list[Outcome], dict, dict, list]:
    """The benign pairs' outcomes; at ``FAULT_STEP``, the forward's pairs and the leaf modules' backward pairs, by
    PyTorch's name, with their judgements, and PyTorch's backward calls."""
    outcomes, at_fault_step, modules, backward_calls = [], {}, {}, []
    for step in steps:
        folder = work / f"{family}-{seed}-benign-{step}"
        result = locate(train_mindspore(family, seed, folder / "ms", step), train_torch(family, seed, folder / "pt", step),
                        step)
        found = result.localization
        outcomes.append(Outcome(family, seed, step, None, 0.0, found.kind, _named(found), False, False, None, False,
                                found.module_share))
        if step == FAULT_STEP:
            paired = [(pair, judgement) for pair, judgement in found.rows if not pair.one_sided]
            at_fault_step = {pair.b.name: (pair, j) for pair, j in paired if not pair.b.is_module}
            modules = {pair.b.name: (pair, j) for pair, j in paired if pair.b.is_module}
            backward_calls = [c for c in read_trace(trace_folder(folder / "pt", step, 0)).calls
                              if c.phase == "backward" and not c.is_module]
    return outcomes, at_fault_step, modules, backward_calls


def fault_cases(family: str, seed: int, work: Path, twins: dict, errors) -> list[Outcome]:
    pairs = {name: pair for name, (pair, _) in twins.items()}
    saved_ms = train_mindspore(family, seed, work / f"{family}-{seed}-ms-saved", FAULT_STEP,
                               save=sorted({pair.a.name for pair in pairs.values()}))
    outcomes = []
    for truth, pair in pairs.items():
        operator, number = truth.rsplit(".", 2)[0], int(truth.rsplit(".", 2)[1])
        aten = "aten." + operator.removeprefix("Aten.")
        for error in errors:
            fault = WrongKernel(aten, number, error)
            folder = work / f"{family}-{seed}-{truth}-{error:g}"
            result = locate(saved_ms, train_torch(family, seed, folder, FAULT_STEP, save=[truth], fault=fault),
                            FAULT_STEP)
            if fault.injected != 1:
                raise RuntimeError(f"{family} seed {seed}: the fault in {truth} ran {fault.injected} times")
            outcomes.append(_fault_outcome(family, seed, truth, error, result, pair, twins[truth][1], "B"))
    return outcomes


def mindspore_fault_cases(family: str, seed: int, work: Path, twins: dict, errors) -> list[Outcome]:
    """As :func:`fault_cases`, the wrong kernel in one MindSpore call at a time (side A), against PyTorch's run."""
    by_mindspore = {pair.a.name: (pair, judgement) for pair, judgement in twins.values()}
    saved_pt = train_torch(family, seed, work / f"{family}-{seed}-pt-saved", FAULT_STEP,
                           save=sorted(pair.b.name for pair, _ in by_mindspore.values()))
    outcomes = []
    for truth, (pair, benign) in by_mindspore.items():
        operator, number = truth.rsplit(".", 2)[0], int(truth.rsplit(".", 2)[1])
        for error in errors:
            fault = MindSporeWrongKernel(operator, number, error)
            folder = work / f"{family}-{seed}-ms-{truth}-{error:g}"
            result = locate(train_mindspore(family, seed, folder, FAULT_STEP, save=[truth], fault=fault), saved_pt,
                            FAULT_STEP)
            if fault.injected != 1:
                raise RuntimeError(f"{family} seed {seed}: the fault in {truth} ran {fault.injected} times")
            outcomes.append(_fault_outcome(family, seed, truth, error, result, pair, benign, "A"))
    return outcomes


def backward_fault_cases(family: str, seed: int, work: Path, modules: dict, backward_calls: list,
                         errors) -> list[Outcome]:
    """A wrong kernel in one PyTorch backward call at a time, each call that a paired leaf module's backward ran
    (MindSpore has no operator-level backward: the module is what can be named). Counted where the fault reaches
    that module's gradient of its input beyond the benign pair's difference there; a kernel computing a parameter's
    gradient does not (the verdict's culprits name that parameter), nor one summing two paths' gradients (a residual
    stream's, which torch names by the module whose input it is): a row of its own."""
    saved_ms = train_mindspore(family, seed, work / f"{family}-{seed}-ms-backward", FAULT_STEP)
    outcomes = []
    for module, (pair, benign) in modules.items():
        for call in (c for c in backward_calls if c.parent == module):
            operator = call.name.rsplit(".", 2)[0]
            number = sum(c.name.rsplit(".", 2)[0] == operator for c in backward_calls[:backward_calls.index(call)])
            for error in errors:
                fault = WrongKernel("aten." + operator.removeprefix("Aten."), number, error, phase="backward")
                folder = work / f"{family}-{seed}-{call.name}-{error:g}"
                result = locate(saved_ms, train_torch(family, seed, folder, FAULT_STEP, fault=fault), FAULT_STEP)
                if fault.injected != 1:
                    raise RuntimeError(f"{family} seed {seed}: the fault in {call.name} ran {fault.injected} times")
                found = result.localization
                row = next((j for p, j in found.rows if p.b is not None and p.b.name == module), None)
                named = found.pair.b if found.pair is not None else None
                outcomes.append(Outcome(
                    family, seed, FAULT_STEP, call.name, error, found.kind, _named(found), exact=False,
                    module=found.kind == OPERATOR and named is not None and named.name == module, side=None,
                    below_noise=row is None or row.output_difference <= benign.output_difference,
                    module_share=found.module_share, faulty_side="B backward"))
    return outcomes


def _fault_outcome(family: str, seed: int, truth: str, error: float, result, pair, benign, side: str) -> Outcome:
    """What ``locate`` found for a fault in ``pair``'s call on ``side`` (A: MindSpore's, B: PyTorch's) named
    ``truth``; ``benign``: the benign pair's judgement of that call (its rounding there)."""
    def call(twins):
        return twins.a if side == "A" else twins.b
    found = result.localization
    row = next((j for p, j in found.rows if call(p) is not None and call(p).name == truth), None)
    named = call(found.pair) if found.pair is not None else None
    return Outcome(family, seed, FAULT_STEP, truth, error, found.kind, _named(found),
                   exact=found.kind == OPERATOR and named is not None and named.name == truth,
                   module=named is not None and module_path(named.parent) == module_path(call(pair).parent),
                   side=result.side.wrong if result.side is not None else None,
                   below_noise=row is None or benign is None or row.output_difference <= benign.output_difference,
                   module_share=found.module_share, faulty_side=side)


def _named(found) -> str:
    if found.pair is None:
        return ""
    return " | ".join(call.name if call is not None else "-" for call in (found.pair.a, found.pair.b))


# ---------------------------------------------------------------- the report

def summarise(outcomes: list[Outcome]) -> dict:
    def share(rows, test) -> dict:
        return {"hits": sum(map(test, rows)), "of": len(rows)}

    summary = {}
    for group, families in (("in sample", ("mlp-ln",)), ("held out", HELD_OUT)):
        rows = [o for o in outcomes if o.family in families]
        benign = [o for o in rows if o.fault is None]
        shares = [o.module_share for o in benign if o.module_share is not None]
        summary[group] = {"benign_quiet": share(benign, lambda o: o.kind not in NAMED),
                          "module_share_min": min(shares, default=None)}
        for side, prefix in (("B", ""), ("A", "mindspore_")):  # PyTorch's faults keep their keys of stop 54
            faults = [o for o in rows if o.faulty_side == side]
            counted = [o for o in faults if not o.below_noise]
            summary[group].update({
                f"{prefix}exact": share(counted, lambda o: o.exact),
                f"{prefix}module": share(counted, lambda o: o.module),
                f"{prefix}side": share([o for o in counted if o.exact], lambda o, side=side: o.side == side),
                f"{prefix}below_noise": sum(o.below_noise for o in faults)})
        backward = [o for o in rows if o.faulty_side == "B backward"]
        summary[group].update({"backward_module": share([o for o in backward if not o.below_noise],
                                                        lambda o: o.module),
                               "backward_below_noise": sum(o.below_noise for o in backward)})
    return summary


def markdown(result: dict) -> str:
    def cell(entry: dict) -> str:
        return f"{entry['hits']}/{entry['of']} ({entry['hits'] / entry['of']:.0%})" if entry["of"] else "n/a"

    groups = result["summary"]
    lines = ["## Localization across frameworks: MindSpore against its PyTorch twin", "",
             f"{result['machine']}; {result['took_s']:.0f} s; load average {result['load_before']} -> "
             f"{result['load_after']}. Reproduce: `{result['command']}`. Design: "
             f"`benchmarks/locate_across_frameworks.py`'s docstring.", "",
             f"| metric | target | in sample (mlp-ln) | held out ({', '.join(HELD_OUT)}) |", "|---|---|---|---|"]
    for key, label, target in (("exact", "wrong PyTorch kernel: exact operator named", "90%"),
                               ("module", "... its module named", "98%"),
                               ("side", "... side named right (B), of those named exactly", "90%"),
                               ("below_noise", "... below the pair's rounding at their call (not counted)", ""),
                               ("mindspore_exact", "wrong MindSpore kernel: exact operator named", "90%"),
                               ("mindspore_module", "... its module named", "98%"),
                               ("mindspore_side", "... side named right (A), of those named exactly", "90%"),
                               ("mindspore_below_noise", "... below the pair's rounding at their call (not counted)",
                                ""),
                               ("backward_module", "wrong PyTorch backward kernel in a leaf module: its module "
                                "named (MindSpore's backward is per cell)", "98%"),
                               ("backward_below_noise", "... not reaching its module's gradient of the input beyond "
                                "the pair's rounding (a parameter's gradient, two paths' gradients summed; not "
                                "counted)", ""),
                               ("benign_quiet", "benign pairs naming no operator", "29 of 30")):
        values = [groups[group].get(key) for group in ("in sample", "held out")]
        lines.append(f"| {label} | {target} | " + " | ".join(
            "n/a" if v is None else str(v) if isinstance(v, int) else cell(v) for v in values) + " |")
    lines.append(f"| module entries aligned, lowest over benign pairs | 95% | "
                 f"{groups['in sample']['module_share_min']:.0%} | {groups['held out']['module_share_min']:.0%} |")
    misses = [o for o in result["outcomes"] if o["fault"] and not o["below_noise"]
              and not (o["module"] if o["faulty_side"] == "B backward" else o["exact"] and o["module"])]
    loud = [o for o in result["outcomes"] if not o["fault"] and o["kind"] in NAMED]
    if misses or loud:
        lines += ["", "| family | seed | step | fault | d | found | named (MindSpore / PyTorch) | side named |",
                  "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {o['family']} | {o['seed']} | {o['step']} | {o['fault'] or 'benign'} | {o['error']:g} | "
                  f"{o['kind']} | {o['named']} | {o['side'] or '-'} |" for o in misses + loud]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3, help="seeds per family (default 3)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder of locate_across_frameworks.{md,json}")
    parser.add_argument("--quick", action="store_true", help="one seed, the fault step only, d = 1e-2: the harness")
    args = parser.parse_args()
    if args.quick and args.out.resolve() == RESULTS.resolve():
        parser.error("--quick needs --out: a dry run never writes into benchmarks/results/")
    torch.set_num_threads(1)
    ms.set_context(mode=ms.PYNATIVE_MODE)
    seeds = range(1 if args.quick else args.seeds)
    steps, errors = ((FAULT_STEP,), (1e-2,)) if args.quick else (BENIGN_STEPS, ERRORS)
    start, load_before = time.perf_counter(), os.getloadavg()
    outcomes: list[Outcome] = []
    with tempfile.TemporaryDirectory(prefix="locate-across-") as scratch:
        os.chdir(scratch)  # MindSpore's compiler reports
        for family in FAMILIES:
            for seed in seeds:
                print(f"{family} seed {seed}", file=sys.stderr, flush=True)
                benign, twins, modules, backward_calls = benign_cases(family, seed, Path(scratch), steps)
                outcomes += benign + fault_cases(family, seed, Path(scratch), twins, errors)
                outcomes += mindspore_fault_cases(family, seed, Path(scratch), twins, errors)
                outcomes += backward_fault_cases(family, seed, Path(scratch), modules, backward_calls, errors)
        os.chdir(ROOT)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    result = {"machine": f"{os.cpu_count()} CPUs, Python {platform.python_version()}, torch {torch.__version__} "
                         f"(1 thread), MindSpore {ms.__version__}, msprobe-mlflow at {commit.strip()}, "
                         f"{datetime.date.today()}",
              "command": " ".join(["benchmarks/locate_across_frameworks.py", *sys.argv[1:]]),
              "took_s": time.perf_counter() - start, "load_before": [round(v, 1) for v in load_before],
              "load_after": [round(v, 1) for v in os.getloadavg()],
              "summary": summarise(outcomes), "outcomes": [o.__dict__ for o in outcomes]}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "locate_across_frameworks.json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    report = markdown(result)
    (args.out / "locate_across_frameworks.md").write_text(report, encoding="utf-8")
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
