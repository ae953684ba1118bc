"""Parameter names as the eager, unwrapped model has them, whatever wraps it for training.

``torch.compile`` adds ``_orig_mod.``, DDP and DataParallel ``module.``, FSDP1 ``_fsdp_wrapped_module.``, activation
checkpointing ``_checkpoint_wrapped_module.`` and Lightning's strategies ``_forward_module.``: the same model would
otherwise be recorded under different names on each stack and two runs could not be compared. A name component is
dropped only where the module that owns it *is* such a wrapper, so a user's own submodule called ``module`` keeps
its name.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # no torch at run time: the comparator matches names of old dumps with this module too
    import torch

# wrapper class name -> the attribute holding the wrapped module. By class name: the wrappers' modules need not be
# importable (FSDP1, Lightning), and importing them just to test isinstance would cost seconds at monitor().
WRAPPED_ATTRIBUTES = {
    "OptimizedModule": "_orig_mod",  # torch.compile
    "DistributedDataParallel": "module",
    "DataParallel": "module",
    "FullyShardedDataParallel": "_fsdp_wrapped_module",  # FSDP1
    "CheckpointWrapper": "_checkpoint_wrapped_module",
    "OffloadWrapper": "_checkpoint_wrapped_module",
    "_LightningModuleWrapperBase": "_forward_module",
    "_FabricModule": "_forward_module",
}

# For names read from old dumps, where no module is at hand: the components a wrapper adds.
WRAPPER_COMPONENTS = frozenset(WRAPPED_ATTRIBUTES.values())


def _wrapped_attribute(module: "torch.nn.Module | None") -> str | None:
    for cls in type(module).__mro__:
        if cls.__name__ in WRAPPED_ATTRIBUTES:
            return WRAPPED_ATTRIBUTES[cls.__name__]
    return None


def wrapper_chain(model: "torch.nn.Module"):
    """``model``, then the module each wrapper on the way down wraps (``compile(DDP(net))``: the three of them)."""
    while model is not None:
        yield model
        attribute = _wrapped_attribute(model)
        model = model._modules.get(attribute) if attribute else None


def eager_name(model: torch.nn.Module, name: str) -> str:
    """``name`` (from ``model.named_parameters()``) without the components that wrappers on its path add."""
    kept, module = [], model
    for component in name.split("."):
        if component != _wrapped_attribute(module):
            kept.append(component)
        module = module._modules.get(component) if module is not None else None
    return ".".join(kept)


def eager_named_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """``model.named_parameters()`` (tied parameters once, under the first name) under their eager names."""
    return [(eager_name(model, name), parameter) for name, parameter in model.named_parameters()]


def strip_wrapper_components(name: str) -> str:
    """A recorded name without any component a known wrapper adds (``_orig_mod.0.weight`` -> ``0.weight``), for
    matching names of dumps written before names were unwrapped. Unlike :func:`eager_name` it cannot tell a
    wrapper's ``module.`` from a user's submodule called ``module``: use it only to match names that differ."""
    return ".".join(component for component in name.split(".") if component not in WRAPPER_COMPONENTS)
