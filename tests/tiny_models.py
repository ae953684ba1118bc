"""Small PyTorch models and the one training loop the tests share: ``train(model, steps, optimizer=, monitor=, data=,
loss=)``. A test says what its training has of its own (the batches, the loss, a hook at some step) and nothing
else; the same arguments give the same gradients bit for bit, run after run.

    monitor = GradientMonitor(GradProbeConfig(dump_path=str(dump), level="L1"), log_to_mlflow=False)
    train(mlp(6, 16, 3), 8, optimizer=sgd(0.05), monitor=monitor, data=gaussian(16, 6, target=sine(3)))
    monitor.stop()

(tests/tiny_transformer.py has the tiny transformer that the operator trace and ``locate`` are tested on.)"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable

import torch

Data = Callable[[int, "torch.Generator | None"], tuple]  # (step, generator) -> (inputs, target)


# ---------------------------------------------------------------- models

def mlp(*widths: int, activation=torch.nn.Tanh, seed: int | None = 0) -> torch.nn.Sequential:
    """``Linear`` layers of these widths with ``activation`` between them (``mlp(6, 16, 3)``: Linear(6, 16), Tanh,
    Linear(16, 3); parameters ``0.weight``, ``0.bias``, ``2.weight``, ...), initialised after
    ``torch.manual_seed(seed)`` (``None``: from torch's global generator as it stands)."""
    if seed is not None:
        torch.manual_seed(seed)
    layers = []
    for number, (width_in, width_out) in enumerate(zip(widths, widths[1:])):
        if number:
            layers.append(activation())
        layers.append(torch.nn.Linear(width_in, width_out))
    return torch.nn.Sequential(*layers)


def normed_mlp(width: int = 8, hidden: int = 16, out: int = 2, eps: float = 1e-5) -> torch.nn.Sequential:
    """LayerNorm, then Linear, Tanh, Linear, with their names: ``ln.weight``, ``ln.bias``, ``body.fc1.weight``,
    ``body.fc1.bias``, ``body.fc2.weight``, ``body.fc2.bias`` (the PyTorch twin of tests/test_cross_framework.py's
    MindSpore network); its forward is ``body(ln(x))``."""
    body = torch.nn.Sequential(OrderedDict(fc1=torch.nn.Linear(width, hidden), act=torch.nn.Tanh(),
                                           fc2=torch.nn.Linear(hidden, out)))
    return torch.nn.Sequential(OrderedDict(ln=torch.nn.LayerNorm(width, eps=eps), body=body))


# ---------------------------------------------------------------- optimizers, batches, losses

def sgd(lr: float) -> Callable[..., torch.optim.Optimizer]:
    """An optimizer factory: plain SGD at learning rate ``lr``."""
    return lambda parameters: torch.optim.SGD(parameters, lr=lr)


def gaussian(rows: int, columns: int, target: Callable | None = None, dtype=None) -> Data:
    """Each step's inputs drawn from the loop's generator: ``torch.randn(rows, columns)``; ``target(x)``, if given,
    their target."""
    def data(step: int, generator):
        x = torch.randn(rows, columns, generator=generator, dtype=dtype)
        return x, (target(x) if target else None)
    return data


def fixed(inputs: torch.Tensor, target=None) -> Data:
    """The same batch at every step."""
    return lambda step, generator: (inputs, target)


def sine(columns: int) -> Callable:
    """The target ``sin`` of the inputs' first ``columns`` columns."""
    return lambda x: torch.sin(x[:, :columns])


def squared_error(output: torch.Tensor, target=None) -> torch.Tensor:
    """The mean squared error against ``target``; without one, the output's mean square."""
    if target is None:
        return output.square().mean()
    return torch.nn.functional.mse_loss(output, target)


def total(output: torch.Tensor, target=None) -> torch.Tensor:
    """The sum of the outputs."""
    return output.sum()


# ---------------------------------------------------------------- the loop

def train(model: torch.nn.Module, steps: int, *, optimizer=sgd(0.1), monitor=None, data: Data,
          loss: Callable = squared_error, seed: int | torch.Generator | None = 1, forward: Callable | None = None,
          before_step: Callable | None = None, after_backward: Callable | None = None,
          after_step: Callable | None = None) -> torch.optim.Optimizer:
    """Trains ``model`` ``steps`` steps; returns its optimizer.

    ``optimizer``: a factory of the model's parameters (:func:`sgd`) or an optimizer already made. ``monitor``:
    monitors ``(model, optimizer)`` before the first step (``monitor.monitor(model, optimizer)``); the caller stops
    it. Each step: ``before_step(step, model, optimizer)``, ``zero_grad()``, ``(x, target) = data(step,
    generator)``, ``loss(forward(model, x), target).backward()`` (``forward`` is ``model(x)`` unless given),
    ``after_backward(step, model)``, ``optimizer.step()``, ``after_step(step)``. ``seed``: an int gives a fresh
    generator seeded with it, a ``torch.Generator`` is drawn from where it stands (a stream continued over calls),
    ``None`` leaves ``data`` torch's global generator."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        optimizer = optimizer(model.parameters())
    if monitor is not None:
        monitor.monitor(model, optimizer)
    generator = torch.Generator().manual_seed(seed) if isinstance(seed, int) else seed
    for step in range(steps):
        if before_step:
            before_step(step, model, optimizer)
        optimizer.zero_grad()
        x, target = data(step, generator)
        loss(forward(model, x) if forward else model(x), target).backward()
        if after_backward:
            after_backward(step, model)
        optimizer.step()
        if after_step:
            after_step(step)
    return optimizer
