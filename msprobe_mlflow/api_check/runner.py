"""Runs each recorded call in MindSpore (tested) and torch (benchmark), forward and backward, and compares.

``Mint.X`` maps to ``mindspore.mint.X`` / ``torch.X``, ``MintFunctional.X`` to ``mindspore.mint.nn.functional.X``
/ ``torch.nn.functional.X``. Both frameworks get the same inputs in the recorded dtype. Statistics task: the tested
outputs come from running MindSpore here; tensor task: they are the recorded ones (MindSpore does not run).

Backward: the recorded backward ``input`` is the sensitivity (the gradient of each forward output); MindSpore
differentiates with ``GradOperation(get_all=True, sens_param=True)``, torch with autograd. Gradients are taken with
respect to the floating-point tensors among the positional arguments (tuple arguments such as ``cat``'s included,
depth first); ``backward.output.i`` is the gradient of the ``i``-th positional tensor, and int or bool tensors get
no row (they have no gradient). In the tensor task a recorded gradient of null (the input needed none) gets no row
either. A call MindSpore or torch cannot run here is a ``skip`` with the framework's message. A call that needs
more memory than this machine has is ``out_of_memory``: refused before anything is allocated when its recorded
tensors alone need more than is available (``memory``), or when a framework or numpy fails to allocate.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import mindspore
import numpy as np
import torch

from msprobe_mlflow.api_check.inputs import (InputCache, InputError, TensorPair, MINDSPORE_DTYPES, TORCH_DTYPES,
                                              dtype_name, make_pair, recorded_values, to_float64)
from msprobe_mlflow.api_check.memory import lack_of_memory
from msprobe_mlflow.api_check.metrics import ERROR, OUT_OF_MEMORY, SKIP, Thresholds, compare_arrays
from msprobe_mlflow.api_check.parser import (DTYPE_TYPE, FLOAT_DTYPES, ApiCall, Argument, ForwardEntry,
                                              TensorArg, ValueArg)
from msprobe_mlflow.api_check.results import (INCOMPLETE_ENTRY, MINDSPORE_CANNOT_RUN, NO_BENCHMARK, NO_GRADIENT,
                                               NO_KERNEL, NOT_IN_MINDSPORE, UNKNOWN_API, ApiResult, OutputResult,
                                               SideResult, side_from_outputs)

MODULES = {
    "Mint": (("mindspore.mint", lambda: mindspore.mint), ("torch", lambda: torch)),
    "MintFunctional": (("mindspore.mint.nn.functional", lambda: mindspore.mint.nn.functional),
                       ("torch.nn.functional", lambda: torch.nn.functional)),
}
DESCRIPTION_LIMIT = 500
# How the frameworks say that an allocation failed on the CPU: a RuntimeError, not a MemoryError.
ALLOCATION_FAILURES = ("DefaultCPUAllocator: can't allocate memory", "Allocate memory failed")


class _SideStopped(Exception):
    """A forward or backward check that ends before comparing; ``status`` is ``skip`` (``skip_group`` says why),
    ``error`` or ``out_of_memory``."""

    def __init__(self, status: str, message: str, skip_group: str = ""):
        super().__init__(message)
        self.status, self.message, self.skip_group = status, message, skip_group


@dataclass
class _Observed:
    """One output ready to compare: float64 values (``None`` if not a tensor), msprobe dtype name, shape."""

    values: np.ndarray | None
    dtype: str
    shape: tuple[int, ...] | None

    @classmethod
    def of(cls, value) -> _Observed:
        shape = tuple(value.shape) if isinstance(value, (mindspore.Tensor, torch.Tensor)) else None
        return cls(to_float64(value), dtype_name(value), shape)


def prepare_worker_process() -> None:
    """A worker process's MindSpore: PyNative mode (each API runs on its own, as recorded) with blocking launches,
    so that a failing kernel raises at its own call: without it an unregistered CPU kernel can make the next,
    valid, op fail too. Both apply to the whole process, and MindSpore cannot turn blocking launches off again:
    hence a process of its own (``replay``)."""
    mindspore.set_context(mode=mindspore.PYNATIVE_MODE)
    mindspore.runtime.launch_blocking()


@contextmanager
def pynative_mode() -> Iterator[None]:
    """PyNative mode for the block, the caller's mode (graph mode in a training script) restored after it."""
    previous = mindspore.get_context("mode")
    if previous != mindspore.PYNATIVE_MODE:
        mindspore.set_context(mode=mindspore.PYNATIVE_MODE)
    try:
        yield
    finally:
        if previous != mindspore.PYNATIVE_MODE:
            mindspore.set_context(mode=previous)


