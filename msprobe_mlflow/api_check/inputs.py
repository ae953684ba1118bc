"""Recorded tensors made real: regenerated from statistics or loaded from ``.npy``, then given to both frameworks
with identical values.

Values are rounded to the recorded dtype once, by torch (round to nearest even), and MindSpore receives those exact
values, so both frameworks start from the same inputs whatever the dtype (BFloat16 included).
"""
from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

import mindspore
import numpy as np
import torch

from msprobe_mlflow.api_check.parser import FLOAT_DTYPES, TensorArg
from msprobe_mlflow.compat import tensor_version
from msprobe_mlflow.directions import checked_npy_header

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


class InputError(ValueError):
    """A recorded tensor that cannot be made (missing file, wrong shape); the message names the file."""


def regenerate(spec: TensorArg) -> np.ndarray:
    """msprobe's rebuild of a tensor from its statistics: a fresh ``RandomState(42)`` for every tensor, ``rand >
    0.5`` for Bool, otherwise ``uniform(Min, Max)`` in float64, truncated toward zero for integer dtypes. An empty
    tensor (``Max``/``Min`` null) is an empty array.

    A recorded ±Infinity (float dtypes only) is replayed, so that the check sees what the real run saw: the first
    element is +inf when Max is, the last is -inf when Min is (all of them when Max and Min are the same infinity).
    Nothing is known of the finite elements but the finite bound, so an infinite bound is replaced by the other
    one (0 when neither is finite) for them."""
    random = np.random.RandomState(SEED)
    if spec.numel == 0:
        return np.zeros(spec.shape, dtype=np.float64)
    if spec.dtype == "Bool":
        return random.rand(*spec.shape) > 0.5
    if math.isinf(spec.minimum) and spec.minimum == spec.maximum:
        return np.full(spec.shape, spec.minimum)
    finite = [bound for bound in (spec.minimum, spec.maximum) if math.isfinite(bound)] or [0.0]
    low, high = min(finite), max(finite)
    if np.isfinite(high - low):
        values = random.uniform(low, high, spec.shape)
    else:  # bounds near the float64 limits: high - low overflows, so interpolate without forming it
        fraction = random.random_sample(spec.shape)
        values = low * (1 - fraction) + high * fraction
    if spec.maximum == math.inf:
        values.flat[0] = math.inf
    if spec.minimum == -math.inf:
        values.flat[-1] = -math.inf
    return values if spec.dtype in FLOAT_DTYPES else np.trunc(values)


def load(spec: TensorArg, where: str) -> np.ndarray:
    """The ``.npy`` of a tensor-task argument (``allow_pickle=False``), checked against the recorded shape. The
    header is checked against the file's size first: a small file claiming a huge shape is refused before numpy
    allocates what it claims."""
    path = spec.data_path
    try:
        checked_npy_header(path)
    except ValueError as error:
        raise InputError(f"{where}: {error}") from None
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


class InputCache:
    """Tensor pairs already made, by their recorded spec: a dump repeats the same inputs (one layer's calls at
    every step and micro-batch), and a spec fixes the values (the statistics task regenerates them from a fixed
    seed; the tensor task loads the same file), so they are made once. Holds at most ``max_bytes`` of tensors,
    the least recently used dropped first. Each ``pair`` is a new ``TensorPair`` (the checker tells a call's
    arguments apart by identity) over the shared tensors; a torch tensor changed in place since it was made (its
    version counter moved) is made again. Calls that may change their inputs in place get fresh ones
    (``runner`` asks no cache for them)."""

    def __init__(self, max_bytes: int = 256 * 2**20):
        self.max_bytes, self.held_bytes = max_bytes, 0
        self._pairs: OrderedDict[TensorArg, tuple[TensorPair, int]] = OrderedDict()

    def pair(self, spec: TensorArg, task: str, where: str) -> TensorPair:
        cached = self._pairs.get(spec)
        if cached is not None and tensor_version(cached[0].torch) == cached[1]:
            self._pairs.move_to_end(spec)
            return TensorPair(spec, cached[0].mindspore, cached[0].torch)
        pair = make_pair(spec, recorded_values(spec, task, where))
        self._forget(spec)
        size = 2 * pair.torch.nbytes  # the torch tensor and MindSpore's copy
        if size <= self.max_bytes:
            self._pairs[spec] = (pair, tensor_version(pair.torch))
            self.held_bytes += size
            while self.held_bytes > self.max_bytes:
                self._forget(next(iter(self._pairs)))
        return TensorPair(spec, pair.mindspore, pair.torch)

    def _forget(self, spec: TensorArg) -> None:
        dropped = self._pairs.pop(spec, None)
        if dropped is not None:
            self.held_bytes -= 2 * dropped[0].torch.nbytes


def to_float64(value) -> np.ndarray | None:
    """A real MindSpore or torch tensor (or array) as a float64 array; ``None`` for anything else. MindSpore's
    values go to numpy first (bfloat16 as ml_dtypes'), then to float64, exactly: ``Tensor.astype`` takes
    milliseconds a tensor, ``asnumpy`` microseconds."""
    if isinstance(value, mindspore.Tensor):
        if value.dtype in (mindspore.complex64, mindspore.complex128):
            return None
        return value.asnumpy().astype(np.float64)
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
