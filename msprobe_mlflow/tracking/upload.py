"""Uploading a local dump into an MLflow run: what the live sink could not send, or a whole msprobe 1.0.3 dump.
The live findings (``rank{R}/findings/``) go up too, file by file, those the run lacks.

Idempotent: it asks the run which steps already have their metrics (the ``total_norm`` history) and their CSV
artifact, and sends only the rest, so running it twice adds nothing. Directions always travel as one packed
archive per rank and step (an msprobe boolean ``.npy`` folder is packed on the way); the steps' archives are
uploaded before their CSVs, so a CSV artifact means the step is complete.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from mlflow.entities import Metric, Run
from mlflow.tracking import MlflowClient

from msprobe_mlflow import __version__
from msprobe_mlflow.directions import PACKED_FILE_NAME, open_step_directions, read_step_directions, write_packed
from msprobe_mlflow.dump import (RANK_PREFIX, TRAINING_LOCK_FILE_NAME, TrainingLock, dump_folder, dump_trainings,
                                 exponents_path, findings_dir, indexed_children, parse_archive_name,
                                 parse_summary_name, rank_dir, read_dump_config, read_summary, relative_rank_dir,
                                 step_dir, step_ranges, summary_csv_path, summary_steps)
from msprobe_mlflow.exponents import read_exponents
from msprobe_mlflow.levels import level_of_header
from msprobe_mlflow.tracking.aggregate import is_summary_key, rank_distribution
from msprobe_mlflow.tracking.experiments import experiment_id_for
from msprobe_mlflow.tracking.exponent_images import log_exponent_pictures
from msprobe_mlflow.tracking.runs import created_run, log_batched, now_ms, tag
from msprobe_mlflow.progress import ProgressLine
from msprobe_mlflow.metrics import step_metrics
from msprobe_mlflow.vocabulary import (ARTIFACT_ROOT, CONFIG_FILE_NAME, DUMP_PATH_TAG, FAILED_RANKS_TAG, FINISHED,
                                       FRAMEWORK_TAG, INCOMPLETE, LEVEL_TAG, MISSING, MISSING_RANKS_TAG,
                                       MLFLOW_STEP_OFFSET_TAG, OVER_RANKS, RANK_FAILURES, RANK_SUMMARY_TAG, RUNNING,
                                       SOURCE_NAME_TAG, TAG_RANGES_LIMIT, TRAINING_ID_TAG,
                                       UNSENT_DISTRIBUTION_STEPS_TAG, VERSION_TAG, WORLD_SIZE_TAG, distribution_key,
                                       grad_key, rank_failure_tag, rank_status_tag, rank_statuses, unsent_steps_tag)

STEPS_PER_REQUEST = 50  # steps whose files go in one pair of requests (upload's progress, stop()'s drain: per pair)


@dataclass
class UploadReport:
    run_id: str
    metrics_logged: int = 0
    files_uploaded: int = 0
    steps_completed: dict[int, list[int]] = field(default_factory=dict)  # rank -> steps whose files were sent
    unsent_distributions: str = ""  # steps whose distributions over the ranks this dump (not every rank) cannot send


def end_run_failed(client: MlflowClient, run_id: str, news: dict[int, str], reason: str = "") -> list[int]:
    """Tags ``news`` (``{rank: status}``: ``failed``, ``killed`` or ``missing``; ``reason`` for a failure), names
    every rank of the run that failed or was killed in ``FAILED_RANKS_TAG`` and the missing ones in
    ``MISSING_RANKS_TAG``, and ends the run FAILED when any failed; returns the failed ranks (empty: the run is
    left as it is). Several ranks may fail at once: each names all the run holds by then."""
    tags = [tag(rank_status_tag(rank), status) for rank, status in news.items()]
    tags += [tag(rank_failure_tag(rank), reason) for rank, status in news.items() if reason and status != MISSING]
    log_batched(client, run_id, tags=tags)
    statuses = rank_statuses(client.get_run(run_id).data.tags)
    failed = sorted(rank for rank, status in statuses.items() if status in RANK_FAILURES)
    missing = sorted(rank for rank, status in statuses.items() if status == MISSING)
    named = [tag(name, step_ranges(ranks, limit=TAG_RANGES_LIMIT)) for name, ranks in (
        (FAILED_RANKS_TAG, failed), (MISSING_RANKS_TAG, missing)) if ranks]
    log_batched(client, run_id, tags=named)
    if failed:
        client.set_terminated(run_id, "FAILED")
    return failed


def close_abandoned_run(client: MlflowClient, run_id: str, run: Run | None = None,
                        dump_path: str | os.PathLike | None = None) -> str | None:
    """A run whose training is over while ranks still say ``running``: they never said how they ended (a
    launcher's SIGKILL: msrun's, or torchrun's after its SIGTERM; the out-of-memory killer's). They are tagged
    ``missing`` and the run ends FAILED. The training is over when a rank failed or was killed (that ends a
    launcher's whole job), or, for a rank of ``dump_path`` (the local dump being uploaded), when no process holds
    its lock file any more (:class:`~msprobe_mlflow.dump.TrainingLock`). Returns what was done, or None for a run
    that may still be training. ``run``: the run as the caller just fetched it (None: fetched here)."""
    run = run or client.get_run(run_id)
    statuses = rank_statuses(run.data.tags)
    running = sorted(rank for rank, status in statuses.items() if status == RUNNING)
    if any(status in RANK_FAILURES for status in statuses.values()):
        gone, why = running, ""
    else:
        gone = [rank for rank in running if dump_path is not None and TrainingLock.abandoned(dump_path, rank)]
        why = f" (no process holds their {TRAINING_LOCK_FILE_NAME} in {dump_path}: killed by SIGKILL?)"
        if not gone:
            return None
    if not gone and run.info.status != "RUNNING" and FAILED_RANKS_TAG in run.data.tags:
        return None
    failed = end_run_failed(client, run_id, {rank: MISSING for rank in gone})
    if not failed:  # no rank failed: the ranks that died end it
        client.set_terminated(run_id, "FAILED")
    return (f"run {run_id}" + (f" lost ranks {step_ranges(failed)} (failed or killed);" if failed else ":")
            + (f" ranks {step_ranges(gone)} never said how they ended{why}: tagged missing;" if gone else "")
            + f" the run is ended FAILED (it was {run.info.status})")


def close_abandoned_run_at(tracking_uri: str | None, run_id: str, dump_path: str | os.PathLike | None = None
                           ) -> str | None:
    """:func:`close_abandoned_run` on the store at ``tracking_uri`` (None: MLflow's current one)."""
    return close_abandoned_run(MlflowClient(tracking_uri), run_id, dump_path=dump_path)


def metric_entities(metrics: dict[str, float], step: int, timestamp_ms: int) -> list[Metric]:
    return [Metric(key, value, timestamp_ms, step) for key, value in metrics.items()]


def dump_step_metrics(dump_path: str | os.PathLike, rank: int, step: int,
                      param_patterns: tuple[str, ...] = ()) -> dict[str, float]:
    """:func:`~msprobe_mlflow.metrics.step_metrics` of a step of the dump, as the live sinks computed them."""
    table = read_summary(summary_csv_path(dump_path, rank, step))
    exponents_file = exponents_path(dump_path, rank, step)
    exponents = read_exponents(exponents_file)[1:] if exponents_file.exists() else None
    return step_metrics(table, rank, param_patterns, exponents)


def metrics_for_step(dump_path: str | os.PathLike, rank: int, step: int, timestamp_ms: int,
                     param_patterns: tuple[str, ...] = (), mlflow_step_offset: int = 0) -> list[Metric]:
    return metric_entities(dump_step_metrics(dump_path, rank, step, param_patterns), step + mlflow_step_offset,
                           timestamp_ms)


def packed_directions_file(folder: Path, scratch: Path) -> Path:
    """The step folder's packed directions file; an msprobe boolean ``.npy`` folder is packed into ``scratch``."""
    packed = folder / PACKED_FILE_NAME
    if packed.exists():
        return packed
    directions = read_step_directions(folder)
    converted = Path(tempfile.mkdtemp(dir=scratch)) / PACKED_FILE_NAME
    names = list(directions)
    write_packed(converted, names, [directions[n][0] for n in names],
                 np.concatenate([np.zeros(0, np.uint8)] + [directions[n][1] for n in names]))
    return converted


def upload_steps_files(client: MlflowClient, run_id: str, dump_path: str | os.PathLike, rank: int,
                       steps: list[int]) -> int:
    """Sends the steps' directions (packed) and exponent counts, then their CSVs, in two requests however many
    steps: a request per file
    cost the live sink's thread three times the CPU (1.7 against 0.6 ms a step of 512 small tensors, SQLite store),
    which fast steps wait for. Every direction file goes before any CSV, so a CSV artifact still means its step is
    complete. Returns the number of files sent."""
    destination = f"{ARTIFACT_ROOT}/{relative_rank_dir(rank)}"
    with tempfile.TemporaryDirectory() as scratch:
        directions, summaries = Path(scratch, "directions"), Path(scratch, "summaries")
        summaries.mkdir()
        archives = 0
        for step in steps:
            folder = step_dir(dump_path, rank, step)
            if folder.is_dir():
                packed = packed_directions_file(folder, Path(scratch))
                _stage(packed, directions / folder.name / packed.name)
                archives += 1
            exponents = exponents_path(dump_path, rank, step)
            if exponents.exists():
                _stage(exponents, directions / exponents.name)
                archives += 1
            csv = summary_csv_path(dump_path, rank, step)
            _stage(csv, summaries / csv.name)
        if archives:
            client.log_artifacts(run_id, str(directions), destination)
        client.log_artifacts(run_id, str(summaries), destination)
    return archives + len(steps)


def _stage(source: Path, target: Path) -> None:
    """``source`` at ``target``, linked (copied where it lies on another file system)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(source, target)
    except OSError as e:
        if not source.is_file():
            raise FileNotFoundError(f"{source}: no such file in the dump") from e
        shutil.copyfile(source, target)


def _steps_with_csv_artifact(client: MlflowClient, run_id: str, rank: int) -> set[int]:
    """The steps whose CSV the run holds, as a file or in a steps archive."""
    steps = set()
    for info in client.list_artifacts(run_id, f"{ARTIFACT_ROOT}/{relative_rank_dir(rank)}"):
        name = info.path.rsplit("/", 1)[-1]
        if not info.is_dir:
            step = parse_summary_name(name)
            steps.update([step] if step is not None else parse_archive_name(name) or [])
    return steps


def _level_of(dump_path: Path, rank: int, step: int) -> str:
    return level_of_header(read_summary(summary_csv_path(dump_path, rank, step)).header).name


def check_steps(dump_path: Path, rank: int, steps: list[int], param_patterns: tuple[str, ...]) -> None:
    """Reads every step's CSV (as its metrics) and the headers of its direction files, so that a damaged or
    hostile dump (a symbolic link, a pickled array, a file that is no archive) is refused before anything of it is
    sent, with the error naming the file."""
    for step in steps:
        metrics_for_step(dump_path, rank, step, 0, param_patterns)
        folder = step_dir(dump_path, rank, step)
        if folder.is_dir():
            open_step_directions(folder)


def upload_dump(dump_path: str | os.PathLike, run_id: str | None = None, *, experiment: str | None = None,
                tracking_uri: str | None = None, ranks: list[int] | None = None, steps: set[int] | None = None,
                param_patterns: tuple[str, ...] = (), progress: bool = False,
                mlflow_step_offset: int | None = None, pictures: bool = True) -> UploadReport:
    """Makes the run hold every step of the dump (or of ``ranks``/``steps``); creates a run when ``run_id`` is None.
    ``mlflow_step_offset``: MLflow step = dump step + this (None: as the run's ``MLFLOW_STEP_OFFSET_TAG`` says).
    ``pictures``: the exponent pictures of the lowest rank uploaded (``tracking/exponent_images.py``), where the
    dump holds exponent counts."""
    dump_path = dump_folder(dump_path, "dump_path")
    wanted_steps = {}
    for rank in indexed_children(dump_path, RANK_PREFIX):
        if ranks is None or rank in ranks:
            wanted_steps[rank] = [s for s in summary_steps(rank_dir(dump_path, rank)) if steps is None or s in steps]
            check_steps(dump_path, rank, wanted_steps[rank], param_patterns)
    saved_config = read_dump_config(dump_path)
    training_id = next(iter(dump_trainings(dump_path)), None)  # one at most: dump_folder refuses a mixed dump
    client = MlflowClient(tracking_uri)
    if run_id is not None:
        tags = client.get_run(run_id).data.tags  # a wrong ID fails here, clearly, before anything is sent
        _check_same_training(run_id, tags.get(TRAINING_ID_TAG), dump_path, training_id)
        if training_id and TRAINING_ID_TAG not in tags:
            client.set_tag(run_id, TRAINING_ID_TAG, training_id)
        if mlflow_step_offset is None:
            mlflow_step_offset = int(tags.get(MLFLOW_STEP_OFFSET_TAG, 0))
        return _upload_steps(client, run_id, dump_path, wanted_steps, saved_config, param_patterns, progress, tags,
                             mlflow_step_offset, pictures)
    with created_run(client, experiment_id_for(client, experiment), run_name=f"upload {dump_path.name}", tags={
            DUMP_PATH_TAG: str(dump_path.resolve()), VERSION_TAG: __version__,
            SOURCE_NAME_TAG: "msprobe-mlflow upload", **({TRAINING_ID_TAG: training_id} if training_id else {})
    }) as new_run_id:
        return _upload_steps(client, new_run_id, dump_path, wanted_steps, saved_config, param_patterns, progress,
                             {}, pictures=pictures)


def _check_same_training(run_id: str, recorded: str | None, dump_path: Path, training_id: str | None) -> None:
    """Refuses to complete a run with another training's dump: its steps would be mixed with the run's own."""
    if recorded and training_id and recorded != training_id:
        raise ValueError(f"--run-id {run_id} holds training {recorded} (its tag {TRAINING_ID_TAG}); dump_path = "
                         f"{str(dump_path)!r} is training {training_id}: give the run that training logged into, or "
                         f"leave out --run-id to upload it into a new run")


def _upload_steps(client: MlflowClient, run_id: str, dump_path: Path, wanted_steps: dict[int, list[int]],
                  saved_config: dict | None, param_patterns: tuple[str, ...], progress: bool,
                  tags: dict[str, str], mlflow_step_offset: int = 0, pictures: bool = True) -> UploadReport:
    """``tags``: the run's when the upload began (a large job's run holds thousands: read once, not per rank)."""
    report = UploadReport(run_id)
    if saved_config is not None and not any(i.path.endswith(CONFIG_FILE_NAME)
                                            for i in client.list_artifacts(run_id, ARTIFACT_ROOT)):
        _upload_config(client, run_id, saved_config)
        report.files_uploaded += 1
    over_ranks = tags.get(RANK_SUMMARY_TAG) == OVER_RANKS
    for rank, wanted in wanted_steps.items():
        if not wanted:
            continue
        if saved_config is None:
            client.set_tag(run_id, LEVEL_TAG, _level_of(dump_path, rank, wanted[0]))
        uploaded = _steps_with_csv_artifact(client, run_id, rank)
        # a run of distributions over the ranks holds rank 0's own summary metrics, the other ranks' only in files
        own_summary = rank == 0 or not over_ranks
        logged = {m.step - mlflow_step_offset for m in client.get_metric_history(
            run_id, grad_key(rank, "total_norm"))} if own_summary else uploaded
        timestamp = now_ms()
        metrics = [m for s in wanted if s not in logged
                   for m in metrics_for_step(dump_path, rank, s, timestamp, param_patterns, mlflow_step_offset)
                   if own_summary or not is_summary_key(m.key, rank)]
        log_batched(client, run_id, metrics=metrics)
        report.metrics_logged += len(metrics)
        missing = [s for s in wanted if s not in uploaded]
        line = ProgressLine(f"rank{rank} upload", len(missing), enabled=progress and bool(missing))
        for first in range(0, len(missing), STEPS_PER_REQUEST):
            chunk = missing[first:first + STEPS_PER_REQUEST]
            report.files_uploaded += upload_steps_files(client, run_id, dump_path, rank, chunk)
            line.advance(len(chunk), item=f"step {chunk[-1]}")
        line.close()
        report.steps_completed[rank] = missing
        if tags.get(rank_status_tag(rank)) == INCOMPLETE:  # the live sink left it so: it is whole now
            client.set_tag(run_id, rank_status_tag(rank), FINISHED)
            client.delete_tag(run_id, unsent_steps_tag(rank))
    if over_ranks:
        report.metrics_logged += _upload_distributions(client, run_id, dump_path, wanted_steps, tags, report,
                                                       mlflow_step_offset)
    for rank in wanted_steps:
        report.files_uploaded += _upload_findings(client, run_id, dump_path, rank)
    if pictures and (pictured := [rank for rank, wanted in wanted_steps.items() if wanted]):
        report.files_uploaded += log_exponent_pictures(client, run_id, dump_path, min(pictured),
                                                       mlflow_step_offset)
    return report


def _upload_distributions(client: MlflowClient, run_id: str, dump_path: Path, wanted_steps: dict[int, list[int]],
                          tags: dict[str, str], report: "UploadReport", mlflow_step_offset: int) -> int:
    """The distributions over the ranks (``tracking/aggregate.py``) of the steps the run lacks, where the dump holds
    every rank of the run (``world_size``): one folder of every rank's dump, on a shared file system. Where it
    does not, the steps rank 0 could not send (its tag) are told in ``report``. Returns the values logged."""
    unsent = tags.get(UNSENT_DISTRIBUTION_STEPS_TAG)
    if sorted(wanted_steps) != list(range(int(tags.get(WORLD_SIZE_TAG, 0)))):
        report.unsent_distributions = unsent or ""
        return 0
    logged = {m.step - mlflow_step_offset
              for m in client.get_metric_history(run_id, distribution_key("total_norm", "median"))}
    ranks = np.array(sorted(wanted_steps))
    timestamp, metrics = now_ms(), []
    for step in sorted(set.intersection(*map(set, wanted_steps.values())) - logged):
        values = [{key[len(grad_key(rank)):]: value for key, value in dump_step_metrics(dump_path, rank, step).items()
                   if is_summary_key(key, rank)} for rank in ranks]
        suffixes = sorted(values[0])
        matrix = np.array([[found.get(suffix, np.nan) for suffix in suffixes] for found in values])
        metrics += metric_entities(rank_distribution(suffixes, ranks, matrix), step + mlflow_step_offset, timestamp)
    log_batched(client, run_id, metrics=metrics)
    if unsent:
        client.delete_tag(run_id, UNSENT_DISTRIBUTION_STEPS_TAG)
    return len(metrics)


def _upload_findings(client: MlflowClient, run_id: str, dump_path: Path, rank: int) -> int:
    """The live sinks' files (``rank{R}/findings/``: verdict, similarities, anomaly flags) the run lacks."""
    folder = findings_dir(dump_path, rank)
    if not folder.is_dir():
        return 0
    destination = f"{ARTIFACT_ROOT}/{relative_rank_dir(rank)}/{folder.name}"
    present = {(info.path.rsplit("/", 1)[-1], info.file_size) for info in client.list_artifacts(run_id, destination)}
    files = [path for path in sorted(folder.iterdir()) if path.is_file() and not path.is_symlink()
             and (path.name, path.stat().st_size) not in present]  # a verdict rewritten since is sent again
    for path in files:
        client.log_artifact(run_id, str(path), destination)
    return len(files)


def _upload_config(client: MlflowClient, run_id: str, saved: dict) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / CONFIG_FILE_NAME
        path.write_text(json.dumps(saved["config"], indent=2), encoding="utf-8")
        client.log_artifact(run_id, str(path), ARTIFACT_ROOT)
    if "framework" in saved:
        client.set_tag(run_id, FRAMEWORK_TAG, saved["framework"])