def check_call(call: ApiCall, task: str, thresholds: Thresholds, cache: InputCache | None = None) -> ApiResult:
    """The verdict for one API call; never raises for a problem of the call's own entries or frameworks. Inputs
    come from ``cache`` when given, except for a call that may change them in place (``_in_place``)."""
    inputs = describe_inputs(call.forward) if call.forward is not None else {}
    stop = (ERROR, call.problem) if call.problem else (SKIP, call.skip_reason) if call.skip_reason else None
    if stop is None and (lacking := lack_of_memory(call)) is not None:
        stop = (OUT_OF_MEMORY, lacking)
    if stop is not None:
        sides = {side: _stopped_side(call, side, *stop, call.skip_group) for side in ("forward", "backward")
                 if getattr(call, f"has_{side}")}
        if not sides:
            return ApiResult(call.name, stop[0], stop[1], inputs=inputs, skip_group=call.skip_group)
        return ApiResult.from_sides(call.name, sides.get("forward"), sides.get("backward"), inputs)
    checker = _CallChecker(call, task, thresholds, None if _in_place(call) else cache)
    forward = checker.side("forward", checker.forward) if call.has_forward else None
    backward = checker.side("backward", checker.backward) if call.has_backward else None
    return ApiResult.from_sides(call.name, forward, backward, inputs)


def _in_place(call: ApiCall) -> bool:
    """An in-place API by both frameworks' convention (``add_``), or one called with ``inplace=True``."""
    inplace = call.forward.kwargs.get("inplace") if call.forward is not None else None
    return call.function.endswith("_") or (isinstance(inplace, ValueArg) and inplace.value is True)


def _stopped_side(call: ApiCall, side: str, status: str, message: str, skip_group: str = "") -> SideResult:
    return SideResult(status, message, [OutputResult(f"{call.name}.{side}", status, message)],
                      skip_group if status == SKIP else "")


