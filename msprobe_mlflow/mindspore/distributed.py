"""``mindspore.communication`` facts the monitor needs: this process's rank and the world size (0 and 1 until
``mindspore.communication.init()`` has run)."""
from __future__ import annotations


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


def summary_all_gather():
    """The all-gather of rank-0 aggregated metrics (``tracking.aggregate``), on the world group, called on the
    writer thread. The float64 values travel as their bytes (int32 pairs): the CPU backend's AllGather rounds
    float64 to float32."""
    import numpy as np
    from mindspore import Tensor, ops

    all_gather = ops.AllGather()
    size = world_size()

    def gather(vector: np.ndarray) -> np.ndarray:
        words = np.ascontiguousarray(vector, dtype=np.float64).view(np.int32)
        return np.ascontiguousarray(all_gather(Tensor(words)).asnumpy()).view(np.float64).reshape(size, -1)

    return gather
