"""API checker speed on many calls: calls per second at 1 and 2 worker processes, against msprobe's way of sharing.

The dump: the statistics example's 17 calls (examples/mindspore_api_dump) repeated with varied shapes until there
are ``--calls`` (default 2,000): repetition r scales every dimension above 1 of every tensor by
``SCALES[r % len(SCALES)]`` (so shapes stay consistent: matmul's inner dimensions, broadcasts, nll_loss's classes),
and renumbers the calls. Repetitions of one scale have identical inputs, as a real dump's repeated layers do.

Variants, each timed from the call of ``check_api_accuracy`` (CSVs written, MLflow off) to its return, in a fresh
Python process each (so each pays its own imports, as a user's run does):
- ``this process``: the benchmark process has launch blocking on, so the calls run in it (no child process).
- ``1 worker`` / ``2 workers``: ``workers=N`` child processes, one call handed out at a time.
- ``round-robin x2``: msprobe's multi-device scheme (PyTorch's ``multi_run_ut``: msprobe 1.0.3's MindSpore checker
  has none) with our checker: calls dealt alternately into two fixed halves, each checked by its own process.
Scaling efficiency = rate at 2 / (2 x rate at 1 worker). The startup (a check of one call) is measured per variant,
and each variant's rate is also given without it. Then MLflow: logging the check of ``--mlflow-calls`` calls with
one nested run per call against ``nested=False``, into a SQLite store and through a local ``mlflow server`` (one
nested run at a time, and ``NESTED_RUNS_AT_ONCE`` at a time).

Run: ``benchmarks/run-api-check`` (``--calls N``, ``--repeats N``, ``--threads default|1|both``). Results go to
``results/api_check.json`` and ``results/api_check.md`` (``--out DIR``: there instead).

``--quick --out DIR``: a dry run of the harness in about a minute (``QUICK``: 20 calls, torch's default threads,
the MLflow logging of 5 calls; arguments given change them), results only in DIR.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's msprobe_mlflow, whichever one the interpreter has installed
EXAMPLE = ROOT / "examples" / "mindspore_api_dump" / "statistics" / "api_info.json"
RESULTS = Path(__file__).resolve().parent / "results"
SCALES = (1, 2, 4, 8, 16, 32, 64)
QUICK = {"calls": 20, "repeats": 1, "threads": "default", "mlflow_calls": 5}  # --quick's defaults
_KEY = re.compile(r"^(?P<api>[A-Za-z_]+\.[A-Za-z0-9_]+)\.(?P<index>\d+)\.(?P<side>forward|backward)$")


def scaled(value, scale: int):
    """Every ``shape`` inside ``value`` with its dimensions above 1 multiplied by ``scale``."""
    if isinstance(value, list):
        return [scaled(item, scale) for item in value]
    if isinstance(value, dict):
        return {key: ([d * scale if d > 1 else d for d in item] if key == "shape" else scaled(item, scale))
                for key, item in value.items()}
    return value


def generate_dump(path: Path, calls: int) -> int:
    """Writes a statistics dump of the first ``calls`` calls of the repeated example (see the module docstring)."""
    example = json.loads(EXAMPLE.read_text(encoding="utf-8"))
    data, names, repetition = {}, set(), 0
    while True:
        for key, entry in example["data"].items():
            match = _KEY.match(key)
            name = f"{match['api']}.{repetition * 10 + int(match['index'])}"
            if name not in names:
                if len(names) == calls:
                    path.write_text(json.dumps({**example, "data": data}), encoding="utf-8")
                    return calls
                names.add(name)
            data[f"{name}.{match['side']}"] = scaled(entry, SCALES[repetition % len(SCALES)])
        repetition += 1


# One variant, run by ``python api_check_benchmark.py --variant NAME DUMP OUT``: prints its timing as JSON.
def run_variant(variant: str, dump: Path, out: Path) -> dict:
    from msprobe_mlflow.api_check import check_api_accuracy
    from msprobe_mlflow.api_check.parser import read_api_info

    if variant == "this process":
        import mindspore

        mindspore.runtime.launch_blocking()  # what lets the calls run here (msprobe_mlflow.api_check.replay)
    if variant.startswith("round-robin"):
        return round_robin(dump, out, int(variant.rsplit("x", 1)[1]))
    workers = 1 if variant == "this process" else int(variant.split()[0])
    started = time.perf_counter()
    report = check_api_accuracy(dump, output_dir=out, log_to_mlflow=False, workers=workers)
    seconds = time.perf_counter() - started
    assert len(report.results) == len(read_api_info(dump).calls)
    return {"seconds": seconds, "calls": len(report.results),
            "statuses": {status: report.count(status) for status in ("pass", "error", "skip")}}


def round_robin(dump: Path, out: Path, shares: int) -> dict:
    """Call i goes to share i % shares (msprobe's split); each share is checked by a process of its own, all at
    once; done when the last one is."""
    document = json.loads(dump.read_text(encoding="utf-8"))
    names = list(dict.fromkeys(key.rsplit(".", 1)[0] for key in document["data"]))
    share_of = {name: i % shares for i, name in enumerate(names)}
    started = time.perf_counter()
    processes = []
    for share in range(shares):
        part = out / f"share{share}.json"
        part.write_text(json.dumps({**document, "data": {key: entry for key, entry in document["data"].items()
                                                         if share_of[key.rsplit(".", 1)[0]] == share}}))
        processes.append(subprocess.Popen([sys.executable, __file__, "--variant", "this process", str(part),
                                           str(out / f"share{share}")], stdout=subprocess.PIPE))
    shares_done = [json.loads(process.communicate()[0]) for process in processes]
    seconds = time.perf_counter() - started
    return {"seconds": seconds, "calls": sum(done["calls"] for done in shares_done),
            "share_seconds": [done["seconds"] for done in shares_done],
            "statuses": {status: sum(done["statuses"][status] for done in shares_done)
                         for status in ("pass", "error", "skip")}}


def timed_variant(variant: str, dump: Path, work: Path, threads: str) -> dict:
    """The variant in a fresh process; ``threads`` "1" sets OMP_NUM_THREADS=1 for it and its children."""
    out = Path(tempfile.mkdtemp(dir=work))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    if threads == "1":
        env["OMP_NUM_THREADS"] = "1"
    completed = subprocess.run([sys.executable, __file__, "--variant", variant, str(dump), str(out)], env=env,
                               stdout=subprocess.PIPE, check=True)
    return json.loads(completed.stdout)


def mlflow_logging(dump: Path, work: Path) -> dict:
    """Seconds to log a check of ``dump`` (checked once, here) without nested runs and with one per call: into a
    SQLite store, and through a local ``mlflow server`` one nested run at a time and ``NESTED_RUNS_AT_ONCE`` at a
    time."""
    import mindspore
    from mlflow import MlflowClient

    from msprobe_mlflow.api_check import check_api_accuracy
    from msprobe_mlflow.api_check.metrics import Thresholds
    from msprobe_mlflow.tracking import api_check_runs

    mindspore.runtime.launch_blocking()
    report = check_api_accuracy(dump, output_dir=work / "mlflow_csv", log_to_mlflow=False)
    at_once = api_check_runs.NESTED_RUNS_AT_ONCE

    def log(uri: str, name: str, nested: bool, runs_at_once: int) -> float:
        MlflowClient(uri).create_experiment(name, artifact_location=(work / "artifacts").as_uri())
        api_check_runs.NESTED_RUNS_AT_ONCE = runs_at_once
        started = time.perf_counter()
        api_check_runs.log_api_check(report, api_check_runs.resolve_target(name, tracking_uri=uri), api_info=dump,
                                     task="statistics", thresholds=Thresholds(), nested=nested)
        return time.perf_counter() - started

    sqlite = f"sqlite:///{work / 'mlflow.db'}"
    timings = {"calls": len(report.results), "runs_at_once": at_once,
               "sqlite_flat": log(sqlite, "flat", False, at_once),
               "sqlite_nested": log(sqlite, "nested", True, at_once)}
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
                               "--workers", "1", "--backend-store-uri", f"sqlite:///{work / 'server.db'}",
                               "--serve-artifacts", "--artifacts-destination", str(work / "server_artifacts")],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                              env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
    try:
        uri = f"http://127.0.0.1:{port}"
        wait_for_server(uri)
        timings["server_flat"] = log(uri, "flat", False, at_once)
        timings["server_nested_one_at_a_time"] = log(uri, "one-at-a-time", True, 1)
        timings["server_nested_at_once"] = log(uri, "at-once", True, at_once)
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
        api_check_runs.NESTED_RUNS_AT_ONCE = at_once
    return timings


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_server(uri: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{uri}/health", timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"mlflow server at {uri} did not answer in {timeout} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=1, help="runs of each variant, interleaved; medians")
    parser.add_argument("--threads", choices=("default", "1", "both"), default="both")
    parser.add_argument("--mlflow-calls", type=int, default=500, help="calls of the dump whose check is logged")
    parser.add_argument("--out", type=Path, help=f"where api_check.json and api_check.md go (default {RESULTS}; "
                        "--quick needs it)")
    parser.add_argument("--quick", action="store_true", help="a dry run of the harness in about a minute: "
                        + ", ".join(f"--{key.replace('_', '-')} {value}" for key, value in QUICK.items())
                        + " unless given; writes only into --out")
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    parser.add_argument("paths", nargs="*", help=argparse.SUPPRESS)
    if "--quick" in sys.argv[1:]:
        parser.set_defaults(**QUICK)
    args = parser.parse_args()
    if args.quick and args.out is None:
        parser.error("--quick needs --out: a dry run never writes into benchmarks/results/")
    if args.variant:
        print(json.dumps(run_variant(args.variant, Path(args.paths[0]), Path(args.paths[1]))))
        return
    variants = ("this process", "1 worker", "2 workers", "round-robin x2")
    thread_settings = ("default", "1") if args.threads == "both" else (args.threads,)
    with tempfile.TemporaryDirectory() as folder:
        work = Path(folder)
        calls = generate_dump(work / "many.json", args.calls)
        one = work / "one.json"
        generate_dump(one, 1)
        load_before = os.getloadavg()
        runs = {(threads, variant): {"many": [], "startup": []} for threads in thread_settings
                for variant in variants}
        for _ in range(args.repeats):
            for threads in thread_settings:
                for variant in variants:
                    print(f"threads {threads}: {variant}...", file=sys.stderr, flush=True)
                    runs[threads, variant]["startup"].append(timed_variant(variant, one, work, threads))
                    runs[threads, variant]["many"].append(timed_variant(variant, work / "many.json", work, threads))
        print("MLflow logging...", file=sys.stderr, flush=True)
        generate_dump(work / "mlflow.json", args.mlflow_calls)
        logging = mlflow_logging(work / "mlflow.json", work)
        load_after = os.getloadavg()
    write_results(calls, runs, logging, load_before, load_after, args)


def write_results(calls, runs, logging, load_before, load_after, args) -> None:
    import mindspore
    import torch

    rows = []
    for (threads, variant), measured in runs.items():
        seconds = statistics.median(run["seconds"] for run in measured["many"])
        startup = statistics.median(run["seconds"] for run in measured["startup"])
        rows.append({"threads": threads, "variant": variant, "seconds": seconds, "startup_seconds": startup,
                     "calls_per_second": calls / seconds,
                     "calls_per_second_after_startup": (calls - 1) / (seconds - startup) if seconds > startup else None,
                     "statuses": measured["many"][0]["statuses"],
                     "share_seconds": measured["many"][0].get("share_seconds")})
    for threads in {row["threads"] for row in rows}:
        one = next(row for row in rows if row["threads"] == threads and row["variant"] == "1 worker")
        for row in rows:
            if row["threads"] == threads and row["variant"] in ("2 workers", "round-robin x2"):
                row["scaling_efficiency"] = row["calls_per_second"] / (2 * one["calls_per_second"])
                if row["calls_per_second_after_startup"] and one["calls_per_second_after_startup"]:
                    row["scaling_efficiency_after_startup"] = (row["calls_per_second_after_startup"]
                                                               / (2 * one["calls_per_second_after_startup"]))
    machine = {"cpus": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version(),
               "torch": torch.__version__, "mindspore": mindspore.__version__,
               "load_average_1min_before_after": [round(load_before[0], 2), round(load_after[0], 2)],
               "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                        text=True).stdout.strip()}
    out = args.out or RESULTS
    out.mkdir(parents=True, exist_ok=True)
    (out / "api_check.json").write_text(json.dumps({"calls": calls, "repeats": args.repeats, "quick": args.quick,
                                                    "machine": machine, "variants": rows, "mlflow": logging},
                                                   indent=1) + "\n")
    lines = [
        "# API checker on many calls",
        "",
        f"A generated statistics dump of {calls} calls (the example's 17, repeated with shapes scaled by "
        f"{', '.join(map(str, SCALES))}), CSVs written, MLflow off; median of {args.repeats} run(s) per variant, "
        f"each in a fresh process. {machine['cpus']} CPUs ({machine['machine']}), Python {machine['python']}, "
        f"torch {machine['torch']}, MindSpore {machine['mindspore']}, msprobe-mlflow at {machine['commit']}; "
        f"1-min load average {machine['load_average_1min_before_after'][0]} before, "
        f"{machine['load_average_1min_before_after'][1]} after. Reproduce: `benchmarks/run-api-check`.",
        "",
        *([f"**Noisy**: the load average exceeded the {machine['cpus']} CPUs (other work on the machine); rerun "
           "on a quiet machine before quoting these figures.", ""]
          if max(machine["load_average_1min_before_after"]) > machine["cpus"] else []),
        "*startup* is the same variant on a dump of one call (process start, imports); *efficiency* is the rate "
        "at two processes over twice the rate of one worker.",
        "",
        "| torch threads | variant | seconds | calls/s | startup s | calls/s after startup | efficiency "
        "(after startup) |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        after = row["scaling_efficiency_after_startup"] if "scaling_efficiency_after_startup" in row else None
        efficiency = (f"{row['scaling_efficiency']:.0%} ({'n/a' if after is None else f'{after:.0%}'})"
                      if "scaling_efficiency" in row else "")
        rate_after = row["calls_per_second_after_startup"]
        lines.append(f"| {row['threads']} | {row['variant']} | {row['seconds']:.1f} | {row['calls_per_second']:.1f}"
                     f" | {row['startup_seconds']:.1f} | {'n/a' if rate_after is None else f'{rate_after:.1f}'} | "
                     f"{efficiency} |")
    shares = [row for row in rows if row.get("share_seconds")]
    lines += ["", "Round-robin shares' own times (s): " + "; ".join(
        f"threads {row['threads']}: {', '.join(f'{s:.1f}' for s in row['share_seconds'])}" for row in shares),
        "", f"MLflow, logging the check of {logging['calls']} calls (ms per nested run = (with nested runs - "
        "without) / calls):", "", "| store | without nested runs s | with nested runs s | ms per nested run |",
        "|---|---:|---:|---:|"]
    for label, flat, nested in (("SQLite", "sqlite_flat", "sqlite_nested"),
                                ("mlflow server, one run at a time", "server_flat", "server_nested_one_at_a_time"),
                                (f"mlflow server, {logging['runs_at_once']} at a time", "server_flat",
                                 "server_nested_at_once")):
        per_run = 1000 * (logging[nested] - logging[flat]) / logging["calls"]
        lines.append(f"| {label} | {logging[flat]:.1f} | {logging[nested]:.1f} | {per_run:.1f} |")
    lines.append("")
    (out / "api_check.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
