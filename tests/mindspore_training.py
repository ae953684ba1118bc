"""A small ``Model.train`` job whose gradients numpy computes independently: one ``Dense`` layer, ``MSELoss``,
learning rate 0 (the weights never change, so each batch's gradient depends on that batch only). And MindSpore's
custom loop (``value_and_grad`` + ``optimizer(grads)``) as the tests write it, with the small network they train."""
from __future__ import annotations

from typing import Callable, Iterable

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, dataset, nn, ops
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


def numpy_batches() -> list[tuple[np.ndarray, np.ndarray]]:
    """``batches()``'s ``(x, y)`` as numpy arrays, one pair a step."""
    return [(X[step * BATCH:(step + 1) * BATCH], Y[step * BATCH:(step + 1) * BATCH]) for step in range(STEPS)]


# ---------------------------------------------------------------- the custom loop

class MLP(nn.Cell):
    """Dense(4, 16), tanh, Dense(16, 2): ``fc1.weight``, ``fc1.bias``, ``fc2.weight``, ``fc2.bias``."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Dense(4, 16)
        self.fc2 = nn.Dense(16, 2)

    def construct(self, x):
        return self.fc2(ops.tanh(self.fc1(x)))


def sine_batches(steps: int, perturbed_from: int | None = None):
    """``steps`` batches of 8 rows of 4 normal inputs (numpy's generator seeded 1), each with its target, the sine
    of its first 2 columns; from step ``perturbed_from`` on, other inputs (a generator seeded 2)."""
    data, other_data = np.random.default_rng(1), np.random.default_rng(2)
    for step in range(steps):
        x = data.standard_normal((8, 4)).astype(np.float32)
        if perturbed_from is not None and step >= perturbed_from:
            x = other_data.standard_normal((8, 4)).astype(np.float32)
        yield x, np.sin(x[:, :2])


def squared_error_of(net: nn.Cell) -> Callable:
    """The loss ``MSELoss()(net(x), y)`` of ``(x, y)``."""
    loss_fn = nn.MSELoss()
    return lambda x, y: loss_fn(net(x), y)


def nan_in_the_first_bias_at(nan_at: int | None) -> Callable:
    """Gradients as a diverging run gives them: at step ``nan_at``, a NaN in the second gradient's first element
    (the first layer's bias); at any other step, unchanged."""
    def change(step: int, grads: tuple) -> tuple:
        if step != nan_at:
            return grads
        bias = grads[1].asnumpy().copy()
        bias[0] = np.nan
        return (grads[0], Tensor(bias), *grads[2:])
    return change


def custom_loop(loss_of: Callable, optimizer: nn.Optimizer, batches: Iterable[tuple[np.ndarray, np.ndarray]], *,
                change_gradients: Callable | None = None, after_step: Callable | None = None) -> None:
    """For each ``(x, y)`` of ``batches`` (numpy): the gradients of ``loss_of(x, y)`` with respect to the
    optimizer's parameters (``value_and_grad``), ``change_gradients(step, grads)`` if given, ``optimizer(grads)``,
    then ``after_step(step)``."""
    gradients_of = ms.value_and_grad(loss_of, None, optimizer.parameters)
    for step, (x, y) in enumerate(batches):
        _, grads = gradients_of(Tensor(x), Tensor(y))
        if change_gradients:
            grads = change_gradients(step, grads)
        optimizer(grads)
        if after_step:
            after_step(step)
