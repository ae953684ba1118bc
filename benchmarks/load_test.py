"""Load test: N simulated ranks driving the real MLflow sink into one real tracking service, nothing lost.

The service is what docker/ deploys: ``mlflow server --workers W`` backed by PostgreSQL (a cluster of its own, from
the OS packages, as the topology tests start it) with its artifact proxy (``--serve-artifacts``). Each simulated
rank is a real :class:`~msprobe_mlflow.sinks.mlflow.MlflowSink` with its own sender thread and client, fed at a
fixed step rate with synthetic L1 step records (4 parameters, 2,762 elements: two files per step, the CSV and the
packed directions), each written to the local dump first as the monitor does. Ranks live in ``--processes`` driver
processes, one driver thread each, that write the dump and call ``handle`` for their ranks at every tick.

Per configuration it reports what the issue asks for:

- *values accepted/s*: metric values the server held at the end of the stepping, per second of stepping (the
  offered rate is ranks x 3 values x the step rate per rank; under aggregation rank 0's own 3 and the 3 metrics'
  distributions over the ranks, 5 values each, x the step rate, whatever the ranks);
- *request latency*: median and 99th percentile of every HTTP request the sinks made (timed around
  ``requests.Session.request``, the one path of MLflow's client);
- *held/sent*: metric values and files the server holds (counted in PostgreSQL and in the artifact folder) against
  those the ranks wrote, at the end of ``stop()`` and after ``msprobe-mlflow upload`` sends what ``stop()`` left
  (the *lost* columns, which must be 0);
- *stop() drain*: from the last step to the last sink closed (bounded by ``MSPROBE_MLFLOW_DRAIN_SECONDS``);
  *upload after*: ``upload_dump`` of each rank the run does not mark ``finished`` (8 at a time, as their nodes
  would), then, where the run names steps in ``msprobe_mlflow.unsent_distribution_steps``, of the folder holding
  every rank's dump (as on a shared file system), sending what ``stop()`` left;
- *training-side cost*: the time a rank's writer spends per step (building the synthetic record, writing the local
  dump, ``handle``, which under aggregation includes the simulated all-gather; the training thread itself only
  hands the step over), median and 99th percentile, and how far the drivers fell behind the step rate (*lag*: the
  simulation's own CPU limit on this machine, not the server's).

Modes: ``per-rank`` (every rank sends its own metrics and files, the default below 64 ranks), ``aggregated``
(rank-0 aggregation: each summary metric's distribution over the ranks goes up in rank 0's requests; the
all-gather is simulated
in-process, rank 0 rebuilding each rank's vector from the same synthetic generator, as the real collective is
tested with torchrun and msrun in tests/test_scale_*.py; the end-of-run exchange of the ranks' statuses goes through a
dict the drivers share) and ``aggregated+archive`` (also each rank's files as one
archive per ``--archive-every`` steps). msprobe 1.0.3 sends nothing to a tracking service, so there is no side to
compare with here.

    PYTHONPATH=. .venv/bin/python benchmarks/load_test.py --ranks 8 64 256 1024 --workers 1 2 --steps 5
    benchmarks/run-load-test            # the full table into benchmarks/results/load_test.{md,json}
    PYTHONPATH=. .venv/bin/python benchmarks/load_test.py --quick --output DIR/load_test   # a dry run, ~1 min

``--quick``: 3 ranks, 1 server worker, every mode, 4 steps at 2 step/s (``QUICK``; arguments given change them),
its table only where ``--output`` says: a dry run of the harness, not a measurement.
"""
from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import platform
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # the tests' PostgreSQL and mlflow server helpers

SHAPES = [(64, 32), (64,), (10, 64), (10,)]
NAMES = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
VALUES_PER_STEP = 3  # grad/rank{R}/{total_norm,max,min} at L1
DISTRIBUTION_VALUES = 5  # per summary metric under aggregation: grad/ranks/{metric} min, median, max, min/max rank
RESULTS = ROOT / "benchmarks" / "results"
QUICK = {"ranks": [3], "workers": [1], "modes": ["per-rank", "aggregated", "aggregated+archive"], "steps": 4,
         "step_rate": 2.0, "processes": 2, "drain_seconds": 30.0, "archive_every": 2}  # --quick's defaults
