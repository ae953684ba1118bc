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
