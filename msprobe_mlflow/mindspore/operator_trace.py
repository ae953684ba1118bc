"""An API-level trace of one MindSpore PyNative training step: every ``mint``/``ops``/``Tensor`` call and every
primitive a cell holds, with the cell it ran in, and every cell's forward and backward, named and laid out as
msprobe 1.0.3 dumps MindSpore (``Mint.add.0.forward``, ``MintFunctional.linear.1.forward``,
``Functional.dense.0.forward``, ``Tensor.__add__.2.forward``, ``Primitive.dense.0.forward``,
``Cell.fc.Dense.forward.0``, ``Cell.fc.Dense.backward.0``).

How: for the traced step only, :meth:`MindSporeOperatorTracer.start` replaces the public functions of
``mindspore.mint`` and ``mindspore.mint.nn.functional``, msprobe's list of ``mindspore.ops`` functions and of
``mindspore.Tensor`` methods (:mod:`~msprobe_mlflow.mindspore.traced_apis`) by wrappers that record each call, gives
the primitives the network's cells hold a class whose ``__call__`` records (msprobe's ``Primitive.`` entries), and
registers forward pre-, forward and backward hooks on every cell of ``network.cells_and_names()`` (the root's
excepted, as msprobe does). :meth:`~MindSporeOperatorTracer.stop` puts every function, method and class back (the
original objects) and removes the hooks, so untraced steps run exactly the code they ran before. A call made inside
another traced call (``mint.nn.functional.linear`` calling ``ops`` internally) is part of the outer call, not an entry
of its own. A ``@mindspore.jit`` function called in the traced step (a compiled train step) runs with everything put
back for its duration, so that its graph is compiled from the original functions and hook-free cells (a cell hook
compiled into a graph fails to compile; a wrapper would stay in the cached graph), and is one
``Jit.<function>.<n>.forward`` entry; its operators are not traced. Statistics tensors are computed with gradients
off, so the autograd graph of the step is the one it has untraced.

What is traced and what is not:

- forward: each API call (inputs before it runs, outputs after), each primitive call of a cell, each cell's
  inputs and outputs (levels ``L1``: APIs, ``L0``: cells, ``mix``: both); an API's parent is the innermost cell it
  ran in (``construct.json``), its call site the Python stack (``stack.json``);
- backward, at cell granularity only: MindSpore PyNative reports a cell's gradients to ``register_backward_hook``
  (``Cell.<path>.<Class>.backward.<n>``: input = the gradients of the cell's outputs, output = those of its inputs,
  msprobe's convention; a gradient MindSpore does not compute, such as that of the network's input data, is
  an argument of type ``NoneType``). The backward's operators themselves run inside MindSpore's autograd (C++),
  below any Python wrapper: there is no API-level backward entry (no ``Mint.add.0.backward``), and what each
  backward operator computed is seen only as the gradients at the cell boundaries. msprobe 1.0.3 gets API-level
  gradients by running every API call as a throwaway cell with a backward hook, which puts hook nodes around every
  operator of the graph; that is not done here.
- GRAPH_MODE: the whole step is one compiled graph; no Python runs per operator, so nothing can be traced and
  :meth:`~MindSporeOperatorTracer.start` refuses (run the traced step in PyNative, or take msprobe's own data dump,
  which ``locate`` reads too).
- Not seen: functions imported by name before the trace started (``from mindspore.mint import add``) and
  MindSpore's own internal calls made outside any wrapper, the operators inside ``@jit`` functions and
  ``@jit``-compiled cells, and primitives that are not attributes of the network's cells.

Statistics: per tensor, max, min, mean and norm in float32 are computed with MindSpore operators on the tensor's
device (with gradients off) and kept as a small tensor per call; :meth:`~MindSporeOperatorTracer.stop` concatenates
them and copies them to the host once. The checksum is the one of :mod:`msprobe_mlflow.torch_kernels.bit_checksum`
(the sums of the tensor's 32-bit words, plain and weighted by their index, mod 2^32, of its bytes in memory order),
so a MindSpore tensor and a PyTorch tensor of equal bits have equal checksums: on a GPU or NPU it is computed on the
device with integer operators (:func:`device_checksum`) and copied with the statistics; on the CPU, where the bytes
already are in host memory, it is summed with numpy when the tensor is recorded (:func:`host_checksum`).
"""
from __future__ import annotations

