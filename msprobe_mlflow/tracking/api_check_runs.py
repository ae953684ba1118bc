"""The MindSpore API checker in MLflow: one run for the check, one nested run per API.

The check's run is nested under ``parent_run_id``, else under the active run when there is one (and then lives in
its parent's experiment). It holds the summary metrics (``apis_total``, ``apis_checked`` = passed + failed,
``apis_passed``, ``apis_failed``, ``apis_skipped``, ``pass_rate`` = passed / checked), the options as params, and
the two CSVs as artifacts under ``api_check/``. Each API's run (named after the call, ``Mint.add.0``) has the
metrics of each output (``forward.output.0.cosine``, ``.max_abs_err``, ``.max_relative_err``), the tags ``status``,
``message``, ``forward_status``, ``backward_status``, and its inputs as params (``input_args.0``), so that
``mlflow.search_runs(filter_string="tags.status = 'error'")`` lists the failures. Each nested run costs three
requests (create with its tags, one ``log_batch``, terminate), whatever its number of values.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import mlflow
from mlflow import MlflowClient
from mlflow.entities import Metric, Param
from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID, MLFLOW_RUN_NAME
from mlflow.utils.time import get_current_time_millis

from msprobe_mlflow import __version__
from msprobe_mlflow.api_check.metrics import ERROR, PASS, SKIP, Thresholds
from msprobe_mlflow.api_check.results import ApiCheckReport, ApiResult
from msprobe_mlflow.tracking import TAG_PREFIX
from msprobe_mlflow.tracking.experiments import experiment_id_for
from msprobe_mlflow.tracking.keys import metric_key

ARTIFACT_FOLDER = "api_check"
TASK_TAG = f"{TAG_PREFIX}api_check.task"
METRIC_FIELDS = ("cosine", "max_abs_err", "max_relative_err")
# MLflow's limits per log_batch request (1000 values in all, at most 100 params), and what we keep of a value.
MAX_PARAMS_PER_BATCH, MAX_VALUES_PER_BATCH = 100, 1000
MAX_TAG_LENGTH, MAX_PARAM_LENGTH = 5000, 500


def summary_metrics(report: ApiCheckReport) -> dict[str, float]:
    passed, failed, skipped = report.count(PASS), report.count(ERROR), report.count(SKIP)
    metrics = {"apis_total": len(report.results), "apis_checked": passed + failed, "apis_passed": passed,
               "apis_failed": failed, "apis_skipped": skipped}
    if passed + failed:
        metrics["pass_rate"] = passed / (passed + failed)
    return metrics


@dataclass(frozen=True)
class CheckRunTarget:
    """Where the check's run goes, settled before the check starts so that a wrong run ID or experiment fails
    at once rather than after the last API."""

    client: MlflowClient
    experiment_id: str
    parent_run_id: str | None


def resolve_target(experiment: str | None = None, parent_run_id: str | None = None,
                   tracking_uri: str | None = None) -> CheckRunTarget:
    """The parent is ``parent_run_id``, else the active run (only when ``tracking_uri`` is None: the active run
    lives in the active store). The experiment is the parent's (``experiment``, if given, must be that one),
    else ``experiment`` (created if missing), else MLflow's current experiment."""
    client = MlflowClient(tracking_uri)
    active = mlflow.active_run() if tracking_uri is None else None
    parent = parent_run_id or (active.info.run_id if active is not None else None)
    if parent is not None:
        parent_experiment = client.get_run(parent).info.experiment_id
        if experiment is not None:
            found = client.get_experiment_by_name(experiment)
            if found is None or found.experiment_id != parent_experiment:
                raise ValueError(f"experiment = {experiment!r} is not the experiment of the parent run {parent} "
                                 f"(experiment ID {parent_experiment}); a nested run lives in its parent's "
                                 "experiment: leave the experiment out")
        return CheckRunTarget(client, parent_experiment, parent)
    return CheckRunTarget(client, experiment_id_for(client, experiment), None)


def log_api_check(report: ApiCheckReport, target: CheckRunTarget, *, api_info: Path, task: str,
                  thresholds: Thresholds, api_filter: str | None = None, nested: bool = True) -> str:
    """Records the check in MLflow (see the module docstring); returns the ID of the check's run. The active run,
    if any, stays active and unchanged."""
    client = target.client
    tags = {MLFLOW_RUN_NAME: f"api-check {api_info.name}", "mlflow.source.name": "msprobe-mlflow api-check",
            f"{TAG_PREFIX}version": __version__, f"{TAG_PREFIX}framework": "mindspore", TASK_TAG: task}
    if target.parent_run_id is not None:
        tags[MLFLOW_PARENT_RUN_ID] = target.parent_run_id
    params = {"api_info": str(api_info), "task": task, "cosine_threshold": thresholds.cosine,
              "max_abs_threshold": thresholds.max_abs_err, "api_filter": api_filter or "", "nested": nested}
    run_id = client.create_run(target.experiment_id, tags=tags).info.run_id
    try:
        _log_batch(client, run_id, summary_metrics(report), params)
        for csv_path in (report.details_csv, report.result_csv):
            if csv_path is not None:
                client.log_artifact(run_id, str(csv_path), ARTIFACT_FOLDER)
        if nested:
            for result in report.results:
                _log_api_run(client, target.experiment_id, run_id, result)
    except BaseException:
        client.set_terminated(run_id, "FAILED")
        raise
    client.set_terminated(run_id, "FINISHED")
    return run_id


def _log_api_run(client: MlflowClient, experiment_id: str, parent_run_id: str, result: ApiResult) -> None:
    tags = {MLFLOW_PARENT_RUN_ID: parent_run_id, MLFLOW_RUN_NAME: _clip(result.name, MAX_PARAM_LENGTH),
            "api_name": _clip(result.name, MAX_TAG_LENGTH), "status": result.status,
            "message": _clip(result.message, MAX_TAG_LENGTH)}
    for side_name, side in (("forward", result.forward), ("backward", result.backward)):
        if side is not None:
            tags[f"{side_name}_status"] = side.status
    metrics = {}
    for row in result.output_rows():
        relative_name = row.name[len(result.name) + 1:] if row.name.startswith(result.name + ".") else row.name
        for field_name in METRIC_FIELDS:
            value = getattr(row, field_name)
            if value is not None:
                metrics[f"{relative_name}.{field_name}"] = value
    run = client.create_run(experiment_id, tags=tags)
    _log_batch(client, run.info.run_id, metrics, result.inputs)
    client.set_terminated(run.info.run_id, "FINISHED")


def _log_batch(client: MlflowClient, run_id: str, metrics: dict[str, float], params: dict[str, object]) -> None:
    """Metrics and params in as few ``log_batch`` requests as MLflow's limits allow (one, usually). Keys go
    through ``metric_key`` (a dump's kwarg names are untrusted)."""
    timestamp = get_current_time_millis()
    metric_entities = [Metric(metric_key(key), float(value), timestamp, 0) for key, value in metrics.items()]
    param_entities = list({metric_key(key): Param(metric_key(key), _clip(str(value), MAX_PARAM_LENGTH))
                           for key, value in params.items()}.values())
    while metric_entities or param_entities:
        params_now = param_entities[:MAX_PARAMS_PER_BATCH]
        metrics_now = metric_entities[:MAX_VALUES_PER_BATCH - len(params_now)]
        client.log_batch(run_id, metrics=metrics_now, params=params_now, synchronous=True)
        param_entities, metric_entities = param_entities[len(params_now):], metric_entities[len(metrics_now):]


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
