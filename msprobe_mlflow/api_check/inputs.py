"""Recorded tensors made real: regenerated from statistics or loaded from ``.npy``, then given to both frameworks
with identical values.

Values are rounded to the recorded dtype once, by torch (round to nearest even), and MindSpore receives those exact
values, so both frameworks start from the same inputs whatever the dtype (BFloat16 included).
"""
from __future__ import annotations

from dataclasses import dataclass

import mindspore
import numpy as np
import torch

from msprobe_mlflow.api_check.parser import FLOAT_DTYPES, TensorArg

SEED = 42

MINDSPORE_DTYPES = {
    "Float16": mindspore.float16, "BFloat16": mindspore.bfloat16, "Float32": mindspore.float32,
    "Float64": mindspore.float64, "Int8": mindspore.int8, "UInt8": mindspore.uint8, "Int16": mindspore.int16,
    "UInt16": mindspore.uint16, "Int32": mindspore.int32, "UInt32": mindspore.uint32, "Int64": mindspore.int64,
    "UInt64": mindspore.uint64, "Bool": mindspore.bool_,
}
TORCH_DTYPES = {
    "Float16": torch.float16, "BFloat16": torch.bfloat16, "Float32": torch.float32, "Float64": torch.float64,
    "Int8": torch.int8, "UInt8": torch.uint8, "Int16": torch.int16, "UInt16": torch.uint16, "Int32": torch.int32,
    "UInt32": torch.uint32, "Int64": torch.int64, "UInt64": torch.uint64, "Bool": torch.bool,
}
_TORCH_DTYPE_NAMES = {value: key for key, value in TORCH_DTYPES.items()}
# The finite range of each float dtype, where a recorded ±Infinity is clipped to.
_FLOAT_LIMITS = {"Float16": 65504.0, "BFloat16": float(torch.finfo(torch.bfloat16).max),
                 "Float32": float(np.finfo(np.float32).max), "Float64": float(np.finfo(np.float64).max)}


class InputError(ValueError):
    """A recorded tensor that cannot be made (missing file, wrong shape); the message names the file."""


def regenerate(spec: TensorArg) -> np.ndarray:
    """msprobe's rebuild of a tensor from its statistics: a fresh ``RandomState(42)`` for every tensor, ``rand >
    0.5`` for Bool, otherwise ``uniform(Min, Max)`` in float64 (±inf clipped to the dtype's finite range),
    truncated toward zero for integer dtypes. An empty tensor (``Max``/``Min`` null) is an empty array."""
    random = np.random.RandomState(SEED)
    if spec.numel == 0:
        return np.zeros(spec.shape, dtype=np.float64)
    if spec.dtype == "Bool":
        return random.rand(*spec.shape) > 0.5
    limit = _FLOAT_LIMITS.get(spec.dtype, float(np.finfo(np.float64).max))
    low, high = (float(np.clip(bound, -limit, limit)) for bound in (spec.minimum, spec.maximum))
    if np.isfinite(high - low):
        values = random.uniform(low, high, spec.shape)
    else:  # the whole float64 range: high - low overflows, so interpolate without forming it
        fraction = random.random_sample(spec.shape)
        values = low * (1 - fraction) + high * fraction
    return values if spec.dtype in FLOAT_DTYPES else np.trunc(values)


def load(spec: TensorArg, where: str) -> np.ndarray:
    """The ``.npy`` of a tensor-task argument (``allow_pickle=False``), checked against the recorded shape."""
    path = spec.data_path
    try:
        array = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as error:
        raise InputError(f"{where}: {path} cannot be loaded as a .npy file ({error})") from None
    if not isinstance(array, np.ndarray) or array.dtype.kind not in "biuf":
        raise InputError(f"{where}: {path} holds dtype {getattr(array, 'dtype', type(array).__name__)}; "
                         "expected a numeric or boolean array")
    if tuple(array.shape) != spec.shape:
        raise InputError(f"{where}: {path} has shape {list(array.shape)} but the dump records {list(spec.shape)}")
    return array


def recorded_values(spec: TensorArg, task: str, where: str) -> np.ndarray:
    return regenerate(spec) if task == "statistics" else load(spec, where)


@dataclass
class TensorPair:
    """One recorded tensor given to both frameworks, with the same values in the recorded dtype."""

    spec: TensorArg
    mindspore: mindspore.Tensor
    torch: torch.Tensor


def make_pair(spec: TensorArg, values: np.ndarray) -> TensorPair:
    """``np.asarray``, not ``np.ascontiguousarray``: the latter makes a 0-d tensor (a reduced loss, and so every
    loss's backward input) one of shape [1], whose gradient torch then refuses."""
    torch_tensor = torch.from_numpy(np.asarray(values, order="C")).to(TORCH_DTYPES[spec.dtype])
    exact = torch_tensor.float() if spec.dtype == "BFloat16" else torch_tensor  # numpy has no bfloat16
    mindspore_tensor = mindspore.Tensor(exact.numpy(), dtype=MINDSPORE_DTYPES[spec.dtype])
    return TensorPair(spec, mindspore_tensor, torch_tensor)


def to_float64(value) -> np.ndarray | None:
    """A real MindSpore or torch tensor (or array) as a float64 array; ``None`` for anything else."""
    if isinstance(value, mindspore.Tensor):
        if value.dtype in (mindspore.complex64, mindspore.complex128):
            return None
        return value.astype(mindspore.float64).asnumpy()
    if isinstance(value, torch.Tensor):
        if value.is_complex():
            return None
        return value.detach().to(torch.float64).numpy()
    if isinstance(value, np.ndarray) and value.dtype.kind in "biuf":
        return value.astype(np.float64)
    return None


def dtype_name(value) -> str:
    """msprobe's dtype name of an output (``Float32``, ``Bool``), or the Python type name of a non-tensor."""
    if isinstance(value, mindspore.Tensor):
        return str(value.dtype)
    if isinstance(value, torch.Tensor):
        return _TORCH_DTYPE_NAMES.get(value.dtype, str(value.dtype))
    return type(value).__name__
