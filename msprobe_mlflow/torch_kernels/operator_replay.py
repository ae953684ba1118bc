"""Which side is wrong: the named operator's real inputs and outputs, saved at a second trace of the step
(``trace_save``, :mod:`msprobe_mlflow.trace.saved_calls`), and its replay in float64 on the CPU from each side's own
inputs. Each side's error is its output's distance from that replay (relative, in the 2-norm); a kernel bug shows as
one side far off and the other at its format's rounding. PyTorch's calls replay as the aten operator they name,
MindSpore's ``mint`` calls as the torch function the API accuracy checker compares them with (``Mint.X``: ``torch.X``,
``MintFunctional.X``: ``torch.nn.functional.X``)."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from msprobe_mlflow.formats import UNIT_ROUNDOFF, added_rounding
from msprobe_mlflow.trace.saved_calls import CALL_FILE, saved_call_path, write_saved_call

SIDE_ROUNDING = 4.0  # a side's error within this many times its format's rounding is that rounding
MAX_SAVED_BYTES = 2 ** 30  # a saved tensor larger than this is refused when read back (untrusted folders)
_NUMPY_LACKS = {torch.bfloat16: torch.float32}
MINT_FAMILIES = {"Mint": torch, "MintFunctional": torch.nn.functional}  # as api_check.runner.MODULES maps them


class NotReplayable(ValueError):
    """The saved call names no operator torch replays (MindSpore's ``Primitive.``, ``Functional.``, ``Tensor.``)."""


@dataclass
class SideError:
    """Each side's output against the float64 replay of its own inputs; None for a side with no call to replay (not
    saved, or one torch cannot replay: MindSpore's primitives, whose attributes the trace does not hold). That side
    is then judged by elimination: the other side within ``tolerance`` (what rounding explains of the named call's
    output difference, the judgement's) is right, so the unreplayed one is off; beyond it, the replayed one is.
    ``rounding_a``, ``rounding_b``: what each side's own format explains of its error (a float32 call is 1e-7 off
    float64 by rounding alone, a float64 call 0): a side within it is not off."""
    error_a: float | None
    error_b: float | None
    tolerance: float = 0.0
    rounding_a: float = 0.0
    rounding_b: float = 0.0

    @property
    def wrong(self) -> str | None:
        """"A" or "B": the one side beyond its format's rounding, or where both are, the one at least 10x further
        off than the other (and beyond 1e-12); or as eliminated."""
        if self.error_a is not None and self.error_b is not None:
            off_a, off_b = self.error_a > max(self.rounding_a, 1e-12), self.error_b > max(self.rounding_b, 1e-12)
            if off_a != off_b:
                return "A" if off_a else "B"
            low, high = sorted((self.error_a, self.error_b))
            return ("A" if self.error_a == high else "B") if off_a and high >= 10 * low else None
        known, other, error = self._known()
        if not self.tolerance:
            return None
        return known if error > self.tolerance else other

    def _known(self) -> tuple[str, str, float]:
        return ("A", "B", self.error_a) if self.error_a is not None else ("B", "A", self.error_b)

    def describe(self, call: str, module: str) -> str:
        where = f"{call} in {module or 'the model'}"
        if self.error_a is not None and self.error_b is not None:
            if self.wrong is None:
                within = ", each within its format's rounding" if self.error_a <= self.rounding_a and \
                    self.error_b <= self.rounding_b else ""
                return f"neither side stands out: A is {self.error_a:.1g} off float64, B {self.error_b:.1g}{within}"
            other = "B" if self.wrong == "A" else "A"
            errors = {"A": self.error_a, "B": self.error_b}
            return f"{self.wrong}'s {where} is {errors[self.wrong]:.1g} off float64, {other}'s {errors[other]:.1g}"
        known, other, error = self._known()
        unreplayed = f"{other}'s call is not replayed"
        if self.wrong is None:
            return f"neither side stands out: {known} is {error:.1g} off float64; {unreplayed}"
        if self.wrong == known:
            return f"{known}'s {where} is {error:.1g} off float64, beyond the {self.tolerance:.1g} rounding explains " \
                   f"({unreplayed})"
        return f"{other}'s {where} is off: {known}'s is {error:.1g} off float64, within the {self.tolerance:.1g} " \
               f"rounding explains, and {unreplayed}"


def save_call(folder: Path, name: str, args, kwargs, output) -> None:
    """Writes one PyTorch call's arguments and outputs (tensors already copied to the host) under ``folder/saved/``."""
    write_saved_call(folder, name, args, kwargs, output, _host_tensor, _dtype_name)


def _host_tensor(value) -> tuple[np.ndarray, str] | None:
    if not isinstance(value, torch.Tensor):
        return None
    return value.to(_NUMPY_LACKS.get(value.dtype, value.dtype)).numpy(), str(value.dtype).removeprefix("torch.")


_TORCH_CONSTANTS = (torch.dtype, torch.memory_format, torch.layout)  # arguments saved by name: float32, preserve_format


def _dtype_name(value) -> str | None:
    return str(value).removeprefix("torch.") if isinstance(value, _TORCH_CONSTANTS) else None


def saved_call_folder(trace_folder: str | Path, name: str) -> Path | None:
    folder = saved_call_path(trace_folder, name)
    return folder if (folder / CALL_FILE).is_file() else None


def _decode(value, folder: Path):
    if isinstance(value, list):
        return [_decode(v, folder) for v in value]
    if isinstance(value, dict) and "tensor" in value:
        path = folder / Path(str(value["tensor"])).name  # a bare file name: never outside the call's folder
        if path.stat().st_size > MAX_SAVED_BYTES:
            raise ValueError(f"{path}: {path.stat().st_size} bytes, over the {MAX_SAVED_BYTES} accepted")
        try:
            array = np.load(path, allow_pickle=False)
        except ValueError as error:  # truncated, or not an array
            raise ValueError(f"{path} cannot be read as a saved tensor ({error})") from None
        dtype = getattr(torch, str(value.get("dtype")), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"{folder / CALL_FILE}: dtype {value.get('dtype')!r} is not a torch dtype")
        return torch.from_numpy(array).to(dtype)
    if isinstance(value, dict) and "dtype" in value:
        constant = getattr(torch, str(value["dtype"]), None)
        if not isinstance(constant, _TORCH_CONSTANTS):
            raise ValueError(f"{folder / CALL_FILE}: {value['dtype']!r} is no torch dtype, layout or memory format")
        return constant
    if isinstance(value, dict) and "unsupported" in value:
        raise ValueError(f"{folder / CALL_FILE}: an argument that cannot be replayed: {value['unsupported']}")
    return value


def _operator(name: str):
    """``Aten.gelu.default.1.forward`` -> ``torch.ops.aten.gelu.default``; ``MintFunctional.gelu.0.forward`` ->
    ``torch.nn.functional.gelu``."""
    family, operator, overload = name.split(".")[:3]
    if family in MINT_FAMILIES:
        function = getattr(MINT_FAMILIES[family], operator)
        if not callable(function):
            raise AttributeError(operator)
        return function
    return getattr(getattr(getattr(torch.ops, family.lower()), operator), overload)


def _in_float64(value):
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.double()
    if isinstance(value, list):
        return [_in_float64(v) for v in value]
    if isinstance(value, torch.dtype) and value.is_floating_point:
        return torch.float64
    return value


def replay_error(folder: Path) -> float:
    """The saved output's distance from the float64 replay of the saved inputs: ||out - ref|| / ||ref||."""
    return _replayed(folder)[0]


def _replayed(folder: Path) -> tuple[float, str]:
    """:func:`replay_error`, and the saved output's format (``float32``; float32 for one no format names)."""
    try:
        call = json.loads((folder / CALL_FILE).read_text(encoding="utf-8"))
        args, output, kwargs, name = call["args"], call["output"], call["kwargs"], call["name"]
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{folder / CALL_FILE} cannot be read as a saved call: {error!r} (expected name, args, "
                         f"kwargs and output)") from None
    args, output = _decode(args, folder), _decode(output, folder)
    kwargs = {k: _decode(v, folder) for k, v in kwargs.items()}
    try:
        operator = _operator(str(name))
    except (AttributeError, ValueError, RuntimeError):
        raise NotReplayable(f"{folder / CALL_FILE}: name {name!r} is no operator this torch replays (expected an aten "
                         f"call such as Aten.gelu.default.1.forward, or a MindSpore Mint or MintFunctional "
                         f"call)") from None
    reference = operator(*_in_float64(args), **{k: _in_float64(v) for k, v in kwargs.items()})
    reference = reference[0] if isinstance(reference, (list, tuple)) else reference
    observed = output[0].double()
    scale = float(torch.linalg.vector_norm(reference))
    gap = float(torch.linalg.vector_norm(observed - reference))
    fmt = str(output[0].dtype).removeprefix("torch.")
    return gap / scale if scale > 0 else (0.0 if gap == 0 else math.inf), fmt if fmt in UNIT_ROUNDOFF else "float32"


def side_error(folder_a: Path, name_a: str, folder_b: Path, name_b: str, tolerance: float = 0.0,
               size: int | None = None, cancelled: float = 1.0) -> SideError | None:
    """Each side's error where it saved a call torch replays (see :class:`SideError`); None where neither did.
    ``size``: how many input elements feed one output element (the judgement's), which sets what each side's
    format explains (SIDE_ROUNDING x :func:`~msprobe_mlflow.formats.added_rounding`, times ``cancelled``: how much
    a result small beside its terms magnifies their rounding); without it, none
    (:func:`~msprobe_mlflow.localization.judge.rounding_reach` gives both)."""
    errors, roundings = [], []
    for folder, name in ((folder_a, name_a), (folder_b, name_b)):
        saved = saved_call_folder(folder, name)
        try:
            error, fmt = _replayed(saved) if saved is not None else (None, "float32")
        except NotReplayable:
            error, fmt = None, "float32"
        errors.append(error)
        roundings.append(SIDE_ROUNDING * added_rounding(fmt, size) * cancelled if size else 0.0)
    return None if errors == [None, None] else SideError(*errors, tolerance, *roundings)
