"""Every backend against the statistic table's numpy reference (msprobe_mlflow.statistics_table.reference), on
the edges: NaN, +-inf, -0.0, empty, sizes not a multiple of 8, rows and blocks, bf16/fp16/float32/float64.

The backends: the CPU kernel (numba), the accelerator's row path (its torch ops, run here on CPU tensors), the
sharded partials, and MindSpore's graph (the real MindSpore). The reference itself is checked against numbers
written out by hand. Opt-in statistics are exercised with test entries of each reduction."""
from __future__ import annotations

import hashlib
import importlib.util
import math
import struct

import numpy as np
import pytest
import torch

from msprobe_mlflow import statistics_table
from msprobe_mlflow.levels import LEVELS, recorded_level
from msprobe_mlflow.records import record_from_statistics
from msprobe_mlflow.statistics_table import Statistic, reference

NAN, INF = math.nan, math.inf
BOUNDS = (-1, 0, 1e-3)  # 1e-3 is not a float32: compared as float32(1e-3)
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}
HAS_MINDSPORE = importlib.util.find_spec("mindspore") is not None


def absolute(x):  # element maps are plain functions (MindSpore's graph parses them), written with shared operators
    return abs(x)


def square(x):
    return x * x


def negative(x):
    return (x < 0) * 1.0


TEST_STATISTICS = (Statistic("abs_mean", absolute, "sum", finish=lambda reduced, numel: reduced / numel if numel
                             else math.nan),
                   Statistic("largest_square", square, "max"), Statistic("smallest_negative", negative, "min"))
EXTRA = tuple(statistic.name for statistic in TEST_STATISTICS)


@pytest.fixture(autouse=True)
def test_statistics(monkeypatch):
    for statistic in TEST_STATISTICS:
        monkeypatch.setitem(statistics_table.EXTRA, statistic.name, statistic)


def edge_gradients(dtype: torch.dtype) -> list[torch.Tensor]:
    rng = np.random.default_rng(0)
    values = [[NAN, 1.0, -2.0], [INF, -INF, 0.5], [-0.0, 0.0], [0.0, -0.0], [-0.0], [], [INF], [-INF, 3.0],
              [1e-45, -7e-39, 5 * 2.0 ** -149, 2.0 ** -126, -1e-300, 1e300, 2.0 ** 127, 6e-8],  # subnormals, beyond
              *(rng.standard_normal(n) * 3 for n in (1, 7, 9, 13, 3 * 512 + 5, 8192 + 13))]
    grads = [torch.tensor(v, dtype=torch.float64).to(dtype) for v in values]
    sprinkled = rng.standard_normal(3000)  # the edge values in an array long enough for the kernels' block paths
    sprinkled[::97] = np.resize(values[8] + [NAN, INF, -INF, 0.0, -0.0], len(sprinkled[::97]))
    return [*grads, torch.tensor(-2.5, dtype=dtype), torch.tensor(rng.standard_normal((3, 5))).to(dtype),
            torch.tensor(sprinkled).to(dtype)]


def on_cpu_kernel(grads, level):
    from msprobe_mlflow.torch_kernels.statistics import launch_step_statistics
    return launch_step_statistics(names(grads), grads, rank=0, step=0, level=level, bounds=BOUNDS, extra=EXTRA)()


def on_device_rows(grads, level):
    from msprobe_mlflow.torch_kernels.statistics import _device_statistics
    bounds32 = statistics_table.float32_bounds(BOUNDS)
    statistics, signs, values = _device_statistics(grads, torch._foreach_norm(grads), recorded_level(level), bounds32,
                                                   False, statistics_table.extra_statistics(EXTRA))()
    return decoded(grads, level, statistics, signs, values)


def on_sharded_partials(grads, level):
    from msprobe_mlflow.torch_kernels.sharded import launch_sharded_statistics
    return launch_sharded_statistics(names(grads), grads, rank=0, step=0, level=level, bounds=BOUNDS, extra=EXTRA)()


