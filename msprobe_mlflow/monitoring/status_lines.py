"""The two lines a monitor says on stderr (``Notices.say``; ``silent=True`` sends them to the logger): when it
starts, where its steps go (the MLflow run, the dump folder, the level, the live verdict's baseline); when it ends,
what it left (the steps in the dump and their size, the anomaly flags, the live verdict), read back from the dump
folder, where the writer and the sinks put them. Under torchrun or msrun the first line is said once, by the first
rank that probes (it is every rank's), and the last by each rank that probes, prefixed with its rank: each rank's
steps, flags and verdict are its own."""
from __future__ import annotations

import json
import os

from msprobe_mlflow.config import GradProbeConfig
from msprobe_mlflow.dump import findings_dir, rank_dir, read_csv, summary_steps
from msprobe_mlflow.session import RankPolicy
from msprobe_mlflow.sinks.anomalies import ANOMALIES_FILE_NAME
from msprobe_mlflow.sinks.baseline import BaselineOptions
from msprobe_mlflow.vocabulary import VERDICT_FILE_NAME


def says_start(ranks: RankPolicy) -> bool:
    """The rank that says the start line: the first one that probes."""
    return ranks.rank == next(iter(ranks.wanted_ranks()), 0)


def start_line(config: GradProbeConfig, ranks: RankPolicy, run_id: str | None, tracking_uri: str | None,
               baseline: BaselineOptions | None) -> str:
    """``probing gradients at level L1 (2 ranks) into MLflow run 3f2a... at http://host:5000; dump: /abs/dump;
    live verdict against baseline runs/base``."""
    ranks_text = f" ({len(ranks.wanted_ranks())} ranks)" if ranks.world_size > 1 else ""
    run = f"MLflow run {run_id} at {tracking_uri}" if run_id else "no MLflow run (the local dump only)"
    live = f"live verdict against baseline {baseline.baseline}" if baseline else "no live verdict"
    return f"probing gradients at level {config.level}{ranks_text} into {run}; dump: " \
           f"{os.path.abspath(config.dump_path)}; {live}"


def end_line(dump_path: str, ranks: RankPolicy, anomaly_flags: bool, live_verdict: bool) -> str:
    """``done: 100 steps, 1.2 MB in /abs/dump/rank0; anomalies: none; live verdict: consistent, 100 steps
    compared`` (``rank 1: done: ...`` under torchrun or msrun)."""
    dump_path = os.path.abspath(dump_path)
    folder = rank_dir(dump_path, ranks.rank)
    steps = len(summary_steps(folder)) if folder.is_dir() else 0
    line = f"done: {steps} step{'s' if steps != 1 else ''}, {readable_size(folder_bytes(folder))} in " \
           f"{folder}; anomalies: {anomalies_text(dump_path, ranks.rank, anomaly_flags)}"
    if live_verdict:
        line += f"; live verdict: {verdict_text(dump_path, ranks.rank)}"
    return f"rank {ranks.rank}: {line}" if ranks.world_size > 1 else line


def anomalies_text(dump_path: str, rank: int, flags_on: bool) -> str:
    if not flags_on:
        return "not flagged (anomaly_flags=False)"
    path = findings_dir(dump_path, rank) / ANOMALIES_FILE_NAME
    rows = read_csv(path)[1:] if path.is_file() else []
    if not rows:
        return "none"
    first = min(int(row[0]) for row in rows)
    return f"{len(rows)} flag{'s' if len(rows) != 1 else ''} from step {first} ({path})"


def verdict_text(dump_path: str, rank: int) -> str:
    path = findings_dir(dump_path, rank) / VERDICT_FILE_NAME
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return f"none ({path} was not written: the warnings above say why)"
    compared = len(report["compared_steps"])
    not_compared = sum(len(steps) for steps in report["steps_not_compared"].values())
    if report["verdict"]["suspicious"]:
        return f"suspicious from step {report['verdict']['first_suspicious_step']} ({path})"
    if not_compared:
        return f"incomplete, {compared} steps compared, {not_compared} not ({path})"
    return f"consistent, {compared} step{'s' if compared != 1 else ''} compared"


def folder_bytes(folder) -> int:
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(folder) for name in names
               if not os.path.islink(os.path.join(root, name)))


def readable_size(size: float) -> str:
    """``512 B``, ``12.3 KB``, ``4.0 MB``, ``1.2 GB`` (powers of 1000, as ``du --si``)."""
    if size < 1000:
        return f"{size} B"
    for unit in ("KB", "MB", "GB"):
        size /= 1000
        if size < 1000 or unit == "GB":
            return f"{size:.1f} {unit}"