import functools
import inspect
import math
import types
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable

import numpy as np
import mindspore as ms
from mindspore import mint, nn, ops
from mindspore.ops.primitive import Primitive

from msprobe_mlflow.mindspore.traced_apis import (FUNCTIONAL, JIT, MINT, MINT_FUNCTIONAL, MSPROBE_OPS,
                                                  MSPROBE_TENSOR_METHODS, PRIMITIVE, TENSOR)
from msprobe_mlflow.trace.files import OUR_CHECKSUM, OperatorCall, Scalar, TensorSummary
from msprobe_mlflow.trace.options import LEVELS
from msprobe_mlflow.trace.recording import CHECKSUM_MASK, PendingSummary, Selection, call_site, checksum_hex, filled

_OWN_FILES = (__file__, functools.__file__)  # left out of call sites
_CHUNK = 1 << 22  # words summed at a time on the host: bounds the temporary arrays to 32 MiB each
_MISSING = object()
# the cell attributes that registering hooks fills (with ``_lazy_*hook*``); None ones are None again at stop()
_CELL_HOOK_STATE = ("_cell_backward_hook", "_cell_backward_pre_hook")
_active: list["MindSporeOperatorTracer"] = []  # at most one tracer holds the functions at a time


def graph_mode_message() -> str:
    return ("MindSpore is in GRAPH_MODE: the step runs as one compiled graph, with no Python per operator, so its "
            "operators cannot be traced; run the traced step in PyNative (mindspore.set_context("
            "mode=mindspore.PYNATIVE_MODE)), or take msprobe's own data dump of the step (task statistics), which "
            "msprobe-mlflow locate reads as well")


