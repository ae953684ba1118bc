"""Which MLflow experiment a run that msprobe-mlflow creates goes into (one rule for upload, compare, api-check),
and how the MLflow UI is told that it holds model training, not a GenAI application."""
from __future__ import annotations

import mlflow
from mlflow.tracking import MlflowClient
from mlflow.tracking.default_experiment import DEFAULT_EXPERIMENT_ID

from msprobe_mlflow.compat import current_experiment_id
from msprobe_mlflow.vocabulary import EXPERIMENT_KIND_TAG

# MLflow 3's UI opens an experiment in its GenAI view unless told otherwise. MLflow 3.7's UI reads the experiment's
# EXPERIMENT_KIND_TAG (what its own "experiment type" selector writes); 3.17's chooses by its "GenAI / Model training"
# switch, which a link sets with the ``workflowType`` query parameter. Both checked in a browser.
MODEL_TRAINING_KIND = "custom_model_development"
MODEL_TRAINING_VIEW = "workflowType=machine_learning"


def experiment_id_for(client: MlflowClient, name: str | None) -> str:
    """``name``'s ID, creating the experiment if missing (marked as model training); without a name, MLflow's
    current experiment when ``client`` talks to the active store, else that store's Default experiment."""
    if name:
        found = client.get_experiment_by_name(name)
        if found:
            return found.experiment_id
        return client.create_experiment(name, tags={EXPERIMENT_KIND_TAG: MODEL_TRAINING_KIND})
    if client.tracking_uri == mlflow.get_tracking_uri():
        return current_experiment_id()
    return DEFAULT_EXPERIMENT_ID


def run_page_link(experiment_id: str, run_id: str) -> str:
    """The run's page, in the model-training view, relative to any page of the same MLflow UI (for Markdown)."""
    return f"#/experiments/{experiment_id}/runs/{run_id}?{MODEL_TRAINING_VIEW}"


def direct_run_link(run_id: str) -> str:
    """The run's page by its ID alone (the UI finds its experiment), relative to any page of the same MLflow UI."""
    return f"#/runs/{run_id}"


def run_page_url(ui_url: str, experiment_id: str, run_id: str) -> str:
    """The run's page in the MLflow UI at ``ui_url``, in the model-training view."""
    return f"{ui_url.rstrip('/')}/{run_page_link(experiment_id, run_id)}"
