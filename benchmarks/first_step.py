"""The first probed step's cost in a fresh process (issue 25, item 12): what a new user pays once per environment.

Each variant runs in a new Python process training 8 x nn.Linear(256, 256) (SGD, batch 8) for ``--steps`` steps:
without a monitor, then under our GradientMonitor with an empty numba cache (the first process of a new
environment: the CPU kernel is compiled) and again with the cache that run left (every later process: the kernel
is loaded). Reported per variant: the import of torch and msprobe_mlflow, the first step (monitor attached before
it), the median of the later steps, and ``stop()``. Results: ``results/first_step.json`` and ``.md``::

    benchmarks/.venv/bin/python benchmarks/first_step.py [--level L2] [--steps 5] [--out DIR]

``--quick --out DIR``: a dry run of the harness (2 steps per process unless ``--steps`` says), results only in DIR.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def child(level: str, steps: int, folder: str) -> dict:
    """One process's timings (run with ``--child``)."""
    started = time.perf_counter()
    import torch
    from msprobe_mlflow import GradProbeConfig
    from msprobe_mlflow.pytorch import GradientMonitor
    imported = time.perf_counter() - started
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    data = torch.randn(8, 256)
    monitor = None
    if level != "none":
        monitor = GradientMonitor(GradProbeConfig(dump_path=folder, level=level, bounds=(-1, 0, 1)))
        monitor.monitor(model, optimizer)
    seconds = []
    for _ in range(steps):
        start = time.perf_counter()
        optimizer.zero_grad()
        model(data).square().mean().backward()
        optimizer.step()
        seconds.append(time.perf_counter() - start)
    start = time.perf_counter()
    if monitor is not None:
        monitor.stop()
        if monitor.errors:
            raise RuntimeError(f"the monitor failed: {monitor.errors[0]}")
    return {"import_s": imported, "first_step_s": seconds[0], "later_step_ms": 1e3 * statistics.median(seconds[1:]),
            "stop_s": time.perf_counter() - start}


def run_child(level: str, steps: int, cache: str) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        env = {**os.environ, "NUMBA_CACHE_DIR": cache}
        done = subprocess.run([sys.executable, __file__, "--child", "--level", level, "--steps", str(steps),
                               "--dump", folder], env=env, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"the {level} process failed:\n{done.stderr[-3000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--level", default="L2", choices=["L0", "L1", "L2", "none"], help="default L2")
    parser.add_argument("--steps", type=int, default=5, help="steps per process (default 5; at least 2)")
    parser.add_argument("--out", type=Path, help=f"where first_step.json and .md go (default {RESULTS}; --quick "
                        "needs it)")
    parser.add_argument("--quick", action="store_true", help="a dry run of the harness: 2 steps per process unless "
                        "--steps says; writes only into --out")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dump", help=argparse.SUPPRESS)
    if "--quick" in sys.argv[1:]:
        parser.set_defaults(steps=2)
    args = parser.parse_args()
    if args.steps < 2:
        parser.error(f"--steps ({args.steps}) must be at least 2: the later steps' median needs one")
    if args.quick and args.out is None:
        parser.error("--quick needs --out: a dry run never writes into benchmarks/results/")
    args.out = args.out or RESULTS
    if args.child:
        print(json.dumps(child(args.level, args.steps, args.dump)))
        return
    with tempfile.TemporaryDirectory() as cache:
        rows = {"no monitor": run_child("none", args.steps, cache),
                f"{args.level}, empty kernel cache (first process)": run_child(args.level, args.steps, cache),
                f"{args.level}, kernel cache filled (later processes)": run_child(args.level, args.steps, cache)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "first_step.json").write_text(json.dumps({"level": args.level, "steps": args.steps,
                                                          "cpus": os.cpu_count(), "variants": rows}, indent=2))
    lines = ["| variant | import (s) | first step (s) | later steps (ms, median) | stop() (s) |",
             "|---|---|---|---|---|"]
    lines += [f"| {name} | {r['import_s']:.2f} | {r['first_step_s']:.2f} | {r['later_step_ms']:.1f} | "
              f"{r['stop_s']:.2f} |" for name, r in rows.items()]
    table = "\n".join(lines)
    intro = __doc__.split("::")[0].rstrip()
    (args.out / "first_step.md").write_text(f"# The first probed step in a fresh process\n\n{intro}\n\n{table}\n")
    print(table)


if __name__ == "__main__":
    main()