class MindSporeOperatorTracer:
    """Records one PyNative step's API and cell calls of ``network``: ``start()``, run forward and backward, then
    ``stop()`` returns a callable that builds the :class:`OperatorCall` list (after the one device-to-host copy).
    ``level``, ``api_list`` and ``scope`` are msprobe's (``L0`` cells, ``L1`` APIs, ``mix`` both; names containing
    any of ``api_list``; the entries from ``scope[0]`` to ``scope[-1]``). ``network`` may be None: APIs only."""

    def __init__(self, network: nn.Cell | None = None, *, level: str = "mix", api_list: tuple[str, ...] = (),
                 scope: tuple[str, ...] = (), save: tuple[str, ...] = ()):
        if level not in LEVELS:
            raise ValueError(f"trace level {level!r} is not one of msprobe's {LEVELS}")
        if network is not None and not isinstance(network, nn.Cell):
            raise TypeError(f"the traced network is a mindspore.nn.Cell, got {type(network).__name__}")
        self.network, self.level = network, level
        self._selection = Selection(scope, api_list)
        self._calls: list[OperatorCall] = []
        self.save = frozenset(save)  # calls whose inputs and outputs are kept, for the float64 replay
        self.saved: dict[str, tuple] = {}  # call name -> (args, kwargs, output), tensors as HostTensor
        self._statistics: list = []  # per tensor, a (1, 4) float32 tensor on its device: concatenated at stop()
        self._checksums: list = []  # per tensor, a (1, 2) int64 tensor on its device (not on the CPU: host sums)
        self._counters: dict[tuple[str, str], int] = defaultdict(int)
        self._cell_counters: dict[str, int] = defaultdict(int)
        self._cells: list[str | None] = []  # the forward's cell stack: entry names (None: the root)
        self._cell_calls: list[OperatorCall | None] = []  # the entries of the cells on that stack, root excepted
        self._backward_parents: dict[int, list] = defaultdict(list)  # id(cell) -> its forward calls' parents
        self._depth = 0  # > 0 inside a traced call: calls made there are part of it
        self._installed: list[tuple] = []  # (owner, attribute, what owner.__dict__ held before, the wrapper)
        self._wrappers: dict[tuple[int, str], Callable] = {}
        self._primitive_classes: dict[tuple[type, str], type] = {}
        self._jit: tuple | None = None  # (the jit executor class, what its __dict__ held as __call__)
        self._primitives: list[tuple[Primitive, type]] = []
        self._hooks: list = []
        self._cell_state: list[tuple[nn.Cell, dict, bool]] = []
        self._started = False
        self.unmeasured: dict[str, str] = {}  # "statistics of Int4 tensors" -> why they are not in the trace
        self._host_checksums = ms.get_context("device_target") == "CPU"

    # -- lifetime --------------------------------------------------------------------------------------------------
    def start(self) -> None:
        if ms.get_context("mode") != ms.PYNATIVE_MODE:
            raise ValueError(graph_mode_message())
        if _active:
            raise RuntimeError("another MindSporeOperatorTracer is tracing; stop() it first")
        _active.append(self)
        self._started = True
        try:
            if self.network is not None:
                self._cell_state = [_cell_hook_state(cell) for _, cell in self.network.cells_and_names()]
            jit_executor = _jit_executor()
            if jit_executor is not None:  # a graph compiled in the traced step must see none of what is installed
                self._jit = (jit_executor, "__call__", jit_executor.__dict__.get("__call__", _MISSING))
                jit_executor.__call__ = self._jit_wrapper(jit_executor.__call__)
            self._install()
        except BaseException:
            self._restore()
            raise

    def _install(self) -> None:
        if self.network is not None:
            self._hook_cells()
        if self.level != "L0":
            self._wrap_primitives()
            self._wrap_apis()

    def _uninstall(self) -> None:
        """Puts back the functions, methods and primitive classes and removes the cell hooks."""
        _put_back(self._installed)
        self._installed = []
        for primitive, original in self._primitives:
            primitive.__class__ = original
        self._primitives = []
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def stop(self) -> Callable[[], list[OperatorCall]]:
        """Restores everything, then copies the statistics to the host (one copy); the callable builds the calls."""
        self._restore()
        with _no_grad():
            statistics = _concatenated(self._statistics, 4)
            checksums = _concatenated(self._checksums, 2)
        self._statistics, self._checksums = [], []
        calls = self._calls

        def build() -> list[OperatorCall]:
            return filled(calls, statistics, checksums)
        return build

    def _restore(self) -> None:
        if not self._started:
            return
        self._uninstall()
        if self._jit is not None:
            _put_back([(*self._jit, None)])
            self._jit = None
        for cell, state, had_primitive in self._cell_state:
            for name, value in state.items():
                if value is None:  # created by the registration: the cell gets its None back
                    object.__setattr__(cell, name, None)
            primitives = cell.__dict__.get("_primitives")
            if not had_primitive and isinstance(primitives, dict):
                primitives.pop("_cell_backward_hook", None)
        self._cell_state = []
        if self in _active:
            _active.remove(self)
        self._started = False

    # -- cells -----------------------------------------------------------------------------------------------------
    def _hook_cells(self) -> None:
        for path, cell in self.network.cells_and_names():
            entry = f"Cell.{path}.{type(cell).__name__}" if path else None
            self._hooks.append(cell.register_forward_pre_hook(functools.partial(self._enter_cell, entry)))
            self._hooks.append(_forward_hook(cell, functools.partial(self._leave_cell, entry)))
            if entry is not None and self.level != "L1":
                self._hooks.append(cell.register_backward_hook(functools.partial(self._cell_backward, entry)))

    def _enter_cell(self, entry, cell, args):
        if entry is None:  # the root: its calls are outside any cell, as in msprobe
            self._cells.append(self._cells[-1] if self._cells else None)
            return None
        name = f"{entry}.forward.{self._cell_counters[entry + '.forward']}"
        self._cell_counters[entry + ".forward"] += 1
        parent = self._cells[-1] if self._cells else None
        self._backward_parents[id(cell)].append(parent)
        call = None
        if self.level != "L1":
            call = OperatorCall(name, [self._argument(a) for a in _leaves(args)], [], parent)
        self._cells.append(name)
        self._cell_calls.append(call)
        return None

    def _leave_cell(self, entry, cell, args, output):
        if not self._cells:
            return None
        self._cells.pop()
        if entry is None:
            return None
        call = self._cell_calls.pop() if self._cell_calls else None
        if call is not None and self._selection.wants(call.name):
            call.outputs = [self._argument(o) for o in _leaves(output)]
            self._calls.append(call)
        return None

    def _cell_backward(self, entry, cell, grad_input, grad_output):
        name = f"{entry}.backward.{self._cell_counters[entry + '.backward']}"
        self._cell_counters[entry + ".backward"] += 1
        parents = self._backward_parents.get(id(cell))
        parent = parents.pop() if parents else None
        if parent is not None:
            parent = parent.replace(".forward.", ".backward.")
        if self._selection.wants(name):  # msprobe's convention: input = the outputs' gradients, output = the inputs'
            self._calls.append(OperatorCall(name, [self._argument(g) for g in _leaves(grad_output)],
                                            [self._argument(g) for g in _leaves(grad_input)], parent))
        return None

    # -- APIs ------------------------------------------------------------------------------------------------------
    def _wrap_apis(self) -> None:
        for owner, name, prefix in traced_apis():
            wrapper = self._wrappers.get((id(owner), name))
            if wrapper is None:
                wrapper = self._wrappers[id(owner), name] = self._wrapper(f"{prefix}.{name}", getattr(owner, name))
            self._installed.append((owner, name, owner.__dict__.get(name, _MISSING), wrapper))
            setattr(owner, name, wrapper)

    def _wrapper(self, operator: str, original):
        tracer = self

        @functools.wraps(original)
        def traced(*args, **kwargs):
            if tracer._depth:
                return original(*args, **kwargs)
            return tracer._traced_call(operator, original, args, kwargs)
        return traced

    def _jit_wrapper(self, original):
        tracer = self

        def traced(executor, *args, **kwargs):
            if tracer._depth or not tracer._started:
                return original(executor, *args, **kwargs)
            # the graph is compiled from (and keeps) the original functions and cells: a cell hook compiled into
            # it fails ("Graph cycle exists"), a wrapper would stay in it
            tracer._uninstall()
            try:
                if tracer.level == "L0":
                    return original(executor, *args, **kwargs)
                operator = f"{JIT}.{getattr(executor.fn, '__name__', 'function')}"
                return tracer._traced_call(operator, functools.partial(original, executor), args, kwargs)
            finally:
                tracer._install()
        return traced

    def _traced_call(self, operator: str, function, args, kwargs):
        """Records the call's inputs (before it runs: an in-place call changes them), runs it, records outputs."""
        name = f"{operator}.{self._counters[operator, 'forward']}.forward"
        self._counters[operator, "forward"] += 1
        wanted = self._selection.wants(name)
        self._depth += 1
        try:
            inputs = [self._argument(a) for a in _leaves((args, kwargs))] if wanted else None
            saved = _host_copies((args, kwargs)) if name in self.save else None  # before it runs: in-place calls
            output = function(*args, **kwargs)
            if saved is not None:
                self.saved[name] = (*saved, _host_copies(output))
            if wanted:
                parent = self._cells[-1] if self._cells else None
                self._calls.append(OperatorCall(name, inputs, [self._argument(o) for o in _leaves(output)],
                                                parent, list(call_site(_OWN_FILES))))
            return output
        finally:
            self._depth -= 1

    def _wrap_primitives(self) -> None:
        """msprobe's ``Primitive.<attribute>`` entries: each primitive a cell of the network holds gets, for the
        trace, a class of its own whose ``__call__`` records (the class is given back at stop())."""
        if self.network is None:
            return
        seen: set[int] = set()
        classes = self._primitive_classes
        for _, cell in self.network.cells_and_names():
            for attribute, primitive in (cell.__dict__.get("_primitives") or {}).items():
                if primitive is None or id(primitive) in seen or attribute.startswith("_cell_backward") or \
                        not isinstance(primitive, Primitive):
                    continue
                seen.add(id(primitive))
                original = type(primitive)
                key = (original, attribute)
                if key not in classes:
                    classes[key] = type(original.__name__, (original,), {
                        "__call__": self._primitive_call(f"{PRIMITIVE}.{attribute}", original.__call__),
                        "__module__": original.__module__, "__qualname__": original.__qualname__})
                primitive.__class__ = classes[key]
                self._primitives.append((primitive, original))

    def _primitive_call(self, operator: str, original):
        tracer = self

        def __call__(primitive, *args, **kwargs):
            if tracer._depth or not tracer._started:
                return original(primitive, *args, **kwargs)
            return tracer._traced_call(operator, functools.partial(original, primitive), args, kwargs)
        return __call__

    # -- statistics ------------------------------------------------------------------------------------------------
    def _argument(self, value):
        if isinstance(value, ms.Tensor):
            return self._tensor(value)
        if isinstance(value, (bool, int, float, str)) or value is None:
            return Scalar(type(value).__name__, value)
        if isinstance(value, ms.dtype.Type):
            return Scalar("mindspore.dtype", str(value))
        if isinstance(value, slice):
            return Scalar("slice", str(value))
        try:
            text = str(value)
        except Exception:  # an object that cannot say what it is is still an argument
            text = f"<{type(value).__qualname__}>"
        return Scalar(f"{type(value).__module__}.{type(value).__qualname__}", text)

    def _tensor(self, tensor: ms.Tensor):
        dtype, shape = str(tensor.dtype), tuple(int(n) for n in tensor.shape)
        requires_grad = bool(getattr(tensor, "requires_grad", False))
        if math.prod(shape) == 0 or tensor.dtype in (ms.complex64, ms.complex128):
            return TensorSummary(dtype, shape, requires_grad=requires_grad)
        self._depth += 1  # the statistics' own calls are not traced
        slot = checksum = None
        try:
            with _no_grad():
                try:
                    values = tensor if tensor.dtype == ms.float32 else tensor.astype(ms.float32)
                    row = mint.cat([mint.max(values).reshape(1, 1), mint.min(values).reshape(1, 1),
                                    mint.mean(values).reshape(1, 1), ops.norm(values.reshape(-1)).reshape(1, 1)],
                                   dim=1)
                    self._statistics.append(row)
                    slot = len(self._statistics) - 1
                except Exception as error:  # no kernel for this dtype here: the entry has no statistics
                    self._unmeasured(dtype, "statistics", error)
                try:
                    if self._host_checksums:
                        checksum = f"{OUR_CHECKSUM}:{checksum_hex(host_checksum(tensor))}"
                    else:
                        self._checksums.append(device_checksum(tensor).reshape(1, 2))
                        checksum = len(self._checksums) - 1
                except Exception as error:
                    self._unmeasured(dtype, "checksum", error)
        finally:
            self._depth -= 1
        return PendingSummary(dtype, shape, requires_grad, slot, checksum)

    def _unmeasured(self, dtype: str, what: str, error: Exception) -> None:
        """A tensor whose statistics or checksum could not be computed is traced without them (said once per
        dtype, in ``unmeasured``): the traced step goes on."""
        key = f"{what} of {dtype} tensors"
        if key not in self.unmeasured:
            self.unmeasured[key] = repr(error)


