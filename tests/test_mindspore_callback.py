"""GradProbeCallback in ``mindspore.train.Model.train`` (real MindSpore 2.10, CPU): every step probed in PyNative
and GRAPH_MODE with no other line of user code, with and without dataset sink mode (on CPU MindSpore trains
without sink either way), and MLflow's autologging convention for the run.

The expected gradients are computed with numpy (tests/mindspore_training.py)."""
from __future__ import annotations

import random
import re

import mlflow
import numpy as np
import pytest

ms = pytest.importorskip("mindspore", reason="MindSpore is not installed (the torch-only stage)")
from mindspore import nn  # noqa: E402
from mindspore.train import Callback, Model, RunContext  # noqa: E402
from mindspore.train.callback._callback import InternalCallbackParam  # noqa: E402
from mlflow.tracking import MlflowClient  # noqa: E402

from mindspore_training import STEPS, assert_steps_match_numpy, batches, dense, numpy_gradients, sgd_model
from msprobe_mlflow.config import GradProbeConfig
from msprobe_mlflow.dump import summary_steps
from msprobe_mlflow.mindspore import GradProbeCallback, autolog

MODES = ("pynative", "graph")  # the conftest fixture `mode` sets each


@pytest.mark.parametrize("mode", list(MODES), indirect=True)
@pytest.mark.parametrize("sink", [False, True], ids=["no-sink", "sink"])
def test_model_train_probes_every_step_with_no_other_line(mode, sink, tmp_path):
    net = dense()
    model = sgd_model(net)
    callback = GradProbeCallback(GradProbeConfig(dump_path=str(tmp_path / "dump")), log_to_mlflow=False)
    model.train(1, batches(), callbacks=[callback], dataset_sink_mode=sink)
    assert_steps_match_numpy(tmp_path / "dump", [p.name for p in net.trainable_params()])
    assert callback.monitor.lost_steps == 0 and callback.monitor.errors == []


def test_without_an_active_run_it_starts_one_and_ends_it_with_the_training(tmp_experiment, tmp_path):
    net = dense()
    model = sgd_model(net)
    callback = GradProbeCallback(GradProbeConfig(dump_path=str(tmp_path / "dump")))
    model.train(1, batches(), callbacks=[callback], dataset_sink_mode=False)
    assert mlflow.active_run() is None
    (run,) = MlflowClient().search_runs([tmp_experiment])
    assert (run.info.status, run.data.tags["mlflow.autologging"]) == ("FINISHED", "msprobe_mlflow")
    assert run.data.tags["msprobe_mlflow.framework"] == "mindspore"
    history = MlflowClient().get_metric_history(run.info.run_id, "grad/rank0/total_norm")
    expected = [np.sqrt(sum(np.sum(g ** 2) for g in numpy_gradients(s).values())) for s in range(STEPS)]
    assert [m.step for m in history] == list(range(STEPS))
    assert [m.value for m in history] == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("started_by", ["callback", "autolog"])
def test_runs_started_after_set_seed_get_names_of_their_own_and_leave_random_alone(started_by, tmp_experiment,
                                                                                    tmp_path):
    """``mindspore.set_seed`` seeds Python's ``random``, from which MLflow draws its run names: every run the
    callback started was named the same, and drawing the name moved the user's random state."""
    if started_by == "autolog":
        autolog(dump_path=str(tmp_path / "autolog"))
    try:
        for training in range(2):
            ms.set_seed(0)
            state = random.getstate()
            callbacks = [GradProbeCallback(GradProbeConfig(dump_path=str(tmp_path / str(training))))] \
                if started_by == "callback" else None
            sgd_model(dense()).train(1, batches(), callbacks=callbacks, dataset_sink_mode=False)
            assert random.getstate() == state
    finally:
        autolog(disable=True)
    names = [run.info.run_name for run in MlflowClient().search_runs([tmp_experiment])]
    assert len(names) == 2 and names[0] != names[1]
    assert all(re.fullmatch(r"Dense-\d{8}-\d{6}\.\d{3}", name) for name in names), names


def test_inside_a_run_it_logs_there_and_leaves_the_run_open(tmp_experiment, tmp_path):
    """Also: a Model built on the user's own TrainOneStepCell (no optimizer=) is found inside the network."""
    net = dense()
    train_step = nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()),
                                     nn.SGD(net.trainable_params(), learning_rate=0.0))
    with mlflow.start_run() as run:
        callback = GradProbeCallback(GradProbeConfig(dump_path=str(tmp_path / "dump")), dump_per_run=True)
        Model(train_step).train(1, batches(), callbacks=[callback], dataset_sink_mode=False)
        assert mlflow.active_run().info.run_id == run.info.run_id
    assert len(MlflowClient().search_runs([tmp_experiment])) == 1
    assert callback.monitor.run_id == run.info.run_id
    assert_steps_match_numpy(tmp_path / "dump" / run.info.run_id, [p.name for p in net.trainable_params()])
    metrics = MlflowClient().get_run(run.info.run_id).data.metrics
    assert "grad/rank0/total_norm" in metrics and "mlflow.autologging" not in \
        MlflowClient().get_run(run.info.run_id).data.tags


