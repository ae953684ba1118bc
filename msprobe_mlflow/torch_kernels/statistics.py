"""Gradient statistics, computed where the gradients are.

On an accelerator, nothing here reads a value on the host: each dtype's gradients are copied into one reused row
buffer, reduced by whole-buffer ops (compiled into fused kernels on CUDA), every per-parameter number lands in one
float64 result tensor (float32 statistics and integer counts are exact in float64), the sign bits in one packed
uint8 tensor, and both are copied to the host with ``non_blocking`` into pinned memory behind a device event (any
accelerator: ``host_copy.py``). The training thread never waits for the device; the writer thread waits for the
event. On the CPU, the gradients already are on the host: the statistics are computed at once by the numba kernel
of :mod:`msprobe_mlflow.torch_kernels.fused`, on zero-copy views.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from msprobe_mlflow import notices
from msprobe_mlflow.compat import foreach_norm
from msprobe_mlflow.layout import (CHECKSUM, CHECKSUMS, CUMULATIVE_COUNTS, EXPONENT_COUNTS, EXTRA, EXTREMES,
                                   StatisticsLayout, packed_length)
from msprobe_mlflow.levels import Level, recorded_level
from msprobe_mlflow.torch_kernels import fused, md5
from msprobe_mlflow.torch_kernels.host_copy import pinned, start_host_copy as _to_host  # any accelerator, no sync
from msprobe_mlflow.records import StepRecord, record_from_statistics
from msprobe_mlflow.statistics_table import (BIT_WEIGHTS, EXPONENT_BINS, EXPONENT_HIGH, EXPONENT_LOW, NON_FINITE_BIN,
                                             ZERO_BIN, Statistic, byte_padding, extra_statistics, float32_bounds)

_constants: dict[tuple, torch.Tensor] = {}


def _device_constant(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small constant on ``device``, copied once and cached: a per-step host-to-device copy would sync."""
    key = (tuple(values), dtype, str(device))
    if key not in _constants:
        _constants[key] = _copied_to(device, values, dtype)
    return _constants[key]


def _copied_to(device: torch.device, values, dtype: torch.dtype) -> torch.Tensor:
    source = torch.as_tensor(values, dtype=dtype)
    if device.type != "cpu":  # pageable host memory would make the copy synchronous
        source = pinned(source)
    return source.to(device, non_blocking=True)


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """A bool vector whose length is a multiple of 8, packed like ``np.packbits`` (first element, high bit)."""
    weights = _device_constant(BIT_WEIGHTS, torch.uint8, bits.device)
    return (bits.view(-1, 8).to(torch.uint8) * weights).sum(dim=1, dtype=torch.uint8)


def pack_signs(grads: list[torch.Tensor]) -> torch.Tensor:
    """``grad > 0`` of each gradient bit-packed like ``np.packbits``, each padded to a whole byte, concatenated.

    Zero, -0.0 and NaN give 0 bits, as msprobe's ``np.save(grad > 0)``.
    """
    if not grads:
        return torch.zeros(0, dtype=torch.uint8)
    return torch.cat([pack_bits(torch.cat(_padded((g > 0).reshape(-1)))) for g in grads])


def _padded(vector: torch.Tensor) -> list[torch.Tensor]:
    """``vector`` and the zeros that pad it to a whole byte of bits (cached zeros: no kernel per parameter)."""
    padding = byte_padding(vector.numel())
    if not padding:
        return [vector]
    return [vector, _device_constant([0] * padding, vector.dtype, vector.device)]


