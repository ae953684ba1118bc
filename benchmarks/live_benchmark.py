"""What the live verdicts cost: iteration time with and without ``baseline=``, and with and without the anomaly
flags, under torch's default threads and under one thread, as ratios measured in one run; and how soon
``on_suspicious`` fires after the step that shows the divergence.

Workloads (from ``monitor_benchmark.py``): 16 x Linear(2048, 2048) (67M parameters: the comparison's bytes
dominate) and 256 x Linear(64, 64) (512 tensors: the flags' per-parameter work dominates), SGD with momentum,
batch 8, our monitor at L1 writing its local dump (no MLflow: the sinks' own cost). Variants:

- ``L1``: the monitor alone (``anomaly_flags=False``);
- ``L1 + flags``: the default, anomaly flags on;
- ``L1 + flags + baseline``: also the live verdict against a baseline dump of the same training whose inputs differ
  from step ``DIVERGES_AT`` on, so the verdict trips inside the timed span.

Each workload is built once and warmed up; every turn puts its weights and momentum back to where they started
(in place, so no fresh memory is touched while timing), attaches, runs one probed warm-up iteration and waits for
its background work, times its iterations (``--iterations``; by default about 3 s a turn), then ``stop()``
(*with drain*: the timed span plus ``stop()``, per iteration). Rounds run every variant in an order rotated by
one; each ratio is the median over rounds of the ratio within a round. ``on_suspicious`` latency: from the end
of the diverging step's ``optimizer.step()`` to the callback, in milliseconds and in iterations the training
thread had finished since.
Results: ``results/live.md`` and ``results/live.json``::

    PYTHONPATH=. .venv/bin/python benchmarks/live_benchmark.py [--rounds 9] [--iterations N] [--quick]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import logging
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from monitor_benchmark import WARM_UP_ITERATIONS, OtherLoad, Workload, stacked_linears  # noqa: E402

from msprobe_mlflow import GradProbeConfig  # noqa: E402
from msprobe_mlflow.pytorch import GradientMonitor  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
DIVERGES_AT = 5  # the baseline's inputs differ from this step on (step 0 is the warm-up)
MONITOR_ONLY, FLAGS, BASELINE = "L1", "L1 + flags", "L1 + flags + baseline"
VARIANTS = (MONITOR_ONLY, FLAGS, BASELINE)


def workloads(quick: bool):
    """(build, timed iterations per turn): a turn of the small model lasts as long as one of the large one (~3 s),
    so that its median is as steady."""
    if quick:
        return [(stacked_linears(4, 256, 8, "4 x Linear(256, 256), batch 8 (quick)"), 8),
                (stacked_linears(104, 16, 8, "104 x Linear(16, 16), batch 8 (quick)"), 8)]
    return [(stacked_linears(16, 2048, 8, "16 x Linear(2048, 2048) fp32, batch 8, SGD momentum"), 8),
            (stacked_linears(256, 64, 8, "256 x Linear(64, 64) fp32 (512 tensors), batch 8, SGD momentum"), 48)]


def iterate(workload: Workload, step: int, diverged: bool = False) -> None:
    workload.optimizer.zero_grad(set_to_none=False)
    batch = -workload.batch if diverged and step >= DIVERGES_AT else workload.batch
    workload.model(batch).square().mean().backward()
    workload.optimizer.step()


class Restartable:
    """A workload whose training can start again from the same weights: ``restart()`` copies them back and zeroes
    the momentum in place (SGD's first step with a zero buffer equals its first step without one)."""

    def __init__(self, build):
        self.workload = build()
        self.name = self.workload.name
        for step in range(WARM_UP_ITERATIONS):  # the first iterations of a process touch fresh memory
            iterate(self.workload, step)
        self.initial = {name: tensor.clone() for name, tensor in self.workload.model.state_dict().items()}

    def restart(self) -> Workload:
        with torch.no_grad():
            for name, tensor in self.workload.model.state_dict().items():
                tensor.copy_(self.initial[name])
            for state in self.workload.optimizer.state.values():
                state["momentum_buffer"].zero_()
        return self.workload


def write_baseline(training: Restartable, folder: Path, steps: int) -> None:
    """The baseline dump: the same training, its inputs negated from ``DIVERGES_AT`` on."""
    workload = training.restart()
    monitor = GradientMonitor(GradProbeConfig(dump_path=str(folder), level="L1"), log_to_mlflow=False,
                              anomaly_flags=False).monitor(workload.model, workload.optimizer)
    for step in range(steps):
        iterate(workload, step, diverged=True)
    monitor.stop()


def turn(training: Restartable, variant: str, folder: Path, baseline: Path, iterations: int) -> dict:
    workload = training.restart()
    probed: dict[int, float] = {}  # step -> when the monitor had probed its gradients
    fired: list[tuple[float, int]] = []  # when on_suspicious ran, and how many steps had begun by then
    options = {"anomaly_flags": variant != MONITOR_ONLY, "silent": True}
    if variant == BASELINE:
        options.update(baseline=str(baseline),
                       on_suspicious=lambda verdict: fired.append((time.perf_counter(), monitor.step)))
    monitor = GradientMonitor(GradProbeConfig(dump_path=str(folder), level="L1"), log_to_mlflow=False,
                              **options).monitor(workload.model, workload.optimizer)
    def note_probed(*_) -> None:  # runs after the monitor's hook, which counted the step
        probed.setdefault(monitor.step - 1, time.perf_counter())

    workload.optimizer.register_step_pre_hook(note_probed)
    iterate(workload, 0)
    monitor.flush()
    seconds = []
    start = time.perf_counter()
    for step in range(1, iterations + 1):
        begin = time.perf_counter()
        iterate(workload, step)
        seconds.append(time.perf_counter() - begin)
    monitor.stop()
    result = {"iteration_s": statistics.median(seconds), "with_drain_s": (time.perf_counter() - start) / iterations}
    if variant == BASELINE:
        if len(fired) != 1:
            raise RuntimeError(f"on_suspicious fired {len(fired)} times, expected once")
        at, steps_begun = fired[0]
        result.update(latency_s=at - probed[DIVERGES_AT], later_steps_begun=steps_begun - (DIVERGES_AT + 1))
    return result


def measure(build, rounds: int, iterations: int, scratch: Path) -> dict:
    training = Restartable(build)
    name = training.name
    print(f"{name} ...", file=sys.stderr, flush=True)
    baseline = scratch / "baseline"
    write_baseline(training, baseline, iterations + 1)
    turns = {variant: [] for variant in VARIANTS}
    with OtherLoad() as load:
        for round_index in range(rounds):
            shift = round_index % len(VARIANTS)
            for variant in VARIANTS[shift:] + VARIANTS[:shift]:
                folder = scratch / "run"
                turns[variant].append(turn(training, variant, folder, baseline, iterations))
                shutil.rmtree(folder, ignore_errors=True)
    shutil.rmtree(baseline, ignore_errors=True)

    def ratios(variant: str, reference: str, key: str) -> list[float]:
        return [a[key] / b[key] for a, b in zip(turns[variant], turns[reference])]

    summary = {"model": name, "load": load.summary, "iterations": iterations,
               "iteration_ms": {v: statistics.median(t["iteration_s"] for t in turns[v]) * 1e3 for v in VARIANTS},
               "latency_ms": [t["latency_s"] * 1e3 for t in turns[BASELINE]],
               "later_steps_begun": [t["later_steps_begun"] for t in turns[BASELINE]], "turns": turns}
    for label, variant, reference in (("flags", FLAGS, MONITOR_ONLY), ("baseline", BASELINE, FLAGS),
                                      ("both", BASELINE, MONITOR_ONLY)):
        for key in ("iteration_s", "with_drain_s"):
            values = ratios(variant, reference, key)
            summary[f"{label}_{key.removesuffix('_s')}_ratio"] = [statistics.median(values), min(values), max(values)]
    return summary


def markdown(result: dict) -> str:
    lines = ["# Live verdicts: what `baseline=` and the anomaly flags cost (CPU)", "",
             f"{result['machine']}. {result['rounds']} rounds of every variant in rotating order, each: the "
             f"workload back at its starting weights, 1 probed warm-up, the timed iterations (in the table), "
             f"stop; our monitor at L1, local dump only. Ratios: median over rounds of the ratio within a round "
             f"(lowest-highest in brackets); *with drain* includes `stop()`, the sinks finishing their queues. The "
             f"baseline diverges at step "
             f"{DIVERGES_AT}; *on_suspicious after* is the time from the monitor probing that step's gradients (its "
             f"`optimizer.step()` pre-hook) to the callback, and how many later steps had begun by then (0: the "
             f"callback came before the next step's `optimizer.step()`).",
             "", "| model | torch threads | timed iterations | L1 ms | flags / L1 | "
             "baseline / flags (target <= 1.05) | "
             "with drain: flags, baseline | on_suspicious after (median, max) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for threads, models in result["by_threads"].items():
        for model in models:
            def ratio(key: str) -> str:
                median, low, high = model[key]
                return f"{median:.3f}x ({low:.2f}-{high:.2f})"
            latency, steps = model["latency_ms"], model["later_steps_begun"]
            lines.append(f"| {model['model']} | {threads} | {model['iterations']} | "
                         f"{model['iteration_ms'][MONITOR_ONLY]:.1f} | "
                         f"{ratio('flags_iteration_ratio')} | {ratio('baseline_iteration_ratio')} | "
                         f"{model['flags_with_drain_ratio'][0]:.3f}x, {model['baseline_with_drain_ratio'][0]:.3f}x | "
                         f"{statistics.median(latency):.0f} ms, {max(latency):.0f} ms; at most {max(steps)} later "
                         f"step(s) begun |")
    lines += ["", "Machine load while measuring (other processes' CPUs, on average): " + "; ".join(
        f"{threads} thread(s), {model['model'].split(' fp32')[0]}: {model['load']['other_processes_cpus']:.1f}"
        for threads, models in result["by_threads"].items() for model in models) + ".",
        "", "Reproduce: `PYTHONPATH=. python benchmarks/live_benchmark.py` (also run by `benchmarks/run`). Figures "
        "from one run on a shared machine: compare ratios within a row, not times between runs."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--iterations", type=int, help="timed iterations per turn (default: 8 for the large "
                        "model, 48 for the small one)")
    parser.add_argument("--quick", action="store_true", help="small models, a dry run of the harness; needs --out")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.quick and args.out == RESULTS:
        parser.error("--quick needs --out: a dry run never writes into benchmarks/results/")
    if args.iterations is not None and args.iterations < DIVERGES_AT:
        parser.error(f"--iterations must be at least {DIVERGES_AT}: the baseline diverges at step {DIVERGES_AT}")
    logging.getLogger("msprobe_mlflow").setLevel(logging.ERROR)  # the verdict each baseline turn gives, 30 times
    default_threads = torch.get_num_threads()
    by_threads = {}
    scratch = Path(tempfile.mkdtemp(prefix="live-benchmark-"))
    try:
        for threads in dict.fromkeys((default_threads, 1)):
            torch.set_num_threads(threads)
            label = f"{threads} (default)" if threads == default_threads else str(threads)
            by_threads[label] = [measure(build, args.rounds, args.iterations or iterations, scratch)
                                 for build, iterations in workloads(args.quick)]
    finally:
        torch.set_num_threads(default_threads)
        shutil.rmtree(scratch, ignore_errors=True)
    result = {"machine": f"{os.cpu_count()} CPUs ({platform.machine()}), torch {torch.__version__}, "
                         f"Python {platform.python_version()}",
              "rounds": args.rounds, "by_threads": by_threads}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "live.json").write_text(json.dumps(result, indent=1))
    (args.out / "live.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
