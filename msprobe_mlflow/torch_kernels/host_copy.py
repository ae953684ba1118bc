"""The one device-to-host copy per step, on any accelerator, without making the training thread wait.

CUDA, Ascend NPUs (torch_npu), XPU and MPS all go through the device-generic APIs (``torch.accelerator``,
``torch.Event``, pinned host memory): the copy is queued with ``non_blocking`` behind the work that computes the
statistics, an event is recorded after it, and only the writer thread waits for that event.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch


def _pinned_empty(tensor: torch.Tensor) -> torch.Tensor:
    """Page-locked host memory where the backend has it (a copy into pageable memory is synchronous)."""
    try:
        return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    except RuntimeError:  # a backend without pinned memory (MPS shares memory with the host)
        return torch.empty(tensor.shape, dtype=tensor.dtype)


def pinned(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` (on the host) in page-locked memory where the backend has it, for a non-blocking copy to a device."""
    try:
        return tensor.pin_memory()
    except RuntimeError:
        return tensor


def start_host_copy(tensor: torch.Tensor) -> Callable[[], np.ndarray]:
    """Starts copying ``tensor`` to the host; the returned callable waits for the copy (call it off the training
    thread) and returns the values as numpy. A CPU tensor is returned as is (a zero-copy view)."""
    if tensor.device.type == "cpu":
        return tensor.numpy
    host = _pinned_empty(tensor)
    host.copy_(tensor, non_blocking=True)
    event = torch.Event(device=tensor.device)
    event.record()

    def wait() -> np.ndarray:
        event.synchronize()
        return host.numpy()
    return wait