class FailAtStep(Callback):
    def __init__(self, step: int):
        self.step = step

    def on_train_step_end(self, run_context):
        if run_context.original_args().cur_step_num == self.step:
            raise RuntimeError("the training failed")


def test_a_failing_training_keeps_its_steps_and_ends_the_run_as_failed(tmp_experiment, tmp_path):
    net = dense()
    model = sgd_model(net)
    callback = GradProbeCallback(GradProbeConfig(dump_path=str(tmp_path / "dump")))
    with pytest.raises(RuntimeError, match="the training failed"):
        model.train(1, batches(), callbacks=[callback, FailAtStep(2)], dataset_sink_mode=False)
    assert mlflow.active_run() is None
    (run,) = MlflowClient().search_runs([tmp_experiment])
    assert run.info.status == "FAILED"
    assert summary_steps(tmp_path / "dump" / "rank0") == [0, 1]
    history = MlflowClient().get_metric_history(run.info.run_id, "grad/rank0/total_norm")
    assert [m.step for m in history] == [0, 1]


def test_real_dataset_sinking_warns_that_only_the_last_step_of_each_sink_is_probed(tmp_path):
    """What Model.train hands its callbacks where the data is sunk (Ascend, GPU; the CPU never sinks)."""
    net = dense()
    params = InternalCallbackParam(optimizer=nn.SGD(net.trainable_params(), learning_rate=0.0),
                                   dataset_sink_mode=True, sink_size=4)
    callback = GradProbeCallback(GradProbeConfig(dump_path=str(tmp_path / "dump")), log_to_mlflow=False)
    with pytest.warns(UserWarning, match=r"sink_size=4\), so only the last step of each sink is probed"):
        callback.on_train_begin(RunContext(params))
    callback.on_train_end(RunContext(params))


def test_a_bad_option_fails_when_the_callback_is_made_not_when_training_starts(tmp_path):
    with pytest.raises(ValueError, match="log_every_n_steps = 0 is not accepted"):
        GradProbeCallback(GradProbeConfig(dump_path=str(tmp_path)), log_every_n_steps=0)


@pytest.mark.parametrize("mode", ["graph"], indirect=True)
def test_a_model_trained_again_in_graph_mode_is_probed_again(mode, tmp_path):
    """The second Model.train runs the graph compiled in the first: the new monitor restarts the probe inside it."""
    net = dense()
    model = sgd_model(net)
    for dump in ("first", "second"):
        callback = GradProbeCallback(GradProbeConfig(dump_path=str(tmp_path / dump)), log_to_mlflow=False)
        model.train(1, batches(), callbacks=[callback], dataset_sink_mode=False)
        assert_steps_match_numpy(tmp_path / dump, [p.name for p in net.trainable_params()])


@pytest.mark.parametrize("mode", list(MODES), indirect=True)
def test_a_fixed_loss_scale_the_optimizer_undoes_itself_is_told_and_the_gradients_are_recorded_scaled(mode, tmp_path):
    from mindspore.amp import FixedLossScaleManager

    from msprobe_mlflow.dump import read_summary, summary_csv_path

    net = dense()
    optimizer = nn.SGD(net.trainable_params(), learning_rate=0.0, loss_scale=1024.0)
    model = Model(net, loss_fn=nn.MSELoss(), optimizer=optimizer,
                  loss_scale_manager=FixedLossScaleManager(1024.0, drop_overflow_update=False))
    callback = GradProbeCallback(GradProbeConfig(dump_path=str(tmp_path / "dump")), log_to_mlflow=False)
    with pytest.warns(UserWarning, match="loss_scale = 1024 itself .* are 1024 times the loss's gradients"):
        model.train(1, batches(), callbacks=[callback], dataset_sink_mode=False)
    names = [p.name for p in net.trainable_params()]
    table = read_summary(summary_csv_path(tmp_path / "dump", 0, 0))
    expected = [1024.0 * float(numpy_gradients(0)[name.split(".")[-1]].max()) for name in names]
    np.testing.assert_allclose(table.numbers("max"), expected, rtol=1e-5)
