"""Gradient statistics, computed where the gradients are.

On an accelerator, nothing here reads a value on the host: every per-parameter number lands in one float64
result tensor (float32 statistics and integer counts are exact in float64), the sign bits in one packed uint8
tensor, and both are copied to the host with ``non_blocking`` into pinned memory behind a CUDA event. The
training thread never waits for the device; the writer thread waits for the event. On the CPU, the gradients
already are on the host: the statistics are computed at once with numpy on zero-copy views.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable

import numpy as np
import torch

from msprobe_mlflow.layout import CUMULATIVE_COUNTS, EXTREMES, StatisticsLayout
from msprobe_mlflow.levels import LEVELS, Level
from msprobe_mlflow.records import StepRecord, record_from_statistics

_BIT_WEIGHTS = (128, 64, 32, 16, 8, 4, 2, 1)  # np.packbits order: first element in the high bit


def _to_host(tensor: torch.Tensor) -> Callable[[], np.ndarray]:
    """Starts the device-to-host copy; the returned callable waits for it (on the writer thread)."""
    if tensor.device.type == "cpu":
        return tensor.numpy
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=torch.cuda.is_available())
    host.copy_(tensor, non_blocking=True)
    if tensor.device.type == "cuda":
        event = torch.cuda.Event()
        event.record()

        def wait() -> np.ndarray:
            event.synchronize()
            return host.numpy()
        return wait
    if hasattr(torch, "accelerator"):
        torch.accelerator.synchronize()  # other accelerators: correct first, a synchronisation point
    return host.numpy


_constants: dict[tuple, torch.Tensor] = {}


def _device_constant(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small constant on ``device``, copied once and cached: a per-step host-to-device copy would sync."""
    key = (tuple(values), dtype, str(device))
    if key not in _constants:
        source = torch.tensor(values, dtype=dtype)
        if device.type == "cuda":  # pageable host memory would make the copy synchronous
            source = source.pin_memory()
        _constants[key] = source.to(device, non_blocking=True)
    return _constants[key]


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """A bool vector whose length is a multiple of 8, packed like ``np.packbits`` (first element, high bit)."""
    weights = _device_constant(_BIT_WEIGHTS, torch.uint8, bits.device)
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
    padding = -vector.numel() % 8
    if not padding:
        return [vector]
    return [vector, _device_constant([0] * padding, vector.dtype, vector.device)]


def launch_step_statistics(names: list[str], grads: list[torch.Tensor], *, rank: int, step: int, level: str,
                           bounds: tuple, directions: bool = True) -> Callable[[], StepRecord]:
    """Computes (CPU) or queues (other devices) the statistics of ``grads``; returns the pending step.

    The flat result is laid out as :class:`msprobe_mlflow.layout.StatisticsLayout` says: ``max, min, norm`` per
    parameter (in the gradient's dtype; ``_foreach_norm`` accumulates in float32), then at L2 per parameter the
    counts of ``x <= b`` for each float32 bound and of ``x == 0``. bf16/fp16 are compared in float32, so the
    float32 bounds are not rounded to the gradient's dtype; float64 stays float64, as msprobe compares it.
    Gradients on several devices (CPU offload) are handled per device and merged back into parameter order on the
    writer thread. ``directions=False`` (the always-on tier's statistics-only steps) computes and copies no sign
    bits, at any level: the record then carries none.
    """
    recorded = LEVELS[level] if directions else dataclasses.replace(LEVELS[level], has_directions=False)
    layout = StatisticsLayout(recorded, bounds, [g.numel() for g in grads])
    bounds32 = [np.float32(b) for b in bounds]
    by_device: dict[torch.device, list[int]] = {}
    for index, grad in enumerate(grads):
        by_device.setdefault(grad.device, []).append(index)
    pending = [(indices, _launch_group([grads[i] for i in indices], layout.level, bounds32))
               for indices in by_device.values()]

    def resolve() -> StepRecord:
        parts = [(indices, collect()) for indices, collect in pending]
        if len(parts) == 1:  # the usual case: one device
            statistics, signs, float32_values = parts[0][1]
        else:
            statistics, signs, float32_values = layout.merge(parts)
        record = record_from_statistics(rank=rank, step=step, level=level, bounds=bounds, names=names,
                                        shapes=[g.shape for g in grads], statistics=statistics, signs=signs,
                                        float32_values=float32_values, directions=directions)
        for _, (_, _, snapshot) in parts:  # hashed: the host snapshots can serve the next steps
            release_snapshot(snapshot)
        return record

    return resolve


