"""A tiny GPT-like transformer (embedding, attention, LayerNorm, GELU MLP), its training loop, and a faulty kernel:
what the operator trace and ``locate`` are tested on."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode


class Block(nn.Module):
    def __init__(self, width: int, heads: int, eps: float = 1e-5):
        super().__init__()
        self.ln_1 = nn.LayerNorm(width, eps=eps)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        h = self.ln_1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 64, width: int = 32, layers: int = 2, heads: int = 2, eps: float = 1e-5):
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.h = nn.ModuleList(Block(width, heads, eps) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, idx):
        x = self.wte(idx)
        for block in self.h:
            x = block(x)
        return self.head(self.ln_f(x))


def batches(count: int, vocab: int = 64, batch: int = 4, length: int = 16) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (batch, length + 1), generator=generator) for _ in range(count)]


class FaultyKernel(TorchDispatchMode):
    """A wrong kernel: the ``number``-th call of aten ``operator`` in ``phase`` returns its first output times
    ``1 + error``, while ``armed``. Both runs call the same operators; one result is off, as on a faulty device."""

    def __init__(self, operator: str, number: int, phase: str = "forward", error: float = 1e-2):
        super().__init__()
        self.operator, self.number, self.phase, self.error = operator, number, phase, error
        self.armed, self.calls, self.injected = False, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        output = func(*args, **(kwargs or {}))
        phase = "backward" if torch._C._current_autograd_node() is not None else "forward"
        if self.armed and func.__name__.split(".")[0] == self.operator and phase == self.phase:
            if self.calls == self.number:
                (output[0] if isinstance(output, tuple) else output).mul_(1 + self.error)
                self.injected += 1
            self.calls += 1
        return output


def one_ulp_up(model: nn.Module) -> None:
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.nextafter(parameter, torch.full_like(parameter, math.inf)))


def train(steps: int, *, on_step=None, dtype=torch.float32, autocast: bool = False, model: nn.Module | None = None,
          before_backward=None):
    """Trains ``TinyGPT`` (or ``model``) with Adam; ``on_step(step, phase, model)`` is called with phase "start"
    before each step's forward and "end" after its backward."""
    torch.manual_seed(0)
    model = (model or TinyGPT()).to(dtype)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step, batch in enumerate(batches(steps)):
        if on_step:
            on_step(step, "start", model)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(batch[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1))
        loss.backward()
        if on_step:
            on_step(step, "end", model)
        optimizer.step()
        optimizer.zero_grad()
    return model


def train_monitored(monitor, steps: int, fault: FaultyKernel | None = None, fault_steps=(), **training):
    """Trains ``TinyGPT`` ``steps`` steps under ``monitor`` (``monitor(model)`` before the first); ``fault``, if
    any, is armed at ``fault_steps``. Stops nothing: the caller stops the monitor."""
    def on_step(step, phase, model):
        if step == 0 and phase == "start":
            monitor.monitor(model)  # the monitor finds the optimizer of the model's parameters
        if fault is not None:
            fault.armed = step in fault_steps

    if fault is None:
        return train(steps, on_step=on_step, **training)
    with fault:
        return train(steps, on_step=on_step, **training)
