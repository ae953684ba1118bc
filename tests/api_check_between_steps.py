"""Run by test_api_check_isolation.py in a process of its own (pytest's has launch blocking on): a graph-mode
MindSpore training of a linear layer that calls the API checker between its two steps. Prints, as JSON, MindSpore's
mode and launch blocking before and after the check, the statuses the check found and the layer after each step.

Usage: python api_check_between_steps.py DUMP OUTPUT_DIR {preset|not-preset}; ``preset`` turns launch blocking on
before training, as a user debugging kernels would.
"""
import json
import sys

import mindspore
import numpy as np
from mindspore import nn
from mindspore._c_expression import RuntimeConf

from msprobe_mlflow.api_check import check_api_accuracy

INPUTS = np.array([[1.0, 2.0, -1.0], [0.5, -1.0, 2.0], [-2.0, 0.0, 1.0], [1.0, 1.0, 1.0]], dtype=np.float32)
TARGETS = np.array([[1.0], [-1.0], [0.5], [2.0]], dtype=np.float32)
WEIGHT = np.array([[0.1, -0.2, 0.3]], dtype=np.float32)
LEARNING_RATE = 0.1


def settings() -> dict:
    return {"mode": mindspore.get_context("mode"), "launch_blocking": RuntimeConf.get_instance().is_launch_blocking()}


def main(dump: str, output_dir: str, preset: str) -> None:
    if preset == "preset":
        mindspore.runtime.launch_blocking()
    mindspore.set_context(mode=mindspore.GRAPH_MODE)
    layer = nn.Dense(3, 1, weight_init=mindspore.Tensor(WEIGHT), bias_init="zeros")
    train_step = nn.TrainOneStepCell(nn.WithLossCell(layer, nn.MSELoss()),
                                     nn.SGD(layer.trainable_params(), learning_rate=LEARNING_RATE))
    x, y = mindspore.Tensor(INPUTS), mindspore.Tensor(TARGETS)

    def state() -> dict:
        return {"weight": layer.weight.asnumpy().tolist(), "bias": layer.bias.asnumpy().tolist()}

    train_step(x, y)
    after_step_1, before = state(), settings()
    report = check_api_accuracy(dump, output_dir=output_dir, log_to_mlflow=False)
    after = settings()
    train_step(x, y)
    print(json.dumps({"before": before, "after": after, "graph_mode": mindspore.GRAPH_MODE,
                      "statuses": {result.name: result.status for result in report.results},
                      "steps": [after_step_1, state()]}))


if __name__ == "__main__":
    main(*sys.argv[1:])
