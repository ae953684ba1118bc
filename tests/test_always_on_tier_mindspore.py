"""The always-on tier through the real MindSpore monitor (CPU): the probe decides in the graph whether a step's
signs are computed, every N steps or in the window a trigger armed; statistics stay at every step."""
from __future__ import annotations

import numpy as np
import pytest

ms = pytest.importorskip("mindspore", reason="MindSpore is not installed (the torch-only stage)")
from mindspore import Tensor, nn  # noqa: E402

from mindspore_training import MLP, custom_loop, nan_in_the_first_bias_at, sine_batches, squared_error_of  # noqa: E402
from msprobe_mlflow import GradProbeConfig  # noqa: E402
from msprobe_mlflow.directions import read_step_directions  # noqa: E402
from msprobe_mlflow.dump import indexed_children, rank_dir, summary_csv_path, summary_steps  # noqa: E402
from msprobe_mlflow.mindspore import GradientMonitor  # noqa: E402

MODES = {"pynative": ms.PYNATIVE_MODE, "graph": ms.GRAPH_MODE}


@pytest.fixture(autouse=True)
def in_tmp_path_and_mode_restored(tmp_path, monkeypatch):
    """MindSpore writes compiler reports (rank_0/om/...) into the current folder."""
    monkeypatch.chdir(tmp_path)
    previous = ms.get_context("mode")
    yield
    ms.set_context(mode=previous)


def monitored_training(dump, steps: int, mode: str = "pynative", nan_at: int | None = None,
                       **options) -> GradientMonitor:
    """PyNative: ``optimizer(grads)`` from Python (``nan_at``: that step's gradients get a NaN), then a flush and a
    collection, so that a trigger is found and armed before the next step starts; graph: a ``TrainOneStepCell``
    and ``collect()`` after each step."""
    ms.set_context(mode=MODES[mode])
    ms.set_seed(0)
    net = MLP()
    optimizer = nn.SGD(net.trainable_params(), learning_rate=0.1)
    monitor = GradientMonitor(GradProbeConfig(dump_path=str(dump), level="L1"), log_to_mlflow=False, silent=True,
                              **options).monitor(optimizer)
    if mode == "graph":
        train_one_step = nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()), optimizer)
        for x, y in sine_batches(steps):
            train_one_step(Tensor(x), Tensor(y))
            monitor.collect()
    else:
        def judged_and_armed(step):
            monitor.flush()  # the writer thread has judged the step (and fired the trigger, if any)...
            monitor.collect()  # ...and the probe is armed before the next step

        custom_loop(squared_error_of(net), optimizer, sine_batches(steps),
                    change_gradients=nan_in_the_first_bias_at(nan_at), after_step=judged_and_armed)
    monitor.stop()
    return monitor


def direction_steps(dump) -> list[int]:
    return indexed_children(rank_dir(dump, 0), "step")


@pytest.mark.parametrize("mode", list(MODES))
def test_every_nth_step_has_directions_and_every_step_the_statistics_of_a_full_run(tmp_path, mode):
    full = monitored_training(tmp_path / "full", 7, mode)
    tier = monitored_training(tmp_path / "tier", 7, mode, directions_every_n_steps=3)
    assert full.errors == [] and tier.errors == []
    assert summary_steps(rank_dir(tmp_path / "tier", 0)) == list(range(7))
    assert direction_steps(tmp_path / "tier") == [0, 3, 6]
    for step in range(7):
        assert summary_csv_path(tmp_path / "tier", 0, step).read_bytes() == \
            summary_csv_path(tmp_path / "full", 0, step).read_bytes()
    for step in (0, 3, 6):
        tier_bits = read_step_directions(tmp_path / "tier" / "rank0" / f"step{step}")
        full_bits = read_step_directions(tmp_path / "full" / "rank0" / f"step{step}")
        assert tier_bits.keys() == full_bits.keys()
        for name in tier_bits:
            np.testing.assert_array_equal(tier_bits[name][1], full_bits[name][1])


def test_a_nan_gradient_arms_directions_for_the_next_steps_once(tmp_path):
    # the NaN step's statistics reach the writer after step 2, which arms the probe for steps 3 and 4
    monitor = monitored_training(tmp_path, 9, nan_at=2, directions_every_n_steps=0, directions_on_anomaly=True,
                                 directions_steps_after_anomaly=2)
    assert monitor.errors == []
    assert summary_steps(rank_dir(tmp_path, 0)) == list(range(9))
    assert direction_steps(tmp_path) == [3, 4]


def test_in_graph_mode_a_norm_spike_arms_the_compiled_probe(tmp_path):
    """A ``TrainOneStepCell`` at learning rate 0 on one batch (the same gradients every step); at step 6 the targets
    are 1000 times larger, so the gradient norms spike; flush and collect after each step, so the probe is armed
    before the next one."""
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_seed(0)
    net = MLP()
    optimizer = nn.SGD(net.trainable_params(), learning_rate=0.0)
    monitor = GradientMonitor(GradProbeConfig(dump_path=str(tmp_path), level="L1"), log_to_mlflow=False, silent=True,
                              directions_every_n_steps=0, directions_on_anomaly=True,
                              directions_steps_after_anomaly=2, spike_window=4).monitor(optimizer)
    train_one_step = nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()), optimizer)
    x = np.random.default_rng(1).standard_normal((8, 4)).astype(np.float32)
    for step in range(10):
        train_one_step(Tensor(x), Tensor(np.sin(x[:, :2]) * (1000.0 if step == 6 else 1.0)))
        monitor.collect()
        monitor.flush()
        monitor.collect()
    monitor.stop()
    assert monitor.errors == []
    assert summary_steps(rank_dir(tmp_path, 0)) == list(range(10))
    assert direction_steps(tmp_path) == [7, 8]