START_DELAY = 1.0  # seconds from the drivers' barrier to step 0


def summary_values(rank: int, step: int) -> np.ndarray:
    """The step's synthetic (max, min, norm) per parameter: the generator's first draw, so rank 0's simulated
    all-gather rebuilds any rank's summary without drawing its directions."""
    generator = np.random.default_rng(rank * 1_000_003 + step)
    values = np.abs(generator.standard_normal((len(SHAPES), 3))).astype(np.float32)
    values[:, 1] *= -1  # min <= 0 <= max
    return values


def synthetic_record(rank: int, step: int):
    """A deterministic L1 step of one rank: the same (rank, step) gives the same record in any process."""
    from msprobe_mlflow.records import StepRecord

    generator = np.random.default_rng(rank * 1_000_003 + step)
    generator.standard_normal((len(SHAPES), 3))  # the summary_values draw
    numels = [int(np.prod(shape)) for shape in SHAPES]
    directions = np.concatenate([np.packbits(generator.random(n) > 0.5) for n in numels])
    return StepRecord(rank=rank, step=step, level="L1", bounds=(-1, 0, 1), names=list(NAMES), shapes=list(SHAPES),
                      values=summary_values(rank, step), directions=directions)


def summary_vector(rank: int, step: int) -> np.ndarray:
    """``[step, max, min, total_norm]`` (suffixes sorted, as ``RankZeroMetrics`` lays
    them out), computed as ``metrics.step_metrics`` does."""
    values = summary_values(rank, step).astype(np.float64)
    total_norm = math.sqrt(math.fsum(float(n) ** 2 for n in values[:, 2]))
    return np.array([step, values[:, 0].max(), values[:, 1].min(), total_norm])


def simulated_all_gather(rank: int, world_size: int, statuses):
    """The collective as rank 0 sees it: every rank's vector of the step (others get their own, unused). The
    end-of-run exchange of statuses is real: each rank puts its vector in ``statuses`` (a dict shared by the
    drivers), where rank 0 waits for all of them as long as the real collective would."""
    from msprobe_mlflow.tracking.aggregate import END_OF_RUN, GATHER_TIMEOUT_SECONDS

    def gather(vector: np.ndarray) -> np.ndarray:
        if vector[0] == END_OF_RUN:
            statuses[rank] = vector.tolist()
            deadline = time.monotonic() + GATHER_TIMEOUT_SECONDS
            while rank == 0 and len(statuses) < world_size:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{world_size - len(statuses)} ranks did not reach the end-of-run exchange")
                time.sleep(0.05)
            return np.array([statuses[r] for r in range(world_size)]) if rank == 0 else np.tile(vector, (world_size, 1))
        if rank != 0:
            return np.tile(vector, (world_size, 1))
        return np.stack([summary_vector(r, int(vector[0])) for r in range(world_size)])
    return gather


@dataclass
class DriverJob:
    ranks: list[int]
    world_size: int
    run_id: str
    tracking_uri: str
    dump_path: str
    steps: int
    step_rate: float
    ready: object  # a Barrier of every driver and the parent: stepping starts START_DELAY after it
    statuses: object  # a shared dict: the end-of-run exchange under aggregation
    aggregated: bool
    archive_every: int
    drain_seconds: float


def timed_requests(latencies: list[tuple[str, float]]) -> None:
    """Times every HTTP request of this process (MLflow's client goes through ``requests.Session.request``)."""
    import requests

    original = requests.Session.request

    def request(self, method, url, *args, **kwargs):
        started = time.perf_counter()
        try:
            return original(self, method, url, *args, **kwargs)
        finally:
            latencies.append(("artifact" if "mlflow-artifacts" in url else "tracking", time.perf_counter() - started))

    requests.Session.request = request


