"""The monitor on a CUDA device: same CSV/direction output as the CPU path, no host sync on the training
thread, and iteration-time ratios against no monitor. Run on a GPU machine; writes JSON and Markdown.

    PYTHONPATH=. python benchmarks/gpu_check.py --out benchmarks/results [--device cuda]

It measures 16 x Linear(2048) fp32 (67M), 256 x Linear(64) fp32 (512 tensors) and 16 x Linear(8192) bf16 (1.07B
parameters; ``--skip-big`` leaves it out), at L0 (MD5 and the ``mix64`` device checksum), L1 and L2.

Needs torch and numpy only (MLflow logging is off here: the GPU machine has no tracking store).
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from msprobe_mlflow import GradProbeConfig
from msprobe_mlflow.directions import read_packed
from msprobe_mlflow.dump import read_csv
from msprobe_mlflow.pytorch import GradientMonitor

LEVELS = ("L0", "L1", "L2")
VARIANTS = ("L0", "L0 mix64", "L1", "L2")  # "L0 mix64": L0 with the device checksum in the MD5 column


def config(folder: str, variant: str, **options) -> GradProbeConfig:
    level, *checksum = variant.split()
    return GradProbeConfig(dump_path=folder, level=level, checksum=checksum[0] if checksum else "md5", **options)


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def probe_once(device: str, grads: dict[str, torch.Tensor], variant: str, folder: Path) -> Path:
    """One optimizer step of a model whose gradients are set by hand; returns the dump folder."""
    model = torch.nn.Module()
    for i, (name, grad) in enumerate(grads.items()):
        model.register_parameter(f"p{i}", torch.nn.Parameter(torch.zeros_like(grad, device=device)))
    for parameter, grad in zip(model.parameters(), grads.values()):
        parameter.grad = grad.to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    with GradientMonitor(config(str(folder), variant, bounds=(-1, -0.25, 0, 0.5)), log_to_mlflow=False) as monitor:
        monitor.monitor(model, optimizer)
        optimizer.step()
    return folder


def correctness(device: str) -> dict:
    """CSV cells and directions of the device path against the CPU path, for awkward gradients."""
    generator = torch.Generator().manual_seed(0)
    special = torch.tensor([0.0, -0.0, float("nan"), float("inf"), -float("inf"), -1.0, 0.5, 1e-30])
    grads = {
        "f32": torch.randn(64, 33, generator=generator),
        "bf16": torch.randn(1000, generator=generator).to(torch.bfloat16),
        "f16": torch.randn(7, 9, generator=generator).to(torch.float16),
        "special": special, "scalar": torch.tensor(-2.5), "empty": torch.zeros(0),
        "f64": torch.randn(5, generator=generator, dtype=torch.float64),
        "rows": torch.randn(3000, generator=generator),  # several of the device buffer's rows
    }
    report = {}
    with tempfile.TemporaryDirectory() as scratch:
        for variant in VARIANTS:
            level = variant.replace(" ", "-")
            csv = "rank0/grad_summary_0.csv"
            cpu = read_csv(probe_once("cpu", grads, variant, Path(scratch) / f"cpu{level}") / csv)
            dev = read_csv(probe_once(device, grads, variant, Path(scratch) / f"dev{level}") / csv)
            header = cpu[0]
            differing = sorted({header[j] for a, b in zip(cpu[1:], dev[1:]) for j, (x, y) in enumerate(zip(a, b))
                                if x != y})
            norm_gap = max((abs(float(a[header.index("norm")]) - float(b[header.index("norm")]))
                            / max(abs(float(a[header.index("norm")])), 1e-30)
                            for a, b in zip(cpu[1:], dev[1:]) if a[0] != "special"), default=0.0)
            same_directions = None
            if not level.startswith("L0"):
                cpu_dirs = read_packed(Path(scratch) / f"cpu{level}/rank0/step0/directions.npz")
                dev_dirs = read_packed(Path(scratch) / f"dev{level}/rank0/step0/directions.npz")
                same_directions = all(np.array_equal(cpu_dirs[k][1], dev_dirs[k][1]) for k in cpu_dirs)
            report[variant] = {"rows": len(cpu) - 1, "same_header": cpu[0] == dev[0], "differing_columns": differing,
                             "max_relative_norm_gap": norm_gap, "same_directions": same_directions}
    return report


def sync_free(device: str) -> dict:
    """``torch.cuda.set_sync_debug_mode("error")`` makes any device-to-host sync raise during the step."""
    result = {}
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)]).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    for variant in VARIANTS:
        with tempfile.TemporaryDirectory() as scratch:
            monitor = GradientMonitor(config(scratch, variant), log_to_mlflow=False)
            monitor.monitor(model, optimizer)
            model(torch.randn(4, 256, device=device)).sum().backward()
            synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                optimizer.step()  # a sync inside the probe is caught by the monitor: read its log too
                monitor.flush()
                result[variant] = f"probe failed: {monitor.errors or 'see log'}" if monitor.errors else "no sync"
            except RuntimeError as e:
                result[variant] = f"synced: {e}"
            finally:
                torch.cuda.set_sync_debug_mode("default")
                monitor.stop()
    return result


def timing(device: str, name: str, model: torch.nn.Module, batch: torch.Tensor, rounds: int, iterations: int) -> dict:
    """Interleaved rounds of none and each variant: median iteration time (synchronised), median training-thread
    time inside the monitor's hook, the first probed step's (torch.compile of the statistics kernel, once per
    process), and the floor (one ``_foreach_norm`` pass over all gradients)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)

    def iteration() -> None:
        optimizer.zero_grad(set_to_none=False)
        model(batch).float().square().mean().backward()
        optimizer.step()

    for _ in range(3):
        iteration()
    synchronize()
    grads = [p.grad for p in model.parameters()]
    floor = []
    for _ in range(20):
        start = time.perf_counter()
        torch._foreach_norm(grads)
        synchronize()
        floor.append(time.perf_counter() - start)
    times = {v: [] for v in ("none", *VARIANTS)}
    hook_times = {v: [] for v in VARIANTS}
    for _ in range(rounds):
        for variant in times:
            monitor = scratch = None
            if variant != "none":
                scratch = tempfile.TemporaryDirectory()
                monitor = GradientMonitor(config(scratch.name, variant), log_to_mlflow=False).monitor(model, optimizer)
                original = monitor._on_optimizer_step

                def timed(*args, _original=original, _variant=variant):
                    start = time.perf_counter()
                    _original(*args)
                    hook_times[_variant].append(time.perf_counter() - start)
                monitor._hook.remove()
                monitor._hook = optimizer.register_step_pre_hook(timed)
            iteration()  # warm-up of this variant
            synchronize()
            for _ in range(iterations):
                start = time.perf_counter()
                iteration()
                synchronize()
                times[variant].append(time.perf_counter() - start)
            if monitor:
                monitor.stop()
                scratch.cleanup()
    base = statistics.median(times["none"])
    floor_s = statistics.median(floor)
    rows = {"model": name, "parameters": sum(p.numel() for p in model.parameters()),
            "tensors": len(grads), "dtype": str(grads[0].dtype), "floor_ms": floor_s * 1e3,
            "none_ms": base * 1e3}
    for variant in VARIANTS:
        iteration_s = statistics.median(times[variant])
        steady = [s for i, s in enumerate(hook_times[variant]) if i % (iterations + 1)]  # not the warm-ups
        hook_s = statistics.median(steady)
        rows[variant] = {"iteration_ms": iteration_s * 1e3, "ratio": iteration_s / base, "hook_ms": hook_s * 1e3,
                         "hook_in_floor_passes": hook_s / floor_s, "first_hook_ms": hook_times[variant][0] * 1e3}
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="tiny models, for a dry run")
    parser.add_argument("--skip-big", action="store_true", help="leave out the 1B-parameter bf16 model")
    args = parser.parse_args()
    device = args.device
    torch.manual_seed(0)
    width, big_width, big_layers = (64, 128, 2) if args.quick else (2048, 8192, 16)
    results = {"device": torch.cuda.get_device_name() if device == "cuda" else platform.processor(),
               "torch": torch.__version__, "correctness": correctness(device),
               "sync": sync_free(device) if device == "cuda" else "not checked (no CUDA)"}
    models = [
        ("16 x Linear(2048, 2048) fp32, batch 8",
         torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(16)]).to(device),
         torch.randn(8, width, device=device)),
        ("256 x Linear(64, 64) fp32 (512 tensors), batch 8",
         torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(256)]).to(device),
         torch.randn(8, 64, device=device)),
        (f"{big_layers} x Linear(8192, 8192) bf16, batch 64",
         torch.nn.Sequential(*[torch.nn.Linear(big_width, big_width) for _ in range(big_layers)]).to(
             device, torch.bfloat16),
         torch.randn(64, big_width, device=device, dtype=torch.bfloat16)),
    ]
    if args.skip_big:
        models = models[:2]
    results["timing"] = [timing(device, name, model, batch, args.rounds, args.iterations)
                         for name, model, batch in models]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu.json").write_text(json.dumps(results, indent=2))
    lines = [f"# Monitor on {results['device']} (torch {results['torch']})", "",
             f"Sync-free training thread (torch.cuda.set_sync_debug_mode('error') during optimizer.step()): "
             f"{results['sync']}", "",
             "Device path vs CPU path, same gradients: " + "; ".join(
                 f"{lvl}: differing columns {r['differing_columns'] or 'none'}, "
                 f"norm gap {r['max_relative_norm_gap']:.1e}, "
                 f"same directions {r['same_directions']}" for lvl, r in results["correctness"].items()), "",
             "| model | params | floor ms | none ms | " + " | ".join(f"{v} ratio" for v in VARIANTS)
             + " | " + "/".join(VARIANTS) + " hook (floor passes) | first probed step ms |",
             "|---|---:|---:|---:|" + "---:|" * len(VARIANTS) + "---|---|"]
    for row in results["timing"]:
        lines.append(f"| {row['model']} | {row['parameters']:,} | {row['floor_ms']:.2f} | {row['none_ms']:.2f} | "
                     + " | ".join(f"{row[v]['ratio']:.2f}x" for v in VARIANTS) + " | "
                     + " / ".join(f"{row[v]['hook_ms']:.1f} ms ({row[v]['hook_in_floor_passes']:.1f})"
                                  for v in VARIANTS)
                     + " | " + " / ".join(f"{row[v]['first_hook_ms']:.0f}" for v in VARIANTS) + " |")
    (out / "gpu.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
