"""MLflow housekeeping (``tracking/runs.py``) against a real SQLite store: batching within MLflow's limits, and
runs that always end."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch
from mlflow.entities import Metric
from mlflow.tracking import MlflowClient
from mlflow.utils.validation import MAX_METRICS_PER_BATCH, MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

from msprobe_mlflow.config import GradProbeConfig
from msprobe_mlflow.pytorch import GradientMonitor
from msprobe_mlflow.tracking.experiments import experiment_id_for, run_page_url
from msprobe_mlflow.tracking.runs import created_run, log_batched, param, tag
from msprobe_mlflow.tracking.upload import upload_dump


@pytest.fixture
def store(tmp_path):
    """A client on a store of its own, and an experiment whose artifacts stay in the temporary folder."""
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment_id = client.create_experiment("runs", artifact_location=(tmp_path / "artifacts").as_uri())
    return client, experiment_id


def test_log_batched_sends_more_values_than_one_request_takes(store):
    client, experiment_id = store
    metrics = [Metric(f"m{i % 7}", float(i), 0, i) for i in range(2 * MAX_METRICS_PER_BATCH + 3)]
    params = [param(f"p{i}", i) for i in range(MAX_PARAMS_TAGS_PER_BATCH + 5)]
    tags = [tag(f"t{i}", i) for i in range(MAX_PARAMS_TAGS_PER_BATCH + 1)]
    with created_run(client, experiment_id) as run_id:
        log_batched(client, run_id, metrics=metrics, params=params, tags=tags)
    run = client.get_run(run_id)
    assert len(run.data.params) == len(params) and run.data.params["p104"] == "104"
    assert {f"t{i}" for i in range(len(tags))} <= set(run.data.tags)
    history = sorted((m.step, m.value) for key in {m.key for m in metrics}
                     for m in client.get_metric_history(run_id, key))
    assert history == [(i, float(i)) for i in range(len(metrics))]


def test_param_and_tag_values_are_clipped_to_mlflows_limits():
    assert param("long", "x" * (MAX_PARAM_VAL_LENGTH + 10)).value == "x" * (MAX_PARAM_VAL_LENGTH - 3) + "..."
    assert param("short", [1, 2]).value == "[1, 2]"
    assert len(tag("long", "y" * 9000).value) <= 8000


def test_a_created_run_ends_finished_or_failed_when_its_work_raises(store):
    client, experiment_id = store
    with created_run(client, experiment_id, run_name="ok") as finished:
        pass
    with pytest.raises(RuntimeError, match="broke"):
        with created_run(client, experiment_id, run_name="broken") as failed:
            raise RuntimeError("broke")
    assert client.get_run(finished).info.status == "FINISHED"
    assert client.get_run(failed).info.status == "FAILED"


def two_step_dump(dump: Path) -> Path:
    """A local L1 dump of two steps, nothing logged."""
    monitor = GradientMonitor(GradProbeConfig(dump_path=str(dump), level="L1"), log_to_mlflow=False)
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor.monitor(model, optimizer)
    for _ in range(2):
        model(torch.ones(1, 2)).sum().backward()
        optimizer.step()
    monitor.stop()
    return dump


def test_upload_into_a_new_run_leaves_it_finished(store, tmp_path):
    client, experiment_id = store
    experiment = client.get_experiment(experiment_id).name
    report = upload_dump(two_step_dump(tmp_path / "dump"), experiment=experiment, tracking_uri=client.tracking_uri)
    run = client.get_run(report.run_id)
    assert run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(report.run_id, "grad/rank0/total_norm")] == [0, 1]


def test_an_experiment_this_tool_creates_opens_in_the_model_training_view(store, tmp_path, monkeypatch):
    client, existing = store
    monkeypatch.chdir(tmp_path)  # a new experiment's default artifact location is under the working folder
    created = experiment_id_for(client, "made-by-msprobe-mlflow")
    # what MLflow's own UI writes when a user picks "Machine learning" as the experiment type
    assert client.get_experiment(created).tags["mlflow.experimentKind"] == "custom_model_development"
    assert experiment_id_for(client, "runs") == existing  # a user's experiment is found, left as it is
    assert "mlflow.experimentKind" not in client.get_experiment(existing).tags


def test_links_to_a_run_open_the_ui_in_its_model_training_view():
    # MLflow 3.9+ chooses the view by a workflow switch, which this query parameter of the page's route sets
    assert run_page_url("http://mlflow:5000/", "3", "abc") == \
        "http://mlflow:5000/#/experiments/3/runs/abc?workflowType=machine_learning"


def test_upload_into_a_new_run_that_fails_midway_leaves_it_failed(store, tmp_path):
    """The experiment's artifact location is a file: the run and its metrics are created, the first file is not."""
    client, _ = store
    (tmp_path / "a_file").write_text("")
    experiment_id = client.create_experiment("unwritable", artifact_location=(tmp_path / "a_file").as_uri())
    with pytest.raises(OSError):
        upload_dump(two_step_dump(tmp_path / "dump"), experiment="unwritable", tracking_uri=client.tracking_uri)
    [run] = client.search_runs([experiment_id])
    assert run.info.status == "FAILED"
    assert run.info.run_name == "upload dump"


ANOTHER_FILE_SYSTEM = Path("/dev/shm")  # a memory file system, where Linux has one


@pytest.mark.skipif(not ANOTHER_FILE_SYSTEM.is_dir()
                    or os.stat(ANOTHER_FILE_SYSTEM).st_dev == os.stat(tempfile.gettempdir()).st_dev,
                    reason="needs a dump on another file system than the temporary folder")
def test_upload_sends_a_dump_on_another_file_system_byte_for_byte_at_its_paths(store, tmp_path):
    """The steps' files are staged for their two requests as links; across file systems, as copies."""
    client, experiment_id = store
    with tempfile.TemporaryDirectory(dir=ANOTHER_FILE_SYSTEM) as elsewhere:
        dump = two_step_dump(Path(elsewhere) / "dump")
        report = upload_dump(dump, experiment=client.get_experiment(experiment_id).name,
                             tracking_uri=client.tracking_uri)
        artifacts = Path(client.download_artifacts(report.run_id, "grad_probe", str(tmp_path / "down")))
        sent = {p.relative_to(artifacts).as_posix(): p.read_bytes() for p in artifacts.rglob("*") if p.is_file()}
        local = {p.relative_to(dump).as_posix(): p.read_bytes() for p in (dump / "rank0").rglob("*")
                 if p.is_file() and (p.name.startswith("grad_summary_") or p.parent.name.startswith("step"))}
    assert {k: v for k, v in sent.items() if k.startswith("rank0/")} == local
    assert report.files_uploaded == len(local) + 1  # and grad_probe/config.json
