"""The loss scale a step's backward ran at, where a ``torch.amp.GradScaler`` (or FSDP's ``ShardedGradScaler``)
set one: the format losses read the gradients at it (:func:`msprobe_mlflow.formats.format_losses`).

A scaler keeps no link from an optimizer to itself. Its ``unscale_(optimizer)``, which ``scaler.step(optimizer)``
calls first, is wrapped while any monitor runs and notes which scaler each optimizer's gradients came from; the
wrapper goes when the last monitor stops. The scale is read as the scaler's own tensor, copied with the step's
statistics: reading it with ``get_scale()`` would wait for the accelerator.
"""
from __future__ import annotations

import weakref

import torch

_scalers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> weak reference to its scaler
_originals: dict[type, object] = {}  # scaler class -> its own unscale_, while wrapped
_watchers = 0


def _scaler_classes() -> list[type]:
    classes = [torch.amp.GradScaler]
    try:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler  # its own unscale_
        classes.append(ShardedGradScaler)
    except ImportError:  # a torch built without distributed
        pass
    return classes


def _noting(original):
    def unscale_(scaler, optimizer):
        _scalers[optimizer] = weakref.ref(scaler)
        return original(scaler, optimizer)
    return unscale_


def watch() -> None:
    """Wraps the scalers' ``unscale_`` (for the first watcher)."""
    global _watchers
    _watchers += 1
    if _watchers == 1:
        for cls in _scaler_classes():
            _originals[cls] = cls.__dict__["unscale_"]
            cls.unscale_ = _noting(_originals[cls])


def unwatch() -> None:
    """Restores the scalers' ``unscale_`` (when the last watcher goes)."""
    global _watchers
    _watchers -= 1
    if _watchers == 0:
        for cls, original in _originals.items():
            cls.unscale_ = original
        _originals.clear()


def scale_of(optimizer: torch.optim.Optimizer | None) -> torch.Tensor | None:
    """The scale (a float32 tensor of one element on the scaler's device) ``optimizer``'s gradients were last unscaled
    from; None when no enabled scaler unscaled them."""
    found = _scalers.get(optimizer) if optimizer is not None else None
    scaler = found() if found is not None else None
    if scaler is None or not scaler.is_enabled() or scaler._scale is None:
        return None
    return scaler._scale
