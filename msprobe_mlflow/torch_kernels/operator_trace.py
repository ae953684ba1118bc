"""A dispatch-level trace of one training step: every aten call, forward and backward, with the module it ran in.

A ``TorchDispatchMode`` sees each aten operator below autograd, so the backward's operators are traced as well as
the forward's; a ``TorchFunctionMode`` (above autograd) writes the module and call site on each autograd node the
forward creates, which is how a backward operator knows its module (``torch._C._current_autograd_node()``).
Views and ``detach`` are left out: their bits are their input's. Statistics (max, min, mean, norm in float32, and
a checksum of the bits, :mod:`~msprobe_mlflow.torch_kernels.bit_checksum`) are computed on the device per tensor,
once per tensor version, and copied to the host in one batch when the trace stops. Nothing is installed outside a
traced step, so other steps pay nothing.
"""
from __future__ import annotations

import weakref
from collections import defaultdict
from typing import Callable

import numpy as np
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from msprobe_mlflow.torch_kernels.bit_checksum import bit_checksum, in_memory_order
from msprobe_mlflow.trace.files import OperatorCall, Scalar, TensorSummary
from msprobe_mlflow.trace.options import LEVELS
from msprobe_mlflow.trace.recording import PendingSummary, Selection, call_site, filled


_NODE_KEY = "msprobe_mlflow.trace"  # autograd node metadata: (forward module entry, call site)
_LEFT_OUT = {torch.ops.aten.detach.default, torch.ops.aten.lift_fresh.default, torch.ops.aten.alias.default}
_LEFT_OUT_NAMESPACES = {"profiler"}  # record_function's markers (an optimizer's step() opens one)
_OWN_FILES = (__file__, torch.utils._python_dispatch.__file__, torch.overrides.__file__)


