"""Whether this machine has the memory a recorded call needs, told before anything is allocated: a call too big for
the machine checking it gets the status ``out_of_memory`` ("not checked: needs N GiB"), never an ``error``, which
would read as the model's inaccuracy. Plain arithmetic on the recorded shapes and dtypes (and the tensor task's
file sizes); no framework is imported.
"""
from __future__ import annotations

import os
from pathlib import Path

from msprobe_mlflow.api_check.parser import ApiCall, TensorArg

ITEM_SIZES = {"Float16": 2, "BFloat16": 2, "Float32": 4, "Float64": 8, "Int8": 1, "UInt8": 1, "Int16": 2,
              "UInt16": 2, "Int32": 4, "UInt32": 4, "Int64": 8, "UInt64": 8, "Bool": 1}
MEMINFO = Path("/proc/meminfo")
# A cgroup's limit and usage (v2, then v1): a container sees the host's memory in /proc/meminfo, not its own limit.
CGROUP_FILES = ((Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory.current")),
                (Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"),
                 Path("/sys/fs/cgroup/memory/memory.usage_in_bytes")))


def memory_needed(call: ApiCall) -> int:
    """Bytes the check of ``call`` holds at least, estimated from its recorded tensors (forward inputs and outputs,
    backward inputs and outputs): ``elements * (8 + 2 * itemsize)`` each. Intermediate values of the API itself are
    not counted; a framework that runs out of memory on them is caught as it fails (``runner``)."""
    entries = []
    if call.forward is not None:
        entries += [call.forward.args, tuple(call.forward.kwargs.values()), call.forward.outputs]
    if call.backward is not None:
        entries += [call.backward.output_grads, call.backward.input_grads]
    # one float64 copy (the regenerated values, an output's values for the metrics), one per framework in its dtype
    return sum(_elements(tensor) * (8 + 2 * ITEM_SIZES[tensor.dtype]) for tensor in _tensors(tuple(entries)))


def _elements(tensor: TensorArg) -> int:
    """The recorded element count; in the tensor task no more than its ``.npy`` file can hold, so that a file that
    does not hold what the dump records is reported as such (an ``error``, when it is loaded) whatever the memory."""
    if tensor.data_path is None:
        return tensor.numel
    try:
        return min(tensor.numel, os.path.getsize(tensor.data_path) // ITEM_SIZES[tensor.dtype])
    except OSError:  # missing: an error when it is loaded
        return 0


def _tensors(argument) -> list[TensorArg]:
    if isinstance(argument, TensorArg):
        return [argument]
    if isinstance(argument, tuple):
        return [tensor for item in argument for tensor in _tensors(item)]
    return []


def available_memory() -> int | None:
    """Bytes that can still be allocated here: Linux's ``MemAvailable``, lowered to what a cgroup memory limit
    leaves; None where neither can be read (not Linux): the check then relies on catching the failure."""
    available = None
    try:
        for line in MEMINFO.read_text(encoding="ascii").splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    for limit_file, usage_file in CGROUP_FILES:
        try:
            limit, usage = limit_file.read_text().strip(), int(usage_file.read_text())
        except (OSError, ValueError):
            continue
        if limit.isdigit():  # "max": no limit
            left = max(int(limit) - usage, 0)
            available = left if available is None else min(available, left)
        break
    return available


def _gib(size: int) -> str:
    return f"{size / 2**30:.1f} GiB"


def lack_of_memory(call: ApiCall) -> str | None:
    """The ``out_of_memory`` message for a call that needs more memory than is available, else None."""
    needed, available = memory_needed(call), available_memory()
    if available is None or needed <= available:
        return None
    return (f"not checked: needs {_gib(needed)} of memory (estimated from the recorded shapes and dtypes), "
            f"{_gib(available)} available here")