def _launch_group(grads: list[torch.Tensor], level: Level, bounds32) -> Callable[[], tuple]:
    """Statistics of gradients that share a device: computed now on the CPU, queued on an accelerator."""
    norms = torch._foreach_norm(grads)
    if grads[0].device.type == "cpu":
        computed = _host_statistics(grads, norms, level, bounds32)
        return lambda: computed
    return _device_statistics(grads, norms, level, bounds32)


def _comparable(grad: torch.Tensor) -> torch.Tensor:
    if not grad.is_floating_point():
        raise TypeError(f"gradient dtype {grad.dtype} has no max/min/sign statistics; expected a real floating type")
    return grad if grad.dtype in (torch.float32, torch.float64) else grad.float()


HOST_BLOCK = 1 << 17  # elements (512 KB of float32): all passes over a block run from the CPU cache


def _host_statistics(grads, norms, level, bounds32):
    """The CPU path, in numpy on zero-copy views, block by block.

    The gradients are walked as one virtual vector (each followed by zeros up to a whole byte, as the packed
    directions are laid out) in blocks of ``HOST_BLOCK`` elements: max, min, the L2 counts and the sign bits of
    a block are all computed while it sits in the cache, so memory is read about once instead of once per
    statistic (about 2.4x faster here on a 16M-element gradient), and small gradients share a block, reduced
    with ``reduceat``, instead of paying numpy's per-call cost each.
    """
    arrays = [_comparable(g).detach().numpy().reshape(-1) for g in grads]
    layout = StatisticsLayout(level, bounds32, [a.size for a in arrays])
    maxima, minima = np.full(len(arrays), -np.inf), np.full(len(arrays), np.inf)
    counts = np.zeros((len(arrays), len(bounds32) + 1), np.int64)
    signs = np.empty(layout.signs_length, np.uint8) if level.has_directions else None
    for block, pieces, sign_offset in _host_blocks(arrays):
        owners = [owner for owner, _, _ in pieces]
        if len(pieces) == 1:  # a slice of a large gradient: plain reductions (reduceat on bools is slow)
            (_, start, length), = pieces
            values = block[start:start + length]
            with np.errstate(invalid="ignore"):
                maxima[owners] = np.maximum(maxima[owners], values.max())
                minima[owners] = np.minimum(minima[owners], values.min())
            if level.has_buckets:
                counts[owners] += [np.count_nonzero(values <= bound) for bound in bounds32] \
                    + [np.count_nonzero(values == 0)]
        else:  # small gradients: reduceat over (piece, gap) segments; a trailing zero ends the last gap
            edges = [edge for _, start, length in pieces for edge in (start, start + length)]
            extended = np.append(block, block.dtype.type(0))
            with np.errstate(invalid="ignore"):  # NaN propagates, as msprobe's max/min do
                np.maximum.at(maxima, owners, np.maximum.reduceat(extended, edges)[0::2])
                np.minimum.at(minima, owners, np.minimum.reduceat(extended, edges)[0::2])
            if level.has_buckets:
                for column, mask in enumerate([extended <= bound for bound in bounds32] + [extended == 0]):
                    np.add.at(counts[:, column], owners, np.add.reduceat(mask, edges, dtype=np.int64)[0::2])
        if signs is not None:
            bits = np.packbits(block > 0)
            signs[sign_offset:sign_offset + bits.size] = bits
    empty = np.array([a.size == 0 for a in arrays], bool)
    maxima[empty] = minima[empty] = np.nan
    norm_values = torch.stack(norms).float().numpy() if norms else np.zeros(0, np.float32)
    head = np.column_stack([maxima.astype(np.float32), minima.astype(np.float32), norm_values]).astype(np.float64)
    statistics = np.concatenate(layout.in_order({EXTREMES: head, CUMULATIVE_COUNTS: counts}))
    float32_values = None
    if level.has_md5:  # a snapshot: the optimizer may change the gradients before the writer hashes them
        float32_values = _snapshot_buffer(layout.values_length)
        for array, piece in zip(arrays, layout.value_slices()):
            float32_values[piece] = array
    return statistics, signs, float32_values


