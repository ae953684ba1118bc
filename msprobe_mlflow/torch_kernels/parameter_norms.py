"""``statistics=["param_norm"]``: each monitored parameter's own L2 norm at the probed step, beside its gradient's.

Read in the optimizer's step pre-hook, before the update: the weights this step's forward and backward used. A
weight that changes without a gradient that moved it (a corrupted weight, a wrong shard loaded) shows there at once,
where the gradients show it first in the layer feeding it. One ``_foreach_norm`` per device, accumulated in float32
(float64 for float64 parameters) and not rounded to a bf16/fp16 parameter's dtype (its weights drift by less than
that dtype's step), stacked on the device and copied to the host without waiting (:mod:`.host_copy`). An FSDP2
parameter (a DTensor) gets its full norm from its shards' sums of squares, one ``all_reduce`` per process group.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from msprobe_mlflow.compat import foreach_norm
from msprobe_mlflow.torch_kernels.host_copy import start_host_copy
from msprobe_mlflow.torch_kernels.sharded import _dtensor_type, _sharding


def launch_parameter_norms(names: list[str], parameters: list[torch.Tensor]) -> Callable[[], np.ndarray]:
    """Starts computing each parameter's norm; the returned callable (off the training thread) gives them as
    float32, in the order given. A collective where parameters are sharded: every rank calls it alike."""
    if not parameters:
        return lambda: np.zeros(0, np.float32)
    DTensor = _dtensor_type()
    groups = [_sharding(p, name).group if DTensor is not None and isinstance(p, DTensor) else None
              for name, p in zip(names, parameters)]
    values = [p.to_local().detach() if DTensor is not None and isinstance(p, DTensor) else p.detach()
              for p in parameters]
    by_kind: dict[tuple, list[int]] = {}  # (device, the dtype the norm is accumulated in)
    for index, value in enumerate(values):
        accumulated = torch.float64 if value.dtype == torch.float64 else torch.float32
        by_kind.setdefault((value.device, accumulated), []).append(index)
    parts = []
    for (_, accumulated), indices in by_kind.items():
        norms = torch.stack(foreach_norm([values[i] for i in indices], dtype=accumulated)).double()
        sharded = {position: groups[i] for position, i in enumerate(indices) if groups[i] is not None}
        if sharded:
            norms = _full_norms(norms, sharded)
        parts.append((indices, start_host_copy(norms)))

    def resolve() -> np.ndarray:
        result = np.zeros(len(parameters), np.float32)
        for indices, norms in parts:
            result[indices] = norms()
        return result
    return resolve


def _full_norms(norms: torch.Tensor, sharded: dict[int, object]) -> torch.Tensor:
    """``norms`` with the shards' ones (position -> process group) made the full parameters': their squares summed
    over each group."""
    squares = norms.square()
    groups: dict[object, list[int]] = {}
    for position, group in sharded.items():
        groups.setdefault(group, []).append(position)
    for group, members in groups.items():
        summed = squares[members]
        dist.all_reduce(summed, op=dist.ReduceOp.SUM, group=group)
        squares[members] = summed
    return squares.sqrt()
