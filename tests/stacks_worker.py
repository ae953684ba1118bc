"""One training of a small model on a training stack, monitored at L2 into ``--dump``; run by the stacks tests.

``--stack single`` trains in one process on the global batch; ``fsdp2`` and ``ddp`` (under torchrun, 2 gloo ranks)
train the same model on the same global batch, each rank on its half; ``compile`` is ``single`` with
``torch.compile``. Every stack must record the same statistics under the same names. The last layer's weight has
one row, so FSDP2 leaves rank 1 an empty shard of it, and the 5-row layer is split unevenly.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

from msprobe_mlflow import GradProbeConfig
from msprobe_mlflow.pytorch import GradientMonitor

GLOBAL_BATCH = 16


def end_process_group() -> None:
    """``destroy_process_group``, then leave without torch's C++ teardown: with gloo it aborts now and then after
    every rank is done ("terminate called without an active exception": 3 of 15 runs of a worker alone, at
    d2a5afb), which is not what these tests check."""
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 5), torch.nn.Tanh(),
                               torch.nn.Linear(5, 1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stack", choices=["single", "fsdp2", "ddp", "compile"], required=True)
    parser.add_argument("--dump", required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--ranks", type=int, nargs="*", default=[], help="the config's rank filter")
    args = parser.parse_args()

    distributed = args.stack in ("fsdp2", "ddp")
    if distributed:
        dist.init_process_group("gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    model = build_model()
    if args.stack == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in (model[0], model[2], model[4]):
            fully_shard(layer)
        fully_shard(model)
    elif args.stack == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    elif args.stack == "compile":
        model = torch.compile(model, backend="aot_eager")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = GradientMonitor(GradProbeConfig(dump_path=args.dump, level="L2", rank=args.ranks), log_to_mlflow=False)
    monitor.monitor(model, optimizer)
    generator = torch.Generator().manual_seed(1)
    share = GLOBAL_BATCH // world
    for _ in range(args.steps):
        x, y = torch.randn(GLOBAL_BATCH, 8, generator=generator), torch.randn(GLOBAL_BATCH, 1, generator=generator)
        mine = slice(rank * share, (rank + 1) * share)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
        optimizer.step()
    monitor.stop()
    if monitor.errors:
        raise SystemExit(f"rank {rank}: monitor errors {monitor.errors}")
    print(f"rank {rank} done", os.getpid(), flush=True)
    if distributed:
        end_process_group()


if __name__ == "__main__":
    main()
