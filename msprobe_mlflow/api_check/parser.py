"""msprobe's MindSpore API dump (``api_info.json`` / ``dump.json``, tasks ``statistics`` and ``tensor``) as typed
records (the format: docs/api_check.md, "Inputs").

A problem with the file as a whole (not JSON, no ``task``, no ``data``) raises ``ValueError``. A problem with one
entry never does: it is kept on the API's record (``ApiCall.forward_problem`` / ``backward_problem`` /
``skip_reason``) with a message naming the key and the field, the value found and what is accepted, so that the
API still gets its row in the report. Nothing here imports MindSpore or torch.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Union

from msprobe_mlflow.api_check.results import INCOMPLETE_ENTRY, NOT_MINT
from msprobe_mlflow.safe_paths import confined_path

TASKS = ("statistics", "tensor")
DUMP_FILE_NAMES = ("api_info.json", "dump.json")
# Where msprobe puts the dump file under its dump_path: step{S}/rank{R}/dump.json ("rank" alone on one device).
MSPROBE_LAYOUT = ("", "rank*/", "step*/rank*/")
LISTED_DUMPS = 10
CHECKED_FAMILIES = ("Mint", "MintFunctional")
SIDES = ("forward", "backward")
FLOAT_DTYPES = ("Float16", "BFloat16", "Float32", "Float64")
INT_DTYPES = ("Int8", "UInt8", "Int16", "UInt16", "Int32", "UInt32", "Int64", "UInt64")
DTYPES = FLOAT_DTYPES + INT_DTYPES + ("Bool",)
TENSOR_TYPE = "mindspore.Tensor"
DTYPE_TYPE = "mindspore.dtype"
# Python scalars, plus the numpy scalar types msprobe writes under their own names ("float32", "int64", "bool_").
SCALAR_TYPES = {
    "int": int, "float": float, "bool": bool, "str": str,
    **{name: int for name in ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")},
    **{name: float for name in ("float16", "float32", "float64")},
    "bool_": bool,
}
_API_NAME = re.compile(r"^(?P<family>[A-Za-z_][A-Za-z0-9_]*)\.(?P<function>[A-Za-z_][A-Za-z0-9_]*)\.(?P<index>\d+)$")


class EntryError(ValueError):
    """A malformed field of one entry; the message names the key and the field."""


@dataclass(frozen=True)
class TensorArg:
    """A recorded ``mindspore.Tensor``: ``maximum``/``minimum`` in the statistics task (``None`` for an empty
    tensor; ±inf kept as recorded), ``data_path`` (resolved, confined to ``dump_data_dir``) in the tensor task."""

    dtype: str
    shape: tuple[int, ...]
    maximum: float | None = None
    minimum: float | None = None
    data_path: Path | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class ValueArg:
    """A recorded non-tensor argument: ``type_name`` is ``int``, ``float``, ``bool``, ``str``, ``slice`` (``value``
    a Python ``slice``) or ``mindspore.dtype`` (``value`` the dtype name, e.g. ``Float32``)."""

    type_name: str
    value: object


# A recorded argument: a tensor, a value, a tuple (JSON list) of arguments, or None (JSON null: msprobe writes null
# for None and for objects it cannot serialise, such as ``dtype=mindspore.float32``).
Argument = Union[TensorArg, ValueArg, tuple, None]


@dataclass(frozen=True)
class ForwardEntry:
    """``kwargs_recorded``: False when the entry has no ``input_kwargs`` (msprobe writes it in every forward entry,
    ``{}`` when there are none): the call is run without keyword arguments, and the check says so."""

    args: tuple[Argument, ...]
    kwargs: dict[str, Argument]
    outputs: tuple[Argument, ...]
    kwargs_recorded: bool = True


@dataclass(frozen=True)
class BackwardEntry:
    """msprobe's backward ``input`` is the gradient arriving at each forward output (used as the sensitivity);
    its ``output`` is the gradient with respect to each tensor input (the tested result in the tensor task)."""

    output_grads: tuple[Argument, ...]
    input_grads: tuple[Argument, ...]


@dataclass
class ApiCall:
    """One API call of the dump (``Mint.add.0``), with its forward and backward entries as far as they parsed.

    ``has_forward``/``has_backward`` say whether the dump lists the entry at all; ``*_problem`` holds the message
    when the entry is listed but malformed. ``problem`` is set when the key itself is malformed, ``skip_reason``
    for what is listed but not checked (another family than ``Mint``/``MintFunctional``, or a key whose suffix is
    not ``forward``/``backward``: such a call is named by its whole key and has neither side), ``skip_group``
    which of the two it is.
    """

    name: str
    family: str = ""
    function: str = ""
    has_forward: bool = False
    has_backward: bool = False
    forward: ForwardEntry | None = None
    backward: BackwardEntry | None = None
    forward_problem: str | None = None
    backward_problem: str | None = None
    problem: str | None = None
    skip_reason: str | None = None
    skip_group: str = ""


@dataclass
class ApiDump:
    """``dump_data_dir``: the folder the tensor task's ``.npy`` files are read from; ``dump_data_dir_found``: how it
    was found, e.g. ``'dump_path/step0/rank0/dump_tensor_data', relative to the current folder``."""

    path: Path
    task: str
    dump_data_dir: Path | None
    calls: list[ApiCall] = field(default_factory=list)
    dump_data_dir_found: str = ""


def read_api_info(path: str | os.PathLike) -> ApiDump:
    """Parse ``api_info.json``; entries are validated one by one (see the module docstring). A folder stands for
    the one dump file in it or below it in msprobe's layout (``dump_file_in``); ``ApiDump.path`` is that file.

    A relative ``dump_data_dir`` is looked for in several folders (``find_dump_data_dir``); each ``data_name`` must
    stay inside ``dump_data_dir``.
    """
    path = Path(path)
    if path.is_dir():
        path = dump_file_in(path)
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise ValueError(f"{path}: cannot be read ({error.strerror or error})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: is not a JSON file ({error})") from None
    if not isinstance(document, dict):
        raise ValueError(f"{path}: the top level is {type(document).__name__}; expected an object with task and data")
    task = document.get("task")
    if task not in TASKS:
        raise ValueError(f"{path}: task = {task!r} is not accepted; expected one of {', '.join(TASKS)}")
    data = document.get("data")
    if not isinstance(data, dict):
        raise ValueError(f"{path}: data = {_short(data)} is not accepted; expected an object of API entries")
    dump_data_dir, found = None, ""
    if task == "tensor":
        raw_dir = document.get("dump_data_dir")
        if not isinstance(raw_dir, str) or not raw_dir:
            raise ValueError(f"{path}: dump_data_dir = {raw_dir!r} is not accepted; the tensor task needs the "
                             "folder of the .npy files (absolute, or relative to the JSON file's folder or to the "
                             "folder the training ran in)")
        dump_data_dir, found = find_dump_data_dir(path, raw_dir, data)

    dump = ApiDump(path, task, dump_data_dir, dump_data_dir_found=found)
    by_name: dict[str, ApiCall] = {}
    for key, entry in data.items():
        api_name, _, side = key.rpartition(".")
        if side not in SIDES:
            dump.calls.append(ApiCall(name=key, skip_reason=f"{key}: suffix {side!r} is not forward or backward; "
                                                            "only forward and backward entries are checked",
                                      skip_group=INCOMPLETE_ENTRY))
            continue
        call = by_name.get(api_name)
        if call is None:
            call = by_name[api_name] = _new_call(api_name)
            dump.calls.append(call)
        setattr(call, f"has_{side}", True)
        if call.problem or call.skip_reason:
            continue
        parser = _EntryParser(key, task, dump_data_dir)
        try:
            setattr(call, side, parser.forward(entry) if side == "forward" else parser.backward(entry))
        except EntryError as error:
            setattr(call, f"{side}_problem", str(error))
    return dump


def dump_file_in(folder: Path) -> Path:
    """The one ``api_info.json``/``dump.json`` in ``folder`` or below it in msprobe's layout (a ``dump_path``, a
    ``step0`` or a ``rank0`` folder); none or several (two steps, two ranks) are refused, naming them."""
    found = sorted({file for pattern in MSPROBE_LAYOUT for name in DUMP_FILE_NAMES
                    for file in folder.glob(pattern + name) if file.is_file()})
    if len(found) == 1:
        return found[0]
    names = ", ".join(str(file.relative_to(folder)) for file in found[:LISTED_DUMPS])
    if len(found) > LISTED_DUMPS:
        names += f" and {len(found) - LISTED_DUMPS} more"
    if not found:
        raise ValueError(f"{folder}: is a folder with no {' or '.join(DUMP_FILE_NAMES)} in it nor below it in "
                         "msprobe's layout (rank*/dump.json, step*/rank*/dump.json); pass the dump file")
    raise ValueError(f"{folder}: holds {len(found)} dumps ({names}); pass the one to check, e.g. {found[0]}")


def find_dump_data_dir(path: Path, raw_dir: str, data: dict) -> tuple[Path, str]:
    """The folder of the tensor task's ``.npy`` files, and how it was found. An absolute ``dump_data_dir`` is taken
    as it is. msprobe writes a relative one relative to the folder the training ran in (``./dump_path/step0/rank0/
    dump_tensor_data``), so it is tried relative to the JSON file's folder, then to the current folder, then to each
    folder above the JSON file (where the training ran, if the check runs elsewhere); the first folder that holds
    one of the dump's ``data_name`` files is taken. Raises ``ValueError`` naming the folders tried when none does
    (a dump without tensors takes the first)."""
    names = [name for name in dict.fromkeys(_data_names(data)) if not os.path.isabs(name)]
    if os.path.isabs(raw_dir):
        tried = [(Path(raw_dir), "absolute")]
    else:
        folder = path.parent.resolve()
        bases = [(folder, "relative to the JSON file's folder"), (Path.cwd(), "relative to the current folder"),
                 *((above, "relative to a folder above the JSON file") for above in folder.parents)]
        tried, seen = [], set()
        for base, how in bases:  # the current folder is often one above the JSON file: tried once, as the former
            if base not in seen:
                seen.add(base)
                tried.append((base / raw_dir, how))
    for folder, how in tried:
        if not names or any(os.path.isfile(os.path.join(folder, name)) for name in names):
            return folder, f"{raw_dir!r}, {how}"
    looked_in = ", ".join(f"{folder} ({how})" for folder, how in tried)
    raise ValueError(f"{path}: dump_data_dir = {raw_dir!r} is not accepted: no folder it may mean holds any of the "
                     f"dump's {len(names)} tensor files (the first: {names[0]}); tried {looked_in}; expected the "
                     "folder of the .npy files, absolute or relative to the JSON file's folder or to the folder the "
                     "training ran in (msprobe writes it so: run the check from there)")


def _data_names(value) -> Iterator[str]:
    """Every tensor's ``data_name`` in a part of the dump, in order."""
    if isinstance(value, dict):
        if value.get("type") == TENSOR_TYPE and isinstance(value.get("data_name"), str):
            yield value["data_name"]
        value = list(value.values())
    if isinstance(value, list):
        for item in value:
            yield from _data_names(item)