class _CallChecker:
    def __init__(self, call: ApiCall, task: str, thresholds: Thresholds, cache: InputCache | None):
        self.call, self.task, self.thresholds, self.cache = call, task, thresholds, cache

    def side(self, side: str, compute: Callable[[], list[OutputResult]]) -> SideResult:
        try:
            return side_from_outputs(compute())
        except _SideStopped as stopped:
            return _stopped_side(self.call, side, stopped.status, stopped.message, stopped.skip_group)
        except MemoryError as error:  # numpy making the inputs or the metrics' float64 copies
            return _stopped_side(self.call, side, OUT_OF_MEMORY, f"not checked: {_first_line(error)}")

    # --- what both sides need -------------------------------------------------------------------------------------

    def qualified_name(self, framework_index: int) -> str:
        """``mindspore.mint.nn.functional.relu`` (0) or ``torch.nn.functional.relu`` (1)."""
        return f"{MODULES[self.call.family][framework_index][0]}.{self.call.function}"

    def functions(self) -> tuple[Callable | None, Callable]:
        """(MindSpore function or None in the tensor task, torch function); a missing one skips the call, a name
        neither framework has is said to be one (a typo, or an API of another version)."""
        (mindspore_path, mindspore_module), (torch_path, torch_module) = MODULES[self.call.family]
        name = self.call.function
        torch_function = getattr(torch_module(), name, None)
        mindspore_function = getattr(mindspore_module(), name, None)
        if not callable(torch_function) and not callable(mindspore_function):
            raise _SideStopped(SKIP, f"neither {mindspore_path}.{name} (MindSpore {mindspore.__version__}) nor "
                                     f"{torch_path}.{name} (torch {torch.__version__}) exists: check the name "
                                     f"{self.call.name} in the dump", UNKNOWN_API)
        if not callable(torch_function):
            raise _SideStopped(SKIP, f"{torch_path}.{name} does not exist, so there is no benchmark", NO_BENCHMARK)
        if self.task == "tensor":
            return None, torch_function
        if not callable(mindspore_function):
            raise _SideStopped(SKIP, f"{mindspore_path}.{name} does not exist in MindSpore {mindspore.__version__}",
                               NOT_IN_MINDSPORE)
        return mindspore_function, torch_function

    def forward_entry(self, needed_by: str) -> ForwardEntry:
        call = self.call
        if call.forward_problem:
            raise _SideStopped(ERROR, call.forward_problem)
        if call.forward is None:
            raise _SideStopped(SKIP, f"{call.name}.forward is missing, so the {needed_by} cannot be run "
                                     "(it needs the forward inputs)", INCOMPLETE_ENTRY)
        return call.forward

    def materialize(self, argument: Argument, where: str):
        """The argument tree with each ``TensorArg`` replaced by a ``TensorPair`` holding its values."""
        if isinstance(argument, TensorArg):
            try:
                if self.cache is not None:
                    return self.cache.pair(argument, self.task, where)
                return make_pair(argument, recorded_values(argument, self.task, where))
            except InputError as error:
                raise _SideStopped(ERROR, str(error)) from None
        if isinstance(argument, tuple):
            return tuple(self.materialize(item, f"{where}[{i}]") for i, item in enumerate(argument))
        return argument

    def forward_inputs(self, entry: ForwardEntry) -> tuple[tuple, dict]:
        key = f"{self.call.name}.forward"
        args = tuple(self.materialize(arg, f"{key}: input_args[{i}]") for i, arg in enumerate(entry.args))
        kwargs = {name: self.materialize(arg, f"{key}: input_kwargs.{name}") for name, arg in entry.kwargs.items()}
        return args, kwargs

    def recorded_outputs(self, recorded: tuple[Argument, ...], where: str) -> list[_Observed]:
        """The tested outputs of the tensor task: the recorded tensors, loaded (``None`` entries compare as
        non-tensors)."""
        observed = []
        for i, spec in enumerate(_flatten(recorded)):
            if not isinstance(spec, TensorArg):
                observed.append(_Observed(None, type(spec).__name__ if spec is not None else "None", None))
                continue
            try:
                values = recorded_values(spec, self.task, f"{where}[{i}]")
            except InputError as error:
                raise _SideStopped(ERROR, str(error)) from None
            observed.append(_Observed(values.astype(np.float64), spec.dtype, spec.shape))
        return observed

    def compare(self, prefix: str, bench: list[_Observed], tested: list[_Observed],
                positions: list[int] | None = None) -> list[OutputResult]:
        positions = positions if positions is not None else list(range(max(len(bench), len(tested))))
        rows = []
        for slot, position in enumerate(positions):
            name = f"{prefix}.{position}"
            if slot >= len(bench) or slot >= len(tested):
                rows.append(OutputResult(name, ERROR, f"the benchmark has {len(bench)} outputs and the tested "
                                                      f"{len(tested)}, so output {position} has no counterpart"))
                continue
            b, t = bench[slot], tested[slot]
            comparison = compare_arrays(b.values, t.values, self.thresholds)
            rows.append(OutputResult(name, comparison.status, comparison.message, b.dtype, t.dtype,
                                     b.shape if b.shape is not None else t.shape, comparison.cosine,
                                     comparison.max_abs_err, comparison.max_relative_err))
        return rows

    # --- forward --------------------------------------------------------------------------------------------------

    def forward(self) -> list[OutputResult]:
        entry = self.forward_entry("forward")
        mindspore_function, torch_function = self.functions()
        args, kwargs = self.forward_inputs(entry)
        if self.task == "statistics":
            tested = [_Observed.of(value) for value in _flatten(self.run_mindspore(
                lambda: mindspore_function(*_for_mindspore(args), **_for_mindspore(kwargs))))]
        else:
            tested = self.recorded_outputs(entry.outputs, f"{self.call.name}.forward: output")
        bench = [_Observed.of(value) for value in _flatten(self.run_torch(
            lambda: torch_function(*_for_torch(args), **_for_torch(kwargs))))]
        return self.compare(f"{self.call.name}.forward.output", bench, tested)

    # --- backward -------------------------------------------------------------------------------------------------

    def backward(self) -> list[OutputResult]:
        call = self.call
        forward_entry = self.forward_entry("backward")
        if call.backward_problem:
            raise _SideStopped(ERROR, call.backward_problem)
        mindspore_function, torch_function = self.functions()
        args, kwargs = self.forward_inputs(forward_entry)
        leaves = _tensor_leaves(args)
        positions = [i for i, leaf in enumerate(leaves) if leaf.spec.dtype in FLOAT_DTYPES]
        if not positions:
            raise _SideStopped(SKIP, "no positional argument is a floating-point tensor, so there is no gradient "
                                     "to compare", NO_GRADIENT)
        key = f"{call.name}.backward"
        unmatched = []
        if self.task == "tensor":
            recorded = _flatten(call.backward.input_grads)
            unmatched = self.unmatched_gradients(recorded, leaves)
            positions = [i for i in positions if i < len(recorded) and recorded[i] is not None]
            if not positions and not unmatched:
                raise _SideStopped(SKIP, f"{key}: output records no gradient (null) for the floating-point inputs, "
                                         "so there is none to compare", NO_GRADIENT)
        if not positions:
            return unmatched
        sensitivities = [self.materialize(spec, f"{key}: input[{i}]")
                         for i, spec in enumerate(_flatten(call.backward.output_grads))]
        bench = self.torch_gradients(torch_function, args, kwargs, leaves, positions, sensitivities)
        if self.task == "statistics":
            tested = self.mindspore_gradients(mindspore_function, args, kwargs, leaves, positions, sensitivities)
        else:
            tested = self.recorded_outputs(tuple(recorded[i] for i in positions), f"{key}: output")
        # every compared position is inside the recorded list and every unmatched one beyond it: already in order
        return self.compare(f"{key}.output", bench, tested, positions) + unmatched

    def unmatched_gradients(self, recorded: list, leaves: list[TensorPair]) -> list[OutputResult]:
        """Error rows where the recorded gradients (one per positional tensor, by position; null for a tensor that
        needs no gradient) cannot be matched: a floating-point tensor past the end of the list, or a gradient past
        the last tensor. Which tensor each listed gradient belongs to is then ambiguous. A list that stops before
        tensors that need no gradient (int, bool) is not."""
        key = f"{self.call.name}.backward"
        ambiguous = ("which tensor each listed gradient belongs to is ambiguous (expected one entry per positional "
                     "tensor, null for one that needs no gradient)")
        rows = [OutputResult(f"{key}.output.{i}", ERROR,
                             f"{key}: output[{i}] is missing, the gradient of positional tensor {i} "
                             f"({leaves[i].spec.dtype} {list(leaves[i].spec.shape)}); {ambiguous}")
                for i in range(len(recorded), len(leaves)) if leaves[i].spec.dtype in FLOAT_DTYPES]
        rows += [OutputResult(f"{key}.output.{i}", ERROR, f"{key}: output[{i}] is a gradient, but the forward has "
                                                          f"only {len(leaves)} positional tensors; {ambiguous}")
                 for i in range(len(leaves), len(recorded)) if recorded[i] is not None]
        return rows

    def torch_gradients(self, function, args, kwargs, leaves, positions, sensitivities) -> list[_Observed]:
        differentiated = {id(leaves[i]): leaves[i].torch.detach().clone().requires_grad_(True) for i in positions}
        torch_args = _for_torch(args, lambda pair: differentiated.get(id(pair), pair.torch))

        def run():
            outputs = _flatten(function(*torch_args, **_for_torch(kwargs)))
            roots, grads = self.sensitivity_pairs(outputs, sensitivities, "torch")
            if not roots:
                raise _SideStopped(SKIP, f"no output of {self.call.function} in torch depends differentiably on "
                                         "the floating-point inputs", NO_GRADIENT)
            torch.autograd.backward(roots, grads)

        self.run_torch(run)
        gradients = [differentiated[id(leaves[i])].grad for i in positions]
        return [_Observed.of(grad if grad is not None else torch.zeros_like(differentiated[id(leaves[i])]))
                for grad, i in zip(gradients, positions)]

    def sensitivity_pairs(self, outputs: list, sensitivities: list, framework: str) -> tuple[list, list]:
        """(outputs to differentiate, their sensitivities); a null recorded sensitivity is zeros."""
        key = f"{self.call.name}.backward"
        if len(sensitivities) != len(outputs):
            raise _SideStopped(ERROR, f"{key}: input has {len(sensitivities)} gradients but the forward returns "
                                      f"{len(outputs)} outputs; expected one per output")
        roots, grads = [], []
        for i, (output, sensitivity) in enumerate(zip(outputs, sensitivities)):
            if framework == "torch" and not (isinstance(output, torch.Tensor) and output.requires_grad):
                continue
            if sensitivity is None:
                grads.append(torch.zeros_like(output) if framework == "torch"
                             else mindspore.Tensor(np.zeros(output.shape), dtype=output.dtype))
            elif not isinstance(sensitivity, TensorPair) or sensitivity.spec.shape != tuple(output.shape):
                found = list(sensitivity.spec.shape) if isinstance(sensitivity, TensorPair) else "not a tensor"
                raise _SideStopped(ERROR, f"{key}: input[{i}] is {found} but forward output {i} has shape "
                                          f"{list(output.shape)}; expected a gradient of that shape")
            else:
                grads.append(sensitivity.torch.to(output.dtype) if framework == "torch"
                             else sensitivity.mindspore if sensitivity.mindspore.dtype == output.dtype
                             else sensitivity.mindspore.astype(output.dtype))
            roots.append(output)
        return roots, grads

    def mindspore_gradients(self, function, args, kwargs, leaves, positions, sensitivities) -> list[_Observed]:
        differentiated = [leaves[i] for i in positions]
        mindspore_kwargs = _for_mindspore(kwargs)

        def forward(*tensors):
            replacement = {id(pair): tensor for pair, tensor in zip(differentiated, tensors)}
            return function(*_for_mindspore(args, lambda pair: replacement.get(id(pair), pair.mindspore)),
                            **mindspore_kwargs)

        def run():
            # One tensor object passed twice (the input cache's, for two arguments recorded alike) is differentiated
            # by MindSpore as one input, each getting the sum of both gradients: the repeats get copies.
            tensors, seen = [], set()
            for pair in differentiated:
                tensors.append(pair.mindspore.copy() if id(pair.mindspore) in seen else pair.mindspore)
                seen.add(id(pair.mindspore))
            _, grads = self.sensitivity_pairs(_flatten(forward(*tensors)), sensitivities, "mindspore")
            gradient_function = mindspore.ops.GradOperation(get_all=True, sens_param=True)(forward)
            return gradient_function(*tensors, grads[0] if len(grads) == 1 else tuple(grads))

        return [_Observed.of(grad) for grad in _flatten(self.run_mindspore(run))]

    # --- running the frameworks -----------------------------------------------------------------------------------

    def run_mindspore(self, run: Callable):
        try:
            return run()
        except _SideStopped:
            raise
        except Exception as error:  # noqa: BLE001 - any framework failure is reported, never raised
            _raise_if_out_of_memory(error, self.qualified_name(0))
            # MindSpore's words for an op this device has no kernel for: "The kernel Atan2Ext unregistered."
            group = NO_KERNEL if "unregistered" in str(error) else MINDSPORE_CANNOT_RUN
            raise _SideStopped(SKIP, f"MindSpore cannot run {self.qualified_name(0)} here: "
                                     f"{_first_line(error)}", group) from None

    def run_torch(self, run: Callable):
        try:
            return run()
        except _SideStopped:
            raise
        except Exception as error:  # noqa: BLE001
            _raise_if_out_of_memory(error, self.qualified_name(1))
            raise _SideStopped(SKIP, f"the benchmark {self.qualified_name(1)} cannot run these inputs: "
                                     f"{_first_line(error)}", NO_BENCHMARK) from None