def launch_step_statistics(names: list[str], grads: list[torch.Tensor], *, rank: int, step: int, level: str | Level,
                           bounds: tuple, directions: bool = True, checksum: str = "md5",
                           extra=(), cache: "StatisticsCache | None" = None) -> Callable[[], StepRecord]:
    """Computes (CPU) or queues (other devices) the statistics of ``grads``; returns the pending step.

    The flat result is laid out as :class:`msprobe_mlflow.layout.StatisticsLayout` says: ``max, min, norm`` per
    parameter (in the gradient's dtype; ``_foreach_norm`` accumulates in float32), then at L2 per parameter the
    counts of ``x <= b`` for each float32 bound and of ``x == 0``. bf16/fp16 are compared in float32, so the
    float32 bounds are not rounded to the gradient's dtype; float64 stays float64, as msprobe compares it.
    Gradients on several devices (CPU offload) are handled per device and merged back into parameter order on the
    writer thread. ``directions=False`` skips the sign bits this step (the record then has none). ``checksum``
    (L0): ``md5``, or ``mix64``, computed where the gradients are (:func:`_row_checksums`) instead of copying
    them to the host for MD5; it takes the device path on the CPU too. MD5 of gradients that are all on the CPU is
    computed here, on the training thread while torch waits (over this rank's cores), reading the gradients in place:
    no model-sized snapshot, and no hashing left to compete with the next steps. ``extra``: the names of opt-in
    statistics (:mod:`msprobe_mlflow.statistics_table`) to compute too. ``cache``: the buffers reused from step to
    step (a monitor's own; None: made for this call only).
    """
    if checksum not in CHECKSUMS:
        raise ValueError(f"checksum = {checksum!r} is not accepted; expected one of {', '.join(CHECKSUMS)}")
    level = recorded_level(level)  # a name, or a level with the opt-in exponents
    recorded = level if directions else dataclasses.replace(level, has_directions=False)
    device_checksum = checksum == "mix64" and recorded.has_md5
    bounds32, statistics = float32_bounds(bounds), extra_statistics(extra)
    cache = cache or StatisticsCache()
    by_device: dict[torch.device, list[int]] = {}
    if grads and all(grad.is_cpu for grad in grads):  # the usual CPU case, without a device object per gradient
        by_device[torch.device("cpu")] = list(range(len(grads)))
    else:
        for index, grad in enumerate(grads):
            by_device.setdefault(grad.device, []).append(index)
    digests = None
    if recorded.has_md5 and not device_checksum and list(by_device) == [torch.device("cpu")]:
        digests = md5.md5_digests(grads)  # in place, before the optimizer writes
        recorded = dataclasses.replace(recorded, has_md5=False)  # so no snapshot is taken
    pending = [(indices, _launch_group([grads[i] for i in indices], recorded, bounds32, device_checksum, statistics,
                                           cache))
               for indices in by_device.values()]

    def resolve() -> StepRecord:
        parts = [(indices, collect()) for indices, collect in pending]
        if len(parts) == 1:  # the usual case: one device
            statistics, signs, float32_values = parts[0][1]
        else:
            layout = StatisticsLayout(recorded, bounds, [g.numel() for g in grads], device_checksum, extra)
            statistics, signs, float32_values = layout.merge(parts)
        record = record_from_statistics(rank=rank, step=step, level=level, bounds=bounds, names=names,
                                        shapes=[g.shape for g in grads], statistics=statistics, signs=signs,
                                        float32_values=float32_values, checksum=device_checksum,
                                        directions=directions, md5=digests, extra=extra)
        for _, (_, _, snapshot) in parts:  # hashed: the host snapshots can serve the next steps
            cache.release_snapshot(snapshot)
        return record

    return resolve


def _launch_group(grads: list[torch.Tensor], level: Level, bounds32, checksum: bool = False,
                  extra: tuple[Statistic, ...] = (), cache: "StatisticsCache | None" = None) -> Callable[[], tuple]:
    """Statistics of gradients that share a device: computed now on the CPU, queued on an accelerator."""
    if grads[0].device.type == "cpu" and not checksum:
        computed = _host_statistics(grads, level, bounds32, extra, cache)
        return lambda: computed
    return _device_statistics(grads, foreach_norm(grads), level, bounds32, checksum, extra, cache)


def _refuse_non_floating(grad: torch.Tensor) -> None:
    if not grad.is_floating_point():
        raise TypeError(f"gradient dtype {grad.dtype} has no max/min/sign statistics; expected a real floating type")


