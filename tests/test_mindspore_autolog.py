"""Autolog for MindSpore (real MindSpore 2.10, CPU): ``Model.train`` gets a GradProbeCallback with no line of user
code, in GRAPH_MODE too, and ``disable=True`` gives ``Model.train`` back its own code."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mlflow
import numpy as np
import pytest

ms = pytest.importorskip("mindspore", reason="MindSpore is not installed (the torch-only stage)")
from mindspore import nn  # noqa: E402
from mindspore.train import Model  # noqa: E402
from mlflow.tracking import MlflowClient  # noqa: E402

from fresh_interpreter import run_and_read_logged_steps
from mindspore_training import STEPS, assert_steps_match_numpy, batches, dense, numpy_gradients, sgd_model
from msprobe_mlflow.config import GradProbeConfig
from msprobe_mlflow.mindspore import GradientMonitor, GradProbeCallback
from msprobe_mlflow.mindspore import autolog

ORIGINAL_TRAIN = Model.train
ORIGINAL_SET_TERMINATED = MlflowClient.set_terminated
CUSTOM_LOOP = Path(__file__).with_name("mindspore_custom_loop.py")


@pytest.fixture
def graph_mode():
    previous = ms.get_context("mode")
    ms.set_context(mode=ms.GRAPH_MODE)
    yield
    ms.set_context(mode=previous)


@pytest.fixture
def autolog_off_afterwards():
    yield
    autolog(disable=True)
    assert Model.train is ORIGINAL_TRAIN
    assert MlflowClient.set_terminated is ORIGINAL_SET_TERMINATED


def test_model_train_in_a_run_is_probed_into_it_until_disabled(graph_mode, autolog_off_afterwards, tmp_experiment,
                                                                tmp_path):
    autolog(dump_path=str(tmp_path / "dump"))
    assert Model.train is not ORIGINAL_TRAIN
    net = dense()
    with mlflow.start_run() as run:
        sgd_model(net).train(1, batches(), dataset_sink_mode=False)
    assert_steps_match_numpy(tmp_path / "dump" / run.info.run_id, [p.name for p in net.trainable_params()])
    history = MlflowClient().get_metric_history(run.info.run_id, "grad/rank0/total_norm")
    assert [m.step for m in history] == [0, 1, 2]

    autolog(disable=True)
    assert Model.train is ORIGINAL_TRAIN
    with mlflow.start_run() as unmonitored:
        sgd_model(dense()).train(1, batches(), dataset_sink_mode=False)
    assert not (tmp_path / "dump" / unmonitored.info.run_id).exists()
    assert MlflowClient().get_run(unmonitored.info.run_id).data.metrics == {}


def test_a_callback_the_user_added_is_not_doubled(autolog_off_afterwards, tmp_experiment, tmp_path):
    autolog(dump_path=str(tmp_path / "autolog"))
    net = dense()
    own = GradProbeCallback(GradProbeConfig(dump_path=str(tmp_path / "own")), log_to_mlflow=False)
    with mlflow.start_run():
        sgd_model(net).train(1, batches(), callbacks=own, dataset_sink_mode=False)
    assert_steps_match_numpy(tmp_path / "own", [p.name for p in net.trainable_params()])
    assert not (tmp_path / "autolog").exists()


def test_msprobe_mlflow_autolog_switches_the_mindspore_patch_on_and_off(tmp_path):
    pytest.importorskip("torch", reason="msprobe_mlflow.autolog() also hooks PyTorch")
    import msprobe_mlflow

    msprobe_mlflow.autolog(dump_path=str(tmp_path / "dump"))
    try:
        assert Model.train is not ORIGINAL_TRAIN
    finally:
        msprobe_mlflow.autolog(disable=True)
    assert Model.train is ORIGINAL_TRAIN


def test_msprobe_mlflow_autolog_probes_model_train_where_torch_is_not_installed(tmp_path, tmp_sqlite_uri):
    """A MindSpore-only install: ``msprobe_mlflow.autolog()`` must not need torch (blocked from importing here)."""
    script = tmp_path / "no_torch.py"
    script.write_text(f"""