def drive(job: DriverJob) -> dict:
    """One driver process: its ranks' sinks, stepped at the fixed rate, then stopped together."""
    os.environ["MSPROBE_MLFLOW_DRAIN_SECONDS"] = str(job.drain_seconds)
    os.environ["MSPROBE_MLFLOW_RANK_WAIT_SECONDS"] = str(job.drain_seconds)
    from msprobe_mlflow.config import GradProbeConfig
    from msprobe_mlflow.dump import write_step
    from msprobe_mlflow.metrics import record_metrics
    from msprobe_mlflow.notices import Notices
    from msprobe_mlflow.session import RankPolicy
    from msprobe_mlflow.tracking.options import TrackingOptions
    from msprobe_mlflow.sinks.mlflow import MlflowSink, settings as sink_settings

    # Requests stay on each simulated rank's sender thread: the request process a real rank starts when its rounds
    # carry several steps (one per training process) would be a process per simulated rank here, and its requests
    # would escape the latency timer. The server sees the same requests either way.
    sink_settings.PROCESS_MIN_ROUND_STEPS = sys.maxsize
    latencies: list[tuple[str, float]] = []
    timed_requests(latencies)
    config = GradProbeConfig(dump_path=job.dump_path, level="L1")
    options = TrackingOptions(job.run_id, job.tracking_uri, aggregate_metrics=job.aggregated,
                              archive_every_n_steps=job.archive_every)
    check = record_metrics(synthetic_record(job.ranks[0], 0))  # the simulated collective sends what a rank would
    assert np.allclose(sorted(check.values()), sorted(summary_vector(job.ranks[0], 0)[1:]), rtol=0, atol=0), check
    notices = Notices(silent=True)

    def open_sink(rank: int) -> MlflowSink:
        gather = simulated_all_gather(rank, job.world_size, job.statuses) if job.aggregated else None
        return MlflowSink(job.run_id, config, options, RankPolicy(rank, job.world_size), framework="pytorch",
                          notices=notices, gather=gather)

    with ThreadPoolExecutor(32) as pool:
        sinks = list(pool.map(open_sink, job.ranks))
    job.ready.wait()
    start_at = time.time() + START_DELAY
    costs, lag = [], 0.0
    for step in range(job.steps):
        wait = start_at + step / job.step_rate - time.time()
        if wait > 0:
            time.sleep(wait)
        lag = max(lag, -wait)
        for sink in sinks:
            started = time.perf_counter()
            record = synthetic_record(sink.rank, step)
            write_step(job.dump_path, record)
            sink.handle(record)
            costs.append(time.perf_counter() - started)
    stop_started = time.time()
    with ThreadPoolExecutor(len(sinks)) as pool:  # all at once, as a job's ranks stop
        list(pool.map(lambda sink: sink.close(), sinks))
    return {"costs": costs, "lag": lag, "stop_started": stop_started, "stopped": time.time(),
            "latencies": latencies, "unsent_steps": sum(len(sink.unsent.steps) for sink in sinks)}


def held_on_server(database_uri: str, artifacts: Path, run_id: str, experiment_id: str) -> dict:
    """What the service holds for the run: distinct (key, step) metric values, tags naming unsent steps, and the
    files (and their bytes) under ``grad_probe/rank*/`` in the artifact folder."""
    import psycopg

    with psycopg.connect(database_uri.replace("postgresql+psycopg://", "postgresql://")) as connection:
        values = connection.execute("SELECT count(*) FROM (SELECT DISTINCT key, step FROM metrics WHERE run_uuid = "
                                    "%s AND key LIKE 'grad/rank%%') AS held", (run_id,)).fetchone()[0]
        unsent_tags = connection.execute("SELECT count(*) FROM tags WHERE run_uuid = %s AND key LIKE "
                                         "'msprobe_mlflow.rank%%.unsent_steps'", (run_id,)).fetchone()[0]
        finished = {key for (key,) in connection.execute(
            "SELECT key FROM tags WHERE run_uuid = %s AND key LIKE 'msprobe_mlflow.rank%%.status' AND value = "
            "'finished'", (run_id,))}
        named = connection.execute("SELECT value FROM tags WHERE run_uuid = %s AND key = "
                                   "'msprobe_mlflow.unsent_distribution_steps'", (run_id,)).fetchone()
    folder = artifacts / experiment_id / run_id / "artifacts" / "grad_probe"
    files = [p for p in folder.rglob("*") if p.is_file() and p.parent != folder] if folder.is_dir() else []
    return {"values": values, "unsent_tags": unsent_tags, "files": files, "bytes": sum(p.stat().st_size for p in files),
            "finished": finished, "unsent_distribution_steps": ranges_of(named[0]) if named else set()}


