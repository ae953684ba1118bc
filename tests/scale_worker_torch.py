"""One rank of a 2-rank DDP job (gloo, CPU) with rank-0 aggregated metrics; started by torchrun from
tests/test_scale_torch.py. Rank 0 logs into the run at ``--tracking-uri``; rank 1 is pointed at a port where no
server listens, so its metrics can only reach the run through rank 0's requests. ``--rank1-steps S ...`` makes rank 1
probe only those steps (rank 0 probes every step), so the all-gathers stop pairing up; ``--rank1-leaves`` makes
rank 1 leave once its steps are delivered, without stopping its monitor, so it never joins the end-of-run exchange."""
from __future__ import annotations

import argparse
import os
import sys

import mlflow
import torch
import torch.distributed as dist

from msprobe_mlflow import GradProbeConfig
from msprobe_mlflow.pytorch import GradientMonitor

NO_SERVER = "http://127.0.0.1:9"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dump", required=True)
    parser.add_argument("--tracking-uri", required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rank1-steps", type=int, nargs="*", default=[])
    parser.add_argument("--rank1-leaves", action="store_true")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                                                           torch.nn.Linear(16, 4)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    uri = args.tracking_uri if rank == 0 else NO_SERVER
    if rank == 0:
        mlflow.set_tracking_uri(uri)
        print("RUN_ID", mlflow.start_run(run_name="aggregated").info.run_id, flush=True)
    steps = args.rank1_steps if rank == 1 else []
    monitor = GradientMonitor(GradProbeConfig(dump_path=args.dump, level="L1", step=steps), tracking_uri=uri,
                              aggregate_metrics=True).monitor(model, optimizer)
    generator = torch.Generator().manual_seed(100 + rank)
    for _ in range(args.steps):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(torch.randn(16, 8, generator=generator)), torch.ones(16, 4)).backward()
        optimizer.step()
    if rank == 1 and args.rank1_leaves:
        monitor.flush()  # every step's all-gather done: only the end-of-run exchange misses rank 1
        os._exit(0)
    monitor.stop()
    sys.stdout.write(f"ERRORS {len(monitor.errors)}\n")  # one write: the ranks share the job's stdout
    sys.stdout.flush()
    if rank == 0:
        mlflow.end_run()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
