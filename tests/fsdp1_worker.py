"""stacks_worker.py's training under FSDP1 (torchrun, 2 gloo ranks, CPU): ``model[2]`` wrapped on its own, the rest
by the root, so the root's flat parameter holds layers 0 and 4 and ``named_parameters()`` lists them out of the
unsharded order; shards split weights mid-byte and leave rank 0 no piece of layer 4. Run by the FSDP1 tests."""
from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
from stacks_worker import GLOBAL_BATCH, build_model, end_process_group
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from msprobe_mlflow import GradProbeConfig
from msprobe_mlflow.pytorch import GradientMonitor


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dump", required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--orig", type=int, choices=[0, 1], required=True, help="use_orig_params")
    parser.add_argument("--level", default="L2")
    parser.add_argument("--inner", action="store_true", help="monitor what the root FSDP1 module wraps: unsupported")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model()
    cpu = torch.device("cpu")
    model[2] = FSDP(model[2], device_id=cpu, use_orig_params=bool(args.orig))
    model = FSDP(model, device_id=cpu, use_orig_params=bool(args.orig))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = GradientMonitor(GradProbeConfig(dump_path=args.dump, level=args.level), log_to_mlflow=False)
    monitor.monitor(model.module if args.inner else model, optimizer)
    generator = torch.Generator().manual_seed(1)
    share = GLOBAL_BATCH // world
    for _ in range(args.steps):
        x, y = torch.randn(GLOBAL_BATCH, 8, generator=generator), torch.randn(GLOBAL_BATCH, 1, generator=generator)
        mine = slice(rank * share, (rank + 1) * share)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
        optimizer.step()
    monitor.stop()
    if args.inner:  # the test reads what failed
        first = monitor.errors[0].replace("\n", " ") if monitor.errors else ""
        # one write per line: the ranks share stdout, and under PYTHONUNBUFFERED print() writes the text and its
        # newline apart, so the other rank's line could start after "rank 0 done" (CI, stop 38)
        sys.stdout.write(f"rank {rank} errors {len(monitor.errors)}: {first}\n")
    elif monitor.errors:
        raise SystemExit(f"rank {rank}: monitor errors {monitor.errors}")
    sys.stdout.write(f"rank {rank} done\n")
    end_process_group()


if __name__ == "__main__":
    main()
