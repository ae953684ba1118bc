"""One traced step of one rank as msprobe 1.0.3 lays out its data dump (task ``statistics``): ``dump.json`` (each
call's input and output tensors: dtype, shape, Max, Min, Mean, Norm), ``construct.json`` (each call's parent
module) and ``stack.json`` (where it was called), in ``step{S}/rank{R}/``.

msprobe's compare reads our traces and ``locate`` reads msprobe's dumps. Beside msprobe's fields a tensor carries
``checksum``: 16 hex digits, equal for equal bytes, and changed by any one changed word (computed on the device,
:mod:`msprobe_mlflow.torch_kernels.bit_checksum`); msprobe's own ``md5`` field (a CRC32 of the bytes) is read as a
checksum of another kind, so two checksums are compared only when both are of one kind.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from msprobe_mlflow.trace.options import TRACE_STEPS_VARIABLE
from msprobe_mlflow.vocabulary import TRACE_FOLDER

DUMP_FILE, CONSTRUCT_FILE, STACK_FILE = "dump.json", "construct.json", "stack.json"
TRACER = "msprobe_mlflow"  # dump.json's "tracer": ours traces every backward operator with all its inputs
OUR_CHECKSUM, MSPROBE_CHECKSUM = "bits64", "crc32"
_STEP_FOLDER, _RANK_FOLDER = re.compile(r"step(\d+)$"), re.compile(r"rank(\d*)$")
MODULE_PREFIXES = ("Module.", "Cell.")  # msprobe's PyTorch and MindSpore module entries


class TraceError(ValueError):
    """A trace that cannot be read: the message names the file and the field."""


@dataclass(frozen=True)
class TensorSummary:
    dtype: str
    shape: tuple[int, ...]
    max: float | None = None  # None: not computed (an empty tensor, a tensor subclass) or not a number
    min: float | None = None
    mean: float | None = None
    norm: float | None = None
    checksum: str | None = None  # "{kind}:{hex}", equal for equal bits (compared within one kind)
    requires_grad: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def statistics(self) -> tuple:
        return self.max, self.min, self.mean, self.norm


@dataclass(frozen=True)
class Scalar:
    """A call's argument that is not a tensor (an epsilon, a dim, a dtype), as msprobe records it."""
    type: str
    value: object


@dataclass
class OperatorCall:
    """One entry of ``dump.json``: an operator (API) call or a module's, in the order the step ran them."""
    name: str  # msprobe's: "Aten.addmm.default.0.forward", "Functional.linear.3.backward", "Module.fc.Linear.forward.0"
    inputs: list = field(default_factory=list)  # TensorSummary and Scalar, positional then keyword, nested flattened
    outputs: list = field(default_factory=list)
    parent: str | None = None  # the module entry it ran in (construct.json)
    stack: list[str] = field(default_factory=list)

    @property
    def is_module(self) -> bool:
        return self.name.startswith(MODULE_PREFIXES)

    @property
    def phase(self) -> str:
        parts = self.name.rsplit(".", 2)
        return parts[-2] if self.is_module else parts[-1]

    @property
    def operator(self) -> str:
        """The name without call counter and phase: ``Aten.addmm.default``, ``Module.fc.Linear``."""
        return self.name.rsplit(".", 2)[0]

    @property
    def tensors_in(self) -> list[TensorSummary]:
        return [a for a in self.inputs if isinstance(a, TensorSummary)]

    @property
    def tensors_out(self) -> list[TensorSummary]:
        return [a for a in self.outputs if isinstance(a, TensorSummary)]


@dataclass
class Trace:
    calls: list[OperatorCall]
    level: str = "L1"
    framework: str = ""
    folder: str = ""
    ours: bool = False  # msprobe's backward entries hold the gradients only, not the tensors the forward saved


