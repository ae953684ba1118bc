"""``mindspore.communication`` facts the monitor needs: this process's rank, the world size (0 and 1 until
``mindspore.communication.init()`` has run), and rank 0's MLflow run ID shared with every rank."""
from __future__ import annotations

import numpy as np

# MLflow run IDs match ``[a-zA-Z0-9][\w\-]{0,255}``: at most 256 characters.
RUN_ID_MAX_LENGTH = 256


def is_distributed() -> bool:
    from mindspore.communication.management import GlobalComm

    return bool(GlobalComm.INITED)


def current_rank() -> int:
    if not is_distributed():
        return 0
    from mindspore.communication import get_rank

    return get_rank()


def world_size() -> int:
    if not is_distributed():
        return 1
    from mindspore.communication import get_group_size

    return get_group_size()


def shared_run_id(local_run_id: str | None) -> str | None:
    """Rank 0's run ID on every rank (a collective: every rank must call it), so all ranks log into one run.

    Sent as one int32 tensor broadcast over the world group (MindSpore's collectives take tensors, not objects):
    the length, then the ID's UTF-8 bytes. An ID longer than MLflow allows is not shared: rank 0 keeps it and the
    other ranks get None (the local dump only) rather than a wrong run.
    """
    if world_size() == 1:
        return local_run_id
    import mindspore as ms
    from mindspore.communication import GlobalComm
    from mindspore.ops.communication import broadcast

    encoded = (local_run_id or "").encode() if current_rank() == 0 else b""
    buffer = np.zeros(RUN_ID_MAX_LENGTH + 1, np.int32)
    if len(encoded) <= RUN_ID_MAX_LENGTH:
        buffer[0] = len(encoded)
        buffer[1:1 + len(encoded)] = np.frombuffer(encoded, np.uint8)
    tensor = ms.Tensor(buffer)
    broadcast(tensor, 0, group=GlobalComm.WORLD_COMM_GROUP)  # in place; the group named: its default is Ascend's
    received = tensor.asnumpy()
    if current_rank() == 0:
        return local_run_id
    return bytes(received[1:1 + received[0]].astype(np.uint8)).decode() or None


def summary_all_gather() -> "SummaryAllGather":
    """The all-gather of rank-0 aggregated metrics (``tracking.aggregate``): see :class:`SummaryAllGather`."""
    return SummaryAllGather()


class SummaryAllGather:
    """Gathers every rank's vector on the world group, called on the writer thread. The float64 values travel as their bytes (int32 pairs): the CPU backend's AllGather rounds
    float64 to float32. :meth:`close` (at ``stop()``) has nothing to release: the world group is the job's."""

    def __init__(self):
        from mindspore import ops

        self.all_gather, self.size = ops.AllGather(), world_size()

    def __call__(self, vector: np.ndarray) -> np.ndarray:
        from mindspore import Tensor

        words = np.ascontiguousarray(vector, dtype=np.float64).view(np.int32)
        gathered = self.all_gather(Tensor(words)).asnumpy()
        return np.ascontiguousarray(gathered).view(np.float64).reshape(self.size, -1)

    def close(self) -> None:
        pass
