"""The MindSpore API checker in MLflow: one run for the check, one nested run per API.

Statuses are msprobe's words, ``pass``, ``error`` and ``skip``, and ``out_of_memory`` (not checked: this machine
lacks the memory the call needs), in the CSVs, the tags and the metric names alike.
The check's run is created when the check starts and ended when it ends, named after the dump's folder and the
start time (``api-check dump_path/step0/rank0 20250101-120000.123``). It is nested under ``parent_run_id``, else
under the active run when there is one (and then lives in its parent's experiment). It holds the summary metrics
(``apis_total``, ``apis_checked`` = pass + error, ``apis_pass``, ``apis_error``, ``apis_skip``,
``apis_out_of_memory``, ``pass_rate`` = pass / checked), the tag ``error_apis`` (the names of the APIs whose status
is error), the options as params, and the two CSVs as artifacts under ``api_check/``.
Each API's run is named after the call, marked with its status unless pass (``[error] Mint.erfinv.0``: in the
UI's runs list every run shows a green Finished, so the name is where a failing API shows), and has the metrics
of each output (``forward/output/0/cosine``, ``.../max_abs_err``, ``.../max_relative_err``: the UI groups them by
``/``), the tags ``status``, ``message``, ``forward_status``, ``backward_status``, ``api_name``, and its inputs as
params (``input_args.0``), so that ``mlflow.search_runs(filter_string="tags.status = 'error'")`` lists the APIs
that fail. Each nested run costs three requests (create with its tags, one ``log_batch``, terminate), whatever its
number of values. The nested runs are logged from the calling process once the check is done (worker processes
never talk to MLflow); a tracking server gets ``NESTED_RUNS_AT_ONCE`` of them at a time (each run's requests
mostly wait on the network and the server's database), without MLflow's per-run link lines, a local store one
after another (SQLite serialises its writers).
"""
from __future__ import annotations

import os
import re
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Iterator

import mlflow
from mlflow import MlflowClient
from mlflow.entities import Metric
from mlflow.environment_variables import MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT
from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID, MLFLOW_RUN_NAME
from mlflow.utils.validation import MAX_TAG_VAL_LENGTH

from msprobe_mlflow import __version__
from msprobe_mlflow.vocabulary import (API_CHECK_ARTIFACT_ROOT, API_CHECK_STATUSES as STATUSES, API_CHECK_TASK_TAG,
                                       ERROR, ERROR_APIS_TAG, FRAMEWORK_TAG, PASS, SOURCE_NAME_TAG, VERSION_TAG)
from msprobe_mlflow.metrics import metric_key
from msprobe_mlflow.tracking.experiments import experiment_id_for
from msprobe_mlflow.tracking.runs import clipped, created_run, log_batched, now_ms, param, tag

METRIC_FIELDS = ("cosine", "max_abs_err", "max_relative_err")
MAX_RUN_NAME_LENGTH = 500  # a run name beyond this is unreadable in the UI's run list
NESTED_RUNS_AT_ONCE = 8
_MSPROBE_FOLDER = re.compile(r"^(step\d+|rank\d*)$")  # the folders msprobe puts under its dump_path


def summary_metrics(report) -> dict[str, float]:
    counts = {status: report.count(status) for status in STATUSES}
    metrics = {"apis_total": len(report.results), "apis_checked": counts[PASS] + counts[ERROR],
               **{f"apis_{status}": count for status, count in counts.items()}}
    if metrics["apis_checked"]:
        metrics["pass_rate"] = counts[PASS] / metrics["apis_checked"]
    return metrics


@dataclass(frozen=True)
class CheckRunTarget:
    """Where the check's run goes, looked up before the check starts so that a wrong run ID or experiment fails
    at once rather than after the last API. Nothing is created before the check's run: a missing experiment is
    created with it (``existing_experiment_id`` None)."""

    client: MlflowClient
    parent_run_id: str | None
    existing_experiment_id: str | None
    experiment: str | None

    def experiment_id(self) -> str:
        return self.existing_experiment_id or experiment_id_for(self.client, self.experiment)