def _new_call(api_name: str) -> ApiCall:
    match = _API_NAME.match(api_name)
    if match is None:
        return ApiCall(name=api_name, problem=f"{api_name}: the key is not Family.function.index.forward|backward "
                                              "(e.g. Mint.add.0.forward)")
    call = ApiCall(name=api_name, family=match["family"], function=match["function"])
    if call.family not in CHECKED_FAMILIES:
        call.skip_reason = (f"{api_name}: {call.family} APIs are not checked; only "
                            f"{' and '.join(CHECKED_FAMILIES)} (mindspore.mint) APIs are")
        call.skip_group = NOT_MINT
    return call


def _short(value, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _EntryParser:
    """Validates one ``data`` entry; every message starts with the entry's key and the field's path in it."""

    def __init__(self, key: str, task: str, dump_data_dir: Path | None):
        self.key, self.task, self.dump_data_dir = key, task, dump_data_dir

    def fail(self, where: str, value, accepted: str):
        raise EntryError(f"{self.key}: {where} = {_short(value)} is not accepted; expected {accepted}")

    def forward(self, entry) -> ForwardEntry:
        if not isinstance(entry, dict):
            self.fail("the entry", entry, "an object with input_args, input_kwargs and output")
        args = self.argument_list(entry, "input_args", required=True)
        kwargs = entry.get("input_kwargs", {})
        if kwargs is None:
            kwargs = {}
        if not isinstance(kwargs, dict):
            self.fail("input_kwargs", kwargs, "an object of keyword arguments")
        parsed_kwargs = {name: self.argument(value, f"input_kwargs.{name}") for name, value in kwargs.items()}
        outputs = self.argument_list(entry, "output", required=self.task == "tensor")
        return ForwardEntry(args, parsed_kwargs, outputs, kwargs_recorded="input_kwargs" in entry)

    def backward(self, entry) -> BackwardEntry:
        if not isinstance(entry, dict):
            self.fail("the entry", entry, "an object with input and output")
        output_grads = self.argument_list(entry, "input", required=True)
        input_grads = self.argument_list(entry, "output", required=self.task == "tensor")
        return BackwardEntry(output_grads, input_grads)

    def argument_list(self, entry: dict, field_name: str, required: bool) -> tuple[Argument, ...]:
        if field_name not in entry and not required:
            return ()
        values = entry.get(field_name)
        if not isinstance(values, list):
            self.fail(field_name, values, "a list of arguments")
        return tuple(self.argument(value, f"{field_name}[{i}]") for i, value in enumerate(values))

    def argument(self, value, where: str) -> Argument:
        if value is None:
            return None
        if isinstance(value, list):
            return tuple(self.argument(item, f"{where}[{i}]") for i, item in enumerate(value))
        if not isinstance(value, dict):
            self.fail(where, value, "an object with a type, a list, or null")
        type_name = value.get("type")
        if type_name == TENSOR_TYPE:
            return self.tensor(value, where)
        if type_name == DTYPE_TYPE:
            dtype = value.get("value")
            if dtype not in DTYPES:
                self.fail(f"{where}.value", dtype, f"one of {', '.join(DTYPES)}")
            return ValueArg(DTYPE_TYPE, dtype)
        if type_name == "slice":
            return ValueArg("slice", self.slice(value.get("value"), f"{where}.value"))
        if type_name in SCALAR_TYPES:
            return ValueArg(SCALAR_TYPES[type_name].__name__, self.scalar(value, where, SCALAR_TYPES[type_name]))
        accepted = [TENSOR_TYPE, DTYPE_TYPE, "slice", *SCALAR_TYPES]
        self.fail(f"{where}.type", type_name, f"one of {', '.join(accepted)}")

    def scalar(self, value: dict, where: str, python_type: type):
        if "value" not in value:
            self.fail(f"{where}.value", None, f"a {python_type.__name__} value (the field is missing)")
        item = value["value"]
        if python_type is int and (isinstance(item, bool) or not isinstance(item, int)):
            self.fail(f"{where}.value", item, "an integer")
        if python_type is float and (isinstance(item, bool) or not isinstance(item, (int, float))):
            self.fail(f"{where}.value", item, "a number")
        if python_type in (bool, str) and not isinstance(item, python_type):
            self.fail(f"{where}.value", item, f"a {python_type.__name__}")
        return float(item) if python_type is float else item

    def slice(self, item, where: str) -> slice:
        if (not isinstance(item, list) or len(item) != 3
                or any(part is not None and (isinstance(part, bool) or not isinstance(part, int)) for part in item)):
            self.fail(where, item, "[start, stop, step], each an integer or null")
        return slice(*item)

    def tensor(self, value: dict, where: str) -> TensorArg:
        dtype = value.get("dtype")
        if dtype not in DTYPES:
            self.fail(f"{where}.dtype", dtype, f"one of {', '.join(DTYPES)}")
        shape = value.get("shape")
        if not isinstance(shape, list) or any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in shape):
            self.fail(f"{where}.shape", shape, "a list of non-negative integers")
        shape = tuple(shape)
        if self.task == "statistics":
            maximum, minimum = self.bound(value, where, "Max", dtype), self.bound(value, where, "Min", dtype)
            empty = math.prod(shape) == 0
            if (maximum is None or minimum is None) and not empty:
                field_name = "Max" if maximum is None else "Min"
                self.fail(f"{where}.{field_name}", None, f"a number: shape {list(shape)} has {math.prod(shape)} "
                                                         "elements (null only for empty tensors)")
            if maximum is not None and minimum is not None and minimum > maximum:
                self.fail(f"{where}.Min", minimum, f"a number not above Max = {maximum!r}")
            return TensorArg(dtype, shape, maximum=maximum, minimum=minimum)
        data_name = value.get("data_name")
        if not isinstance(data_name, str) or not data_name:
            self.fail(f"{where}.data_name", data_name, f"the name of a .npy file in {self.dump_data_dir}")
        try:
            data_path = confined_path(self.dump_data_dir, data_name, f"{where}.data_name")
        except ValueError as error:
            raise EntryError(f"{self.key}: {error}") from None
        return TensorArg(dtype, shape, data_path=data_path)

    def bound(self, value: dict, where: str, field_name: str, dtype: str) -> float | None:
        """``Max``/``Min``: a number (``true``/``false`` for Bool tensors), ±Infinity (float tensors), or null;
        never NaN."""
        item = value.get(field_name)
        if item is None:
            return None
        if isinstance(item, bool):
            if dtype != "Bool":
                self.fail(f"{where}.{field_name}", item, f"a number for a {dtype} tensor")
            return float(item)
        if not isinstance(item, (int, float)) or math.isnan(item):
            self.fail(f"{where}.{field_name}", item, "a number, Infinity, -Infinity or null (empty tensor)")
        if math.isinf(item) and dtype not in FLOAT_DTYPES:
            self.fail(f"{where}.{field_name}", item, f"a finite number for an {dtype} tensor")
        return float(item)
