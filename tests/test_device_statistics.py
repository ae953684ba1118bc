"""The accelerator path (one reused row buffer per dtype) gives the host path's exact numbers.

It runs here on CPU tensors: the torch ops a CUDA device runs (compiled there, eager here), without the device."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from msprobe_mlflow.layout import StatisticsLayout
from msprobe_mlflow.levels import LEVELS, recorded_level
from msprobe_mlflow.statistics_table import EXPONENT_LOW, ZERO_BIN, exponent_counts
from msprobe_mlflow.torch_kernels.statistics import ROW, StatisticsCache, _device_statistics, _host_statistics


def awkward_gradients() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [
        torch.randn(ROW * 3 + 5, generator=generator),                           # rows, the last partly padding
        torch.tensor([0.0, -0.0, float("nan"), float("inf"), -float("inf"), -1.0, 0.5]),
        torch.zeros(0),                                                          # empty
        torch.tensor(-2.5),                                                      # scalar
        torch.randn(33, 7, generator=generator).to(torch.bfloat16),
        torch.randn(5, generator=generator, dtype=torch.float64),
        torch.randn(ROW * 2, generator=generator).to(torch.float16),            # several rows, half
        torch.randn(9, generator=generator),
    ]


@pytest.mark.parametrize("level", ["L0", "L1", "L2"])
def test_device_path_equals_host_path(level):
    grads = awkward_gradients()
    norms = torch._foreach_norm(grads)
    bounds = [np.float32(b) for b in (-1, -0.25, 0, 0.5)]
    recorded = recorded_level(level, exponents=True)  # the opt-in exponent counts on both paths too
    host_statistics, host_signs, host_values = _host_statistics(grads, recorded, bounds)
    statistics, signs, values = _device_statistics(grads, norms, recorded, bounds)()
    np.testing.assert_array_equal(statistics, host_statistics)
    if level == "L0":
        np.testing.assert_array_equal(values, host_values)
        assert signs is None
    else:
        np.testing.assert_array_equal(signs, host_signs)


def test_host_path_counts_match_numpy_by_hand():
    grad = torch.tensor([-2.0, -1.0, -0.5, 0.0, -0.0, 0.25, 1.0, 3.0, float("nan")])
    statistics, signs, _ = _host_statistics([grad], recorded_level("L2", exponents=True),
                                            [np.float32(b) for b in (-1, 0, 1)])
    # max, min are NaN (NaN propagates); counts of x <= -1, <= 0, <= 1 and == 0 exclude the NaN.
    assert np.isnan(statistics[0]) and np.isnan(statistics[1])
    assert statistics[3:7].tolist() == [2, 5, 7, 2]
    # exponents: -2.0 and 3.0 at 1; -1.0 and 1.0 at 0; -0.5 at -1; 0.25 at -2; then 2 zeros and the NaN.
    exponents = statistics[7:]
    assert {EXPONENT_LOW + b: int(exponents[b]) for b in np.flatnonzero(exponents[:ZERO_BIN])} == \
        {1: 2, 0: 2, -1: 1, -2: 1}
    assert exponents[ZERO_BIN:].tolist() == [2, 1]
    assert signs.tolist() == [np.packbits([0, 0, 0, 0, 0, 1, 1, 1, 0])[0], 0]


@pytest.mark.parametrize("level", ["L0", "L1", "L2"])
def test_results_of_several_devices_merge_back_into_parameter_order(level):
    """CPU offload puts some gradients on the host and others on the accelerator: each device's group is
    computed apart, then merged; here two CPU groups stand in for two devices."""
    from msprobe_mlflow.torch_kernels.statistics import _launch_group

    grads = awkward_gradients()
    bounds = [np.float32(b) for b in (-1, 0, 1)]
    whole = _host_statistics(grads, LEVELS[level], bounds)
    groups = [[0, 2, 5], [1, 3, 4, 6, 7]]
    parts = [(indices, _launch_group([grads[i] for i in indices], LEVELS[level], bounds)()) for indices in groups]
    merged = StatisticsLayout(level, bounds, [g.numel() for g in grads]).merge(parts)
    for expected, found in zip(whole, merged):
        if expected is None:
            assert found is None
        else:
            np.testing.assert_array_equal(found, expected)


@pytest.mark.parametrize("level", ["L1", "L2"])
def test_gradients_across_kernel_blocks_and_batched_small_ones_give_numpy_numbers(level):
    """Gradients split across the kernel's blocks (sizes around ``BLOCK``), and small ones sharing one kernel
    call, give what one numpy pass per gradient gives."""
    from msprobe_mlflow.torch_kernels.fused import BLOCK, SMALL_ARRAY

    generator = torch.Generator().manual_seed(1)
    sizes = [BLOCK - 1, BLOCK, BLOCK + 3, 2 * BLOCK + 9, SMALL_ARRAY - 1, SMALL_ARRAY + 1, 101, 51]
    grads = awkward_gradients()[1:] + [torch.randn(n, generator=generator) for n in sizes] + [torch.randn(3, 17)]
    bounds = [np.float32(b) for b in (-1, 0, 1)]
    found, signs, _ = _host_statistics(grads, recorded_level(level, exponents=True), bounds)
    rows, counts, packed, exponents = [], [], [], []
    for grad in grads:
        values = grad.float().numpy().ravel() if grad.dtype != torch.float64 else grad.numpy().ravel()
        with np.errstate(invalid="ignore"):
            high, low = (values.max(), values.min()) if values.size else (np.nan, np.nan)
        rows.append([np.float32(high), np.float32(low), np.float32(torch.linalg.vector_norm(grad).float())])
        counts += [np.count_nonzero(values <= b) for b in bounds] + [np.count_nonzero(values == 0)]
        packed.append(np.packbits(values > 0))
        exponents.append(exponent_counts(values))
    expected = np.concatenate([np.array(rows, np.float64).reshape(-1), *([counts] if level == "L2" else []),
                               np.concatenate(exponents)])
    np.testing.assert_array_equal(found, expected)
    np.testing.assert_array_equal(signs, np.concatenate(packed))


def dispatched_ops(grads: list[torch.Tensor], level: str) -> list[str]:
    """The top-level torch ops that queuing one step on the device path dispatches, as the profiler records them."""
    from torch.profiler import ProfilerActivity, profile

    norms = torch._foreach_norm(grads)
    bounds = [np.float32(b) for b in (-1, 0, 1)]
    cache = StatisticsCache()
    _device_statistics(grads, norms, LEVELS[level], bounds, cache=cache)()  # the buffer and constants made once
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        _device_statistics(grads, norms, LEVELS[level], bounds, cache=cache)
    return sorted(event.name for event in profiler.events() if event.cpu_parent is None)


@pytest.mark.parametrize("level", ["L0", "L1", "L2"])
def test_the_ops_dispatched_per_step_do_not_grow_with_the_number_of_gradients(level):
    def model(tensors: int) -> list[torch.Tensor]:  # weights and biases, as nn.Linear(64, 64) layers have
        return [torch.randn(64, 64) if i % 2 == 0 else torch.randn(64) for i in range(tensors)]

    few, many = dispatched_ops(model(32), level), dispatched_ops(model(512), level)
    assert many == few
    assert len(many) < 512 // 4  # a few per statistic, not one per gradient


@pytest.mark.parametrize("values, maximum, minimum", [([-0.0, 0.0, -1.0], "0.0", "-1.0"),
                                                      ([0.0, -0.0, 1.0], "1.0", "-0.0"),
                                                      ([-0.0, -0.0], "-0.0", "-0.0")])
def test_signed_zeros_order_below_and_above_each_other_on_both_paths(values, maximum, minimum):
    """Of +0.0 and -0.0, max is +0.0 and min -0.0, whatever their order (torch.max and np.max depend on it)."""
    grads = [torch.tensor(values)]
    norms, bounds = torch._foreach_norm(grads), [np.float32(0)]
    for statistics in (_host_statistics(grads, LEVELS["L1"], bounds)[0],
                       _device_statistics(grads, norms, LEVELS["L1"], bounds)()[0]):
        assert [repr(float(v)) for v in statistics[:2]] == [maximum, minimum]