def resolve_target(experiment: str | None = None, parent_run_id: str | None = None,
                   tracking_uri: str | None = None) -> CheckRunTarget:
    """The parent is ``parent_run_id``, else the active run (only when ``tracking_uri`` is None: the active run
    lives in the active store). The experiment is the parent's (``experiment``, if given, must be that one),
    else ``experiment`` (created when the run is logged, if missing), else MLflow's current experiment."""
    client = MlflowClient(tracking_uri)
    active = mlflow.active_run() if tracking_uri is None else None
    parent = parent_run_id or (active.info.run_id if active is not None else None)
    found = client.get_experiment_by_name(experiment) if experiment else None
    if parent is None:
        return CheckRunTarget(client, None, found.experiment_id if found else None, experiment)
    parent_experiment = client.get_run(parent).info.experiment_id
    if experiment is not None and (found is None or found.experiment_id != parent_experiment):
        raise ValueError(f"experiment = {experiment!r} is not the experiment of the parent run {parent} "
                         f"(experiment ID {parent_experiment}); a nested run lives in its parent's "
                         "experiment: leave the experiment out")
    return CheckRunTarget(client, parent, parent_experiment, experiment)


@dataclass(frozen=True)
class CheckRun:
    """The check's run while the check goes on (``check_run``)."""

    client: MlflowClient
    experiment_id: str
    run_id: str
    nested: bool

    def log(self, report) -> None:
        """The check's results: summary metrics, the ``error_apis`` tag, the CSVs, one nested run per API."""
        error_apis = ", ".join(result.name for result in report.with_status(ERROR))
        _log_values(self.client, self.run_id, summary_metrics(report), {}, {ERROR_APIS_TAG: error_apis})
        for csv_path in (report.details_csv, report.result_csv):
            if csv_path is not None:
                self.client.log_artifact(self.run_id, str(csv_path), API_CHECK_ARTIFACT_ROOT)
        if self.nested:
            _log_api_runs(self.client, self.experiment_id, self.run_id, report.results)


@contextmanager
def check_run(target: CheckRunTarget, *, api_info: Path, task: str, thresholds,
              api_filter: str | None = None, nested: bool = True) -> Iterator[CheckRun]:
    """The check's run, created as the block starts and ended as it ends (FAILED if it raises), so that the
    run's duration is the check's; it holds the options (``api_info`` as the resolved path of the dump file) from
    the start. The active run, if any, stays active and unchanged."""
    api_info = Path(api_info).resolve()
    client = target.client
    tags = {MLFLOW_RUN_NAME: clipped(run_name(api_info), MAX_RUN_NAME_LENGTH),
            SOURCE_NAME_TAG: "msprobe-mlflow api-check", VERSION_TAG: __version__, FRAMEWORK_TAG: "mindspore",
            API_CHECK_TASK_TAG: task}
    if target.parent_run_id is not None:
        tags[MLFLOW_PARENT_RUN_ID] = target.parent_run_id
    params = {"api_info": str(api_info), "task": task, "cosine_threshold": thresholds.cosine,
              "max_abs_threshold": thresholds.max_abs_err, "api_filter": api_filter or "", "nested": nested}
    experiment_id = target.experiment_id()
    with created_run(client, experiment_id, tags=tags) as run_id:
        _log_values(client, run_id, {}, params)
        yield CheckRun(client, experiment_id, run_id, nested)


def log_api_check(report, target: CheckRunTarget, *, api_info: Path, task: str,
                  thresholds, api_filter: str | None = None, nested: bool = True) -> str:
    """Records a check already done in one go (its run lasts as long as the logging); returns the run's ID."""
    with check_run(target, api_info=api_info, task=task, thresholds=thresholds, api_filter=api_filter,
                   nested=nested) as run:
        run.log(report)
    return run.run_id