@dataclass(frozen=True)
class HostTensor:
    """A saved call's tensor, copied to the host: its values (float32 where numpy has no such format) and its dtype,
    as MindSpore names it (``Float32``)."""
    values: np.ndarray
    dtype: str


def _host_copies(value):
    """``value`` with each tensor copied to the host as a :class:`HostTensor` (tuples, lists and dicts opened)."""
    if isinstance(value, ms.Tensor):
        with _no_grad():
            readable = value if value.dtype != ms.bfloat16 else value.astype(ms.float32)
            return HostTensor(np.array(readable.asnumpy(), copy=True), str(value.dtype))
    if isinstance(value, (list, tuple)):
        return [_host_copies(v) for v in value]
    if isinstance(value, dict):
        return {k: _host_copies(v) for k, v in value.items()}
    return value


def traced_apis() -> list[tuple[object, str, str]]:
    """(owner, attribute, entry prefix) of every function and method the trace wraps, in this MindSpore."""
    found = []
    for owner, prefix in ((mint, MINT), (mint.nn.functional, MINT_FUNCTIONAL)):
        for name in sorted(vars(owner)):
            value = vars(owner)[name]
            if not name.startswith("_") and isinstance(value, (types.FunctionType, types.BuiltinFunctionType)):
                found.append((owner, name, prefix))
    for name in MSPROBE_OPS:
        value = getattr(ops, name, None)
        if isinstance(value, (types.FunctionType, types.BuiltinFunctionType)):
            found.append((ops, name, FUNCTIONAL))
    for name in MSPROBE_TENSOR_METHODS:
        try:
            value = inspect.getattr_static(ms.Tensor, name)
        except AttributeError:
            continue
        if isinstance(value, (types.FunctionType, types.MethodDescriptorType, types.WrapperDescriptorType)):
            found.append((ms.Tensor, name, TENSOR))
    return found


