"""One rank of a 2-rank gloo job: the sharded statistics of DTensors equal the unsharded statistics of the same
full tensors, at every level, for shards along dim 0 and dim 1, uneven and empty shards, a replicated tensor, a
plain tensor beside them, NaN, infinities, bf16 and float64, with the opt-in exponent counts (summed over the
shards by the same all_reduce); and the full tensors' norms from their shards (the
monitor's ``param_norm``). Started by torchrun from tests/test_training_stacks.py;
exits non-zero with the first difference."""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from stacks_worker import end_process_group
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from msprobe_mlflow.levels import recorded_level
from msprobe_mlflow.torch_kernels.parameter_norms import launch_parameter_norms
from msprobe_mlflow.torch_kernels.sharded import launch_sharded_statistics
from msprobe_mlflow.torch_kernels.statistics import launch_step_statistics


def full_tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    with_nan = torch.randn(5, 3, generator=generator)
    with_nan[4, 1] = float("nan")
    with_infinities = torch.randn(3, 4, generator=generator)
    with_infinities[0, 0], with_infinities[2, 3] = float("inf"), float("-inf")
    return {
        "rows": torch.randn(7, 3, generator=generator),             # uneven: 4 + 3 rows
        "one_row": torch.randn(1, 5, generator=generator),          # rank 1's shard is empty
        "columns": torch.randn(3, 5, generator=generator),          # along dim 1: 3 + 2 columns
        "with_nan": with_nan,
        "with_infinities": with_infinities,
        "replicated": torch.randn(4, generator=generator),
        "bf16": torch.randn(6, 2, generator=generator).bfloat16(),
        "float64": torch.randn(5, 2, generator=generator, dtype=torch.float64),
        "plain": torch.randn(2, 2, generator=generator),            # not a DTensor
        "scalar": torch.tensor(-0.25),                                # not a DTensor, no dimension
    }


PLACEMENTS = {"columns": Shard(1), "replicated": Replicate(), "plain": None, "scalar": None}


def main() -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,))
    full = full_tensors()
    sharded = [tensor if PLACEMENTS.get(name, Shard(0)) is None
               else distribute_tensor(tensor, mesh, [PLACEMENTS.get(name, Shard(0))]) for name, tensor in full.items()]
    names = list(full)
    for level in ("L0", "L1", "L2"):
        options = dict(rank=dist.get_rank(), step=0, level=recorded_level(level, exponents=True), bounds=(-1, 0, 0.5))
        got = launch_sharded_statistics(names, sharded, **options)()
        expected = launch_step_statistics(names, list(full.values()), **options)()
        np.testing.assert_allclose(got.values, expected.values, rtol=1e-6, err_msg=level)
        assert got.shapes == expected.shapes, level
        for field in ("bucket_counts", "zero_counts", "md5"):
            assert np.array_equal(getattr(got, field), getattr(expected, field)) \
                if getattr(expected, field) is not None else getattr(got, field) is None, f"{level} {field}"
        if expected.directions is not None:
            assert np.array_equal(got.directions, expected.directions), f"{level} directions"
        assert np.array_equal(got.exponent_counts.full(), expected.exponent_counts.full()), f"{level} exponents"
    full_norms = [np.linalg.norm(t.double().numpy().reshape(-1)) for t in full.values()]  # the parameters' own
    np.testing.assert_allclose(launch_parameter_norms(names, sharded)(), np.float32(full_norms), rtol=1e-6)
    print("rank", dist.get_rank(), "sharded statistics equal", flush=True)
    end_process_group()


if __name__ == "__main__":
    main()
