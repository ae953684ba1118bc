"""Where a probed step's time goes: the CPU each thread and process of ours adds per step, beside the iteration.

``monitor_benchmark.py`` gives the ratios; this gives the profile behind them. Same models and monitor as there
(16 x Linear(2048, 2048) and 256 x Linear(64, 64), SGD with momentum, batch 8; ours with the anomaly flags and the
local dump, no MLflow) at L0, L1 and L2, torch on 1 thread and with its default threads. Each round runs no monitor
and ours in turn (the order rotated by one each round), each for at least ``--seconds`` of iterations after one
warm-up step whose background work is waited for; medians over rounds of, per iteration (the pre-hook's figures: a turn's
mean):

- iteration: wall time, and its ratio to no monitor's in the same round;
- pre-hook: the training thread's wall time in the optimizer pre-hook, and of that the statistics kernel's (the
  calls spread over the cores, ``fused.in_parallel``: at L0 the MD5s); the rest is Python over the gradients
  (lists, checks, addresses, the step's layout);
- CPU by thread, over no monitor's: the training thread; the writer thread (the record, and handing it to the local
  dump: for steps of 128 parameters or more, a pickle into the local dump's process, else the dump itself); the
  anomaly flags' thread; the process's other threads (torch's OpenMP workers, the kernel's helper threads); the
  local dump's process. CPU time is read per thread (``time.pthread_getcpuclockid``) at the start and end of the
  timed span.

Each turn's dump is deleted after it. On this project's VMs (Firecracker) that matters: file data written into
memory the VM has not touched before costs 50-90 ms of CPU per 8.4 MB (once about 250 MB of new file data has
piled up), against 2 ms into memory a deleted file freed. The first is the VM's cost of memory touched for the first
time, not the dump's: the profile measures the second.

Results: ``results/step_profile.md`` and ``.json``::

    benchmarks/.venv/bin/python benchmarks/step_profile.py [--rounds 7] [--seconds 2] [--quick]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from monitor_benchmark import (NO_MONITOR, WARM_UP_ITERATIONS, OtherLoad, attach_ours,  # noqa: E402
                               children_cpu_seconds, code_version, floor_seconds, workloads)

from msprobe_mlflow import dump_process  # noqa: E402
from msprobe_mlflow.torch_kernels import fused, md5  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
TRAINING, WRITER, FLAGS, OTHER, DUMP = ("training thread", "writer thread", "anomaly flags' thread",
                                        "other threads", "local dump's process")
THREAD_NAMES = {"msprobe-mlflow-writer": WRITER, "msprobe-mlflow-anomalies": FLAGS}


def cpu_by_part() -> dict[str, float]:
    """CPU seconds used so far by the training (main) thread, our writer and anomaly flags' threads (by their
    names), the process's other threads, and its child processes (the local dump's)."""
    seconds = dict.fromkeys((TRAINING, WRITER, FLAGS, OTHER, DUMP), 0.0)
    for thread in threading.enumerate():
        try:
            used = time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
        except OSError:  # ended meanwhile: counted in the process's time, under other threads
            continue
        part = TRAINING if thread is threading.main_thread() else \
            next((p for prefix, p in THREAD_NAMES.items() if thread.name.startswith(prefix)), OTHER)
        seconds[part] += used
    seconds[OTHER] += time.process_time() - sum(seconds.values())  # threads not Python's: torch's, ended helpers
    seconds[DUMP] = children_cpu_seconds()
    return seconds


class KernelTimer:
    """The training thread's wall time in the statistics kernel's calls and the MD5s (``in_parallel``), per step."""

    MODULES = (fused, md5)  # md5 imports in_parallel by name

    def __init__(self):
        self.seconds = 0.0
        original = fused.in_parallel

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                if threading.current_thread() is threading.main_thread():
                    self.seconds += time.perf_counter() - start
        self._original = original
        for module in self.MODULES:
            module.in_parallel = timed  # benchmark only

    def close(self) -> None:
        for module in self.MODULES:
            module.in_parallel = self._original


def turn(workload, level: str | None, seconds: float, folder: Path) -> dict:
    """One variant's turn: attach (``level`` None: no monitor), a warm-up step, iterations for ``seconds``."""
    attached = attach_ours(level, False, workload, folder) if level else None
    kernel = KernelTimer()
    try:
        workload.iteration()
        if attached:
            attached.flush()
        kernel.seconds, iteration_seconds = 0.0, []
        cpu_start, wall_start = cpu_by_part(), time.perf_counter()
        while time.perf_counter() - wall_start < seconds:
            start = time.perf_counter()
            workload.iteration()
            iteration_seconds.append(time.perf_counter() - start)
        if attached:
            attached.flush()  # the background work of the timed steps is theirs
        cpu_end = cpu_by_part()
    finally:
        kernel.close()
        if attached:
            attached.stop()
    count = len(iteration_seconds)
    result = {"iteration_s": statistics.median(iteration_seconds),
              "cpu_s": {part: (cpu_end[part] - cpu_start[part]) / count for part in cpu_start}}
    if attached:
        result.update(hook_s=statistics.fmean(attached.hook_seconds[1:]), kernel_s=kernel.seconds / count)
    return result


