"""What a monitor's statistics keep between its steps (gradient-sized row buffers, L0 host snapshots) is its own,
and is released when it stops: the buffers themselves are freed, and another monitor's are left alone."""
from __future__ import annotations

import gc
import weakref

import numpy as np
import torch

from msprobe_mlflow import GradProbeConfig
from msprobe_mlflow.pytorch import GradientMonitor
from msprobe_mlflow.torch_kernels.statistics import ROW, StatisticsCache


def trained_monitor(tmp_path, name: str) -> tuple[GradientMonitor, torch.nn.Module]:
    """L0 with the device checksum: the row-buffer path, which runs on the CPU too."""
    model = torch.nn.Linear(40, 30)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    config = GradProbeConfig(dump_path=str(tmp_path / name), level="L0", checksum="mix64")
    monitor = GradientMonitor(config, log_to_mlflow=False).monitor(model, optimizer)
    model(torch.ones(3, 40)).sum().backward()
    optimizer.step()
    return monitor, model


def test_a_monitors_stop_frees_its_buffers_and_leaves_another_monitors_alone(tmp_path):
    first, _ = trained_monitor(tmp_path, "first")
    second, _ = trained_monitor(tmp_path, "second")
    first._session.flush()  # the writer has taken the step: the buffers are held by the caches alone
    second._session.flush()
    held = {name: [weakref.ref(buffer.flat) for buffer in monitor._cache.row_buffers.values()]
            for name, monitor in (("first", first), ("second", second))}
    rows = -(-1200 // ROW) + -(-30 // ROW)
    assert len(held["first"]) == 1 and first._cache.nbytes() >= rows * ROW * 4

    first.stop()
    gc.collect()
    assert first.errors == [] and first._cache.nbytes() == 0
    assert [ref() for ref in held["first"]] == [None]
    assert all(ref() is not None for ref in held["second"])  # the other monitor keeps its own
    second.stop()
    gc.collect()
    assert [ref() for ref in held["second"]] == [None]


def test_an_l0_snapshot_is_reused_once_hashed_and_freed_at_release():
    cache = StatisticsCache()
    snapshot = cache.snapshot_buffer(1000)
    cache.release_snapshot(snapshot[:10])  # a view: its whole buffer comes back
    again = cache.snapshot_buffer(500)
    assert again.base is snapshot  # reused, not made afresh
    cache.release_snapshot(again)
    held = weakref.ref(cache.free_snapshots[0])
    assert cache.nbytes() == 1000 * np.dtype(np.float32).itemsize
    del snapshot, again
    cache.release()
    gc.collect()
    assert cache.nbytes() == 0 and held() is None