def _comparable(grad: torch.Tensor) -> torch.Tensor:
    _refuse_non_floating(grad)
    return grad if grad.dtype in (torch.float32, torch.float64) else grad.float()


def _host_array(grad: torch.Tensor) -> np.ndarray:
    """A CPU gradient as a flat numpy array, a zero-copy view where it is contiguous (bf16/fp16 as float32).
    Called once per gradient per step: no call it can do without (a gradient seldom requires grad)."""
    grad = grad if grad.dtype in (torch.float32, torch.float64) else _comparable(grad)
    return (grad.detach() if grad.requires_grad else grad).numpy().reshape(-1)


_READ_IN_PLACE = {torch.float32, torch.float64}


def _host_statistics(grads, level, bounds32, extra: tuple[Statistic, ...] = (),
                     cache: "StatisticsCache | None" = None):
    """The CPU path: :mod:`msprobe_mlflow.torch_kernels.fused` reads each gradient once where it lies (bf16 and fp16
    are compared in float32, non-contiguous gradients in a contiguous copy), computing max, min, the norm, the L2
    counts and the sign bits together. The norms it cannot give bit for bit as torch's (bf16/fp16/float64,
    non-contiguous) come from torch. Opt-in ``extra`` statistics are their numpy reference, one more read each."""
    cache = cache or StatisticsCache()
    dtypes = {g.dtype for g in grads}
    in_place = dtypes <= _READ_IN_PLACE and all(map(torch.Tensor.is_contiguous, grads))
    readable = grads if in_place else [_comparable(g).contiguous() for g in grads]  # held until the kernel is done
    located = fused.Located.of_tensors(readable, float64=torch.float64 in dtypes)
    layout = cache.layout(level, bounds32, located.sizes, [s.name for s in extra])
    signs = np.empty(layout.signs_length, np.uint8) if level.has_directions else None
    maxima, minima, counts, norms, exponents = fused.located_statistics(
        located, bounds32, with_counts=level.has_buckets, with_signs=level.has_directions,
        sign_offsets=layout.sign_offsets(), signs=signs, with_norms=True, with_exponents=level.has_exponents)
    by_torch = np.isnan(norms)
    if not in_place:
        by_torch |= ~np.fromiter((g.dtype is torch.float32 and g.is_contiguous() for g in grads), bool, len(grads))
    if by_torch.any():  # torch's own kernel, in the gradient's dtype
        at = np.flatnonzero(by_torch)
        norms[at] = torch.stack(foreach_norm([grads[i] for i in at])).float().numpy()
    head = np.column_stack([maxima.astype(np.float32), minima.astype(np.float32), norms]).astype(np.float64)
    sections = {EXTREMES: head, CUMULATIVE_COUNTS: counts, EXPONENT_COUNTS: exponents}
    arrays = [_host_array(g) for g in readable] if extra or level.has_md5 else []
    if extra:
        sections[EXTRA] = np.array([[s.reduce(array) for s in extra] for array in arrays])
    statistics = np.concatenate(layout.in_order(sections))
    float32_values = None
    if level.has_md5:  # a snapshot: the optimizer may change the gradients before the writer hashes them
        float32_values = cache.snapshot_buffer(layout.values_length)
        for array, piece in zip(arrays, layout.value_slices()):
            float32_values[piece] = array
    return statistics, signs, float32_values


