"""One rank of a small DDP job (gloo, CPU) monitored into one MLflow run; started by torchrun from the tests.

Rank 0 starts the run (``--run-name``) and prints ``RUN_ID <id>``; every rank calls ``monitor()`` and so logs into
rank 0's run. ``--perturb-from S`` scales the inputs of every rank from step S on, so gradient directions
change from that step: the comparator must name it. ``--die-at S`` makes rank 1 exit abruptly at step S (the
ranks then train without DDP, so the survivor is not stuck in an all-reduce with a dead peer). ``--raise-at R S``
makes rank R's training raise at step S (under DDP: the other rank's all-reduce then fails, or torchrun stops it
with SIGTERM). ``--ranks R ...`` is the config's rank filter. ``--nan-at R S`` puts a NaN into rank R's first gradient at step S, after DDP's
all-reduce (so only rank R sees it at S; its weights turn NaN and every rank's gradients follow a step later).
``--pause-at S --resume-file F`` makes every rank wait before step S until file F exists (a test breaks something
meanwhile); a run that cannot be ended (tracking server down) is reported on stderr, as the job's last line of
work.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import mlflow
import torch
import torch.distributed as dist
from mlflow.exceptions import MlflowException

from msprobe_mlflow import GradProbeConfig
from msprobe_mlflow.pytorch import GradientMonitor


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dump", required=True)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--level", default="L2")
    parser.add_argument("--run-name", default="distributed")
    parser.add_argument("--perturb-from", type=int, default=None)
    parser.add_argument("--die-at", type=int, default=None)
    parser.add_argument("--raise-at", type=int, nargs=2, default=None, metavar=("RANK", "STEP"))
    parser.add_argument("--pause-at", type=int, default=None)
    parser.add_argument("--resume-file", default=None)
    parser.add_argument("--nan-at", type=int, nargs=2, default=None, metavar=("RANK", "STEP"))
    parser.add_argument("--ranks", type=int, nargs="*", default=[], help="the config's rank filter")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    if args.die_at is None:
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    run = mlflow.start_run(run_name=args.run_name) if rank == 0 else None
    config = GradProbeConfig(dump_path=args.dump, level=args.level, rank=args.ranks)
    monitor = GradientMonitor(config).monitor(model, optimizer)
    if rank == 0:
        print("RUN_ID", run.info.run_id, flush=True)
    generator = torch.Generator().manual_seed(100 + rank)
    for step in range(args.steps):
        if args.die_at is not None and rank == 1 and step == args.die_at:
            os._exit(17)
        if args.raise_at == [rank, step]:
            raise RuntimeError(f"training fails at step {step} on purpose")
        if step == args.pause_at:
            deadline = time.monotonic() + 300
            while not os.path.exists(args.resume_file) and time.monotonic() < deadline:
                time.sleep(0.1)
        x = torch.randn(16, 8, generator=generator)
        if args.perturb_from is not None and step >= args.perturb_from:
            x = -3 * x.flip(0)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), torch.ones(16, 4)).backward()
        if args.nan_at == [rank, step]:
            next(model.parameters()).grad.view(-1)[0] = float("nan")
        optimizer.step()
    monitor.stop()
    if run is not None:
        try:
            mlflow.end_run()
        except MlflowException as e:
            print(f"could not end run {run.info.run_id}: {e.message[:300]}", file=sys.stderr)
    if args.die_at is None:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