class OperatorTracer:
    """Records one step's calls of ``model``: ``start()``, run forward and backward, then ``stop()`` returns a
    callable that builds the :class:`OperatorCall` list (after the one device-to-host copy)."""

    def __init__(self, model: torch.nn.Module, *, level: str = "mix", api_list: tuple[str, ...] = (),
                 scope: tuple[str, ...] = (), save: tuple[str, ...] = ()):
        if level not in LEVELS:
            raise ValueError(f"trace level {level!r} is not one of msprobe's {LEVELS}")
        self.level = level
        self._selection = Selection(scope, api_list)
        self.save = frozenset(save)  # calls whose inputs and outputs are kept, for the float64 replay
        self.saved: dict[str, tuple] = {}  # call name -> (args, kwargs, output), copied to the host
        self._module_names = {id(m): n for n, m in model.named_modules()}
        self._calls: list[OperatorCall] = []
        self._statistics: list[torch.Tensor] = []  # a row per tensor version, stacked at stop()
        self._checksums: list[torch.Tensor] = []
        self._seen: dict[int, tuple] = {}  # id(tensor) -> (weakref, version, slot): one statistic per version
        self._counters: dict[tuple[str, str], int] = defaultdict(int)
        self._module_counters: dict[str, int] = defaultdict(int)
        self._modules: list[tuple[str, OperatorCall | None]] = []  # the forward's module stack
        self._last_backward_module: str | None = None
        self._measuring = False  # while the tracer computes statistics, its own operators are not traced
        self._modes: list = []
        self._hooks: list = []

    # -- lifetime --------------------------------------------------------------------------------------------------
    def start(self) -> None:
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
        self._hooks = [register_module_forward_pre_hook(self._enter_module),
                       register_module_forward_hook(self._leave_module, always_call=True)]
        self._modes = [_NodeTagger(self), _OperatorRecorder(self)]
        for mode in self._modes:
            mode.__enter__()

    def stop(self) -> Callable[[], list[OperatorCall]]:
        for mode in reversed(self._modes):
            mode.__exit__(None, None, None)
        for hook in self._hooks:
            hook.remove()
        self._modes, self._hooks, self._seen = [], [], {}
        statistics = [s.to("cpu") for s in _stacked(self._statistics)]  # the one device-to-host copy (and its sums')
        checksums = [c.to("cpu") for c in _stacked(self._checksums)]
        calls = self._calls

        def build() -> list[OperatorCall]:
            values = np.concatenate([s.numpy() for s in statistics]) if statistics else np.zeros((0, 4))
            sums = np.concatenate([c.numpy() for c in checksums]) if checksums else np.zeros((0, 2), np.int64)
            return filled(calls, values, sums)
        return build

    # -- modules ---------------------------------------------------------------------------------------------------
    def _enter_module(self, module, args):
        path = self._module_names.get(id(module))
        if not path:  # the root module, or one outside the model
            self._modules.append((self._modules[-1][0] if self._modules else None, None))
            return
        entry = f"Module.{path}.{type(module).__name__}.forward"
        number = self._module_counters[entry]
        self._module_counters[entry] += 1
        name = f"{entry}.{number}"
        call = None
        if self.level != "L1":
            call = OperatorCall(name, [self._argument(a) for a in tree_leaves(args)], [],
                                self._modules[-1][0] if self._modules else None)
        self._modules.append((name, call))

    def _leave_module(self, module, args, output):
        if not self._modules:
            return
        name, call = self._modules.pop()
        if call is not None and self._selection.wants(name):
            call.outputs = [self._argument(o) for o in tree_leaves(output)]
            self._calls.append(call)

    # -- operators -------------------------------------------------------------------------------------------------
    def _name(self, func) -> tuple[str, str, str | None, tuple] | None:
        """The next call of ``func``'s name (msprobe's ``Aten.mm.default.3.backward``), phase, module and call
        site; None for what is not traced."""
        namespace, operator = func._schema.name.split("::")
        if self.level == "L0" or func in _LEFT_OUT or func.is_view or namespace in _LEFT_OUT_NAMESPACES:
            return None
        node = torch._C._current_autograd_node()
        if node is None:
            phase, module, stack = "forward", self._modules[-1][0] if self._modules else None, None
        else:
            phase = "backward"
            module, stack = node.metadata.get(_NODE_KEY, (self._last_backward_module, ()))
        operator = f"{namespace.capitalize()}.{operator}.{func._overloadname}"  # msprobe's "Aten.mm.default"
        return f"{operator}.{self._counters[(operator, phase)]}.{phase}", phase, module, stack

    def _copied_if_saved(self, func, args, kwargs):
        """Host copies of the arguments of a call to save, taken before it runs (an in-place call changes them)."""
        named = self._name(func) if self.save else None
        if named is None or named[0] not in self.save:
            return None
        return tree_map(_host_copy, (args, kwargs))

    def _inputs_before(self, func, args, kwargs) -> list | None:
        """An operator that writes into its arguments (``add_``, ``out=``): their summaries before it runs (what it
        read); its outputs are then summarised afresh (the version counter moves only after this mode returns)."""
        if not func._schema.is_mutable or self._name(func) is None:
            return None
        return [self._argument(a) for a in tree_leaves((args, kwargs))]

    def _record(self, func, args, kwargs, output, copied=None, before=None) -> None:
        named = self._name(func)
        if named is None:
            return
        name, phase, module, stack = named
        self._counters[name.rsplit(".", 2)[0], phase] += 1
        if phase == "backward":
            self._last_backward_module = module
            module = module.replace(".forward.", ".backward.") if module else None
        elif stack is None:
            stack = call_site(_OWN_FILES)
        if not self._selection.wants(name):
            return
        if copied is not None:
            self.saved[name] = (*copied, tree_map(_host_copy, output))
        inputs = before if before is not None else [self._argument(a) for a in tree_leaves((args, kwargs))]
        outputs = [self._argument(o, fresh=before is not None) for o in tree_leaves(output)]
        self._calls.append(OperatorCall(name, inputs, outputs, module, list(stack)))

    def _tag_nodes(self, output) -> None:
        """Writes the current module and call site on the autograd nodes ``output`` comes from."""
        module = self._modules[-1][0] if self._modules else None
        for tensor in tree_leaves(output):
            node = getattr(tensor, "grad_fn", None) if isinstance(tensor, torch.Tensor) else None
            if node is not None and _NODE_KEY not in node.metadata:
                node.metadata[_NODE_KEY] = (module, call_site(_OWN_FILES))

    # -- statistics ------------------------------------------------------------------------------------------------
    def _argument(self, value, fresh: bool = False):
        if isinstance(value, torch.Tensor):
            return self._tensor(value, fresh)
        if isinstance(value, (bool, int, float, str)) or value is None:
            return Scalar(type(value).__name__, value)
        if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return Scalar(type(value).__name__.replace("Sym", "").lower(), str(value))
        return Scalar(f"{type(value).__module__}.{type(value).__qualname__}", str(value))

    def _tensor(self, tensor: torch.Tensor, fresh: bool = False):
        dtype, shape = str(tensor.dtype), tuple(tensor.shape)
        plain = type(tensor) in (torch.Tensor, torch.nn.Parameter) and tensor.layout == torch.strided and \
            tensor.device.type != "meta" and not tensor.is_quantized and tensor.numel() > 0
        if not plain:
            return TensorSummary(dtype, shape, requires_grad=tensor.requires_grad)
        seen = self._seen.get(id(tensor))
        if fresh:
            slot = self._launch(tensor)
        elif seen is not None and seen[0]() is tensor and seen[1] == tensor._version:
            slot = seen[2]
        else:
            slot = self._launch(tensor)
            self._seen[id(tensor)] = (weakref.ref(tensor), tensor._version, slot)
        return PendingSummary(dtype, shape, tensor.requires_grad, slot, slot)

    def _launch(self, tensor: torch.Tensor) -> int:
        """Queues the tensor's statistics and checksum on its device; returns their row."""
        self._measuring = True
        try:
            with torch.no_grad(), torch.autocast(tensor.device.type, enabled=False):
                return self._queue_statistics(in_memory_order(tensor))
        finally:
            self._measuring = False

    def _queue_statistics(self, data: torch.Tensor) -> int:
        if data.is_complex():
            data = torch.view_as_real(data)
        values = data if data.dtype == torch.float32 else data.float()
        low, high = torch.aminmax(values)
        self._statistics.append(torch.stack([high, low, values.mean(), torch.linalg.vector_norm(values)]))
        self._checksums.append(bit_checksum(data))
        return len(self._statistics) - 1


def _host_copy(value):
    return value.detach().to("cpu", copy=True) if isinstance(value, torch.Tensor) else value


def _stacked(rows: list[torch.Tensor]) -> list[torch.Tensor]:
    """The rows as one tensor on the first row's device (a trace on one device: one copy to the host)."""
    if not rows:
        return []
    return [torch.stack([row.to(rows[0].device) for row in rows])]


class _OperatorRecorder(TorchDispatchMode):
    def __init__(self, tracer: OperatorTracer):
        super().__init__()
        self.tracer = tracer

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.tracer._measuring:
            return func(*args, **(kwargs or {}))
        copied = self.tracer._copied_if_saved(func, args, kwargs or {})
        before = self.tracer._inputs_before(func, args, kwargs or {})
        output = func(*args, **(kwargs or {}))
        self.tracer._record(func, args, kwargs or {}, output, copied, before)
        return output


class _NodeTagger(TorchFunctionMode):
    def __init__(self, tracer: OperatorTracer):
        super().__init__()
        self.tracer = tracer

    def __torch_function__(self, func, types, args=(), kwargs=None):
        output = func(*args, **(kwargs or {}))
        if torch.is_grad_enabled():
            self.tracer._tag_nodes(output)
        return output
