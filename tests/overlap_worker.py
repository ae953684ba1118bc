"""One training of a small model, monitored at L2 into ``--dump`` with the overlap on or off (``--overlap``); run
by tests/test_overlap.py, under torchrun (2 gloo ranks) for the distributed stacks.

``--stack``: ``ddp`` accumulates ``--micro-batches`` micro-batches under DDP's ``no_sync`` (the last one
all-reduces); ``allreduce`` sums each gradient over the ranks with ``dist.all_reduce`` after backward (a write
that bumps no version counter: the overlap must see it by the norm); ``fsdp2`` shards with ``fully_shard``.
Prints ``OVERLAP <status> EARLY <gradients computed early>`` per rank.
"""
from __future__ import annotations

import argparse
import contextlib

import torch
import torch.distributed as dist
from stacks_worker import end_process_group

from msprobe_mlflow import GradProbeConfig
from msprobe_mlflow.pytorch import GradientMonitor, overlap


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stack", choices=["ddp", "allreduce", "fsdp2"], required=True)
    parser.add_argument("--dump", required=True)
    parser.add_argument("--overlap", choices=["on", "off"], required=True)
    parser.add_argument("--micro-batches", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    overlap.BUCKET_ELEMENTS = 1  # each gradient to the worker as soon as it is ready, before the all-reduce
    overlap.MIN_AVERAGE_ELEMENTS = 0  # a small model's gradients overlap too
    overlap.cores_left_to_a_worker = lambda: 1  # and beside torch's threads, whatever the machine

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 5), torch.nn.Tanh(),
                                torch.nn.Linear(5, 1))
    if args.stack == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    elif args.stack == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in (model[0], model[2], model[4]):
            fully_shard(layer)
        fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = GradientMonitor(GradProbeConfig(dump_path=args.dump, level="L2"), log_to_mlflow=False,
                              overlap=args.overlap == "on").monitor(model, optimizer)
    generator = torch.Generator().manual_seed(10 + rank)
    micro_batches = args.micro_batches if args.stack == "ddp" else 1
    for _ in range(args.steps):
        optimizer.zero_grad()
        for micro in range(micro_batches):
            last = micro == micro_batches - 1
            with contextlib.nullcontext() if last or args.stack != "ddp" else model.no_sync():
                x, y = torch.randn(4, 8, generator=generator), torch.randn(4, 1, generator=generator)
                torch.nn.functional.mse_loss(model(x), y).backward()
        if args.stack == "allreduce":
            for parameter in model.parameters():
                dist.all_reduce(parameter.grad)
        optimizer.step()
    monitor.stop()
    if monitor.errors:
        raise SystemExit(f"rank {rank}: monitor errors {monitor.errors}")
    print(f"OVERLAP {monitor.overlap} EARLY {monitor.early_gradients}", flush=True)
    end_process_group()


if __name__ == "__main__":
    main()
