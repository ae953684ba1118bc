"""The live verdict and the anomaly flags of a MindSpore training in GRAPH_MODE (``Model.train`` with
GradProbeCallback, real MindSpore 2.10 on CPU) reach its MLflow run with the PyTorch monitor's keys and tags, and
the live verdict is the one ``compare_runs`` gives afterwards."""
from __future__ import annotations

import mlflow
import numpy as np
import pytest

ms = pytest.importorskip("mindspore", reason="MindSpore is not installed (the torch-only stage)")
from mindspore import dataset  # noqa: E402
from mlflow.tracking import MlflowClient  # noqa: E402

from mindspore_training import dense, sgd_model
from msprobe_mlflow import GradProbeConfig, compare_runs
from msprobe_mlflow.mindspore import GradProbeCallback

BATCH, STEPS, PERTURBED_FROM, NAN_AT = 4, 6, 3, 2


@pytest.fixture(autouse=True)
def graph_mode():
    previous = ms.get_context("mode")
    ms.set_context(mode=ms.GRAPH_MODE)
    yield
    ms.set_context(mode=previous)


def inputs(perturbed: bool = False, nan_at: int | None = None) -> dataset.Dataset:
    """``STEPS`` batches; ``perturbed``: other inputs from ``PERTURBED_FROM`` on; ``nan_at``: a NaN in that batch."""
    x = np.random.default_rng(1).standard_normal((BATCH * STEPS, 5)).astype(np.float32)
    if perturbed:
        x[BATCH * PERTURBED_FROM:] = np.random.default_rng(2).standard_normal((BATCH * (STEPS - PERTURBED_FROM), 5))
    if nan_at is not None:
        x[BATCH * nan_at, 0] = np.nan
    y = np.sin(x[:, :3])
    return dataset.NumpySlicesDataset({"x": x, "y": y}, shuffle=False).batch(BATCH)


def train_in_run(dump, data: dataset.Dataset, **options) -> str:
    with mlflow.start_run() as run:
        callback = GradProbeCallback(GradProbeConfig(dump_path=str(dump)), **options)
        sgd_model(dense()).train(1, data, callbacks=[callback], dataset_sink_mode=False)
    assert callback.monitor.errors == []
    return run.info.run_id


def test_a_perturbed_step_gets_the_live_verdict_compare_runs_gives_afterwards(tmp_experiment, tmp_path):
    baseline = train_in_run(tmp_path / "baseline", inputs())
    calls = []
    with pytest.warns(UserWarning, match=rf"rank 0: step {PERTURBED_FROM} is suspicious against baseline"):
        candidate = train_in_run(tmp_path / "candidate", inputs(perturbed=True), baseline=baseline,
                                 on_suspicious=calls.append)
    afterwards = compare_runs(baseline, candidate)
    assert afterwards.verdict.first_suspicious_step == PERTURBED_FROM
    assert calls == [afterwards.verdict.ranks[0]]
    tags = MlflowClient().get_run(candidate).data.tags
    assert tags["msprobe_mlflow.live_verdict"] == "suspicious"
    assert tags["msprobe_mlflow.first_suspicious_step"] == str(PERTURBED_FROM)
    assert tags["msprobe_mlflow.baseline"] == baseline
    history = MlflowClient().get_metric_history(candidate, "summary_similarity/rank0")
    live = dict(sorted((m.step, m.value) for m in history))
    assert [live[s] for s in afterwards.comparison.ranks[0].steps] == afterwards.comparison.ranks[0].summary


def test_a_nan_batch_is_flagged_in_the_run_at_its_step(tmp_experiment, tmp_path):
    with pytest.warns(UserWarning, match=f"non-finite gradients at step {NAN_AT}: weight, bias"):
        run_id = train_in_run(tmp_path / "nan", inputs(nan_at=NAN_AT))
    client = MlflowClient()
    tags = client.get_run(run_id).data.tags
    assert tags["msprobe_mlflow.first_nonfinite_step"] == str(NAN_AT)
    assert tags["msprobe_mlflow.nonfinite_parameters"] == "weight, bias"
    history = client.get_metric_history(run_id, "anomalies/rank0/flagged_params")
    assert (NAN_AT, 2.0) in {(m.step, m.value) for m in history}
    logged = client.list_artifacts(run_id, "grad_probe/rank0/findings")
    assert [a.path for a in logged] == ["grad_probe/rank0/findings/anomalies.csv"]
