"""Makes the example MindSpore API dumps in this folder by running real ``mindspore.mint`` ops on this CPU.

    .venv/bin/python examples/mindspore_api_dump/make_dump.py

writes ``statistics/api_info.json`` (task ``statistics``) and ``tensor/api_info.json`` with its
``tensor/dump_tensor_data/*.npy`` (task ``tensor``), in msprobe 1.0.3's ``dump.json`` format: the same keys
(``Mint.add.0.forward``), argument records, statistics (computed as msprobe does, in float32 for BFloat16 and
integer tensors, ``null`` for an empty tensor) and ``.npy`` names. Like msprobe, the backward entries come from a
cell backward hook: ``input`` is the gradient arriving at the outputs (0-d for a reduced loss), ``output`` the
gradient of each tensor input (``null`` for a bool input and for ``nll_loss``'s Int64 target, zeros for ``mul``'s
Int64 input: what MindSpore's hook gives), and a call whose tensors sit in a tuple argument (``cat``) gets no
backward entry because the hook does not fire for it. ``Mint.erfinv.0`` is a real MindSpore 2.10 CPU accuracy
problem (inputs near 1), so the example reports it as error. Two differences from msprobe: ``dump_data_dir`` is
written relative to the JSON file (so the example can move), and ``Mint.atan2.0``, whose kernel MindSpore does not
have on CPU, is recorded from torch's result, as a run on an Ascend device would have recorded it.
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import mindspore
import numpy as np
import torch
from mindspore import mint, nn, ops

HERE = Path(__file__).resolve().parent
DATA_FOLDER = "dump_tensor_data"


class Recorder:
    """Collects msprobe-style entries for one task; in the tensor task also saves each tensor as ``.npy``."""

    def __init__(self, task: str, folder: Path):
        self.task, self.folder, self.data = task, folder, {}
        self.counts: dict[str, int] = {}

    def next_name(self, family: str, function: str) -> str:
        prefix = f"{family}.{function}"
        index = self.counts.get(prefix, 0)
        self.counts[prefix] = index + 1
        return f"{prefix}.{index}"

    def describe(self, value, file_stem: str):
        """One argument as msprobe writes it; ``file_stem`` is ``Mint.add.0.forward.input.0`` (no ``.npy``)."""
        if isinstance(value, (tuple, list)):
            return [self.describe(item, f"{file_stem}.{i}") for i, item in enumerate(value)]
        if isinstance(value, (mindspore.Tensor, torch.Tensor)):
            return self.describe_tensor(*as_numpy(value), file_stem)
        if isinstance(value, bool | int | float | str):
            return {"type": type(value).__name__, "value": value}
        return None  # None, and what msprobe cannot serialise (a mindspore dtype), are written as null

    def describe_tensor(self, array: np.ndarray, dtype: str, file_stem: str) -> dict:
        record = {"type": "mindspore.Tensor", "dtype": dtype, "shape": list(array.shape)}
        if array.size == 0:
            record.update(Max=None, Min=None, Mean=None, Norm=None)
        elif dtype == "Bool":
            record.update(Max=bool(array.max()), Min=bool(array.min()), Mean=None, Norm=None)
        else:
            values = array.astype(np.float32)
            record.update(Max=float(values.max()), Min=float(values.min()), Mean=float(values.mean()),
                          Norm=float(np.linalg.norm(values)))
        if self.task == "tensor":
            data_name = f"{file_stem}.npy"
            np.save(self.folder / DATA_FOLDER / data_name, array)
            record["data_name"] = data_name
        return record

    def forward(self, name: str, args: tuple, kwargs: dict, outputs) -> None:
        self.data[f"{name}.forward"] = {
            "input_args": self.describe(list(args), f"{name}.forward.input"),
            "input_kwargs": {key: self.describe(value, f"{name}.forward.kwargs.{key}")
                             for key, value in kwargs.items()},
            "output": self.describe(list(outputs) if isinstance(outputs, tuple) else [outputs],
                                    f"{name}.forward.output"),
        }

    def backward(self, name: str, output_grads: tuple, input_grads: tuple) -> None:
        self.data[f"{name}.backward"] = {"input": self.describe(list(output_grads), f"{name}.backward.input"),
                                         "output": self.describe(list(input_grads), f"{name}.backward.output")}

    def write(self) -> Path:
        document = {"task": self.task, "level": "L1", "framework": "mindspore",
                    "dump_data_dir": DATA_FOLDER if self.task == "tensor" else None, "data": self.data}
        path = self.folder / "api_info.json"
        path.write_text(json.dumps(document, indent=1) + "\n", encoding="utf-8")
        return path


def as_numpy(tensor) -> tuple[np.ndarray, str]:
    """The values and msprobe's dtype name; BFloat16 is saved as float32 (as msprobe does)."""
    if isinstance(tensor, torch.Tensor):
        name = {torch.float32: "Float32", torch.float16: "Float16", torch.int64: "Int64", torch.bool: "Bool"}
        return tensor.detach().numpy(), name[tensor.dtype]
    if tensor.dtype == mindspore.bfloat16:
        return tensor.astype(mindspore.float32).asnumpy(), "BFloat16"
    return tensor.asnumpy(), str(tensor.dtype)


class _HookedCall(nn.Cell):
    """The API as a cell, so that a backward hook sees its gradients (msprobe wraps each API the same way)."""

    def __init__(self, function, kwargs):
        super().__init__()
        self.function, self.kwargs = function, kwargs

    def construct(self, *args):
        return self.function(*args, **self.kwargs)