def _raise_if_out_of_memory(error: Exception, function: str) -> None:
    if isinstance(error, MemoryError) or any(words in str(error) for words in ALLOCATION_FAILURES):
        raise _SideStopped(OUT_OF_MEMORY, f"not checked: {function} ran out of memory here: "
                                          f"{_first_line(error)}") from None


def _first_line(error: Exception, limit: int = 300) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = f"{type(error).__name__}: {lines[0] if lines else ''}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _flatten(value) -> list:
    """Tuples and lists (torch's named tuples included) flattened depth first; anything else is one item."""
    if isinstance(value, (tuple, list)):
        return [item for element in value for item in _flatten(element)]
    return [value]


def _tensor_leaves(tree) -> list[TensorPair]:
    return [leaf for leaf in _flatten(tree) if isinstance(leaf, TensorPair)]


def _for_framework(tree, framework: str, tensor_for: Callable[[TensorPair], object] | None):
    if isinstance(tree, TensorPair):
        return tensor_for(tree) if tensor_for is not None else getattr(tree, framework)
    if isinstance(tree, tuple):
        return tuple(_for_framework(item, framework, tensor_for) for item in tree)
    if isinstance(tree, dict):
        return {name: _for_framework(item, framework, tensor_for) for name, item in tree.items()}
    if isinstance(tree, ValueArg):
        if tree.type_name == DTYPE_TYPE:
            return (MINDSPORE_DTYPES if framework == "mindspore" else TORCH_DTYPES)[tree.value]
        return tree.value
    return tree