def host_checksum(tensor: ms.Tensor) -> tuple[int, int]:
    """The two sums of the tensor's bytes in memory order, with numpy on the host (the CPU's way)."""
    array = tensor.asnumpy()  # its elements in logical order
    order = _memory_permutation(tensor)
    if order is not None:
        array = np.transpose(array.reshape([n for n in array.shape if n != 1]), order)
    raw = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    if raw.size % 4:
        raw = np.concatenate([raw, np.zeros(4 - raw.size % 4, np.uint8)])
    words = raw.view(np.uint32)
    total = weighted = 0
    for start in range(0, words.size, _CHUNK):  # uint64 sums wrap mod 2^64, which keeps them right mod 2^32
        chunk = words[start:start + _CHUNK].astype(np.uint64)
        total += int(chunk.sum(dtype=np.uint64))
        weighted += int((chunk * np.arange(start, start + chunk.size, dtype=np.uint64)).sum(dtype=np.uint64))
    return total & CHECKSUM_MASK, weighted & CHECKSUM_MASK


def device_checksum(tensor: ms.Tensor) -> ms.Tensor:
    """The two sums (int64, to be read mod 2^32) computed with MindSpore operators on the tensor's device: its
    bytes in memory order viewed as 32-bit words (a signed word is its unsigned self mod 2^32)."""
    order = _memory_permutation(tensor)
    data = tensor
    if order is not None:
        data = mint.permute(data.reshape([n for n in tensor.shape if n != 1]), tuple(order))
    flat = data.contiguous().reshape(-1).view(ms.uint8)
    if flat.shape[0] % 4:
        flat = mint.cat([flat, mint.zeros(4 - flat.shape[0] % 4, dtype=ms.uint8)])
    words = flat.view(ms.int32).astype(ms.int64)
    index = ops.arange(words.shape[0], dtype=ms.int64)
    return mint.cat([words.sum().reshape(1), (words * index).sum().reshape(1)])