def run_name(api_info: Path) -> str:
    """``api-check {dump folder} {start time}`` (``api-check dump_path/step0/rank0 20250101-120000.123``): the
    file is always api_info.json or dump.json, so its folder (from msprobe's dump_path down) and the time tell two
    checks apart. MLflow's own names come from Python's ``random``, which the user's seed fixes."""
    folders = [api_info.parent]
    while _MSPROBE_FOLDER.match(folders[-1].name) and folders[-1].parent != folders[-1]:
        folders.append(folders[-1].parent)
    now = datetime.now()
    return (f"api-check {'/'.join(folder.name for folder in reversed(folders))} "
            f"{now:%Y%m%d-%H%M%S}.{now.microsecond // 1000:03d}")


def _log_api_runs(client: MlflowClient, experiment_id: str, parent_run_id: str, results: list) -> None:
    """One nested run per API: ``NESTED_RUNS_AT_ONCE`` at a time for a tracking server, else one by one. The first
    failure stops the runs not yet started and is raised."""
    if not client.tracking_uri.startswith(("http://", "https://")):
        for result in results:
            _log_api_run(client, experiment_id, parent_run_id, result)
        return
    pool = ThreadPoolExecutor(NESTED_RUNS_AT_ONCE, thread_name_prefix="msprobe-mlflow-api-runs")
    try:
        with _run_links_not_printed():
            for future in [pool.submit(_log_api_run, client, experiment_id, parent_run_id, result)
                           for result in results]:
                future.result()
    finally:
        pool.shutdown(cancel_futures=True)


@contextmanager
def _run_links_not_printed() -> Iterator[None]:
    """On a tracking server MLflow asks for each run once more as it ends, to print two lines with its link: for
    thousands of nested runs, thousands of lines and a quarter of the requests. MLflow's own switch turns that
    off while they are logged and is set back after (the check's run still prints its link)."""
    name = MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT.name
    previous = os.environ.get(name)
    os.environ[name] = "true"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = previous


def _log_api_run(client: MlflowClient, experiment_id: str, parent_run_id: str, result) -> None:
    name = result.name if result.status == PASS else f"[{result.status}] {result.name}"
    tags = {MLFLOW_PARENT_RUN_ID: parent_run_id, MLFLOW_RUN_NAME: clipped(name, MAX_RUN_NAME_LENGTH),
            "api_name": clipped(result.name, MAX_TAG_VAL_LENGTH), "status": result.status,
            "message": clipped(result.message, MAX_TAG_VAL_LENGTH)}
    for side_name, side in (("forward", result.forward), ("backward", result.backward)):
        if side is not None:
            tags[f"{side_name}_status"] = side.status
    metrics = {}
    for row in result.output_rows():
        relative_name = row.name[len(result.name) + 1:] if row.name.startswith(result.name + ".") else row.name
        for field_name in METRIC_FIELDS:
            value = getattr(row, field_name)
            if value is not None:
                metrics[metric_key(*relative_name.split("."), field_name)] = value
    with created_run(client, experiment_id, tags=tags) as run_id:
        _log_values(client, run_id, metrics, result.inputs)


def _log_values(client: MlflowClient, run_id: str, metrics: dict[str, float], params: dict[str, object],
                tags: dict[str, str] | None = None) -> None:
    """Metrics, params and tags in as few ``log_batch`` requests as MLflow's limits allow (one, usually). Metric
    and param keys go through ``metric_key`` (a dump's kwarg names are untrusted)."""
    timestamp = now_ms()
    log_batched(client, run_id,
                metrics=[Metric(metric_key(key), float(value), timestamp, 0) for key, value in metrics.items()],
                params=list({metric_key(key): param(metric_key(key), value) for key, value in params.items()}.values()),
                tags=[tag(key, value) for key, value in (tags or {}).items()])
