"""GradProbeCallback in ``mindspore.train.Model.train`` (real MindSpore 2.10, CPU): every step probed in PyNative
and GRAPH_MODE with no other line of user code, with and without dataset sink mode (on CPU MindSpore trains
without sink either way), and MLflow's autologging convention for the run.

The expected gradients are computed with numpy: one ``Dense`` layer, ``MSELoss``, learning rate 0 (the weights
never change, so each batch's gradient depends on that batch only)."""
from __future__ import annotations

import mlflow
import numpy as np
import pytest

ms = pytest.importorskip("mindspore", reason="MindSpore is not installed (the torch-only stage)")
from mindspore import Tensor, dataset, nn  # noqa: E402
from mindspore.train import Callback, Model, RunContext  # noqa: E402
from mindspore.train.callback._callback import InternalCallbackParam  # noqa: E402
from mlflow.tracking import MlflowClient  # noqa: E402

from msprobe_mlflow.config import GradProbeConfig
from msprobe_mlflow.dump import read_summary, summary_csv_path, summary_steps
from msprobe_mlflow.mindspore import GradProbeCallback

MODES = {"pynative": ms.PYNATIVE_MODE, "graph": ms.GRAPH_MODE}
BATCH, STEPS = 4, 3
rng = np.random.default_rng(7)
X = rng.standard_normal((BATCH * STEPS, 5)).astype(np.float32)
Y = rng.standard_normal((BATCH * STEPS, 3)).astype(np.float32)
WEIGHT = rng.standard_normal((3, 5)).astype(np.float32)
BIAS = rng.standard_normal(3).astype(np.float32)


@pytest.fixture
def mode(request):
    previous = ms.get_context("mode")
    ms.set_context(mode=MODES[request.param])
    yield request.param
    ms.set_context(mode=previous)


def dense() -> nn.Dense:
    return nn.Dense(5, 3, weight_init=Tensor(WEIGHT), bias_init=Tensor(BIAS))


def batches() -> dataset.Dataset:
    return dataset.NumpySlicesDataset({"x": X, "y": Y}, shuffle=False).batch(BATCH)


def numpy_gradients(step: int) -> dict[str, np.ndarray]:
    """d/dW, d/db of mean((x W^T + b - y)^2) over the batch of ``step``."""
    x, y = (a[step * BATCH:(step + 1) * BATCH].astype(np.float64) for a in (X, Y))
    residual = 2 * (x @ WEIGHT.T.astype(np.float64) + BIAS - y) / y.size
    return {"weight": residual.T @ x, "bias": residual.sum(axis=0)}


def assert_steps_match_numpy(dump_path, names: list[str]) -> None:
    assert summary_steps(dump_path / "rank0") == list(range(STEPS))
    for step in range(STEPS):
        rows = read_summary(summary_csv_path(dump_path, 0, step)).rows
        assert [row[0] for row in rows] == names
        for row, grad in zip(rows, numpy_gradients(step).values()):
            assert [float(cell) for cell in row[1:4]] == pytest.approx(
                [grad.max(), grad.min(), np.linalg.norm(grad)], rel=1e-5)
            assert row[4] == str(list(grad.shape))


@pytest.mark.parametrize("mode", list(MODES), indirect=True)
@pytest.mark.parametrize("sink", [False, True], ids=["no-sink", "sink"])
def test_model_train_probes_every_step_with_no_other_line(mode, sink, tmp_path):
    net = dense()
    model = Model(net, loss_fn=nn.MSELoss(), optimizer=nn.SGD(net.trainable_params(), learning_rate=0.0))
    callback = GradProbeCallback(GradProbeConfig(dump_path=str(tmp_path / "dump")), log_to_mlflow=False)
    model.train(1, batches(), callbacks=[callback], dataset_sink_mode=sink)
    assert_steps_match_numpy(tmp_path / "dump", [p.name for p in net.trainable_params()])
    assert callback.monitor.lost_steps == 0 and callback.monitor.errors == []


def test_without_an_active_run_it_starts_one_and_ends_it_with_the_training(tmp_experiment, tmp_path):
    net = dense()
    model = Model(net, loss_fn=nn.MSELoss(), optimizer=nn.SGD(net.trainable_params(), learning_rate=0.0))
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
    model = Model(net, loss_fn=nn.MSELoss(), optimizer=nn.SGD(net.trainable_params(), learning_rate=0.0))
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
    model = Model(net, loss_fn=nn.MSELoss(), optimizer=nn.SGD(net.trainable_params(), learning_rate=0.0))
    for dump in ("first", "second"):
        callback = GradProbeCallback(GradProbeConfig(dump_path=str(tmp_path / dump)), log_to_mlflow=False)
        model.train(1, batches(), callbacks=[callback], dataset_sink_mode=False)
        assert_steps_match_numpy(tmp_path / dump, [p.name for p in net.trainable_params()])