def ranges_of(text: str) -> set[int]:
    """The numbers of ``3-5,9``."""
    ranks = set()
    for part in text.split(","):
        first, _, last = part.partition("-")
        ranks.update(range(int(first), int(last or first) + 1))
    return ranks


def files_held(files: list[Path]) -> int:
    """Step files held: a per-step file counts 1, an archive the steps' files it holds (2 per step at L1)."""
    from msprobe_mlflow.dump import parse_archive_name

    return sum(2 * len(steps) if (steps := parse_archive_name(p.name)) is not None else 1 for p in files)


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else math.nan


def measure(server, database_uri: str, artifacts: Path, *, workers: int, ranks: int, mode: str, steps: int,
            step_rate: float, processes: int, drain_seconds: float, archive_every: int) -> dict:
    """One row of the table: a fresh run, the ranks stepped and stopped, the server counted, the rest uploaded."""
    from mlflow.tracking import MlflowClient

    from msprobe_mlflow.tracking.upload import upload_dump

    client = MlflowClient(server.uri)
    experiment_id = client.create_experiment(f"load {workers}w {ranks}r {mode} {time.time_ns()}")
    run_id = client.create_run(experiment_id).info.run_id
    dump = Path(tempfile.mkdtemp(prefix="msprobe-load-dump-"))
    try:
        slices = [list(range(ranks))[i::processes] for i in range(min(processes, ranks))]
        context = multiprocessing.get_context("spawn")
        with context.Manager() as manager, context.Pool(len(slices)) as pool:
            ready, statuses = manager.Barrier(len(slices) + 1), manager.dict()
            pending = pool.map_async(drive, [DriverJob(part, ranks, run_id, server.uri, str(dump), steps, step_rate,
                                                       ready, statuses, mode.startswith("aggregated"), archive_every,
                                                       drain_seconds) for part in slices])
            ready.wait()  # every sink is open
            time.sleep(START_DELAY + steps / step_rate)
            held_while_stepping = held_on_server(database_uri, artifacts, run_id, experiment_id)["values"]
            results = pending.get()
        at_stop = held_on_server(database_uri, artifacts, run_id, experiment_id)
        upload_started = time.monotonic()
        incomplete = [rank for rank in range(ranks) if f"msprobe_mlflow.rank{rank}.status" not in at_stop["finished"]]
        with ThreadPoolExecutor(8) as pool:  # as the nodes whose ranks the run names would
            list(pool.map(lambda rank: upload_dump(dump, run_id, tracking_uri=server.uri, ranks=[rank]), incomplete))
        if at_stop["unsent_distribution_steps"]:  # the folder of every rank's dump, as on a shared file system
            upload_dump(dump, run_id, tracking_uri=server.uri)
        upload_seconds = time.monotonic() - upload_started
        after_upload = held_on_server(database_uri, artifacts, run_id, experiment_id)
    finally:
        shutil.rmtree(dump, ignore_errors=True)
    latencies = [seconds for result in results for _, seconds in result["latencies"]]
    kinds = [kind for result in results for kind, _ in result["latencies"]]
    rank_steps = ranks * steps
    sent_values = steps * VALUES_PER_STEP * (1 + DISTRIBUTION_VALUES) if mode.startswith("aggregated") \
        else rank_steps * VALUES_PER_STEP
    sent_files = rank_steps * 2
    stepping = steps / step_rate
    costs = [c for result in results for c in result["costs"]]
    return {
        "workers": workers, "ranks": ranks, "mode": mode, "steps": steps, "step_rate": step_rate,
        "offered_values_per_s": sent_values / steps * step_rate,
        "values_accepted_per_s": held_while_stepping / stepping,
        "latency_p50_ms": 1000 * percentile(latencies, 50), "latency_p99_ms": 1000 * percentile(latencies, 99),
        "requests": len(latencies), "tracking_requests_per_rank_step": kinds.count("tracking") / rank_steps,
        "artifact_requests_per_rank_step": kinds.count("artifact") / rank_steps,
        "artifact_bytes_per_rank_step": after_upload["bytes"] / rank_steps,
        "sent_values": sent_values, "held_values_at_stop": at_stop["values"],
        "sent_files": sent_files, "held_files_at_stop": files_held(at_stop["files"]),
        "ranks_naming_unsent_steps_at_stop": at_stop["unsent_tags"], "ranks_uploaded_after": len(incomplete),
        "steps_unsent_at_close": sum(result["unsent_steps"] for result in results),  # the sinks' own count
        "held_values_after_upload": after_upload["values"],
        "held_files_after_upload": files_held(after_upload["files"]),
        "lost_values": sent_values - after_upload["values"],
        "lost_files": sent_files - files_held(after_upload["files"]),
        "ranks_naming_unsent_steps_after_upload": after_upload["unsent_tags"],
        "stop_drain_s": max(r["stopped"] for r in results) - min(r["stop_started"] for r in results),
        "upload_after_s": upload_seconds,
        "writer_cost_p50_ms": 1000 * percentile(costs, 50), "writer_cost_p99_ms": 1000 * percentile(costs, 99),
        "driver_lag_s": max(r["lag"] for r in results), "stepping_s": stepping,
        "values_accepted_per_s_overall": at_stop["values"] / (stepping + max(r["stopped"] for r in results)
                                                              - min(r["stop_started"] for r in results)),
    }


