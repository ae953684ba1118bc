"""What the PyTorch statistics keep between steps (gradient-sized row buffers, small device constants, L0 host
snapshots) is released when a monitor stops: the bytes held come back to 0 and the buffers themselves are freed."""
from __future__ import annotations

import gc
import weakref

import numpy as np
import torch

from msprobe_mlflow import GradProbeConfig
from msprobe_mlflow.pytorch import GradientMonitor, statistics


def test_a_monitors_stop_releases_the_statistics_buffers(tmp_path):
    grads = [torch.randn(1000), torch.randn(3, 5)]
    buffer = statistics._row_buffer(grads)  # what a step on an accelerator makes, here on the CPU
    statistics._device_constant((1.0, 2.0), torch.float64, torch.device("cpu"))
    snapshot = np.empty(4096, np.float32)
    statistics.release_snapshot(snapshot)
    held = [weakref.ref(buffer.flat), weakref.ref(buffer.row_owner)]
    rows = -(-1000 // statistics.ROW) + 1
    assert statistics.cached_bytes() >= rows * statistics.ROW * 4 + 2 * 8 + snapshot.nbytes
    del buffer, snapshot

    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = GradientMonitor(GradProbeConfig(dump_path=str(tmp_path / "dump"), level="L1"),
                              log_to_mlflow=False).monitor(model, optimizer)
    model(torch.ones(3, 4)).sum().backward()
    optimizer.step()
    monitor.stop()
    gc.collect()
    assert monitor.errors == []
    assert statistics.cached_bytes() == 0
    assert [ref() for ref in held] == [None, None]
