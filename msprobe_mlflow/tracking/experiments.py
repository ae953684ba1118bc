"""Which MLflow experiment a run that msprobe-mlflow creates goes into (one rule for upload, compare, api-check)."""
from __future__ import annotations

import mlflow
from mlflow.tracking import MlflowClient
from mlflow.tracking.default_experiment import DEFAULT_EXPERIMENT_ID
# Private, with no public equivalent: it honours set_experiment and MLFLOW_EXPERIMENT_NAME / _ID. Checked against
# MLflow 3.x, the range pyproject.toml allows.
from mlflow.tracking.fluent import _get_experiment_id


def experiment_id_for(client: MlflowClient, name: str | None) -> str:
    """``name``'s ID, creating the experiment if missing; without a name, MLflow's current experiment when
    ``client`` talks to the active store, else that store's Default experiment."""
    if name:
        found = client.get_experiment_by_name(name)
        return found.experiment_id if found else client.create_experiment(name)
    if client.tracking_uri == mlflow.get_tracking_uri():
        return _get_experiment_id()
    return DEFAULT_EXPERIMENT_ID
