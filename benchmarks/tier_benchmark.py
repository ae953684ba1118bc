"""What the always-on tier costs: iteration time with statistics at every step and directions every ``--every``
steps (``directions_every_n_steps``, with ``directions_on_anomaly``), against our L1/L2 with directions at every
step and msprobe 1.0.3's L1/L2 (which always record them), as ratios to no monitor, measured in one run under
torch's default threads and under one thread.

Workloads, variants' harness and statistics come from ``monitor_benchmark.py``: 16 x Linear(2048, 2048) (67M
parameters) and 256 x Linear(64, 64) (512 tensors), SGD with momentum, batch 8; every turn attaches, runs one
probed warm-up iteration (step 0: a tier step with directions) and waits for its background work, times
``--iterations`` iterations (steps 1.., statistics only for the tier while ``--iterations`` < ``--every``), then
``stop()``. Rounds run the variants in an order rotated by one; each ratio is the median over rounds of the ratio
within a round. *Amortised* is the tier's cost over a whole period of ``--every`` steps: one step at the full
level's ratio, the others at the tier's. Results: ``results/tier.md`` and ``results/tier.json``::

    benchmarks/.venv/bin/python benchmarks/tier_benchmark.py [--rounds 5] [--iterations 8] [--every 100] [--quick]

(``benchmarks/.venv`` holds msprobe 1.0.3: ``benchmarks/setup-env``; without msprobe, its variants are left out.)
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from monitor_benchmark import (BOUNDS, NO_MONITOR, WARM_UP_ITERATIONS, Attached, OtherLoad, Variant,  # noqa: E402
                               attach_msprobe, measure, timed, workloads)

from msprobe_mlflow import GradProbeConfig  # noqa: E402
from msprobe_mlflow.pytorch import GradientMonitor  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def attach_ours(level: str, workload, folder: Path, **options) -> Attached:
    monitor = GradientMonitor(GradProbeConfig(dump_path=str(folder), level=level, bounds=BOUNDS),
                              log_to_mlflow=False, silent=True, **options).monitor(workload.model, workload.optimizer)
    hook_seconds: list[float] = []
    monitor._hook.remove()  # benchmark only: the hook again, wrapped in a timer (as monitor_benchmark.py does)
    monitor._hook = workload.optimizer.register_step_pre_hook(timed(monitor._on_optimizer_step, hook_seconds))

    def stop() -> None:
        monitor.stop()
        if monitor.errors:
            raise RuntimeError(f"our monitor failed: {monitor.errors[0]}")
    return Attached(hook_seconds, monitor.flush, stop)


def variants(every: int, with_msprobe: bool) -> list[Variant]:
    found = [Variant(NO_MONITOR, None)]
    for level in ("L1", "L2"):
        if with_msprobe:
            found.append(Variant(f"msprobe 1.0.3 {level}", lambda w, f, level=level: attach_msprobe(level, w, f)))
        found.append(Variant(f"ours {level}", lambda w, f, level=level: attach_ours(level, w, f)))
        found.append(Variant(f"ours {level} tier", lambda w, f, level=level: attach_ours(
            level, w, f, directions_every_n_steps=every, directions_on_anomaly=True)))
    return found


def benchmark(build, rounds: int, iterations: int, every: int, with_msprobe: bool, scratch: Path) -> dict:
    workload = build()
    print(f"{workload.name} ...", file=sys.stderr, flush=True)
    for _ in range(WARM_UP_ITERATIONS):
        workload.iteration()
    all_variants = variants(every, with_msprobe)
    turns: dict[str, list[dict]] = {v.name: [] for v in all_variants}
    with OtherLoad() as load:
        for round_index in range(rounds):
            shift = round_index % len(all_variants)
            for variant in all_variants[shift:] + all_variants[:shift]:
                folder = scratch / "dump"
                turns[variant.name].append(measure(workload, variant, folder, iterations))
                shutil.rmtree(folder, ignore_errors=True)

    def ratio(name: str, key: str) -> list[float]:
        def value(turn: dict) -> float:
            return statistics.median(turn[key]) if isinstance(turn[key], list) else turn[key]
        values = [value(turn) / value(base) for turn, base in zip(turns[name], turns[NO_MONITOR])]
        return [statistics.median(values), min(values), max(values)]

    def median_ms(name: str, key: str) -> float:
        return statistics.median(v for t in turns[name] for v in t.get(key, [0.0])) * 1e3

    rows = {name: {"iteration_ms": median_ms(name, "iteration_s"), "in_monitor_ms": median_ms(name, "hook_s"),
                   "iteration_ratio": ratio(name, "iteration_s"), "cpu_ratio": ratio(name, "cpu_s"),
                   "with_drain_ratio": ratio(name, "with_drain_s")} for name in turns}
    for level in ("L1", "L2"):
        full, tier = rows[f"ours {level}"]["iteration_ratio"][0], rows[f"ours {level} tier"]["iteration_ratio"][0]
        rows[f"ours {level} tier"]["amortised_ratio"] = ((every - 1) * tier + full) / every
    return {"model": workload.name, "load": load.summary, "variants": rows, "turns": turns}


def markdown(result: dict) -> str:
    every = result["every"]
    lines = ["# The always-on tier: statistics every step, directions every N steps (CPU)", "",
             f"{result['machine']}. {result['rounds']} rounds of every variant in rotating order, each: attach, 1 "
             f"probed warm-up, {result['iterations']} timed iterations, stop. *tier*: `directions_every_n_steps="
             f"{every}, directions_on_anomaly=True` (the timed steps record statistics only); *amortised*: one step "
             f"in {every} at the full level's ratio. Ratios to no monitor: median over rounds of the ratio within a "
             f"round (lowest-highest in brackets); *in monitor*: the training thread's time in the optimizer "
             f"pre-hook; *CPU*: process CPU time of all threads; *with drain*: including `stop()`, the writer "
             f"finishing its queue.", "",
             "| model | torch threads | variant | iteration ms | in monitor ms | iteration x none | CPU x none "
             "| with drain x none | amortised x none |", "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for threads, models in result["by_threads"].items():
        for model in models:
            for name, row in model["variants"].items():
                if name == NO_MONITOR:
                    continue
                cells = [f"{row[key][0]:.2f}x ({row[key][1]:.2f}-{row[key][2]:.2f})"
                         for key in ("iteration_ratio", "cpu_ratio", "with_drain_ratio")]
                amortised = f"{row['amortised_ratio']:.3f}x" if "amortised_ratio" in row else ""
                lines.append(f"| {model['model'].split(' fp32')[0]} | {threads} | {name} | {row['iteration_ms']:.1f} "
                             f"| {row['in_monitor_ms']:.1f} | {' | '.join(cells)} | {amortised} |")
    lines += ["", "Machine load while measuring (other processes' CPUs, on average): " + "; ".join(
        f"{threads} thread(s), {model['model'].split(' fp32')[0]}: {model['load']['other_processes_cpus']:.1f}"
        for threads, models in result["by_threads"].items() for model in models) + ".", "",
        "Reproduce: `benchmarks/.venv/bin/python benchmarks/tier_benchmark.py`. Figures from one run on a shared "
        "machine: compare ratios within a row group, not times between runs."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iterations", type=int, default=8)
    parser.add_argument("--every", type=int, default=100, help="directions_every_n_steps of the tier variants")
    parser.add_argument("--quick", action="store_true", help="small models, a dry run of the harness; needs --out")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.quick and args.out == RESULTS:
        parser.error("--quick needs --out: a dry run never writes into benchmarks/results/")
    if not args.iterations < args.every:
        parser.error(f"--iterations ({args.iterations}) must be below --every ({args.every}): the timed steps are "
                     f"meant to be the tier's statistics-only steps")
    with_msprobe = importlib.util.find_spec("msprobe") is not None
    if not with_msprobe:
        print("msprobe is not installed (benchmarks/setup-env): its variants are left out", file=sys.stderr)
    default_threads = torch.get_num_threads()
    by_threads = {}
    scratch = Path(tempfile.mkdtemp(prefix="tier-benchmark-"))
    try:
        for threads in dict.fromkeys((default_threads, 1)):
            torch.set_num_threads(threads)
            label = f"{threads} (default)" if threads == default_threads else str(threads)
            by_threads[label] = [benchmark(build, args.rounds, args.iterations, args.every, with_msprobe, scratch)
                                 for build in workloads(args.quick)]
    finally:
        torch.set_num_threads(default_threads)
        shutil.rmtree(scratch, ignore_errors=True)
    result = {"machine": f"{os.cpu_count()} CPUs ({platform.machine()}), torch {torch.__version__}, "
                         f"Python {platform.python_version()}",
              "rounds": args.rounds, "iterations": args.iterations, "every": args.every, "by_threads": by_threads}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tier.json").write_text(json.dumps(result, indent=1))
    (args.out / "tier.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
