"""Gradient statistics with torch ops on the gradients' device, brought to the host in one asynchronous copy.

Nothing here calls ``.item()`` or reads a value on the host: every per-parameter number lands in one float64
result tensor (float32 statistics and integer counts are exact in float64), the sign bits in one packed uint8
tensor, and both are copied to the host with ``non_blocking`` into pinned memory behind a CUDA event. The
training thread therefore never waits for the device; the writer thread waits for the event.
"""
from __future__ import annotations

import hashlib
import math
from typing import Callable

import numpy as np
import torch

from msprobe_mlflow.records import StepRecord

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


def pack_signs(grads: list[torch.Tensor]) -> torch.Tensor:
    """``grad > 0`` of each gradient bit-packed like ``np.packbits``, each padded to a whole byte, concatenated.

    Zero, -0.0 and NaN give 0 bits, as msprobe's ``np.save(grad > 0)``.
    """
    device = grads[0].device if grads else "cpu"
    pieces = []
    for grad in grads:
        pieces.append((grad > 0).reshape(-1))
        padding = -grad.numel() % 8
        if padding:
            pieces.append(torch.zeros(padding, dtype=torch.bool, device=device))
    if not pieces:
        return torch.zeros(0, dtype=torch.uint8)
    bits = torch.cat(pieces).view(-1, 8).to(torch.uint8)
    weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.uint8, device=device)
    return (bits * weights).sum(dim=1, dtype=torch.uint8)


def launch_step_statistics(names: list[str], grads: list[torch.Tensor], *, rank: int, step: int, level: str,
                           bounds: tuple) -> Callable[[], StepRecord]:
    """Queues the statistics of ``grads`` on their device; returns the pending step for the writer thread.

    Per parameter the result tensor holds ``max, min, norm`` (float32, in the gradient's dtype: ``aminmax`` and
    ``_foreach_norm``, which accumulates in float32), then at L2 the counts of ``x <= b`` for each float32 bound
    and of ``x == 0``; buckets are differences of those counts, so NaN and +inf land in the last bucket.
    """
    shapes = [tuple(g.shape) for g in grads]
    statistics, counts = [], []
    bounds32 = [float(np.float32(b)) for b in bounds]
    for grad, norm in zip(grads, torch._foreach_norm(grads) if grads else []):
        if grad.numel():
            minimum, maximum = torch.aminmax(grad)
        else:
            maximum = minimum = torch.full((), math.nan, device=grad.device)
        statistics += [maximum.float(), minimum.float(), norm.float()]
        if level == "L2":
            # bf16/fp16 go up to float32 so the float32 bounds are not rounded to the gradient's dtype; float64
            # stays float64, as msprobe compares it (float32(1e-50) would be a zero).
            comparable = grad if grad.dtype == torch.float64 else grad.float()
            counts += [(comparable <= bound).sum() for bound in bounds32]
            counts.append((comparable == 0).sum())
    device = grads[0].device if grads else torch.device("cpu")
    parts = [torch.stack(statistics).double()] if statistics else []
    if counts:
        parts.append(torch.stack(counts).double())
    result = _to_host(torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64, device=device))
    signs = _to_host(pack_signs(grads)) if level != "L0" else None
    float32_bytes = _to_host(torch.cat([g.reshape(-1).float() for g in grads])) if level == "L0" and grads else None

    def resolve() -> StepRecord:
        values = result()
        count = len(names)
        record = StepRecord(rank=rank, step=step, level=level, bounds=tuple(bounds), names=list(names),
                            shapes=shapes, values=values[: 3 * count].reshape(count, 3).astype(np.float32))
        if level == "L2":
            cumulative = values[3 * count:].reshape(count, len(bounds) + 1).astype(np.int64)
            at_most = cumulative[:, :-1]
            numels = np.array(record.numels, dtype=np.int64)[:, None]
            record.bucket_counts = np.diff(at_most, axis=1, prepend=0, append=numels)
            record.zero_counts = cumulative[:, -1]
        if signs is not None:
            record.directions = signs()
        if level == "L0":
            record.md5 = _md5_per_parameter(float32_bytes() if float32_bytes else np.zeros(0, np.float32),
                                            record.numels)
        return record

    return resolve


def _md5_per_parameter(flat: np.ndarray, numels: list[int]) -> list[str]:
    """Hex MD5 of each parameter's float32 little-endian C-order bytes (msprobe's L0 ``MD5`` column)."""
    flat = flat.astype("<f4", copy=False)
    digests, start = [], 0
    for numel in numels:
        digests.append(hashlib.md5(flat[start:start + numel].tobytes()).hexdigest())
        start += numel
    return digests
