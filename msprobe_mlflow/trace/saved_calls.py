"""The calls a trace saves (``trace_save``, ``MSPROBE_MLFLOW_TRACE_SAVE``) so that a float64 replay can tell which
side is wrong, whatever the framework: ``saved/{call name}/call.json`` (the arguments' structure: tensors by file,
scalars by value) and one ``.npy`` per tensor (float32 where numpy has no such format: bfloat16's values exactly),
read back with ``allow_pickle=False`` (``torch_kernels.operator_replay``). Dtypes are named as torch names them
(``float32``, ``bfloat16``, ``int64``: MindSpore's names lower-cased)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import numpy as np

from msprobe_mlflow.notices import Notices
from msprobe_mlflow.safe_paths import param_file_stem

SAVED_FOLDER, CALL_FILE = "saved", "call.json"

HostTensor = Callable[[object], "tuple[np.ndarray, str] | None"]  # a framework tensor -> (its values, dtype name)
DtypeName = Callable[[object], "str | None"]  # a framework dtype -> its name


def saved_call_path(trace_folder: str | Path, name: str) -> Path:
    return Path(trace_folder) / SAVED_FOLDER / param_file_stem(name, "")


def write_saved_call(trace_folder: Path, name: str, args, kwargs: dict, output, host_tensor: HostTensor,
                     dtype_name: DtypeName) -> dict:
    """Writes one call's arguments and outputs under ``trace_folder/saved/``; returns ``call.json``'s content."""
    target = saved_call_path(trace_folder, name)
    target.mkdir(parents=True, exist_ok=True)
    counter = iter(range(1 << 30))

    def encode(value):
        tensor = host_tensor(value)
        if tensor is not None:
            array, dtype = tensor
            file = f"tensor_{next(counter)}.npy"
            np.save(target / file, array, allow_pickle=False)
            return {"tensor": file, "dtype": dtype, "shape": list(array.shape)}
        if isinstance(value, (list, tuple)):
            return [encode(v) for v in value]
        if isinstance(value, (bool, int, float, str)) or value is None:
            return value
        dtype = dtype_name(value)
        if dtype is not None:
            return {"dtype": dtype}
        return {"unsupported": repr(value)}

    call = {"name": name, "args": encode(list(args)), "kwargs": {k: encode(v) for k, v in kwargs.items()},
            "output": encode(list(output) if isinstance(output, (list, tuple)) else [output])}
    (target / CALL_FILE).write_text(json.dumps(call, indent=1), encoding="utf-8")
    return call


def say_unsaved(notices: Notices, step: int, wanted: frozenset[str], saved) -> None:
    """One warning naming the calls ``trace_save`` asked for that the traced step did not make."""
    missing = sorted(wanted - set(saved))
    if missing:
        notices.warn(f"step {step} made no call named {', '.join(missing)}: nothing saved for it (names as locate "
                     f"prints them, in this training's trace)")
