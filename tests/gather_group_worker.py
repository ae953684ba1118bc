"""One rank of a 2-rank gloo job (torchrun, CPU) that starts and stops a monitor with rank-0 aggregation three
times; started by tests/test_gather_group.py. Writes to ``{dump}/groups_rank{R}.txt``, per cycle, how many process
groups this rank holds while monitoring and after ``stop()`` (torch's own table, where a group never destroyed stays).
"""
from __future__ import annotations

import argparse
from pathlib import Path

import mlflow
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from msprobe_mlflow import GradProbeConfig
from msprobe_mlflow.pytorch import GradientMonitor


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dump", required=True)
    parser.add_argument("--tracking-uri", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mlflow.set_tracking_uri(args.tracking_uri)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    lines = [f"before {len(distributed_c10d._world.pg_map)}"]
    for cycle in range(3):
        run = mlflow.start_run() if rank == 0 else None
        monitor = GradientMonitor(GradProbeConfig(dump_path=f"{args.dump}/{cycle}", level="L0"),
                                  tracking_uri=args.tracking_uri, aggregate_metrics=True).monitor(model, optimizer)
        during = len(distributed_c10d._world.pg_map)
        for _ in range(2):
            optimizer.zero_grad()
            model(torch.ones(3, 4)).sum().backward()
            optimizer.step()
        monitor.stop()
        lines.append(f"cycle {during} {len(distributed_c10d._world.pg_map)} {len(monitor.errors)}")
        if run is not None:
            mlflow.end_run()
    dist.destroy_process_group()
    Path(args.dump, f"groups_rank{rank}.txt").write_text("\n".join(lines), encoding="utf-8")


if __name__ == "__main__":
    main()