def _memory_permutation(tensor: ms.Tensor) -> list[int] | None:
    """For a view whose elements fill one block of memory in another order (a transposed weight): the order of
    its non-unit dimensions from the outermost in memory, so the elements are read as memory holds them (what the
    PyTorch checksum reads); None for a contiguous tensor or one with gaps (read in logical order)."""
    if not hasattr(tensor, "is_contiguous") or tensor.is_contiguous():
        return None
    dims = [(int(stride), int(size), index) for index, (stride, size) in
            enumerate((s, n) for s, n in zip(tensor.stride(), tensor.shape) if n != 1)]
    expected = 1
    for stride, size, _ in sorted(dims):
        if stride != expected:
            return None
        expected *= size
    return [index for _, _, index in sorted(dims, reverse=True)]


def _cell_hook_state(cell: nn.Cell) -> tuple[nn.Cell, dict, bool]:
    """What registering hooks changes on a cell, as it is before: the hook dictionaries MindSpore creates on
    first use (None until then) and whether it holds a backward-hook primitive."""
    state = {name: value for name, value in cell.__dict__.items() if value is None and
             (name in _CELL_HOOK_STATE or name.startswith("_lazy_") and "hook" in name)}
    return cell, state, "_cell_backward_hook" in (cell.__dict__.get("_primitives") or {})


def _forward_hook(cell: nn.Cell, hook):
    """A forward hook that runs also when the cell's forward raises (the cell stack stays right), where this
    MindSpore has ``always_call``."""
    try:
        return cell.register_forward_hook(hook, always_call=True)
    except TypeError:
        return cell.register_forward_hook(hook)


def _put_back(installed: list[tuple]) -> None:
    """Gives each owner the attribute its ``__dict__`` held (deleting ours where it held none: a method then
    comes from the base class again, as before)."""
    for owner, name, before, _ in reversed(installed):
        if before is _MISSING:
            delattr(owner, name)
        else:
            setattr(owner, name, before)


def _concatenated(rows: list, width: int) -> np.ndarray:
    if not rows:
        return np.zeros((0, width))
    return mint.cat(rows).asnumpy()


def _leaves(value) -> list:
    """The arguments of a call flattened as msprobe flattens them: tuples, lists and dicts opened."""
    if isinstance(value, (list, tuple)):
        return [leaf for item in value for leaf in _leaves(item)]
    if isinstance(value, dict):
        return [leaf for item in value.values() for leaf in _leaves(item)]
    return [value]


def _no_grad():
    from mindspore.common import _no_grad as no_grad
    return no_grad()


def _jit_executor():
    try:
        from mindspore.graph.api import _JitExecutor
    except ImportError:  # another MindSpore: jit functions are not told apart
        return None
    return _JitExecutor