def on_mindspore(grads, level):
    import mindspore as ms
    from msprobe_mlflow.layout import StatisticsLayout
    from msprobe_mlflow.mindspore.probe import _statistics_graph
    from msprobe_mlflow.mindspore.statistics import prepare_extra, propagate_nan
    dtype = {torch.float32: ms.float32, torch.float64: ms.float64, torch.bfloat16: ms.bfloat16,
             torch.float16: ms.float16}[grads[0].dtype]
    tensors = tuple(ms.Tensor(g.double().numpy(), dtype) for g in grads)
    layout = StatisticsLayout(level, BOUNDS, [g.numel() for g in grads], extra=EXTRA)
    statistics, signs, values = _statistics_graph(ms.mutable(tensors), (True,) * len(grads),
                                                  layout.level.has_buckets, statistics_table.float32_bounds(BOUNDS),
                                                  prepare_extra(EXTRA), layout.level.has_exponents)
    statistics = propagate_nan(statistics.asnumpy(), layout)
    return decoded(grads, level, statistics, signs.asnumpy(), values.asnumpy())


def flushed(values):
    """``values`` with float32 subnormals made zeros of their sign."""
    return np.where(np.abs(values) < np.finfo(np.float32).tiny, values * 0, values).astype(np.asarray(values).dtype)


def names(grads):
    return [f"g{i}" for i in range(len(grads))]


def decoded(grads, level, statistics, signs, values):
    return record_from_statistics(rank=0, step=0, level=level, bounds=BOUNDS, names=names(grads),
                                  shapes=[g.shape for g in grads], statistics=statistics, signs=signs,
                                  float32_values=values, extra=EXTRA)


BACKENDS = {"cpu_kernel": on_cpu_kernel, "device_rows": on_device_rows, "sharded_partials": on_sharded_partials,
            "mindspore": pytest.param(on_mindspore, marks=pytest.mark.skipif(not HAS_MINDSPORE,
                                                                              reason="MindSpore is not installed"))}


def same(found, expected, rel: float = 0.0) -> bool:
    """Equal (NaN to NaN, and zeros of the same sign), or within ``rel``."""
    found, expected = float(found), float(expected)
    if math.isnan(expected) or math.isnan(found):
        return math.isnan(expected) and math.isnan(found)
    if rel == 0.0 or math.isinf(expected):
        return found == expected and math.copysign(1, found) == math.copysign(1, expected)
    return found == pytest.approx(expected, rel=rel)


NORM_TOLERANCE = {"float32": 1e-6, "float64": 1e-6, "bfloat16": 2 ** -8, "float16": 2 ** -11}  # summation order


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", BACKENDS.values(), ids=BACKENDS.keys())
def test_every_backend_records_what_the_numpy_reference_gives(backend, dtype):
    grads = edge_gradients(DTYPES[dtype])
    record, md5_record = backend(grads, recorded_level("L2", exponents=True)), backend(grads, "L0")
    signs = record.packed_directions()
    for i, grad in enumerate(grads):
        exact = grad.numpy() if grad.dtype == torch.float64 else grad.float().numpy()  # bf16/fp16 widen exactly
        expected = reference(exact, BOUNDS, EXTRA, dtype)
        if backend is on_mindspore:  # its compiled CPU kernels flush float32 subnormals to zero, read or written
            if dtype != "float64":
                expected = {**reference(flushed(exact), BOUNDS, EXTRA, dtype), "md5": expected["md5"]}
            else:  # cast to float32 for the MD5
                expected["md5"] = statistics_table.md5_hex(flushed(exact.astype(np.float32)))
            expected["max"], expected["min"] = flushed(expected["max"]), flushed(expected["min"])
        where = f"gradient {i} {grad.reshape(-1)[:4].tolist()} ({grad.numel()} elements)"
        found_max, found_min, found_norm = record.values[i]
        for key, found in (("max", found_max), ("min", found_min)):  # known: MindSpore's max and min do not order
            if backend is on_mindspore and expected[key] == 0 and found == 0:  # -0.0 below +0.0: either zero
                expected[key] = found
        assert same(found_max, expected["max"]), f"max of {where}: {found_max} != {expected['max']}"
        assert same(found_min, expected["min"]), f"min of {where}: {found_min} != {expected['min']}"
        assert same(found_norm, expected["norm"], NORM_TOLERANCE[dtype]), f"norm of {where}"
        assert record.bucket_counts[i].tolist() == expected["bucket_counts"], f"buckets of {where}"
        assert int(record.zero_counts[i]) == expected["zero_count"], f"zeros of {where}"
        np.testing.assert_array_equal(record.exponent_counts.full()[i], expected["exponent_counts"],
                                      err_msg=f"exponents of {where}")
        np.testing.assert_array_equal(signs[f"g{i}"], expected["signs"], err_msg=f"signs of {where}")
        widened_nan = dtype == "float16" or (dtype == "bfloat16" and backend is on_mindspore)
        if not (widened_nan and np.isnan(exact).any()):  # torch widens a float16 NaN (MindSpore a bfloat16 one in a
            assert md5_record.md5[i] == expected["md5"], f"MD5 of {where}"  # long array) to a kernel's payload
        for statistic in TEST_STATISTICS:
            found = record.extra[statistic.name][i]
            rel = 1e-6 if statistic.reduction == "sum" else 0.0
            assert same(found, expected[statistic.name], rel), f"{statistic.name} of {where}: {found}"


