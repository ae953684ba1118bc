"""A custom MindSpore training loop (``value_and_grad`` + ``optimizer(grads)``, PyNative) under
``msprobe_mlflow.mindspore.autolog()``, started by tests/test_mindspore_autolog.py in the folder holding its
``config.json``: the first run trains with the loop alone, the second adds the two lines autolog's warning shows.
Prints ``RUN_ID <id>`` for each run."""
from __future__ import annotations

import mindspore as ms
import mlflow
from mindspore import nn

import msprobe_mlflow.mindspore
from mindspore_training import custom_loop, dense, numpy_batches, squared_error_of


def sgd(net: nn.Cell) -> nn.Optimizer:
    return nn.SGD(net.trainable_params(), learning_rate=0.0)


ms.set_context(mode=ms.PYNATIVE_MODE)
msprobe_mlflow.mindspore.autolog("config.json")
with mlflow.start_run() as run:
    print("RUN_ID", run.info.run_id, flush=True)
    net = dense()
    custom_loop(squared_error_of(net), sgd(net), numpy_batches())
with mlflow.start_run() as run:
    print("RUN_ID", run.info.run_id, flush=True)
    net = dense()
    optimizer = sgd(net)
    from msprobe_mlflow.mindspore import GradientMonitor
    monitor = GradientMonitor("config.json").monitor(optimizer)
    custom_loop(squared_error_of(net), optimizer, numpy_batches())