def _for_mindspore(tree, tensor_for=None):
    return _for_framework(tree, "mindspore", tensor_for)


def _for_torch(tree, tensor_for=None):
    return _for_framework(tree, "torch", tensor_for)


def describe(argument: Argument) -> str:
    """A short text for a recorded argument: ``Tensor Float32 [2, 3] in [-1.0, 1.0]``, ``int 1``, ``None``."""
    if argument is None:
        return "None"
    if isinstance(argument, tuple):
        return "(" + ", ".join(describe(item) for item in argument) + ")"
    if isinstance(argument, ValueArg):
        return f"{argument.type_name} {argument.value!r}"
    text = f"Tensor {argument.dtype} {list(argument.shape)}"
    if argument.data_path is not None:
        return f"{text} from {argument.data_path.name}"
    if argument.minimum is not None:
        return f"{text} in [{argument.minimum!r}, {argument.maximum!r}]"
    return text


def describe_inputs(entry: ForwardEntry) -> dict[str, str]:
    """One description per top-level argument, keyed ``input_args.0`` and ``input_kwargs.{name}``."""
    described = {f"input_args.{i}": describe(arg) for i, arg in enumerate(entry.args)}
    described.update({f"input_kwargs.{name}": describe(arg) for name, arg in entry.kwargs.items()})
    return {key: text if len(text) <= DESCRIPTION_LIMIT else text[: DESCRIPTION_LIMIT - 3] + "..."
            for key, text in described.items()}
