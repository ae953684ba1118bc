"""FSDP1 (``FullyShardedDataParallel``): each original parameter's local piece of the flattened, sharded gradient.

FSDP1 flattens a wrapped module's parameters into one ``FlatParameter`` and gives each rank a 1-D shard of it. With
``use_orig_params=False`` the model's only parameter is that shard (``..._flat_param``); with ``True`` each original
parameter's ``.grad`` is its 1-D piece of the shard (possibly empty). Either way this module maps every original
parameter to its unwrapped name, its full shape and the range of its flattened full gradient this rank holds, so
that :mod:`msprobe_mlflow.torch_kernels.sharded` records the full gradient's statistics under the unsharded model's
names and in its order. Modules are recognised by class name, as in :mod:`msprobe_mlflow.parameter_names`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from msprobe_mlflow.parameter_names import eager_name

FSDP1_CLASS = "FullyShardedDataParallel"  # FSDP2's fully_shard makes classes named FSDP<Module>


@dataclass(frozen=True)
class FlatSlot:
    """Where original parameter ``index`` of ``handle``'s FlatParameter lies in this rank's flat gradient."""

    handle: object  # FSDP1's FlatParamHandle
    index: int

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self.handle.flat_param._shapes[self.index])

    @property
    def group(self):
        """The group the flat parameter is sharded over; None where every rank holds it whole (NO_SHARD)."""
        return self.handle.process_group if self.handle.uses_sharded_strategy else None

    def piece(self, parameter: torch.nn.Parameter) -> tuple[torch.Tensor | None, int, int]:
        """``(local 1-D gradient piece, its start in the flattened full gradient, the most elements any rank's
        piece can hold)``, or ``(None, 0, 0)`` where the flat parameter has no gradient. A rank that holds none of
        the parameter gets an empty piece, not None: it must still take part in the step's collectives. The
        capacity is the same on every rank, so the sign bits pad to one width."""
        flat = self.handle.flat_param
        own = None if parameter is flat else parameter.grad  # use_orig_params=True: the piece FSDP1 exposes
        if flat.grad is None and own is None:
            return None, 0, 0
        info = flat._shard_param_infos[self.index]
        sharded = self.handle.uses_sharded_strategy
        expected = (info.numel_in_shard or 0) if sharded else flat._numels[self.index]
        if (own is not None and own.numel() != expected) or \
                (own is None and flat.grad is not None and sharded and flat.grad.numel() != flat.numel()):
            raise RuntimeError(f"FSDP1 gradient of {flat._fqns[self.index]!r} is not this rank's shard of it: an "
                               f"optimizer step inside no_sync() (gradients not yet reduce-scattered) is not "
                               f"supported; FSDP2 (torch.distributed.fsdp.fully_shard) is")
        capacity = flat.numel() if sharded else flat._numels[self.index]
        if not info.in_shard:
            return (flat.grad if own is None else own).new_zeros(0), 0, capacity
        if own is None:  # use_orig_params=False, or no .grad exposed: slice the flat shard's gradient, no padding
            own = flat.grad[info.offset_in_shard:info.offset_in_shard + info.numel_in_shard]
        return own.reshape(-1), info.intra_param_start_idx, capacity


def has_fsdp1(model: torch.nn.Module) -> bool:
    """An FSDP1 module, or a flat parameter of one (the model passed may be what an FSDP1 module wraps)."""
    return any(type(m).__name__ == FSDP1_CLASS for m in model.modules()) or \
        any(getattr(p, "_is_flat_param", False) for p in model.parameters())


def _handles(model: torch.nn.Module):
    for module in model.modules():
        if type(module).__name__ == FSDP1_CLASS and getattr(module, "_handle", None) is not None:
            yield module._handle


def fsdp1_named_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter, FlatSlot | None]]:
    """``(unwrapped name, parameter whose gradient holds it, slot or None)`` for every parameter, in the unsharded
    model's order: a module's own parameters, then its children's (FSDP1 moves a flat parameter's originals to
    the wrapped module, so ``named_parameters()`` alone would list them out of order). Tied parameters are FSDP1's
    ``_shared_param_infos``, left out of ``_fqns``: recorded once under the first name, as ``named_parameters()``
    does unsharded."""
    slots: dict[int, list[FlatSlot]] = {}  # id(flat param) -> its originals; id(original) -> [its slot]
    for handle in _handles(model):
        flat = handle.flat_param
        if handle._use_orig_params:
            for index, parameter in enumerate(flat._params):
                slots[id(parameter)] = [FlatSlot(handle, index)]
        else:
            slots[id(flat)] = [FlatSlot(handle, index) for index in range(flat._num_params)]
    module_order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    entries = []
    for raw, parameter in model.named_parameters():
        if getattr(parameter, "_is_flat_param", False) and id(parameter) not in slots:
            raise NotImplementedError(f"{raw!r} is the flat parameter of an FSDP1 module outside the monitored model, "
                                      f"its sharding unknown: monitor the FullyShardedDataParallel module itself")
        prefix = raw.rsplit(".", 1)[0] + "." if "." in raw else ""
        for slot in slots.get(id(parameter), [None]):
            full = raw if slot is None or parameter is not slot.handle.flat_param \
                else prefix + slot.handle.flat_param._fqns[slot.index]
            owner = full.rsplit(".", 1)[0] if "." in full else ""
            entries.append((module_order.get(owner, len(module_order)), len(entries), eager_name(model, full),
                            parameter, slot))
    return [(name, parameter, slot) for _, _, name, parameter, slot in sorted(entries, key=lambda e: e[:2])]
