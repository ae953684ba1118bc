"""Gradient statistics, computed where the gradients are.

On an accelerator, nothing here reads a value on the host: every per-parameter number lands in one float64
result tensor (float32 statistics and integer counts are exact in float64), the sign bits in one packed uint8
tensor, and both are copied to the host with ``non_blocking`` into pinned memory behind a CUDA event. The
training thread never waits for the device; the writer thread waits for the event. On the CPU, the gradients
already are on the host: the statistics are computed at once with numpy on zero-copy views.
"""
from __future__ import annotations

import math
from typing import Callable

import numpy as np
import torch

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
    """Computes (CPU) or queues (other devices) the statistics of ``grads``; returns the pending step.

    The flat result holds ``max, min, norm`` per parameter (in the gradient's dtype; ``_foreach_norm`` accumulates
    in float32), then at L2 per parameter the counts of ``x <= b`` for each float32 bound and of ``x == 0`` (see
    :func:`record_from_statistics`). bf16/fp16 are compared in float32, so the float32 bounds are not rounded to
    the gradient's dtype; float64 stays float64, as msprobe compares it.
    """
    norms = torch._foreach_norm(grads) if grads else []
    bounds32 = [np.float32(b) for b in bounds]
    describe = dict(rank=rank, step=step, level=level, bounds=bounds, names=names, shapes=[g.shape for g in grads])
    if all(g.device.type == "cpu" for g in grads):
        statistics, signs, float32_values = _host_statistics(grads, norms, level, bounds32)
        return lambda: record_from_statistics(**describe, statistics=statistics, signs=signs,
                                              float32_values=float32_values)
    result, signs, float32_values = _device_statistics(grads, norms, level, bounds32)
    return lambda: record_from_statistics(**describe, statistics=result(), signs=signs() if signs else None,
                                          float32_values=float32_values() if float32_values else None)


def _comparable(grad: torch.Tensor) -> torch.Tensor:
    if not grad.is_floating_point():
        raise TypeError(f"gradient dtype {grad.dtype} has no max/min/sign statistics; expected a real floating type")
    return grad if grad.dtype in (torch.float32, torch.float64) else grad.float()


def _host_statistics(grads, norms, level, bounds32):
    """The CPU path, in numpy on zero-copy views: numpy's SIMD comparisons and counts, and ``np.packbits``,
    are several times faster here than torch's bool reductions (measured in benchmarks/)."""
    arrays = [_comparable(g).detach().numpy().reshape(-1) for g in grads]
    extremes, counts = [], []
    for array in arrays:
        extremes.append((array.max(), array.min()) if array.size else (np.nan, np.nan))
        if level == "L2":
            counts += [np.count_nonzero(array <= bound) for bound in bounds32]
            counts.append(np.count_nonzero(array == 0))
    norm_values = torch.stack(norms).float().numpy() if norms else np.zeros(0, np.float32)
    per_parameter = [(np.float32(high), np.float32(low), norm) for (high, low), norm in zip(extremes, norm_values)]
    statistics = np.array([v for triple in per_parameter for v in triple] + counts, dtype=np.float64)
    signs = float32_values = None
    if level == "L0":  # a snapshot: the optimizer may change the gradients before the writer hashes them
        float32_values = np.empty(sum(a.size for a in arrays), np.float32)
        start = 0
        for array in arrays:
            float32_values[start:start + array.size] = array
            start += array.size
    else:
        signs = np.concatenate([np.zeros(0, np.uint8)] + [np.packbits(a > 0) for a in arrays])
    return statistics, signs, float32_values


def _device_statistics(grads, norms, level, bounds32):
    """Any other device: torch ops that stay on it, one asynchronous copy of each result to the host."""
    statistics, counts = [], []
    for grad, norm in zip(grads, norms):
        if grad.numel():
            minimum, maximum = torch.aminmax(grad)
        else:
            maximum = minimum = torch.full((), math.nan, device=grad.device)
        statistics += [maximum.float(), minimum.float(), norm.float()]
        if level == "L2":
            comparable = _comparable(grad)
            counts += [(comparable <= float(bound)).sum() for bound in bounds32]
            counts.append((comparable == 0).sum())
    parts = [torch.stack(statistics).double()] + ([torch.stack(counts).double()] if counts else [])
    result = _to_host(torch.cat(parts))
    signs = _to_host(pack_signs(grads)) if level != "L0" else None
    float32_values = _to_host(torch.cat([g.reshape(-1).float() for g in grads])) if level == "L0" else None
    return result, signs, float32_values
