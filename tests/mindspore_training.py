"""A small ``Model.train`` job whose gradients numpy computes independently: one ``Dense`` layer, ``MSELoss``,
learning rate 0 (the weights never change, so each batch's gradient depends on that batch only)."""
from __future__ import annotations

import numpy as np
import pytest
from mindspore import Tensor, dataset, nn
from mindspore.train import Model

from msprobe_mlflow.dump import read_summary, summary_csv_path, summary_steps

BATCH, STEPS = 4, 3
rng = np.random.default_rng(7)
X = rng.standard_normal((BATCH * STEPS, 5)).astype(np.float32)
Y = rng.standard_normal((BATCH * STEPS, 3)).astype(np.float32)
WEIGHT = rng.standard_normal((3, 5)).astype(np.float32)
BIAS = rng.standard_normal(3).astype(np.float32)


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
        table = read_summary(summary_csv_path(dump_path, 0, step))  # at any level: columns found by name
        assert table.column("param_name") == names
        grads = list(numpy_gradients(step).values())
        for column, expected in (("max", np.max), ("min", np.min), ("norm", np.linalg.norm)):
            assert table.numbers(column) == pytest.approx([expected(grad) for grad in grads], rel=1e-5)
        assert table.shapes() == [grad.shape for grad in grads]


def sgd_model(net: nn.Cell) -> Model:
    """``Model`` with MSELoss and SGD at learning rate 0."""
    return Model(net, loss_fn=nn.MSELoss(), optimizer=nn.SGD(net.trainable_params(), learning_rate=0.0))
