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


def summary_all_gather() -> "SummaryAllGather":
    """The all-gather of rank-0 aggregated metrics (``tracking.aggregate``). A collective: every rank calls it once,
    where the monitor starts. See :class:`SummaryAllGather`."""
    global _gathers_made
    _gathers_made += 1
    return SummaryAllGather(_gathers_made)


class SummaryAllGather:
    """Gathers every rank's vector on a gloo group of its own, so the probe's collectives (on the writer thread)
    never interleave with training's on the default group, and time out after ``GATHER_TIMEOUT_SECONDS``;
    :meth:`close` destroys that group, at ``stop()`` once the sinks are closed (each monitor made one it kept).

    The end-of-run exchange (``END_OF_RUN``) goes through the job's rendezvous store instead: it runs at ``stop()``,
    and a gloo collective right before the job's ``destroy_process_group()`` aborted the process now and then
    (``terminate called without an active exception``, about one run in ten on a loaded machine)."""

    def __init__(self, number: int):
        from datetime import timedelta

        from msprobe_mlflow.compat import default_store
        from msprobe_mlflow.tracking.aggregate import GATHER_TIMEOUT_SECONDS

        self.timeout = timedelta(seconds=GATHER_TIMEOUT_SECONDS)
        self.group = torch.distributed.new_group(backend="gloo", timeout=self.timeout)
        self.store = default_store()
        self.size, self.rank = world_size(), current_rank()
        self.keys = [f"msprobe_mlflow/end_of_run/{number}/{r}" for r in range(self.size)]  # one set per monitor

    def __call__(self, vector):
        import numpy as np

        from msprobe_mlflow.tracking.aggregate import END_OF_RUN

        vector = np.ascontiguousarray(vector, dtype=np.float64)
        if vector[0] == END_OF_RUN:  # every rank sets its vector and waits for all (so all fail alike); rank 0 reads
            self.store.set(self.keys[self.rank], vector.tobytes())
            self.store.wait(self.keys, self.timeout)
            if self.rank != 0:  # the others need not read N keys each (N x N requests to the store at a large end)
                return np.tile(vector, (self.size, 1))
            return np.stack([np.frombuffer(self.store.get(key), dtype=np.float64) for key in self.keys])
        mine = torch.from_numpy(vector)
        everyone = [torch.empty_like(mine) for _ in range(self.size)]
        torch.distributed.all_gather(everyone, mine, group=self.group)
        return torch.stack(everyone).numpy()

    def close(self) -> None:
        """Destroys the gloo group (a local call, no collective: each rank at its own ``stop()``). Nothing to do once
        the job destroyed every group itself (``destroy_process_group()`` before ``stop()``)."""
        group, self.group = self.group, None
        if group is not None and is_distributed():
            torch.distributed.destroy_process_group(group)


_gathers_made = 0  # the same count on every rank: each monitor makes its gather collectively