class StatisticsCache:
    """What one monitor's statistics keep from step to step: the gradient-sized row buffers of the device path and
    the model-sized L0 host snapshots. Owned by the monitor, made as its first steps need them, and dropped at its
    ``stop()`` (:meth:`release`): nothing gradient-sized outlives a monitor, and two monitors never share one. (The
    few-byte device constants of :func:`_device_constant` are shared by all: no gradient memory.)"""

    SNAPSHOTS_KEPT = 2  # one hashed by the writer while the next step fills the other
    ROW_BUFFERS_KEPT = 8  # shapes that change every step (rare) must not pile up buffers

    def __init__(self):
        self.row_buffers: dict[tuple, _RowBuffer] = {}
        self.free_snapshots: list[np.ndarray] = []
        self._layout: tuple[tuple, StatisticsLayout] | None = None  # the last step's, and what made it

    def layout(self, level: Level, bounds, numels: np.ndarray, extra) -> StatisticsLayout:
        """The step's :class:`StatisticsLayout`, made once for a model's gradients (a few microseconds per
        gradient) and then found by its numbers."""
        key = (level, tuple(map(float, bounds)), numels.tobytes(), tuple(extra))
        if self._layout is None or self._layout[0] != key:
            self._layout = (key, StatisticsLayout(level, bounds, numels.tolist(), extra=extra))
        return self._layout[1]

    def snapshot_buffer(self, size: int) -> np.ndarray:
        """A float32 buffer of ``size`` elements for an L0 snapshot: a view of a buffer the writer has hashed (see
        :meth:`release_snapshot`) when one is large enough; a fresh buffer of the model's size costs page faults
        worth hundreds of milliseconds, seconds on some virtual machines."""
        for index, buffer in enumerate(self.free_snapshots):
            if buffer.size >= size:
                return self.free_snapshots.pop(index)[:size]
        return np.empty(size, np.float32)

    def release_snapshot(self, buffer: np.ndarray | None) -> None:
        """Hands back a hashed snapshot for the next steps."""
        if buffer is not None and len(self.free_snapshots) < self.SNAPSHOTS_KEPT:
            self.free_snapshots.append(buffer if buffer.base is None else buffer.base)

    def row_buffer(self, grads: list[torch.Tensor]) -> "_RowBuffer":
        """The row buffer of these gradients' device, dtype and shapes, made once."""
        key = (grads[0].device, grads[0].dtype, tuple(tuple(g.shape) for g in grads))
        if key not in self.row_buffers:
            if len(self.row_buffers) >= self.ROW_BUFFERS_KEPT:
                self.row_buffers.clear()
            self.row_buffers[key] = _RowBuffer.of(grads)
        return self.row_buffers[key]

    def release(self) -> None:
        self.row_buffers.clear()
        self.free_snapshots.clear()
        self._layout = None

    def nbytes(self) -> int:
        """The bytes :meth:`release` frees (each row buffer's tensors; its ``targets`` are views of ``flat``)."""
        tensors = [getattr(buffer, f.name) for buffer in self.row_buffers.values()
                   for f in dataclasses.fields(buffer) if f.name != "targets"]
        return sum(t.nbytes for t in tensors if isinstance(t, torch.Tensor)) + \
            sum(b.nbytes for b in self.free_snapshots)


ROW = 512  # elements: the device buffer's rows; each gradient starts a row, so a row's statistics are one gradient's