def write_trace(folder: str | os.PathLike, calls: list[OperatorCall], *, level: str, framework: str) -> Path:
    """Writes ``dump.json``, ``construct.json`` and ``stack.json`` of ``calls`` into ``folder`` (created)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    data = {}
    for call in calls:
        inputs = [_tensor_json(a, framework) for a in call.inputs]
        outputs = [_tensor_json(a, framework) for a in call.outputs]
        data[call.name] = {"input": inputs, "output": outputs} if call.phase == "backward" else \
            {"input_args": inputs, "input_kwargs": {}, "output": outputs}
    dump = {"task": "statistics", "level": level, "framework": framework, "tracer": TRACER, "dump_data_dir": None,
            "data": data}
    for name, content in ((DUMP_FILE, dump), (CONSTRUCT_FILE, {c.name: c.parent for c in calls}),
                          (STACK_FILE, {c.name: c.stack for c in calls if c.stack})):
        temporary = folder / f".{name}.partial"
        with open(temporary, "w", encoding="utf-8") as f:
            json.dump(content, f, indent=1)
        os.replace(temporary, folder / name)
    return folder


def _tensor_json(argument, framework: str) -> dict:
    if isinstance(argument, Scalar):
        return {"type": argument.type, "value": argument.value}
    entry = {"type": "mindspore.Tensor" if framework == "mindspore" else "torch.Tensor", "dtype": argument.dtype,
             "shape": list(argument.shape), "Max": argument.max, "Min": argument.min, "Mean": argument.mean,
             "Norm": argument.norm, "requires_grad": argument.requires_grad}
    if argument.checksum is not None:
        entry["checksum"] = argument.checksum.split(":", 1)[1]
    return entry


def read_trace(folder: str | os.PathLike) -> Trace:
    """The trace in ``folder`` (or of the ``dump.json`` named): ours or msprobe 1.0.3's data dump."""
    path = Path(folder)
    folder = path.parent if path.name == DUMP_FILE else path
    dump = _load(folder / DUMP_FILE)
    if not isinstance(dump, dict) or not isinstance(dump.get("data"), dict):
        raise TraceError(f"{folder / DUMP_FILE}: field 'data' is missing or not an object; expected msprobe's "
                         f"dump.json (task statistics, tensor or md5)")
    parents = _load(folder / CONSTRUCT_FILE, optional=True) or {}
    stacks = _load(folder / STACK_FILE, optional=True) or {}
    calls = []
    for name, entry in dump["data"].items():
        where = f"{folder / DUMP_FILE}: data.{name}"
        if not isinstance(entry, dict):
            raise TraceError(f"{where} is not an object")
        inputs = _arguments(entry.get("input_args", entry.get("input", [])), where + ".input") + \
            _arguments(list((entry.get("input_kwargs") or {}).values()), where + ".input_kwargs")
        stack = stacks.get(name) if isinstance(stacks, dict) else None
        calls.append(OperatorCall(name, inputs, _arguments(entry.get("output", []), where + ".output"),
                                  parents.get(name) if isinstance(parents, dict) else None,
                                  [str(line) for line in stack] if isinstance(stack, list) else []))
    return Trace(calls, str(dump.get("level", "")), str(dump.get("framework", "")), str(folder),
                 dump.get("tracer") == TRACER)


def _load(path: Path, optional: bool = False):
    if not path.is_file():
        if optional:
            return None
        raise TraceError(f"{path} does not exist: a trace folder holds msprobe's dump.json (and construct.json, "
                         f"stack.json)")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise TraceError(f"{path} cannot be read as JSON: {e}") from None


def _arguments(values, where: str) -> list:
    if values is None:
        return []
    if not isinstance(values, list):
        values = [values]
    flat = []
    for index, value in enumerate(values):
        if isinstance(value, list):
            flat.extend(_arguments(value, f"{where}[{index}]"))
        elif isinstance(value, dict) and "dtype" in value and "shape" in value:
            flat.append(_tensor(value, f"{where}[{index}]"))
        elif isinstance(value, dict):
            flat.append(Scalar(str(value.get("type", "")), value.get("value")))
        elif value is not None:
            flat.append(Scalar(type(value).__name__, value))
    return flat


