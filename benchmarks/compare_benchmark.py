"""Comparator speed: msprobe-mlflow's compare_dumps against msprobe 1.0.3's GradComparator on the same dump.

The dump: 3 optimizer steps of a 67M-parameter model (16 x nn.Linear(2048, 2048), 32 parameters), written by our
GradientMonitor in msprobe's boolean ``.npy`` form (what both tools read), then converted to our packed form; dump
B has other inputs from step 1 on. Each variant runs ``--repeats`` times, interleaved (one of each per round, so
drift in the machine's load hits all alike); the medians and the ratios msprobe / ours are written to
``results/compare.json`` and ``results/compare.md``. Our ``similarities.csv`` is checked against msprobe's.
Run it with ``benchmarks/run-compare`` (it sets up ``benchmarks/.venv`` with msprobe 1.0.3 first).

``--quick --out DIR``: a dry run of the harness in seconds (4 x nn.Linear(64, 64), 1 round), results only in DIR;
without msprobe 1.0.3 installed it leaves msprobe's variant out, saying so, and the ratios are to our first variant.
"""
from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from msprobe_mlflow import GradProbeConfig, compare_dumps
from msprobe_mlflow.directions import PACKED_FILE_NAME, read_step_directions, write_packed
from msprobe_mlflow.dump import indexed_children, rank_dir, step_dir, summary_csv_path, summary_steps
from msprobe_mlflow.pytorch import GradientMonitor

RESULTS = Path(__file__).resolve().parent / "results"
LAYERS, WIDTH, STEPS = 16, 2048, 3
QUICK_LAYERS, QUICK_WIDTH = 4, 64  # --quick
MSPROBE_VARIANT = "msprobe 1.0.3 GradComparator (npy, a plot per parameter)"


def train(dump: Path, perturb_from: int | None, layers: int = LAYERS, width: int = WIDTH) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    config = GradProbeConfig(dump_path=str(dump), direction_format="npy")
    monitor = GradientMonitor(config, log_to_mlflow=False).monitor(model, optimizer)
    inputs, noise = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
    for step in range(STEPS):
        x = torch.randn(8, width, generator=inputs)
        if perturb_from is not None and step >= perturb_from:
            x = x + 0.5 * torch.randn(8, width, generator=noise)
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()
    monitor.stop()


