"""The CPU kernel (msprobe_mlflow.torch_kernels.fused) against numpy and torch computed here, on the edges: NaN, +-inf,
-0.0, empty arrays, sizes around the norm's rows of 8 and the kernel's blocks, float64, several threads."""
import numpy as np
import pytest
import torch

from msprobe_mlflow.torch_kernels import fused

BOUNDS = np.array([-1, 0, 1e-3], np.float32)
SIZES = [0, *range(1, 40), 100, fused.BLOCK - 1, fused.BLOCK, fused.BLOCK + 5, 3 * fused.BLOCK + 13]


def arrays_of(sizes, dtype, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(n) * rng.uniform(0.01, 100)).astype(dtype) for n in sizes]


def computed(arrays, bounds=BOUNDS):
    offsets = np.cumsum([0] + [(a.size + 7) // 8 for a in arrays])
    signs = np.full(offsets[-1], 0xAA, np.uint8)  # every byte must be written
    maxima, minima, counts, norms, _ = fused.statistics(arrays, bounds, with_counts=True, with_signs=True,
                                                     sign_offsets=list(offsets[:-1]), signs=signs, with_norms=True)
    return maxima, minima, counts, norms, [signs[offsets[i]:offsets[i + 1]] for i in range(len(arrays))]


def expected_extreme(array, reduction):
    """np.max/np.min, with +0.0 above -0.0 and NaN for an empty array or one holding NaN."""
    if not array.size or np.isnan(array).any():
        return np.nan
    value = reduction(array)
    if value == 0:
        zeros = array[array == 0]
        value = reduction(np.where(np.signbit(zeros), -1.0, 1.0)) * 0.0
    return value


def assert_matches(arrays, bounds=BOUNDS):
    maxima, minima, counts, norms, signs = computed(arrays, bounds)
    for i, array in enumerate(arrays):
        for found, reduction in ((maxima[i], np.max), (minima[i], np.min)):
            expected = expected_extreme(array, reduction)
            assert (np.isnan(found) and np.isnan(expected)) or (found == expected and
                                                                np.signbit(found) == np.signbit(expected)), i
        assert counts[i].tolist() == [int((array <= b).sum()) for b in bounds.astype(array.dtype)] + \
            [int((array == 0).sum())], i
        np.testing.assert_array_equal(signs[i], np.packbits(array > 0))
        if array.dtype == np.float32:  # bit for bit torch's norm, which the CSV has always held
            torch_norm = torch.linalg.vector_norm(torch.from_numpy(array)).numpy()
            assert norms[i].tobytes() == torch_norm.tobytes() or np.isnan(torch_norm) and np.isnan(norms[i]), i
        else:
            assert np.isnan(norms[i])  # left to torch


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_sizes_around_rows_and_blocks_match_numpy_and_torch(dtype):
    assert_matches(arrays_of(SIZES, dtype))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_nan_infinities_and_signed_zeros(dtype):
    """The max and min come from the words' extremes read signed and unsigned: all-negative and all-positive rows,
    and NaN with its sign bit set (the largest word read unsigned), each through the 8 lanes and the tail."""
    special = [np.array(v, dtype) for v in (
        [np.nan, 1.0, -2.0], [np.inf, -np.inf, 3.0], [-0.0, 0.0], [0.0, -0.0], [-0.0, -0.0, -0.0],
        [-np.inf] * 9, [1e-45, -1e-45, 0.0], [np.inf] * 17,
        [-3.0, -0.5, -7.0, -1e-30, -2.0, -0.25, -9.0, -1.5, -4.0], [-np.nan, -1.0, 2.0], [-np.nan, -1.0, -np.inf],
        [2.0, 0.5, 8.0, 1e-30, 3.0, 0.25, 9.0, 1.5, 4.0, 6.0], [-np.nan] * 10)]
    big = arrays_of([fused.BLOCK + 3], dtype)[0]
    big[fused.BLOCK + 1] = np.nan  # NaN in the last block only
    assert_matches(special + [big])


def test_bounds_compare_in_the_arrays_dtype():
    bound = np.float32(0.1)  # float64(0.1) < float32(0.1): a float64 array compares with the float32 bound's value
    values = np.array([0.1, np.float64(bound), 0.10000001], np.float64)
    assert_matches([values], np.array([bound], np.float32))


def test_many_small_arrays_share_a_call_and_big_ones_spread_over_threads(monkeypatch):
    monkeypatch.setattr(fused, "worker_threads", lambda: 2)
    sizes = [fused.SMALL_ARRAY - 1, 3, 0, fused.SMALL_ARRAY, 2 * fused.PARALLEL_MIN // 3, 5 * fused.BLOCK + 1]
    arrays = arrays_of(sizes, np.float32, seed=1)
    arrays[1][:] = [np.nan, -0.0, 0.0]
    assert_matches(arrays)