def profile(build, levels: tuple[str, ...], rounds: int, seconds: float) -> dict:
    workload = build()
    for _ in range(WARM_UP_ITERATIONS):
        workload.iteration()
    names = [NO_MONITOR, *levels]
    turns: dict[str, list[dict]] = {name: [] for name in names}
    with OtherLoad() as load:
        for round_index in range(rounds):
            for name in names[round_index % len(names):] + names[:round_index % len(names)]:
                with tempfile.TemporaryDirectory(prefix="step-profile-") as folder:  # deleted: see the docstring
                    turns[name].append(turn(workload, None if name == NO_MONITOR else name, seconds, Path(folder)))
    none = turns[NO_MONITOR]
    rows, median = {}, statistics.median
    for level in levels:
        ours = turns[level]
        rows[level] = {
            "iteration_ms": median([t["iteration_s"] for t in ours]) * 1e3,
            "ratio": median([t["iteration_s"] / n["iteration_s"] for t, n in zip(ours, none)]),
            "hook_ms": median([t["hook_s"] for t in ours]) * 1e3,
            "kernel_ms": median([t["kernel_s"] for t in ours]) * 1e3,
            "cpu_ms": {part: median([t["cpu_s"][part] - n["cpu_s"][part] for t, n in zip(ours, none)]) * 1e3
                       for part in ours[0]["cpu_s"]},
            "cpu_ratio": median([sum(t["cpu_s"].values()) / sum(n["cpu_s"].values()) for t, n in zip(ours, none)]),
        }
    return {"workload": workload.name, "parameters": workload.parameter_count,
            "tensors": len(workload.gradients), "no_monitor_ms": statistics.median(
                [t["iteration_s"] for t in none]) * 1e3, "floor_ms": statistics.median(floor_seconds(workload)) * 1e3,
            "load": load.summary, "levels": rows}


def signed(milliseconds: float) -> str:
    return f"{milliseconds if abs(milliseconds) >= 0.005 else 0.0:+.2f}"  # no "-0.00"


def markdown(result: dict) -> str:
    lines = ["# Where a probed step's time goes", "",
             f"{result['machine']}; msprobe-mlflow at {result['code']}. Reproduce: "
             f"`benchmarks/.venv/bin/python benchmarks/step_profile.py --rounds {result['rounds']} "
             f"--seconds {result['seconds']}`. {result['rounds']} rounds, each running no monitor and ours in turn "
             f"for {result['seconds']} s of iterations; medians over rounds, per iteration. *Pre-hook*: the training "
             f"thread's mean wall time in the monitor's optimizer pre-hook, *kernel* the statistics kernel's calls in it "
             f"(spread over the cores; at L0 the MD5s), the rest is Python over the gradients. *CPU +ms*: CPU time "
             f"over no monitor's, by thread and process (*other threads*: torch's OpenMP workers and the kernel's "
             f"helpers; the local dump is written by a process of its own for steps of "
             f"{dump_process.PROCESS_MIN_PARAMETERS} parameters or more, else on the writer thread).", ""]
    parts = (TRAINING, WRITER, FLAGS, OTHER, DUMP)
    for threads, workloads_profiled in result["by_threads"].items():
        lines += [f"## torch threads: {threads}", "",
                  "| model | level | no monitor ms | ours ms | x none | pre-hook ms | kernel ms | floor ms | "
                  + " | ".join(f"CPU +ms: {part}" for part in parts) + " | CPU x none |",
                  "|---|---|" + "---:|" * (8 + len(parts))]
        for found in workloads_profiled:
            model = f"{found['tensors']} tensors, {found['parameters'] / 1e6:.1f}M parameters"
            for level, row in found["levels"].items():
                lines.append(f"| {model} | {level} | {found['no_monitor_ms']:.1f} | {row['iteration_ms']:.1f} | "
                             f"{row['ratio']:.2f}x | {row['hook_ms']:.2f} | {row['kernel_ms']:.2f} | "
                             f"{found['floor_ms']:.2f} | "
                             + " | ".join(signed(row['cpu_ms'][part]) for part in parts)
                             + f" | {row['cpu_ratio']:.2f}x |")
        loads = "; ".join(f"{found['tensors']} tensors, {found['load']['other_processes_cpus']:.1f}"
                          for found in workloads_profiled)
        lines += ["", f"Other processes' CPUs in use on average while measuring: {loads}.", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="example: benchmarks/.venv/bin/python benchmarks/step_profile.py "
                                            "--rounds 7 --seconds 2")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--seconds", type=float, default=2.0, help="timed iterations per turn, at least")
    parser.add_argument("--levels", nargs="+", default=["L0", "L1", "L2"], choices=["L0", "L1", "L2"])
    parser.add_argument("--quick", action="store_true", help="small models, a dry run of the harness; needs --out")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.quick and args.out == RESULTS:
        parser.error("--quick needs --out: a dry run never writes into benchmarks/results/")
    if args.rounds < 1 or args.seconds <= 0:
        parser.error(f"--rounds ({args.rounds}) must be 1 or more and --seconds ({args.seconds}) above 0")
    default_threads = torch.get_num_threads()
    by_threads = {}
    warnings.filterwarnings("ignore", module="msprobe_mlflow")  # the dump's notices (anomaly flags) each turn
    try:
        for threads in dict.fromkeys((1, default_threads)):
            torch.set_num_threads(threads)
            label = f"{threads} (default)" if threads == default_threads else str(threads)
            by_threads[label] = [profile(build, tuple(args.levels), args.rounds, args.seconds)
                                 for build in workloads(args.quick)]
            print(f"torch threads {label}: done", file=sys.stderr)
    finally:
        torch.set_num_threads(default_threads)
    result = {"machine": f"{os.cpu_count()} CPUs ({platform.machine()}), torch {torch.__version__}, "
                         f"Python {platform.python_version()}",
              "code": code_version(), "rounds": args.rounds, "seconds": args.seconds, "by_threads": by_threads}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "step_profile.json").write_text(json.dumps(result, indent=1))
    (args.out / "step_profile.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