COLUMNS = [("workers", "W", "{}"), ("ranks", "N", "{}"), ("mode", "mode", "{}"),
           ("offered_values_per_s", "values/s offered", "{:.0f}"),
           ("values_accepted_per_s", "values/s accepted", "{:.0f}"),
           ("latency_p50_ms", "p50 ms", "{:.0f}"), ("latency_p99_ms", "p99 ms", "{:.0f}"),
           ("requests_per_s", "requests/s served", "{:.0f}"),
           ("tracking_requests_per_rank_step", "tracking req/rank-step", "{:.2f}"),
           ("artifact_requests_per_rank_step", "artifact req/rank-step", "{:.2f}"),
           ("artifact_bytes_per_rank_step", "artifact bytes/rank-step", "{:.0f}"),
           ("held_values_at_stop", "values held at stop", "{}"), ("sent_values", "values sent", "{}"),
           ("held_files_at_stop", "files held at stop", "{}"), ("sent_files", "files sent", "{}"),
           ("ranks_naming_unsent_steps_at_stop", "ranks tagged unsent", "{}"),
           ("lost_values", "values lost after upload", "{}"), ("lost_files", "files lost after upload", "{}"),
           ("stop_drain_s", "stop() drain s", "{:.1f}"), ("upload_after_s", "upload after s", "{:.1f}"),
           ("writer_cost_p50_ms", "writer ms/step p50", "{:.2f}"), ("writer_cost_p99_ms", "p99", "{:.2f}"),
           ("driver_lag_s", "driver lag s", "{:.1f}")]


def held_in_time(row: dict) -> bool:
    """The service kept up: everything was on the server when ``stop()`` returned, and at least 90% of the values
    offered during the stepping had arrived by its end."""
    return (row["held_values_at_stop"] == row["sent_values"] and row["held_files_at_stop"] == row["sent_files"]
            and row["values_accepted_per_s"] >= 0.9 * row["offered_values_per_s"])


