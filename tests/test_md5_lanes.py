"""The L0 column's MD5s, 16 at a time (msprobe_mlflow.torch_kernels.md5), against hashlib: every length around the
64-byte blocks and the padding's two cases, more gradients than lanes, the dtypes and layouts hashlib takes."""
import hashlib

import pytest
import torch

from msprobe_mlflow.torch_kernels import md5


def expected(tensors):
    return [hashlib.md5(t.detach().float().contiguous().numpy().astype("<f4").tobytes()).hexdigest() for t in tensors]


@pytest.mark.parametrize("threads", [1, 2])
def test_digests_are_hashlibs_for_every_length_around_a_block_and_more_gradients_than_lanes(monkeypatch, threads):
    monkeypatch.setattr(md5, "worker_threads", lambda: threads)
    generator = torch.Generator().manual_seed(0)
    sizes = [*range(0, 50), 1000, 4096, 100_003, *torch.randint(0, 5000, (40,), generator=generator).tolist()]
    tensors = [torch.randn(n, generator=generator) for n in sizes]  # 16 floats fill a block
    tensors[3][:] = torch.tensor([float("nan"), -0.0, float("inf")])
    assert md5.md5_digests(tensors) == expected(tensors)
    big = [torch.randn(md5.PARALLEL_MIN // 3 + k, generator=generator) for k in range(20)]  # threads apply
    assert md5.md5_digests(big) == expected(big)


def test_other_dtypes_and_layouts_are_hashed_as_their_float32_bytes(monkeypatch):
    monkeypatch.setattr(md5, "worker_threads", lambda: 2)
    generator = torch.Generator().manual_seed(1)
    tensors = [torch.randn(9, dtype=torch.float64, generator=generator),
               torch.randn(40, 6, generator=generator)[:, ::2], torch.randn(33, generator=generator).bfloat16(),
               torch.randn(70, generator=generator), torch.randn(5, 7, generator=generator).t()]
    assert md5.md5_digests(tensors) == expected(tensors)


def test_a_gradient_far_longer_than_the_others_goes_to_hashlib_and_equal_ones_share_the_lanes():
    mb = 1 << 20
    alone, groups = md5._plan([9 * mb] * 36 + [154 * mb] + [3 * mb] * 100, threads=2)  # GPT-2's embedding
    assert alone == [36]
    assert sorted(i for group in groups for i in group) == [i for i in range(137) if i != 36]
    alone, groups = md5._plan([16 * mb] * 16, threads=2)  # one group fills the lanes: a second would idle half
    assert (alone, groups) == ([], [list(range(16))])
    alone, groups = md5._plan([16 * mb] * 40, threads=2)
    assert alone == [] and sorted(map(len, groups)) == [20, 20]
