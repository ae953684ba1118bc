"""MindSpore's monitor and callback take the same options object as PyTorch's (real MindSpore, CPU): the always-on
tier, the archives and the aggregation switch work there, and ``overlap``, removed, is refused saying why."""
from __future__ import annotations

import mlflow
import pytest

pytest.importorskip("mindspore", reason="MindSpore is not installed (the torch-only stage)")
from mlflow.tracking import MlflowClient  # noqa: E402

from mindspore_training import STEPS, batches, dense, sgd_model  # noqa: E402
from msprobe_mlflow import MonitorOptions  # noqa: E402
from msprobe_mlflow.config import GradProbeConfig  # noqa: E402
from msprobe_mlflow.mindspore import GradientMonitor, GradProbeCallback  # noqa: E402


@pytest.mark.parametrize("overlap", [True, False])
def test_overlap_is_refused_saying_it_was_removed(overlap, tmp_path):
    with pytest.raises(TypeError, match=r"^overlap was removed: the step kernel reads gradients at memory speed"):
        GradientMonitor(GradProbeConfig(dump_path=str(tmp_path)), overlap=overlap)
    with pytest.raises(TypeError, match=r"^overlap was removed: "):
        GradProbeCallback({"task": "grad_probe", "dump_path": str(tmp_path)}, overlap=overlap)


def test_the_callback_takes_the_tier_archives_and_aggregation_from_the_object(tmp_experiment, tmp_path):
    options = MonitorOptions.of(directions_every_n_steps=2, archive_every_n_steps=2, aggregate_metrics=False)
    dump = tmp_path / "dump"
    with mlflow.start_run() as run:
        callback = GradProbeCallback({"task": "grad_probe", "dump_path": str(dump), "grad_probe": {"grad_level": "L1"}},
                                     options=options)
        sgd_model(dense()).train(1, batches(), callbacks=[callback], dataset_sink_mode=False)
    assert callback.monitor.options == options and callback.monitor.errors == []
    assert STEPS == 3 and sorted(p.name for p in (dump / "rank0").glob("step*")) == ["step0", "step2"]
    artifacts = [a.path for a in MlflowClient().list_artifacts(run.info.run_id, "grad_probe/rank0")]
    assert sorted(a for a in artifacts if a.endswith(".zip")) == ["grad_probe/rank0/steps_0-1.zip",
                                                                   "grad_probe/rank0/steps_2.zip"]
    history = MlflowClient().get_metric_history(run.info.run_id, "grad/rank0/total_norm")
    assert [m.step for m in history] == [0, 1, 2]