def closing_note(rows: list[dict]) -> list[str]:
    """Per server size and mode: the largest N that held in time, and how the next one missed."""
    lines = ["## What it shows", ""]
    for workers, mode in dict.fromkeys((row["workers"], row["mode"]) for row in rows):
        tried = sorted((row for row in rows if (row["workers"], row["mode"]) == (workers, mode)),
                       key=lambda row: row["ranks"])
        held = [row["ranks"] for row in tried if held_in_time(row)]
        missed = next((row for row in tried if not held_in_time(row)), None)
        text = f"- {workers} worker(s), {mode}: held in time up to {max(held) if held else 'no'} ranks"
        if missed:
            text += (f"; at {missed['ranks']} ranks {missed['values_accepted_per_s']:.0f} of "
                     f"{missed['offered_values_per_s']:.0f} values/s arrived while stepping, stop() left "
                     f"{missed['sent_values'] - missed['held_values_at_stop']} values and "
                     f"{missed['sent_files'] - missed['held_files_at_stop']} files to the later upload "
                     f"({missed['ranks_naming_unsent_steps_at_stop']} ranks tagged them), request p99 "
                     f"{missed['latency_p99_ms'] / 1000:.1f} s")
        lost = sum(row["lost_values"] + row["lost_files"] for row in tried)
        lines.append(text + f"; lost after the upload: {lost}.")
    tried_ranks = sorted({row["ranks"] for row in rows})
    lines += ["", f"Ranks tried: {tried_ranks}. *Held in time*: every value and file on the server when `stop()` "
              f"returned, and at least 90% of the offered values arrived while stepping. Where a row missed, the "
              f"p99 latency of 30 s and more is requests waiting for one of the server's database connections "
              f"(MLflow's pool timeout), behind the bursts of every rank's requests (per-rank) or behind the "
              f"archives at `stop()` (aggregated): the capacity "
              f"model in docker/README.md says what to change. *driver lag*: the simulated ranks themselves fell "
              f"behind the step rate (this machine's CPU), so the offered rate was lower than stated."]
    return lines


def values_per_step(rows: list[dict]) -> str:
    """The metric values a rank sent per step in the per-rank rows (5 in tables measured before the summary metrics
    were cut to 3; an ``--append`` may mix them)."""
    counts = sorted({row["sent_values"] // (row["ranks"] * row["steps"]) for row in rows
                     if row["mode"] == "per-rank"}) or [VALUES_PER_STEP]
    return " or ".join(map(str, counts))


def markdown(rows: list[dict], setup: dict) -> str:
    lines = ["# Load test: N simulated ranks into one tracking service", "",
             f"Generated by `{setup['command']}` on {setup['machine']} ({setup['cpus']} CPUs, shared with other work "
             f"while measured: the figures are noisy; rerun on a quiet machine with `benchmarks/run-load-test`).", "",
             f"Service: `mlflow server --workers W` (MLflow {setup['mlflow']}) on PostgreSQL {setup['postgres']} with "
             f"the artifact proxy, on the same machine as the ranks. Each rank: the real `MlflowSink`, synthetic L1 "
             f"steps ({values_per_step(rows)} metric values and 2 files per step; under aggregation rank 0 sends a "
             f"step's {VALUES_PER_STEP} values and {DISTRIBUTION_VALUES} per metric of their distributions over the "
             f"ranks, {VALUES_PER_STEP * (1 + DISTRIBUTION_VALUES)} whatever N) at {setup['step_rate']:g} step/s for "
             f"{setup['steps']} "
             f"steps, driven by {setup['processes']} processes; `stop()` drains for at most "
             f"{setup['drain_seconds']:g} s, then `msprobe-mlflow upload` sends the rest.", "",
             "| " + " | ".join(label for _, label, _ in COLUMNS) + " |",
             "|" + "---|" * len(COLUMNS)]
    for row in rows:
        row = {**row, "requests_per_s": row["requests"] / (row["stepping_s"] + row["stop_drain_s"])}
        lines.append("| " + " | ".join(form.format(row[key]) for key, _, form in COLUMNS) + " |")
    return "\n".join([*lines, "", *closing_note(rows)]) + "\n"