def record_mint(recorder: Recorder, family: str, function: str, args: tuple, kwargs: dict | None = None,
                backward: bool = True) -> None:
    """Runs ``mindspore.mint[.nn.functional].function`` forward (and backward, through a cell hook, with a random
    sensitivity) and records what msprobe would record."""
    kwargs = kwargs or {}
    module = mint.nn.functional if family == "MintFunctional" else mint
    api = getattr(module, function)
    name = recorder.next_name(family, function)
    outputs = api(*args, **kwargs)
    recorder.forward(name, args, kwargs, outputs)
    if not backward:
        return
    seen = {}
    cell = _HookedCall(api, kwargs)
    cell.register_backward_hook(lambda _cell, grad_input, grad_output: seen.update(inputs=grad_input,
                                                                                  outputs=grad_output))
    sensitivity = random_like(outputs)
    ops.GradOperation(get_all=True, sens_param=True)(lambda *inputs: cell(*inputs))(*args, sensitivity)
    if seen:  # the hook does not fire when the tensors sit inside a tuple argument
        recorder.backward(name, as_tuple(seen["outputs"]), as_tuple(seen["inputs"]))


def record_other(recorder: Recorder, family: str, function, args: tuple) -> None:
    """A non-mint API (``Functional.relu`` is ``mindspore.ops.relu``): msprobe dumps these too."""
    name = recorder.next_name(family, function.__name__)
    recorder.forward(name, args, {}, function(*args))


def record_from_torch(recorder: Recorder, function: str, args: tuple) -> None:
    """An API this CPU's MindSpore cannot run, recorded from torch's forward and backward."""
    name = recorder.next_name("Mint", function)
    leaves = [torch.from_numpy(as_numpy(arg)[0]).requires_grad_(True) for arg in args]
    output = getattr(torch, function)(*leaves)
    sensitivity = torch.from_numpy(np.random.RandomState(7).uniform(-1, 1, tuple(output.shape)).astype(np.float32))
    output.backward(sensitivity)
    recorder.forward(name, args, {}, output.detach())
    recorder.backward(name, (sensitivity,), tuple(leaf.grad for leaf in leaves))


def as_tuple(value) -> tuple:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def random_like(outputs):
    if isinstance(outputs, tuple):
        return tuple(random_like(output) for output in outputs)
    values = np.random.RandomState(7).uniform(-1, 1, outputs.shape).astype(np.float32)
    return mindspore.Tensor(values).astype(outputs.dtype)


def tensor(shape, low=-1.0, high=1.0, dtype=mindspore.float32, seed=0):
    return mindspore.Tensor(np.random.RandomState(seed).uniform(low, high, shape).astype(np.float32)).astype(dtype)


def record_all(recorder: Recorder) -> None:
    x, y = tensor((2, 3), seed=1), tensor((2, 3), seed=2)
    record_mint(recorder, "Mint", "add", (x, y))
    record_mint(recorder, "Mint", "mul", (x, mindspore.Tensor(np.arange(6).reshape(2, 3))))  # Int64 input
    record_mint(recorder, "Mint", "matmul", (x, tensor((3, 4), seed=3)))
    record_mint(recorder, "Mint", "exp", (x,))
    record_mint(recorder, "MintFunctional", "relu", (x,))
    record_mint(recorder, "MintFunctional", "softmax", (x,), {"dim": -1})
    record_mint(recorder, "MintFunctional", "linear", (x, tensor((4, 3), seed=4), tensor((4,), seed=5)))
    record_mint(recorder, "Mint", "sum", (x,), {"dim": 1, "dtype": mindspore.float32})  # dtype= is written null
    record_mint(recorder, "Mint", "cat", ((x, y),), {"dim": 0})  # tuple input: no backward entry
    record_mint(recorder, "Mint", "where", (mindspore.Tensor(np.array([[True, False, True], [False, True, False]])),
                                            x, y))  # Bool input
    record_mint(recorder, "Mint", "matmul", (tensor((4, 8), 0, 2, mindspore.float16, 6),
                                             tensor((8, 4), 0, 2, mindspore.float16, 7)))  # Float16
    record_mint(recorder, "Mint", "add", (tensor((2, 3), dtype=mindspore.bfloat16, seed=8),
                                          tensor((2, 3), dtype=mindspore.bfloat16, seed=9)))  # BFloat16
    # MindSpore 2.10's CPU erfinv loses accuracy near ±1 (erfinv(0.999): 2.2777 where the answer is 2.3268)
    record_mint(recorder, "Mint", "erfinv", (tensor((2, 3), 0.99, 0.9995, seed=10),))
    # a reduced loss: its output, and so its backward input, is a 0-d tensor; the Int64 target needs no gradient
    record_mint(recorder, "MintFunctional", "nll_loss", (tensor((2, 3), -2.0, 0.0, seed=11),
                                                         mindspore.Tensor(np.array([0, 2]))))
    record_mint(recorder, "MintFunctional", "smooth_l1_loss", (x, y))
    record_from_torch(recorder, "atan2", (x, y))
    record_other(recorder, "Functional", ops.relu, (x,))


def main() -> int:
    mindspore.runtime.launch_blocking()
    for task in ("statistics", "tensor"):
        folder = HERE / task
        shutil.rmtree(folder, ignore_errors=True)
        (folder / DATA_FOLDER if task == "tensor" else folder).mkdir(parents=True)
        recorder = Recorder(task, folder)
        record_all(recorder)
        print(f"{recorder.write()}: {len(recorder.data)} entries", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