def _tensor(value: dict, where: str) -> TensorSummary:
    shape = value.get("shape")
    if not isinstance(shape, list) or not all(isinstance(n, int) and n >= 0 for n in shape):
        raise TraceError(f"{where}.shape is {shape!r}; expected a list of sizes")
    statistics = []
    for key in ("Max", "Min", "Mean", "Norm"):
        number = value.get(key)
        if number is not None and (isinstance(number, bool) or not isinstance(number, (int, float))):
            number = _number(number, f"{where}.{key}")
        statistics.append(None if number is None else float(number))
    checksum = f"{OUR_CHECKSUM}:{value['checksum']}" if value.get("checksum") else \
        f"{MSPROBE_CHECKSUM}:{value['md5']}" if value.get("md5") else None
    return TensorSummary(str(value["dtype"]), tuple(shape), *statistics, checksum, bool(value.get("requires_grad")))


def _number(value, where: str) -> float | None:
    """msprobe writes booleans' Max and Min as true/false and some non-finite values as strings."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            raise TraceError(f"{where} is {value!r}; expected a number or null") from None
    raise TraceError(f"{where} is {value!r}; expected a number or null")


def trace_root(root: str | os.PathLike, rank: int | None = None) -> Path:
    """The folder holding ``step{S}/`` folders: ``root`` itself, or a monitor's dump folder's ``rank{R}/trace/``."""
    root = Path(root)
    monitored = {int(m.group(1)): p / TRACE_FOLDER for p in (root.iterdir() if root.is_dir() else ())
                 if (m := _RANK_FOLDER.match(p.name)) and m.group(1) and (p / TRACE_FOLDER).is_dir()}
    if not monitored or traced_steps(root):
        return root
    if rank is None and len(monitored) > 1:
        raise TraceError(f"{root} holds the traces of ranks {sorted(monitored)}: name one (--rank)")
    if rank is not None and rank not in monitored:
        raise TraceError(f"{root} has no trace of rank {rank}; it holds ranks {sorted(monitored)}")
    return monitored[rank if rank is not None else next(iter(monitored))]


def trace_folder(root: str | os.PathLike, step: int | None = None, rank: int | None = None) -> Path:
    """The folder holding ``step``'s trace of ``rank`` under ``root`` (``root/step{S}/rank{R}``; msprobe names a
    rank ``rank`` without its number outside torch.distributed), or ``root`` itself when it holds a dump.json. A
    monitor's dump folder holds its traces in ``rank{R}/trace/``."""
    root = Path(root)
    if (root / DUMP_FILE).is_file() or root.name == DUMP_FILE:
        return root.parent if root.name == DUMP_FILE else root
    root = trace_root(root, rank)
    steps = traced_steps(root)
    if not steps:
        raise TraceError(f"{root} holds no trace: expected step{{S}}/rank{{R}}/dump.json (msprobe's dump layout); "
                         f"rerun the training with {TRACE_STEPS_VARIABLE}=S to trace step S")
    if step is None:
        if len(steps) > 1:
            raise TraceError(f"{root} holds traces of steps {steps}: name one (--step)")
        step = steps[0]
    if step not in steps:
        raise TraceError(f"{root} has no trace of step {step}; its traced steps: {steps}. Rerun the training with "
                         f"{TRACE_STEPS_VARIABLE}={step} to trace it")
    ranks = sorted((root / f"step{step}").iterdir())
    ranks = {m.group(1): p for p in ranks if (m := _RANK_FOLDER.match(p.name)) and (p / DUMP_FILE).is_file()}
    if rank is None:
        if len(ranks) > 1:
            raise TraceError(f"{root}/step{step} holds ranks {sorted(ranks)}: name one (--rank)")
        return next(iter(ranks.values()))
    for key in (str(rank), "") if rank == 0 else (str(rank),):
        if key in ranks:
            return ranks[key]
    raise TraceError(f"{root}/step{step} has no trace of rank {rank}; it holds {sorted(ranks) or 'none'}")


def traced_steps(root: str | os.PathLike) -> list[int]:
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(int(m.group(1)) for p in root.iterdir() if (m := _STEP_FOLDER.match(p.name)) and p.is_dir())
