"""A custom MindSpore training loop (``value_and_grad`` + ``optimizer(grads)``, PyNative) under
``msprobe_mlflow.mindspore.autolog()``, started by tests/test_mindspore_autolog.py in the folder holding its
``config.json``: the first run trains with the loop alone, the second adds the two lines autolog's warning shows.
Prints ``RUN_ID <id>`` for each run."""
from __future__ import annotations

import mindspore as ms
import mlflow
from mindspore import Tensor, nn

import msprobe_mlflow.mindspore
from mindspore_training import BATCH, STEPS, X, Y, dense


def train(net: nn.Cell, optimizer: nn.Optimizer) -> None:
    loss_fn = nn.MSELoss()

    def loss_of(x, y):
        return loss_fn(net(x), y)

    gradients_of = ms.value_and_grad(loss_of, None, optimizer.parameters)
    for step in range(STEPS):
        batch = slice(step * BATCH, (step + 1) * BATCH)
        _, grads = gradients_of(Tensor(X[batch]), Tensor(Y[batch]))
        optimizer(grads)


def sgd(net: nn.Cell) -> nn.Optimizer:
    return nn.SGD(net.trainable_params(), learning_rate=0.0)


ms.set_context(mode=ms.PYNATIVE_MODE)
msprobe_mlflow.mindspore.autolog("config.json")
with mlflow.start_run() as run:
    print("RUN_ID", run.info.run_id, flush=True)
    net = dense()
    train(net, sgd(net))
with mlflow.start_run() as run:
    print("RUN_ID", run.info.run_id, flush=True)
    net = dense()
    optimizer = sgd(net)
    from msprobe_mlflow.mindspore import GradientMonitor
    monitor = GradientMonitor("config.json").monitor(optimizer)
    train(net, optimizer)
