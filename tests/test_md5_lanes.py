"""The L0 column's MD5s, 16 at a time (msprobe_mlflow.pytorch.md5), against hashlib: every length around the
64-byte blocks and the padding's two cases, more arrays than lanes, the dtypes and layouts hashlib takes instead."""
import hashlib

import numpy as np
import pytest

from msprobe_mlflow.pytorch import md5


def expected(arrays):
    return [hashlib.md5(np.ascontiguousarray(a, "<f4").tobytes()).hexdigest() for a in arrays]


@pytest.mark.parametrize("threads", [1, 2])
def test_digests_are_hashlibs_for_every_length_around_a_block_and_more_arrays_than_lanes(monkeypatch, threads):
    monkeypatch.setattr(md5, "worker_threads", lambda: threads)
    rng = np.random.default_rng(0)
    sizes = [*range(0, 50), 1000, 4096, 100_003, *rng.integers(0, 5000, 40)]  # 16 floats fill a block
    arrays = [rng.standard_normal(int(n)).astype(np.float32) for n in sizes]
    arrays[3][:] = [np.nan, -0.0, np.inf]
    assert md5.md5_digests(arrays) == expected(arrays)
    big = [rng.standard_normal(md5.PARALLEL_MIN // 3 + k).astype(np.float32) for k in range(20)]  # threads apply
    assert md5.md5_digests(big) == expected(big)


def test_other_dtypes_and_layouts_are_hashed_as_their_float32_bytes(monkeypatch):
    monkeypatch.setattr(md5, "worker_threads", lambda: 2)
    rng = np.random.default_rng(1)
    arrays = [rng.standard_normal(9), rng.standard_normal((40, 6)).astype(np.float32)[:, ::2],
              rng.standard_normal(33).astype(">f4"), rng.standard_normal(70).astype(np.float32)]
    assert md5.md5_digests(arrays) == expected(arrays)


def test_an_array_far_longer_than_the_others_goes_to_hashlib_and_equal_ones_share_the_lanes():
    mb = 1 << 20
    alone, groups = md5._plan([9 * mb] * 36 + [154 * mb] + [3 * mb] * 100, threads=2)  # GPT-2's embedding
    assert alone == [36]
    assert sorted(i for group in groups for i in group) == [i for i in range(137) if i != 36]
    alone, groups = md5._plan([16 * mb] * 16, threads=2)  # one group fills the lanes: a second would idle half
    assert (alone, groups) == ([], [list(range(16))])
    alone, groups = md5._plan([16 * mb] * 40, threads=2)
    assert alone == [] and sorted(map(len, groups)) == [20, 20]
