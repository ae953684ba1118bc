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
    never interleave with training's on the default group, and time out after ``GATHER_TIMEOUT_SECONDS``.

    The end-of-run exchange (``END_OF_RUN``) goes through the job's rendezvous store instead: it runs at ``stop()``,
    and a gloo collective right before the job's ``destroy_process_group()`` aborted the process now and then
    (``terminate called without an active exception``, about one run in ten on a loaded machine)."""
    from datetime import timedelta

    import numpy as np

    from msprobe_mlflow.compat import default_store
    from msprobe_mlflow.tracking.aggregate import END_OF_RUN, GATHER_TIMEOUT_SECONDS

    global _gathers_made
    _gathers_made += 1
    timeout = timedelta(seconds=GATHER_TIMEOUT_SECONDS)
    group = torch.distributed.new_group(backend="gloo", timeout=timeout)
    store = default_store()
    size, rank = world_size(), current_rank()
    keys = [f"msprobe_mlflow/end_of_run/{_gathers_made}/{r}" for r in range(size)]  # one set per monitor

    def gather(vector: np.ndarray) -> np.ndarray:
        vector = np.ascontiguousarray(vector, dtype=np.float64)
        if vector[0] == END_OF_RUN:  # every rank sets its vector and waits for all (so all fail alike); rank 0 reads
            store.set(keys[rank], vector.tobytes())
            store.wait(keys, timeout)
            if rank != 0:  # the others need not read N keys each (N x N requests to the store at a large job's end)
                return np.tile(vector, (size, 1))
            return np.stack([np.frombuffer(store.get(key), dtype=np.float64) for key in keys])
        mine = torch.from_numpy(vector)
        everyone = [torch.empty_like(mine) for _ in range(size)]
        torch.distributed.all_gather(everyone, mine, group=group)
        return torch.stack(everyone).numpy()

    return gather


_gathers_made = 0  # the same count on every rank: each monitor makes its gather collectively
