"""torch.distributed facts the monitor needs: this process's rank, the world size, and the shared run ID."""
from __future__ import annotations

import torch


def is_distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def current_rank() -> int:
    return torch.distributed.get_rank() if is_distributed() else 0


def world_size() -> int:
    return torch.distributed.get_world_size() if is_distributed() else 1


def shared_run_id(local_run_id: str | None) -> str | None:
    """Rank 0's run ID on every rank (a collective: every rank must call it), so all ranks log into one run."""
    if world_size() == 1:
        return local_run_id
    holder = [local_run_id if current_rank() == 0 else None]
    torch.distributed.broadcast_object_list(holder, src=0)
    return holder[0]


def summary_all_gather():
    """The all-gather of rank-0 aggregated metrics (``tracking.aggregate``). A collective: every rank calls it once,
    where the monitor starts. It makes a gloo group of its own, so the probe's collectives (on the writer thread)
    never interleave with training's on the default group, and time out after ``GATHER_TIMEOUT_SECONDS``."""
    from datetime import timedelta

    import numpy as np

    from msprobe_mlflow.tracking.aggregate import GATHER_TIMEOUT_SECONDS

    group = torch.distributed.new_group(backend="gloo", timeout=timedelta(seconds=GATHER_TIMEOUT_SECONDS))
    size = world_size()

    def gather(vector: np.ndarray) -> np.ndarray:
        mine = torch.from_numpy(np.ascontiguousarray(vector, dtype=np.float64))
        everyone = [torch.empty_like(mine) for _ in range(size)]
        torch.distributed.all_gather(everyone, mine, group=group)
        return torch.stack(everyone).numpy()

    return gather