def to_packed(npy_dump: Path, packed_dump: Path) -> None:
    """The same directions in our packed form (one ``directions.npz`` per step), CSVs copied."""
    for rank in indexed_children(npy_dump, "rank"):
        for step in summary_steps(rank_dir(npy_dump, rank)):
            directions = read_step_directions(step_dir(npy_dump, rank, step))
            names = list(directions)
            write_packed(step_dir(packed_dump, rank, step) / PACKED_FILE_NAME, names,
                         [directions[n][0] for n in names], np.concatenate([directions[n][1] for n in names]))
            shutil.copy(summary_csv_path(npy_dump, rank, step), summary_csv_path(packed_dump, rank, step))


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def read_similarities(path: Path) -> dict[str, list[float]]:
    with open(path, encoding="utf-8-sig", newline="") as f:
        rows = list(csv.reader(f))
    return {row[0]: [float(v) for v in row[1:]] for row in rows[1:]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="rounds of every variant (default 5)")
    parser.add_argument("--work-dir", help="where the dumps go (default: a temporary folder, deleted afterwards)")
    parser.add_argument("--out", type=Path, help=f"where compare.json and compare.md go (default {RESULTS}; "
                        "--quick needs it)")
    parser.add_argument("--quick", action="store_true", help=f"a dry run of the harness in seconds: "
                        f"{QUICK_LAYERS} x nn.Linear({QUICK_WIDTH}, {QUICK_WIDTH}), 1 round unless --repeats says; "
                        "without msprobe 1.0.3, its variant is left out")
    if "--quick" in sys.argv[1:]:
        parser.set_defaults(repeats=1)
    args = parser.parse_args()
    if args.quick and args.out is None:
        parser.error("--quick needs --out: a dry run never writes into benchmarks/results/")
    out_folder = args.out or RESULTS
    layers, width = (QUICK_LAYERS, QUICK_WIDTH) if args.quick else (LAYERS, WIDTH)
    with_msprobe = importlib.util.find_spec("msprobe") is not None
    if not with_msprobe and not args.quick:
        parser.error("msprobe 1.0.3 is not installed: benchmarks/run-compare sets up benchmarks/.venv with it "
                     "(--quick leaves its variant out)")
    if not with_msprobe:
        print("msprobe 1.0.3 is not installed (benchmarks/setup-env): its variant is left out, the ratios are to "
              "our first variant", file=sys.stderr)

    work = Path(tempfile.mkdtemp(prefix="compare-bench-", dir=args.work_dir))
    try:
        started = time.perf_counter()
        npy_a, npy_b, packed_a, packed_b = (work / name for name in ("npy_a", "npy_b", "packed_a", "packed_b"))
        train(npy_a, None, layers, width)
        train(npy_b, 1, layers, width)
        to_packed(npy_a, packed_a)
        to_packed(npy_b, packed_b)
        print(f"dumps written in {time.perf_counter() - started:.1f} s", file=sys.stderr)

        def ours(a: Path, b: Path, **options):
            return lambda out: compare_dumps(a, b, out, progress=False, **options)

        variants = {}
        if with_msprobe:
            # msprobe 1.0.3, benchmark environment only
            from msprobe.core.grad_probe.grad_compare import GradComparator

            variants[MSPROBE_VARIANT] = lambda out: GradComparator.compare_distributed(str(npy_a), str(npy_b),
                                                                                       str(out))
        variants.update({
            "ours, npy, a plot per parameter": ours(npy_a, npy_b, per_param_plots=True),
            "ours, npy, default plots (summary + heat map)": ours(npy_a, npy_b),
            "ours, npy, no plots": ours(npy_a, npy_b, plots=False),
            "ours, packed, default plots (summary + heat map)": ours(packed_a, packed_b),
            "ours, packed, no plots": ours(packed_a, packed_b, plots=False),
        })
        times: dict[str, list[float]] = {name: [] for name in variants}
        outputs: dict[str, Path] = {}
        for round_number in range(args.repeats):
            for index, (name, run) in enumerate(variants.items()):
                out = work / f"out_{index}_{round_number}"
                begin = time.perf_counter()
                with open(os.devnull, "w") as quiet, _redirect_stdout(quiet):
                    run(out)
                times[name].append(time.perf_counter() - begin)
                if round_number == 0:
                    outputs[name] = out
                else:
                    shutil.rmtree(out)
            print(f"round {round_number + 1}/{args.repeats} done", file=sys.stderr)

        reference_name = next(iter(variants))
        reference = read_similarities(outputs[reference_name] / "rank0" / "similarities.csv")
        agree = all(read_similarities(out / "rank0" / "similarities.csv") == reference for out in outputs.values())
        reference_bytes = (outputs[reference_name] / "rank0" / "similarities.csv").read_bytes()
        same_bytes = all((out / "rank0" / "similarities.csv").read_bytes() == reference_bytes
                         for out in outputs.values())
        medians = {name: statistics.median(values) for name, values in times.items()}
        summary = reference["summary"]
        result = {
            "model": f"{layers} x nn.Linear({width}, {width})",
            "parameters": layers * (width * width + width),
            "steps": STEPS,
            "dump_bytes": {"npy (per dump)": folder_bytes(npy_a), "packed (per dump)": folder_bytes(packed_a)},
            "summary_similarity": summary,
            "quick": args.quick,
            "reference": reference_name,  # msprobe's variant, or without msprobe (--quick) our first
            "results_identical_to_msprobe": agree,  # without msprobe (--quick): to the reference
            "csv_bytes_identical_to_msprobe": same_bytes,
            "repeats": args.repeats,
            "seconds": times,
            "median_seconds": medians,
            "speedup_vs_msprobe": {name: medians[reference_name] / m for name, m in medians.items()},
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "numpy": np.__version__,
                        "torch": torch.__version__, "platform": platform.platform()},
        }
        out_folder.mkdir(parents=True, exist_ok=True)
        (out_folder / "compare.json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
        (out_folder / "compare.md").write_text(markdown(result, reference_name), encoding="utf-8")
        print(markdown(result, reference_name))
        return 0 if agree else 1
    finally:
        shutil.rmtree(work, ignore_errors=True)


class _redirect_stdout:
    """msprobe logs every step to stdout; keep the benchmark's output readable."""

    def __init__(self, target):
        self.target = target

    def __enter__(self):
        self.saved, sys.stdout = sys.stdout, self.target

    def __exit__(self, *exc):
        sys.stdout = self.saved


def markdown(result: dict, reference_name: str) -> str:
    if reference_name == MSPROBE_VARIANT:
        against, ratio = "msprobe's", "msprobe / this"
    else:  # --quick without msprobe 1.0.3
        against, ratio = f"{reference_name}'s (msprobe 1.0.3 not installed: its variant left out)", "reference / this"
    lines = [
        "# Comparator benchmark",
        "",
        f"{result['model']} ({result['parameters']:,} parameters), {result['steps']} steps, one rank; "
        f"dump B takes other inputs from step 1 on (summary similarity "
        f"{', '.join(f'{v:.4f}' for v in result['summary_similarity'])}).",
        f"Dump size per run: npy {result['dump_bytes']['npy (per dump)'] / 1e6:.0f} MB, packed "
        f"{result['dump_bytes']['packed (per dump)'] / 1e6:.0f} MB. "
        f"{result['repeats']} interleaved rounds, median wall time; {result['machine']['cpus']} CPUs, "
        f"Python {result['machine']['python']}, numpy {result['machine']['numpy']}, "
        f"torch {result['machine']['torch']}.",
        f"similarities.csv values identical to {against}: "
        f"{'yes' if result['results_identical_to_msprobe'] else 'NO'}"
        f" (byte for byte: {'yes' if result['csv_bytes_identical_to_msprobe'] else 'no'}).",
        "",
        f"| variant | median s | {ratio} |",
        "|---|---:|---:|",
    ]
    for name, median in result["median_seconds"].items():
        lines.append(f"| {name} | {median:.3f} | {result['speedup_vs_msprobe'][name]:.1f}x |")
    lines += ["", f"Reproduce: `benchmarks/run-compare` (reference: {reference_name}).", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