def test_the_reference_gives_the_numbers_written_out_by_hand():
    values = np.array([-2.0, -1.0, -0.5, 0.0, -0.0, 0.25, 1.0, 3.0, NAN], np.float32)
    found = reference(values, (-1, 0, 1), EXTRA)
    assert math.isnan(found["max"]) and math.isnan(found["min"]) and math.isnan(found["norm"])
    assert found["bucket_counts"] == [2, 3, 2, 2]  # {-2, -1}, {-0.5, 0, -0.0}, {0.25, 1}, {3, NaN}
    assert found["zero_count"] == 2
    assert found["signs"].tolist() == [0b00000111, 0]
    assert math.isnan(found["abs_mean"]) and math.isnan(found["largest_square"])
    assert found["smallest_negative"] == 0.0  # x < 0 is False for NaN

    finite = reference(np.array([3.0, -4.0, -0.0, 0.0], np.float32), (0.5,), EXTRA)
    assert (finite["max"], finite["min"], finite["norm"]) == (3.0, -4.0, 5.0)
    assert finite["abs_mean"] == np.float32(7 / 4) and finite["largest_square"] == 16.0
    assert finite["bucket_counts"] == [3, 1] and finite["zero_count"] == 2
    assert finite["md5"] == hashlib.md5(struct.pack("<4f", 3.0, -4.0, -0.0, 0.0)).hexdigest()
    signed = reference(np.array([-0.0, 0.0], np.float32), (0,))
    assert np.signbit(signed["min"]) and not np.signbit(signed["max"])
    assert reference(np.array([1.0, 1.0], np.float32), (0,), dtype="bfloat16")["norm"] == np.float32(1.4140625)
    assert reference(np.zeros(0, np.float32), (0,), EXTRA)["abs_mean"] != 0.0  # NaN: no element


def test_an_unknown_statistic_is_refused_naming_those_accepted():
    with pytest.raises(ValueError, match="'no_such'.*abs_mean"):
        statistics_table.extra_statistics(["no_such"])
    with pytest.raises(ValueError, match="reduction 'mean'.*sum, max, min"):
        Statistic("mean", absolute, "mean")


def test_opt_in_columns_reach_the_csv_after_norm_and_a_summary_metric():
    from msprobe_mlflow.metrics import record_metrics
    grads = [torch.tensor([1.0, -3.0]), torch.tensor([2.0, 0.0, -2.0, 4.0])]
    record = on_cpu_kernel(grads, "L1")
    assert record.csv_header() == ["param_name", "max", "min", "norm", *EXTRA, "shape"]
    assert record.csv_rows()[0][4:] == [2.0, 9.0, 0.0, [2]]
    metrics = record_metrics(record)
    assert metrics["grad/rank0/abs_mean"] == pytest.approx((2.0 * 2 + 2.0 * 4) / 6)  # weighted by elements
    assert metrics["grad/rank0/largest_square"] == pytest.approx((9.0 * 2 + 16.0 * 4) / 6)
    from msprobe_mlflow.torch_kernels.statistics import launch_step_statistics
    default = launch_step_statistics(["a", "b"], grads, rank=0, step=0, level="L1", bounds=BOUNDS)()
    assert default.csv_header() == ["param_name", "max", "min", "norm", "shape"] and default.extra is None