import sys
from pathlib import Path
sys.modules["torch"] = None  # what an install without torch gives: import torch raises ImportError
sys.path[:0] = [{str(Path(__file__).parent)!r}, {str(Path(__file__).parent.parent)!r}]
import mlflow, msprobe_mlflow
from mindspore_training import assert_steps_match_numpy, batches, dense, sgd_model
mlflow.set_tracking_uri({tmp_sqlite_uri!r})
msprobe_mlflow.autolog(dump_path={str(tmp_path / "dump")!r})
net = dense()
with mlflow.start_run() as run:
    sgd_model(net).train(1, batches(), dataset_sink_mode=False)
assert_steps_match_numpy(Path({str(tmp_path / "dump")!r}, run.info.run_id), [p.name for p in net.trainable_params()])
print(run.info.run_id)
""")
    run_id, logged_steps = run_and_read_logged_steps(script, tmp_sqlite_uri)
    assert logged_steps == [0, 1, 2]


def test_an_optimizer_the_user_monitors_already_trains_on_with_a_warning(autolog_off_afterwards, tmp_path):
    autolog(dump_path=str(tmp_path / "autolog"), log_to_mlflow=False)
    net = dense()
    optimizer = nn.SGD(net.trainable_params(), learning_rate=0.0)
    own = GradientMonitor(GradProbeConfig(dump_path=str(tmp_path / "own")), log_to_mlflow=False).monitor(optimizer)
    with pytest.warns(UserWarning, match="GradProbeCallback does not monitor this training: this optimizer is "
                                         "already monitored by another GradientMonitor"):
        Model(net, loss_fn=nn.MSELoss(), optimizer=optimizer).train(1, batches(), dataset_sink_mode=False)
    own.stop()
    assert_steps_match_numpy(tmp_path / "own", [p.name for p in net.trainable_params()])


def test_a_custom_loop_under_autolog_is_told_at_its_runs_end_which_two_lines_monitor_it(tmp_path, tmp_sqlite_uri):
    """``value_and_grad`` + ``optimizer(grads)`` never calls ``Model.train``: the run ends empty, with one warning
    naming it and the two lines; a second run that adds those lines gets the gradients, numpy's, and no warning."""
    (tmp_path / "config.json").write_text(json.dumps({"task": "grad_probe", "dump_path": "dump",
                                                      "grad_probe": {"grad_level": "L1"}}))
    done = subprocess.run([sys.executable, str(CUSTOM_LOOP)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "MLFLOW_TRACKING_URI": tmp_sqlite_uri})
    assert done.returncode == 0, done.stderr[-3000:]
    alone, monitored = [line.split()[1] for line in done.stdout.splitlines() if line.startswith("RUN_ID ")]
    told = [line for line in done.stderr.splitlines() if "ended with no gradients" in line]
    assert len(told) == 1 and f"MLflow run {alone} ended" in told[0], done.stderr[-3000:]
    assert "autolog() probes MindSpore's Model.train only" in told[0]
    assert ("`from msprobe_mlflow.mindspore import GradientMonitor` and "
            "`monitor = GradientMonitor(\"config.json\").monitor(optimizer)`") in told[0]
    assert "Traceback" not in done.stderr
    client = MlflowClient(tmp_sqlite_uri)
    assert client.get_run(alone).data.metrics == {}
    history = sorted(client.get_metric_history(monitored, "grad/rank0/total_norm"), key=lambda m: m.step)
    expected = [np.sqrt(sum(np.sum(g ** 2) for g in numpy_gradients(step).values())) for step in range(STEPS)]
    assert [m.step for m in history] == list(range(STEPS))
    assert [m.value for m in history] == pytest.approx(expected, rel=1e-5)