_free_snapshots: list[np.ndarray] = []


def _snapshot_buffer(size: int) -> np.ndarray:
    """A float32 buffer for an L0 snapshot, reused once the writer has hashed it (see ``release_snapshot``):
    a fresh buffer of the model's size each step costs page faults worth hundreds of milliseconds."""
    for index, buffer in enumerate(_free_snapshots):
        if buffer.size == size:
            return _free_snapshots.pop(index)
    return np.empty(size, np.float32)


def release_snapshot(buffer: np.ndarray | None) -> None:
    if buffer is not None and len(_free_snapshots) < 2:
        _free_snapshots.append(buffer)


def _host_blocks(arrays):
    """Yields ``(block, pieces, sign_offset)``: a block of the padded virtual vector, the ``(parameter, start,
    length)`` of each gradient piece in it, and where its packed bits go. Pieces of one gradient start at
    multiples of 8 elements, so each block packs into whole bytes."""
    pending, size, sign_offset = [], 0, 0
    for owner, array in enumerate(arrays):
        for low in range(0, array.size, HOST_BLOCK):
            piece = array[low:low + HOST_BLOCK]
            padding = -(low + piece.size) % 8 if low + piece.size == array.size else 0
            pending.append((owner, piece, padding))
            size += piece.size + padding
            if size >= HOST_BLOCK:
                yield (*_joined(pending), sign_offset)
                pending, sign_offset, size = [], sign_offset + size // 8, 0
    if pending:
        yield (*_joined(pending), sign_offset)


def _joined(pending) -> tuple[np.ndarray, list[tuple[int, int, int]]]:
    """One piece without padding stays a zero-copy view; several are copied into one small block."""
    (owner, piece, padding), *others = pending
    if not others and not padding:
        return piece, [(owner, 0, piece.size)]
    parts, pieces, position = [], [], 0
    for owner, piece, padding in pending:
        pieces.append((owner, position, piece.size))
        parts += [piece, np.zeros(padding, piece.dtype)]
        position += piece.size + padding
    return np.concatenate(parts), pieces


SMALL_TENSOR = 1 << 16  # elements: below this, kernel launches cost more than the data; batch such tensors
CHUNK = 1 << 24  # elements per batch, so float32 counts of a segment stay exact