@dataclass
class _RowBuffer:
    """A flat buffer that holds one step's gradients of one dtype, each starting a row of ``ROW`` elements,
    allocated once for a set of gradient sizes and reused every step (with the constants that describe it)."""

    flat: torch.Tensor
    targets: list[torch.Tensor]  # each gradient's place in ``flat``, in its shape
    row_valid: torch.Tensor  # int32 per row: how many of its elements belong to a gradient (the rest is padding)
    row_counts: torch.Tensor  # int64 per gradient: its rows (for segment_reduce)
    row_owner: torch.Tensor  # int64 per row: its gradient (for scatter_reduce_ and index_add_)
    row_first_index: torch.Tensor  # int64 per row: the index in its gradient of the row's first element
    empty: torch.Tensor  # bool per gradient
    starts: list[int]  # where each gradient starts in ``flat``

    @classmethod
    def of(cls, grads: list[torch.Tensor]) -> "_RowBuffer":
        numels = [g.numel() for g in grads]
        rows = [-(-n // ROW) for n in numels]
        starts = np.concatenate([[0], np.cumsum(rows)[:-1]]).astype(np.int64) * ROW
        flat = torch.empty(sum(rows) * ROW, dtype=grads[0].dtype, device=grads[0].device)
        valid = np.concatenate([np.minimum(ROW, n - ROW * np.arange(r)) for n, r in zip(numels, rows)] + [[]])
        return cls(
            flat=flat, targets=[flat[start:start + n].view(g.shape) for start, n, g in zip(starts, numels, grads)],
            row_valid=_copied_to(flat.device, valid.astype(np.int32), torch.int32),
            row_counts=_copied_to(flat.device, rows, torch.int64),
            row_owner=_copied_to(flat.device, np.repeat(np.arange(len(rows)), rows), torch.int64),
            row_first_index=_copied_to(flat.device, np.concatenate([np.arange(r) * ROW for r in rows] + [[]]),
                                       torch.int64),
            empty=_copied_to(flat.device, [n == 0 for n in numels], torch.bool),
            starts=[int(start) for start in starts])


_SPLITMIX64 = [c - (1 << 64) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB)]  # as int64


def _logical_shift_right(words: torch.Tensor, bits: int) -> torch.Tensor:
    return (words >> bits) & ((1 << (64 - bits)) - 1)  # torch shifts int64 arithmetically


def _row_checksums(flat: torch.Tensor, valid: torch.Tensor, row_first_index: torch.Tensor) -> torch.Tensor:
    """Per row, the sum modulo 2**64 of ``splitmix64(w + (i + 1) * 0x9E3779B97F4A7C15)`` over its elements, ``w``
    the unsigned bits of the element's float32 value and ``i`` its index in the gradient (C order): summed per
    gradient, the ``mix64`` checksum. Integer sums are exact in any order, so every device gives the same
    number; a changed element or two swapped ones change it (unless by a 2**-64 chance). Not cryptographic."""
    words = flat.view(-1, ROW).float().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    index = row_first_index[:, None] + torch.arange(1, ROW + 1, device=flat.device)
    mixed = words + index * _SPLITMIX64[0]
    mixed = (mixed ^ _logical_shift_right(mixed, 30)) * _SPLITMIX64[1]
    mixed = (mixed ^ _logical_shift_right(mixed, 27)) * _SPLITMIX64[2]
    mixed = mixed ^ _logical_shift_right(mixed, 31)
    return torch.where(valid, mixed, 0).sum(dim=1)


def _order_keys(words: torch.Tensor) -> torch.Tensor:
    """Integers that order as the float32/float64 whose bits are ``words`` (int32/int64) do, -0.0 just below +0.0
    (as the CPU kernel's keys: max and min then agree with it on signed zeros); the function is its own inverse."""
    return words ^ ((words >> (words.element_size() * 8 - 1)) & torch.iinfo(words.dtype).max)


def _row_statistics(flat: torch.Tensor, row_valid: torch.Tensor, row_first_index: torch.Tensor, bounds: tuple,
                    with_counts: bool, with_signs: bool, with_checksum: bool, extra: tuple = (),
                    with_exponents: bool = False) -> tuple:
    """Per row of ``flat`` (``ROW`` elements, the first ``row_valid`` of them a gradient's): max and min (as
    :func:`_order_keys`), whether it holds a NaN, the counts of ``x <= b`` per bound and of ``x == 0`` (float64),
    the packed ``x > 0`` bits, :func:`_row_checksums`, each ``extra`` statistic's reduction (float64, one
    column each) and every element's exponent bin (int16, :func:`exponent_bins`). The same few whole-buffer ops
    whatever the number of gradients."""
    rows = flat.view(-1, ROW)
    rows = rows if rows.dtype == torch.float64 else rows.float()  # bf16/fp16 compare in float32, exactly
    valid = torch.arange(ROW, device=flat.device) < row_valid[:, None]
    keys = _order_keys(rows.view(torch.int32 if rows.dtype == torch.float32 else torch.int64))
    limits = torch.iinfo(keys.dtype)
    maxima = torch.where(valid, keys, limits.min).amax(dim=1)
    minima = torch.where(valid, keys, limits.max).amin(dim=1)
    has_nan = (valid & rows.isnan()).any(dim=1)
    counts = None
    if with_counts:
        counts = torch.stack([(valid & (rows <= bound)).sum(dim=1, dtype=torch.float64) for bound in bounds]
                             + [(valid & (rows == 0)).sum(dim=1, dtype=torch.float64)], dim=1)
    bits = None
    if with_signs:
        weights = _device_constant(BIT_WEIGHTS, torch.uint8, flat.device)
        positive = (valid & (rows > 0)).view(rows.shape[0], ROW // 8, 8).to(torch.uint8)
        bits = (positive * weights).sum(dim=2, dtype=torch.uint8).reshape(-1)
    checksums = _row_checksums(flat, valid, row_first_index) if with_checksum else None
    extras = torch.stack([_row_reduction(statistic, rows, valid) for statistic in extra], dim=1) if extra else None
    bins = exponent_bins(rows).to(torch.int16) if with_exponents else None
    return maxima, minima, has_nan, counts, bits, checksums, extras, bins


EXPONENT_CHUNK_ROWS = 1 << 16  # rows whose exponents are counted together: a bounded temporary (32M elements)


def exponent_bins(values: torch.Tensor) -> torch.Tensor:
    """Each element's exponent bin (:func:`msprobe_mlflow.statistics_table.exponent_counts`), int64, from its IEEE
    fields by whole-tensor ops; a float32 subnormal ``m * 2**-149`` sits at ``-149 + floor(log2 m)``, read from
    ``m`` converted to float32 exactly. Anything but float64 is compared in float32."""
    if values.dtype == torch.float64:
        words, shift, mask, bias, magnitude = values.view(torch.int64), 52, 0x7FF, 1023, (1 << 63) - 1
    else:
        words, shift, mask, bias, magnitude = values.float().view(torch.int32).long(), 23, 0xFF, 127, (1 << 31) - 1
    biased = (words >> shift) & mask
    bins = (biased - (bias + EXPONENT_LOW)).clamp(0, EXPONENT_HIGH - EXPONENT_LOW)
    if shift == 23:  # float64's subnormals are all below 2**-150: the lowest bin, as clamped
        mantissa = (words & 0x7FFFFF).float().view(torch.int32).long()
        bins = torch.where(biased == 0, ((mantissa >> 23) & 0xFF) - 127 - 149 - EXPONENT_LOW, bins)
    bins = torch.where(biased == mask, NON_FINITE_BIN, bins)
    return torch.where((words & magnitude) == 0, ZERO_BIN, bins)


def count_into(counts: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Adds 1 to ``counts`` (int64) at every ``index``: ``scatter_add_``, which needs no host sync (``bincount``
    reads the largest index on the host)."""
    ones = torch.ones((), dtype=torch.int64, device=counts.device).expand(index.numel())
    return counts.scatter_add_(0, index.reshape(-1), ones)


def _gradient_exponent_counts(buffer: "_RowBuffer", bins: torch.Tensor, gradients: int) -> torch.Tensor:
    """Each gradient's exponent counts (float64, ``(gradients, EXPONENT_BINS)``) from its rows' ``bins`` (int16,
    from :func:`_row_statistics`): every element's bin and its gradient make one index (:func:`count_into`), a
    bounded number of rows at a time; padding goes to one more bin, dropped."""
    counts = torch.zeros(gradients * EXPONENT_BINS + 1, dtype=torch.int64, device=bins.device)
    lane = torch.arange(ROW, device=bins.device)
    for first in range(0, bins.shape[0], EXPONENT_CHUNK_ROWS):
        chunk = slice(first, first + EXPONENT_CHUNK_ROWS)
        index = buffer.row_owner[chunk, None] * EXPONENT_BINS + bins[chunk]
        count_into(counts, torch.where(lane < buffer.row_valid[chunk, None], index, gradients * EXPONENT_BINS))
    return counts[:-1].view(gradients, EXPONENT_BINS).double()


_NEUTRAL = {"sum": 0.0, "max": -math.inf, "min": math.inf}  # what padding contributes to each reduction


def _row_reduction(statistic: Statistic, rows: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """An opt-in statistic per row: its element map, then its reduction over the valid elements, in float64."""
    mapped = torch.where(valid, statistic.element(rows).double(), _NEUTRAL[statistic.reduction])
    return {"sum": mapped.sum, "max": mapped.amax, "min": mapped.amin}[statistic.reduction](dim=1)


COMPILED_DEVICES = frozenset({"cuda"})  # device types where torch.compile fuses _row_statistics into a read or two
_compiled: dict[str, Callable] = {}
_compile_failed: set[str] = set()  # device types where torch.compile failed in this process: eager from then on


def _fused_row_statistics(flat: torch.Tensor, *args) -> tuple:
    """:func:`_row_statistics`, compiled (once per device type; the first probed step pays the compilation) where
    ``COMPILED_DEVICES`` says; eager elsewhere, and from the first compilation failure on (``_compile_failed``),
    with one warning."""
    device = flat.device.type
    if device not in COMPILED_DEVICES or device in _compile_failed:
        return _row_statistics(flat, *args)
    try:
        if device not in _compiled:
            _compiled[device] = torch.compile(_row_statistics, dynamic=True)
        return _compiled[device](flat, *args)
    except Exception as e:  # a missing compiler or an unsupported device must not cost the statistics
        _compile_failed.add(device)
        notices.warn(f"torch.compile of the {device} statistics failed ({e!r}); using eager torch ops, several "
                     f"reads of each gradient per step")
        return _row_statistics(flat, *args)


def _device_statistics(grads, norms, level, bounds32, checksum: bool = False,
                       extra: tuple[Statistic, ...] = (), cache: StatisticsCache | None = None) -> Callable[[], tuple]:
    """Any other device: the gradients of each dtype are copied into one reused buffer (one ``_foreach_copy_``),
    reduced per row by :func:`_row_statistics`, then per gradient over its rows (``segment_reduce``,
    ``scatter_reduce_``); each
    result is copied to the host asynchronously. The ops dispatched per step do not grow with the number of
    gradients. Each gradient's packed signs (and L0 values) are cut out of its rows on the writer thread."""
    layout = StatisticsLayout(level, bounds32, [g.numel() for g in grads], checksum, [s.name for s in extra])
    cache = cache or StatisticsCache()
    groups: dict[torch.dtype, list[int]] = {}
    for index, grad in enumerate(grads):
        _refuse_non_floating(grad)
        groups.setdefault(grad.dtype, []).append(index)
    pending = [_queue_dtype_group(grads, indices, norms, level, bounds32, checksum, extra, cache, layout)
               for indices in groups.values()]

    def cut(flat: np.ndarray, indices: list[int], starts: list[int], length: Callable[[int], int]) -> np.ndarray:
        """Each gradient's piece of a buffer laid out in rows, concatenated (padding left out)."""
        pieces = [flat[start:start + length(grads[i].numel())] for i, start in zip(indices, starts)]
        return np.concatenate([np.zeros(0, flat.dtype), *pieces])

    def collect() -> tuple:
        parts = []
        for indices, starts, statistics, signs, values in pending:
            packed = cut(signs(), indices, [s // 8 for s in starts], packed_length) if signs else None
            flat = cut(values(), indices, starts, int) if values else None
            parts.append((indices, (statistics(), packed, flat)))
        return layout.merge(parts)

    return collect


def _queue_dtype_group(grads, indices: list[int], norms, level, bounds32, checksum: bool,
                       extra: tuple[Statistic, ...], cache: StatisticsCache, layout: StatisticsLayout) -> tuple:
    """The gradients of one dtype (``indices``): copied into their row buffer, reduced, and their results' copies
    to the host started. Returns what ``collect`` reads back: the indices, where each gradient starts in the
    buffer, and the pending statistics, signs and L0 values."""
    members = [grads[i] for i in indices]
    buffer = cache.row_buffer(members)
    torch._foreach_copy_(buffer.targets, members)
    maxima, minima, has_nan, counts, bits, checksums, extras, bins = _fused_row_statistics(
        buffer.flat, buffer.row_valid, buffer.row_first_index, tuple(map(float, bounds32)), level.has_buckets,
        level.has_directions, checksum, extra, level.has_exponents)
    sections = _gradient_sections(buffer, indices, norms, extra, maxima, minima, has_nan, counts, checksums, extras)
    if bins is not None:
        sections[EXPONENT_COUNTS] = _gradient_exponent_counts(buffer, bins, len(indices))
    statistics = _to_host(torch.cat(layout.subset(indices).in_order(sections)))
    signs = _to_host(bits) if bits is not None else None
    values = None
    if level.has_md5 and not checksum:  # copied on the CPU: a host view would see the next step refill it
        values = _to_host(buffer.flat.to(torch.float32, copy=buffer.flat.device.type == "cpu"))
    return indices, buffer.starts, statistics, signs, values


def _gradient_sections(buffer: _RowBuffer, indices: list[int], norms, extra: tuple[Statistic, ...], maxima, minima,
                       has_nan, counts, checksums, extras) -> dict:
    """The layout's sections of one row buffer's gradients, on the device: each row statistic reduced over its
    gradient's rows by whole-buffer ops, so that their number does not grow with the gradients'."""
    nan = torch.full((), math.nan, dtype=torch.float64, device=buffer.flat.device)
    undefined = buffer.empty | (_per_gradient(buffer, has_nan.double(), "max") > 0)  # NaN propagates, as in np.max
    extremes = torch.stack([_gradient_extreme(buffer, len(indices), maxima, "amax", undefined, nan),
                            _gradient_extreme(buffer, len(indices), minima, "amin", undefined, nan),
                            torch.stack([norms[i] for i in indices]).float().double()], dim=1)
    sections = {EXTREMES: extremes}
    if counts is not None:
        sections[CUMULATIVE_COUNTS] = _per_gradient(buffer, counts, "sum")
    if checksums is not None:  # as two exact float64 halves
        sums = torch.zeros(len(indices), dtype=torch.int64, device=checksums.device)
        sums.index_add_(0, buffer.row_owner, checksums)
        sections[CHECKSUM] = torch.stack([(sums >> 32) & 0xFFFFFFFF, sums & 0xFFFFFFFF], dim=1).double()
    if extras is not None:  # an empty gradient has no rows: its max and min are NaN
        sections[EXTRA] = torch.stack([
            torch.where(buffer.empty, 0.0 if s.reduction == "sum" else nan,
                        _per_gradient(buffer, extras[:, i], s.reduction))
            for i, s in enumerate(extra)], dim=1)
    return sections


def _per_gradient(buffer: _RowBuffer, rows: torch.Tensor, reduction: str) -> torch.Tensor:
    """A row statistic reduced over each gradient's rows (its rows are contiguous: one segment each)."""
    return torch.segment_reduce(rows, reduction, lengths=buffer.row_counts, axis=0, unsafe=True)


def _gradient_extreme(buffer: _RowBuffer, gradients: int, row_keys: torch.Tensor, reduction: str,
                      undefined: torch.Tensor, nan: torch.Tensor) -> torch.Tensor:
    """Each gradient's max or min from its rows' order keys (:func:`_order_keys`), as the float32 msprobe writes;
    NaN where the gradient is empty or holds a NaN."""
    keys = torch.zeros(gradients, dtype=row_keys.dtype, device=nan.device).scatter_reduce_(
        0, buffer.row_owner, row_keys, reduction, include_self=False)
    values = _order_keys(keys).view(torch.float32 if keys.dtype == torch.int32 else torch.float64)
    return torch.where(undefined, nan, values.float().double())  # float32, as msprobe writes