def rewrite_markdown(output: Path) -> None:
    """OUTPUT.md again from OUTPUT.json (after an edit of the table's layout)."""
    saved = json.loads(output.with_suffix(".json").read_text())
    output.with_suffix(".md").write_text(markdown(saved["rows"], saved["setup"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 64, 256, 1024])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--modes", nargs="+", default=["per-rank"],
                        choices=["per-rank", "aggregated", "aggregated+archive"])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--step-rate", type=float, default=1.0, help="steps per second of every rank")
    parser.add_argument("--processes", type=int, default=4, help="driver processes the ranks are spread over")
    parser.add_argument("--drain-seconds", type=float, default=60.0, help="MSPROBE_MLFLOW_DRAIN_SECONDS")
    parser.add_argument("--archive-every", type=int, default=10, help="steps per archive in aggregated+archive")
    parser.add_argument("--output", help="writes OUTPUT.json and OUTPUT.md (default benchmarks/results/load_test; "
                        "--quick needs it)")
    parser.add_argument("--append", action="store_true", help="keep the rows OUTPUT.json holds, add these")
    parser.add_argument("--markdown-only", action="store_true", help="only write OUTPUT.md again from OUTPUT.json")
    parser.add_argument("--quick", action="store_true", help="a dry run of the harness in about a minute: "
                        + ", ".join(f"--{key.replace('_', '-')} {value}" for key, value in QUICK.items())
                        + " unless given; writes only into --output")
    if "--quick" in sys.argv[1:]:
        parser.set_defaults(**QUICK)
    args = parser.parse_args()
    if args.quick and args.output is None:
        parser.error("--quick needs --output: a dry run never writes into benchmarks/results/")
    output = Path(args.output or RESULTS / "load_test")
    if args.markdown_only:
        return rewrite_markdown(output)

    import mlflow
    from mlflow_server import MlflowServer
    from postgres import PostgresCluster, PostgresUnavailable

    try:
        cluster = PostgresCluster()
    except PostgresUnavailable as e:
        raise SystemExit(f"load_test.py needs PostgreSQL: {e}")
    work = Path(tempfile.mkdtemp(prefix="msprobe-load-"))
    rows = json.loads(output.with_suffix(".json").read_text())["rows"] if args.append else []
    measured = {(w, n, m) for w in args.workers for n in args.ranks for m in args.modes}
    rows = [row for row in rows if (row["workers"], row["ranks"], row["mode"]) not in measured]  # measured again
    try:
        cluster.start()
        for workers in args.workers:
            database_uri = cluster.create_database(f"load{workers}")
            server = MlflowServer(work / f"server{workers}", backend_uri=database_uri,
                                  extra_args=["--workers", str(workers)]).start()
            try:
                for ranks in args.ranks:
                    for mode in args.modes:
                        row = measure(server, database_uri, Path(server.artifacts_destination), workers=workers,
                                      ranks=ranks, mode=mode, steps=args.steps, step_rate=args.step_rate,
                                      processes=args.processes, drain_seconds=args.drain_seconds,
                                      archive_every=args.archive_every if mode.endswith("archive") else 1)
                        print(json.dumps(row), flush=True)
                        rows.append(row)
            finally:
                server.stop()
    finally:
        cluster.remove()
        shutil.rmtree(work, ignore_errors=True)
    setup = {"command": "benchmarks/load_test.py --quick" if args.quick else "benchmarks/run-load-test",
             "machine": platform.platform(),
             "cpus": os.cpu_count(), "mlflow": mlflow.__version__, "postgres": cluster.bin_dir.parent.name,
             "steps": args.steps, "step_rate": args.step_rate, "processes": args.processes,
             "drain_seconds": args.drain_seconds}
    output.parent.mkdir(parents=True, exist_ok=True)
    output.with_suffix(".json").write_text(json.dumps({"setup": setup, "rows": rows}, indent=2))
    output.with_suffix(".md").write_text(markdown(rows, setup))
    print(markdown(rows, setup))


if __name__ == "__main__":
    main()