def _device_statistics(grads, norms, level, bounds32) -> Callable[[], tuple]:
    """Any other device: torch ops that stay on it, one asynchronous copy of each result to the host.

    Large gradients are reduced one by one; small ones are batched, by dtype, into chunks of one padded flat
    vector reduced with ``segment_reduce``, so a model of many small tensors costs a few kernels per chunk,
    not several per tensor. Each block's results are merged back into parameter order on the writer thread.
    """
    layout = StatisticsLayout(level, bounds32, [g.numel() for g in grads])
    blocks = [[i] for i, g in enumerate(grads) if g.numel() >= SMALL_TENSOR]
    blocks += _small_chunks(grads, [i for i, g in enumerate(grads) if g.numel() < SMALL_TENSOR])
    statistics, signs = [], []
    for indices in blocks:
        members = [grads[i] for i in indices]
        reduce = _large_gradient_statistics if members[0].numel() >= SMALL_TENSOR else _small_chunk_statistics
        rows, bits = reduce(members, level, bounds32)  # rows: (max, min, [counts]) x parameters
        norm = torch.stack([norms[i] for i in indices]).float().double()  # float32, as msprobe writes
        extremes = torch.stack([rows[0], rows[1], norm], dim=1)
        statistics.append(torch.cat(layout.in_order({EXTREMES: extremes, CUMULATIVE_COUNTS: rows[2:].T})))
        signs.append(bits)
    sizes = [t.numel() for t in statistics]
    statistics_host = _to_host(torch.cat(statistics))
    signs_host = _to_host(torch.cat(signs)) if level.has_directions else None
    sign_sizes = [t.numel() for t in signs] if level.has_directions else None
    float32_host = _to_host(torch.cat([g.reshape(-1).float() for g in grads])) if level.has_md5 else None

    def collect() -> tuple:
        block_statistics = np.split(statistics_host(), np.cumsum(sizes)[:-1])
        block_signs = np.split(signs_host(), np.cumsum(sign_sizes)[:-1]) if signs_host else [None] * len(blocks)
        parts = [(indices, (stats, bits, None)) for indices, stats, bits in zip(blocks, block_statistics, block_signs)]
        merged_statistics, merged_signs, _ = layout.merge(parts)
        return merged_statistics, merged_signs, float32_host() if float32_host else None

    return collect


def _large_gradient_statistics(grads, level, bounds32):
    """One large gradient: ``aminmax``, and at L2 a compare-and-count per bound, then its packed signs."""
    (grad,) = grads
    minimum, maximum = torch.aminmax(grad)
    rows = [maximum.float().double(), minimum.float().double()]
    if level.has_buckets:
        comparable = _comparable(grad)
        rows += [(comparable <= float(b)).sum().double() for b in bounds32] + [(comparable == 0).sum().double()]
    bits = pack_bits(torch.cat(_padded((grad > 0).reshape(-1)))) if level.has_directions else None
    return torch.stack(rows).reshape(-1, 1), bits


def _small_chunks(grads, small: list[int]) -> list[list[int]]:
    """Indices of the small gradients, grouped by the dtype they are compared in, in chunks under ``CHUNK``."""
    chunks, current, size, dtype = [], [], 0, None
    for i in sorted(small, key=lambda i: str(_comparison_dtype(grads[i]))):
        numel = grads[i].numel() + 7
        if current and (size + numel > CHUNK or _comparison_dtype(grads[i]) != dtype):
            chunks.append(current)
            current, size = [], 0
        current.append(i)
        size += numel
        dtype = _comparison_dtype(grads[i])
    return chunks + ([current] if current else [])


def _comparison_dtype(grad: torch.Tensor) -> torch.dtype:
    return torch.float64 if grad.dtype == torch.float64 else torch.float32


def _small_chunk_statistics(grads, level, bounds32):
    """Small gradients as one padded flat vector whose segments alternate parameter and padding (zeros to a
    whole byte); reductions run over all segments and keep the parameters' ones."""
    pieces, lengths = [], []
    for grad in grads:
        vector = _comparable(grad).reshape(-1)
        padded = _padded(vector)
        pieces += padded
        lengths += [vector.numel(), sum(p.numel() for p in padded) - vector.numel()]
    flat = torch.cat(pieces)
    segment_lengths = _device_constant(lengths, torch.int64, flat.device)
    empty = _device_constant([n == 0 for n in lengths[0::2]], torch.bool, flat.device)

    def per_parameter(data: torch.Tensor, reduction: str) -> torch.Tensor:
        return torch.segment_reduce(data, reduction, lengths=segment_lengths, unsafe=True)[0::2]

    nan = torch.full((), math.nan, dtype=torch.float64, device=flat.device)
    rows = [torch.where(empty, nan, per_parameter(flat, "max").float().double()),  # float32, as msprobe writes
            torch.where(empty, nan, per_parameter(flat, "min").float().double())]
    if level.has_buckets:
        rows += [per_parameter((flat <= float(b)).float(), "sum").double() for b in bounds32]
        rows.append(per_parameter((flat == 0).float(), "sum").double())
    return torch.stack(rows), pack_bits(flat > 0) if level.has_directions else None
