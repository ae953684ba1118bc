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
