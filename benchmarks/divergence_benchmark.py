"""The divergence benchmark (issue 24): does a verdict rule name the first step at which two trainings part, with
the parameter the bug touched, and stay quiet on pairs that only differ in rounding?

Two model families, trained with the real ``GradientMonitor`` (L2, bounds ``[-1, 0, 1]``, the weights' norms
``statistics=["param_norm"]``, local dump only; the rule ``noise, gradients only`` judges the same dumps with that
column left out of the baseline's, as a monitor without it records them, and ``noise, formats not recorded`` with
the baseline's recorded compute formats left out, as for a MindSpore run or msprobe's dumps), each
a function of (seed, step) alone: a GPT-2 from ``transformers.GPT2Config`` (2 layers, width 64, 4 heads, 128 tokens,
random weights, AdamW, batches of 8 x 32 synthetic tokens; the key third of its fused attention bias ``c_attn.bias``
has a gradient that is zero in exact arithmetic, so its signs are rounding noise) and a small conv net (Conv2d with
bias then BatchNorm2d, whose bias gradient is zero in exact arithmetic too; ReLU; a LayerNorm and Linear head; SGD
with momentum; 1 x 8 x 8 synthetic images of 10 classes). Per family and seed (3 seeds):

- the baseline: float32, clean, 300 steps;
- benign pairs, 300 steps each against the baseline: float64 (model and data), bf16 autocast, perturbed rounding
  (every initial weight times 1 + 2^-23 x a random sign, one ulp); the same for two set-ups the noise rule was not
  settled on, benign pairs only (``ELSEWHERE``): GPT-2 on random tokens with warmup and gradient clipping, an MLP
  with SGD and a step-decayed learning rate;
- harmful scenarios (``SCENARIOS``: data, optimizer, model code, numerics, gradient plumbing, silent corruption),
  60 steps each, in three variants against the baseline: the bug alone from step 30 (float32); on top of one noise
  (float64 for seed 0, bf16 for seed 1, perturbed rounding for seed 2) from step 30; on top of that noise from 0.

The truth is measured, not assumed: the first step at which the bug run's recorded gradients (summary CSV bytes,
direction bits) differ from the clean run of the same noise (the baseline, or the 300-step benign run); a scenario
whose gradients never differ is reported as invalid. The live verdict: the on-noise variants of seed 0 trained again
with ``baseline=`` and ``on_suspicious``, per rule.

Phases (``--work`` holds the dumps; default ``/tmp/divergence``):

    python benchmarks/divergence_benchmark.py generate   # trains every run not already in --work (cached)
    python benchmarks/divergence_benchmark.py live       # the live-verdict runs, each rule (trained every time)
    python benchmarks/divergence_benchmark.py evaluate   # compare_dumps per rule -> results/divergence.{json,md}
    python benchmarks/divergence_benchmark.py all        # the three in turn (what benchmarks/run-divergence runs)
    python benchmarks/divergence_benchmark.py report     # the last evaluation (--out) summed up again, no judging

Before and after a change to the rule, on the same dumps: ``PYTHONPATH=/old/checkout python ... evaluate --out
/tmp/before``, then ``python ... evaluate --merge /tmp/before/divergence.json``: the old package's rules become
columns beside the new (``noise at <commit>``).

``--quick``: 1 seed, 3 scenarios, few steps, results in ``--work`` only (a dry run of the harness).
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import hashlib
import inspect
import json
import logging
import multiprocessing
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
import zipfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import torch

from msprobe_mlflow import GradProbeConfig, directions
from msprobe_mlflow.compare.engine import compare_dumps
from msprobe_mlflow.directions import read_step_directions
from msprobe_mlflow.dump import findings_dir, step_dir, summary_csv_path
from msprobe_mlflow.pytorch import GradientMonitor
from msprobe_mlflow.statistics_table import PARAMETER_NORM

try:  # exponent counts, where the package records them (compare reports their shift beside the verdict)
    from msprobe_mlflow.statistics_table import EXPONENTS
    EXPONENT_COUNTS = [EXPONENTS]
except ImportError:
    EXPONENT_COUNTS = []

RESULTS = Path(__file__).resolve().parent / "results"
RECIPE = 3  # bump when a training or what it records changes: dumps cached under another recipe are trained again
# (3: the monitor records exponent counts too, which compare reports beside the verdict)
NOISES = ("float64", "bf16", "rounding", "threads")  # threads: float32 on 2 threads against the baseline's 1
NOISE_OF_SEED = {0: "float64", 1: "bf16", 2: "rounding"}
VARIANTS = ("alone", "on noise", "from step 0")


@dataclasses.dataclass(frozen=True)
class Plan:
    seeds: tuple[int, ...] = (0, 1, 2)
    benign_steps: int = 300
    harmful_steps: int = 60
    bug_step: int = 30
    scenarios: tuple[str, ...] | None = None  # None: all

    def scenario_list(self) -> list[Scenario]:
        return [s for s in SCENARIOS if self.scenarios is None or s.name in self.scenarios]


QUICK = Plan(seeds=(0,), benign_steps=24, harmful_steps=12, bug_step=6,
             scenarios=("learning rate x10", "gradient zeroed", "gradients x2"))


# ---- the two model families: a model, an optimizer, and a data stream that is a function of (seed, step) only

def generator(*key) -> torch.Generator:
    digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)


def at_least_float32(logits: torch.Tensor) -> torch.Tensor:
    """bf16 logits (autocast) in float32 for the loss; float64 ones stay float64."""
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


class GPT2:
    name = "gpt2"
    vocab, length, batch_size = 128, 32, 8
    bf16_layer, zeroed, corrupted, flipped = ("transformer.h.1.mlp.c_fc", "transformer.h.1.mlp.c_fc.weight",
                                              "transformer.h.0.mlp.c_proj.weight", "transformer.h.0.attn.c_proj.weight")
    feeding = {"bf16_layer": ["transformer.h.1.ln_2.weight", "transformer.h.1.ln_2.bias"],
               "corrupted": ["transformer.h.0.mlp.c_fc.weight", "transformer.h.0.mlp.c_fc.bias"]}

    @staticmethod
    def build() -> torch.nn.Module:
        from transformers import GPT2Config, GPT2LMHeadModel
        config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32, bos_token_id=None,
                            eos_token_id=None, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        config._attn_implementation = "eager"  # the mask is an explicit tensor (the causal-mask bug removes it)
        return GPT2LMHeadModel(config)

    @staticmethod
    def optimizer(model) -> torch.optim.Optimizer:
        return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)

    def batch(self, seed: int, step: int, stream: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
        """Sequences t -> (a t + 1) mod V with a per sequence, 10% of tokens random; targets: the next token."""
        g = generator(seed, step, stream)
        start = torch.randint(self.vocab, (self.batch_size, 1), generator=g)
        factor = torch.tensor([3, 5, 7])[torch.randint(3, (self.batch_size, 1), generator=g)]
        tokens = [start]
        for _ in range(self.length - 1):
            tokens.append((tokens[-1] * factor + 1) % self.vocab)
        tokens = torch.cat(tokens, 1)
        noise = torch.rand(tokens.shape, generator=g) < 0.1
        tokens = torch.where(noise, torch.randint(self.vocab, tokens.shape, generator=g), tokens)
        return tokens, tokens[:, 1:].clone()

    def loss(self, model, inputs, targets, reduction: str) -> torch.Tensor:
        logits = model(input_ids=inputs).logits[:, :-1]
        return torch.nn.functional.cross_entropy(at_least_float32(logits).reshape(-1, self.vocab),
                                                 targets.reshape(-1), reduction=reduction)

    @staticmethod
    def change_code(model) -> None:
        """Model-code bug: the causal mask dropped (every position sees the future)."""
        for block in model.transformer.h:
            block.attn.register_forward_pre_hook(lambda _, args, kwargs: (args, {**kwargs, "attention_mask": None}),
                                                 with_kwargs=True)


class ConvNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 8, 3, padding=1)  # biased, then BatchNorm: a gradient zero in exact arithmetic
        self.bn1 = torch.nn.BatchNorm2d(8)
        self.conv2 = torch.nn.Conv2d(8, 16, 3, padding=1)
        self.bn2 = torch.nn.BatchNorm2d(16)
        self.act = torch.nn.ReLU()
        self.pool = torch.nn.AdaptiveAvgPool2d(2)
        self.norm = torch.nn.LayerNorm(64)
        self.dropout = torch.nn.Dropout(0.0)
        self.head = torch.nn.Linear(64, 10)

    def forward(self, x):
        x = self.act(self.bn1(self.conv1(x)))
        x = self.pool(self.act(self.bn2(self.conv2(x)))).flatten(1)
        return self.head(self.dropout(self.norm(x)))


class Conv:
    name = "conv"
    batch_size, classes = 32, 10
    example_shape, prototypes = (1, 8, 8), "prototypes"  # an image; the key of the seed's prototypes
    bf16_layer, zeroed, corrupted, flipped = "head", "conv2.weight", "conv2.weight", "head.weight"
    feeding = {"bf16_layer": ["norm.weight", "norm.bias"],
               "corrupted": ["bn1.weight", "bn1.bias", "conv1.weight", "conv1.bias"]}

    @staticmethod
    def build() -> torch.nn.Module:
        return ConvNet()

    @staticmethod
    def optimizer(model) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)

    def batch(self, seed: int, step: int, stream: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
        """Noisy copies of 10 fixed prototypes (fixed per seed); the target is the prototype's class."""
        prototypes = torch.randn(self.classes, *self.example_shape, generator=generator(seed, self.prototypes))
        g = generator(seed, step, stream)
        labels = torch.randint(self.classes, (self.batch_size,), generator=g)
        return prototypes[labels] + 0.7 * torch.randn(self.batch_size, *self.example_shape, generator=g), labels

    @staticmethod
    def loss(model, inputs, targets, reduction: str) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(at_least_float32(model(inputs)), targets, reduction=reduction)

    @staticmethod
    def change_code(model) -> None:
        """Model-code bug: ReLU replaced by GELU."""
        model.act = torch.nn.GELU()


class GPT2Unstable(GPT2):
    """Benign pairs only: GPT-2 as above on unlearnable random tokens, with a 50-step warmup and the gradients
    clipped to norm 1, as pretraining recipes do: its trajectories pass through phases where the training amplifies
    any difference (a set-up the noise rule's constants were not settled on)."""
    name = "gpt2-clip"
    clip = 1.0

    def batch(self, seed: int, step: int, stream: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.randint(self.vocab, (self.batch_size, self.length), generator=generator(seed, step, stream))
        return tokens, tokens[:, 1:].clone()

    @staticmethod
    def schedule(optimizer) -> torch.optim.lr_scheduler.LRScheduler:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 50))


class MLPDecay:
    """Benign pairs only: an MLP (GELU, LayerNorm) with SGD, momentum and weight decay, its learning rate divided by
    ten every 100 steps (a step both runs take alike, which moves every difference at once)."""
    name = "mlp-decay"
    batch_size, classes = 64, 10

    @staticmethod
    def build() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU(), torch.nn.LayerNorm(128),
                                   torch.nn.Linear(128, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))

    @staticmethod
    def optimizer(model) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)

    @staticmethod
    def schedule(optimizer) -> torch.optim.lr_scheduler.LRScheduler:
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=100, gamma=0.1)

    def batch(self, seed: int, step: int, stream: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
        inputs = torch.randn(self.batch_size, 32, generator=generator(seed, step, stream))
        return inputs, inputs[:, :self.classes].argmax(1)

    @staticmethod
    def loss(model, inputs, targets, reduction: str) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(at_least_float32(model(inputs)), targets, reduction=reduction)


class ResidualBlock(torch.nn.Module):
    def __init__(self, channels: int, act: torch.nn.Module):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(channels)
        self.conv2 = torch.nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(channels)
        self.act = act

    def forward(self, x):
        return self.act(x + self.bn2(self.conv2(self.act(self.bn1(self.conv1(x))))))


class ResNetBN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.act = torch.nn.ReLU()
        self.stem = torch.nn.Conv2d(1, 16, 3, padding=1, bias=False)
        self.bn = torch.nn.BatchNorm2d(16)
        self.layer1, self.layer2 = ResidualBlock(16, self.act), ResidualBlock(16, self.act)
        self.pool = torch.nn.AdaptiveAvgPool2d(1)
        self.dropout = torch.nn.Dropout(0.0)
        self.head = torch.nn.Linear(16, 10)

    def forward(self, x):
        x = self.layer2(self.layer1(self.act(self.bn(self.stem(x)))))
        return self.head(self.dropout(self.pool(x).flatten(1)))


class ResNet(Conv):
    """Held out: a residual conv net, every convolution followed by BatchNorm (the running statistics of one run
    feed its next steps), SGD with momentum at learning rate 0.1."""
    name = "resnet-bn"
    bf16_layer, zeroed, corrupted, flipped = "head", "layer2.conv1.weight", "layer1.conv2.weight", "head.weight"
    feeding = {"bf16_layer": ["layer2.bn2.weight", "layer2.bn2.bias"],
               "corrupted": ["layer1.bn1.weight", "layer1.bn1.bias", "layer1.conv1.weight"]}

    @staticmethod
    def build() -> torch.nn.Module:
        return ResNetBN()

    @staticmethod
    def optimizer(model) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)

    @staticmethod
    def change_code(model) -> None:
        """Model-code bug: ReLU replaced by GELU (the blocks share the model's activation)."""
        act = torch.nn.GELU()
        model.act = model.layer1.act = model.layer2.act = act


class GRUNet(torch.nn.Module):
    def __init__(self, vocab: int, classes: int):
        super().__init__()
        self.embedding = torch.nn.Embedding(vocab, 32)
        self.rnn = torch.nn.GRU(32, 64, batch_first=True)
        self.norm = torch.nn.LayerNorm(64)
        self.dropout = torch.nn.Dropout(0.0)
        self.head = torch.nn.Linear(64, classes)
        self.pool_last = True

    def forward(self, tokens):
        states, _ = self.rnn(self.embedding(tokens).to(self.head.weight.dtype))
        pooled = states[:, -1] if self.pool_last else states.mean(1)
        return self.head(self.dropout(self.norm(pooled)))


class Recurrent:
    """Held out: a GRU over token sequences (its recurrence multiplies any difference through 24 time steps),
    Adam; the class is the sequence's token sum modulo 10."""
    name = "gru"
    vocab, length, batch_size, classes = 32, 24, 32, 10
    bf16_layer, zeroed, corrupted, flipped = "head", "rnn.weight_hh_l0", "rnn.weight_ih_l0", "head.weight"
    feeding = {"bf16_layer": ["norm.weight", "norm.bias"], "corrupted": ["embedding.weight"]}

    def build(self) -> torch.nn.Module:
        return GRUNet(self.vocab, self.classes)

    @staticmethod
    def optimizer(model) -> torch.optim.Optimizer:
        return torch.optim.Adam(model.parameters(), lr=3e-3)

    def batch(self, seed: int, step: int, stream: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.randint(self.vocab, (self.batch_size, self.length), generator=generator(seed, step, stream))
        return tokens, tokens.sum(1) % self.classes

    @staticmethod
    def loss(model, inputs, targets, reduction: str) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(at_least_float32(model(inputs)), targets, reduction=reduction)

    @staticmethod
    def change_code(model) -> None:
        """Model-code bug: the mean of the states pooled instead of the last one."""
        model.pool_last = False


class Expert(torch.nn.Module):
    def __init__(self, width: int, act: torch.nn.Module):
        super().__init__()
        self.fc1, self.fc2, self.act = torch.nn.Linear(width, 2 * width), torch.nn.Linear(2 * width, width), act

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class ViTMoE(torch.nn.Module):
    """A vision-transformer block on 2 x 2 patches of an 8 x 8 image whose MLP is a top-1 mixture of two experts:
    the router's choice is discrete, so rounding that moves a token across the boundary changes its path."""

    def __init__(self, width: int = 32):
        super().__init__()
        self.act = torch.nn.GELU()
        self.patch = torch.nn.Linear(4, width)
        self.position = torch.nn.Parameter(torch.randn(16, width) * 0.02)
        self.ln1, self.ln2, self.norm = (torch.nn.LayerNorm(width) for _ in range(3))
        self.attention = torch.nn.MultiheadAttention(width, 4, batch_first=True)
        self.router = torch.nn.Linear(width, 2)
        self.experts = torch.nn.ModuleList(Expert(width, self.act) for _ in range(2))
        self.dropout = torch.nn.Dropout(0.0)
        self.head = torch.nn.Linear(width, 10)

    def forward(self, images):
        patches = images.unfold(2, 2, 2).unfold(3, 2, 2).reshape(images.shape[0], 16, 4)
        x = self.patch(patches) + self.position
        y = self.ln1(x)
        x = x + self.attention(y, y, y, need_weights=False)[0]
        y = self.ln2(x)
        weights = torch.softmax(self.router(y), dim=-1)
        choice = weights.argmax(-1, keepdim=True)
        mixed = sum((choice == i) * weights[..., i:i + 1] * expert(y) for i, expert in enumerate(self.experts))
        x = x + self.dropout(mixed)
        return self.head(self.norm(x).mean(1))


class VisionMoE(Conv):
    """Held out: :class:`ViTMoE` with AdamW on the conv family's images."""
    name = "vit-moe"
    bf16_layer, zeroed, corrupted, flipped = ("head", "experts.0.fc2.weight", "experts.1.fc1.weight",
                                              "attention.out_proj.weight")
    feeding = {"bf16_layer": ["norm.weight", "norm.bias"], "corrupted": ["ln2.weight", "ln2.bias"]}

    @staticmethod
    def build() -> torch.nn.Module:
        return ViTMoE()

    @staticmethod
    def optimizer(model) -> torch.optim.Optimizer:
        return torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)

    @staticmethod
    def change_code(model) -> None:
        """Model-code bug: the experts' GELU replaced by ReLU."""
        act = torch.nn.ReLU()
        model.act = act
        for expert in model.experts:
            expert.act = act


class HighRateNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.norm, self.fc2 = torch.nn.Linear(32, 128), torch.nn.LayerNorm(128), torch.nn.Linear(128, 128)
        self.act, self.dropout, self.head = torch.nn.Tanh(), torch.nn.Dropout(0.0), torch.nn.Linear(128, 10)

    def forward(self, x):
        return self.head(self.dropout(self.act(self.fc2(self.norm(self.act(self.fc1(x)))))))


class HighRate(MLPDecay):
    """Held out: an MLP trained by plain SGD at learning rate 0.5, near the edge of stability (each step's
    difference is amplified by the large update), no schedule."""
    name = "mlp-high-lr"
    schedule = None
    bf16_layer, zeroed, corrupted, flipped = "fc2", "fc1.weight", "fc2.weight", "head.weight"
    feeding = {"bf16_layer": ["norm.weight", "norm.bias"], "corrupted": ["norm.weight", "norm.bias"]}

    @staticmethod
    def build() -> torch.nn.Module:
        return HighRateNet()

    @staticmethod
    def optimizer(model) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=0.5)

    @staticmethod
    def change_code(model) -> None:
        """Model-code bug: Tanh replaced by ReLU."""
        model.act = torch.nn.ReLU()


class LlamaBlock(torch.nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads, self.causal = heads, True
        self.norm1, self.norm2 = torch.nn.RMSNorm(width, eps=1e-5), torch.nn.RMSNorm(width, eps=1e-5)
        self.q, self.k, self.v, self.o = (torch.nn.Linear(width, width, bias=False) for _ in range(4))
        self.gate, self.up = (torch.nn.Linear(width, 2 * width, bias=False) for _ in range(2))
        self.down = torch.nn.Linear(2 * width, width, bias=False)

    def forward(self, x):
        b, t, w = x.shape
        y = self.norm1(x)
        q, k, v = (p(y).view(b, t, self.heads, w // self.heads).transpose(1, 2) for p in (self.q, self.k, self.v))
        attended = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        x = x + self.o(attended.transpose(1, 2).reshape(b, t, w))
        y = self.norm2(x)
        return x + self.down(torch.nn.functional.silu(self.gate(y)) * self.up(y))


class LlamaNet(torch.nn.Module):
    """A two-block Llama-style decoder: RMSNorm, causal attention without biases or positions, a SwiGLU MLP."""

    def __init__(self, vocab: int, width: int = 64, heads: int = 4):
        super().__init__()
        self.embedding = torch.nn.Embedding(vocab, width)
        self.blocks = torch.nn.ModuleList(LlamaBlock(width, heads) for _ in range(2))
        self.norm = torch.nn.RMSNorm(width, eps=1e-5)
        self.dropout = torch.nn.Dropout(0.0)
        self.head = torch.nn.Linear(width, vocab, bias=False)

    def forward(self, tokens):
        x = self.embedding(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.dropout(self.norm(x)))


class Llama(GPT2):
    """Held out (declared at stop 55, before it was measured and before the rule changes again): :class:`LlamaNet`
    on GPT-2's token sequences, AdamW."""
    name = "llama"
    bf16_layer, zeroed, corrupted, flipped = "blocks.1.up", "blocks.1.gate.weight", "blocks.0.down.weight", \
        "blocks.0.o.weight"
    feeding = {"bf16_layer": ["blocks.1.norm2.weight"], "corrupted": ["blocks.0.up.weight", "blocks.0.gate.weight"]}

    def build(self) -> torch.nn.Module:
        return LlamaNet(self.vocab)

    def loss(self, model, inputs, targets, reduction: str) -> torch.Tensor:
        logits = model(inputs)[:, :-1]
        return torch.nn.functional.cross_entropy(at_least_float32(logits).reshape(-1, self.vocab),
                                                 targets.reshape(-1), reduction=reduction)

    @staticmethod
    def change_code(model) -> None:
        """Model-code bug: the causal mask dropped (every position sees the future)."""
        for block in model.blocks:
            block.causal = False


class SignalNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.gn1 = torch.nn.Conv1d(4, 16, 5, padding=2), torch.nn.GroupNorm(4, 16)
        self.conv2, self.gn2 = torch.nn.Conv1d(16, 32, 5, padding=2), torch.nn.GroupNorm(8, 32)
        self.act, self.pool = torch.nn.SiLU(), torch.nn.AdaptiveAvgPool1d(4)
        self.norm, self.dropout, self.head = torch.nn.LayerNorm(128), torch.nn.Dropout(0.0), torch.nn.Linear(128, 10)

    def forward(self, x):
        x = self.act(self.gn1(self.conv1(x)))
        x = self.pool(self.act(self.gn2(self.conv2(x)))).flatten(1)
        return self.head(self.dropout(self.norm(x)))


class Signals(Conv):
    """Held out (declared at stop 55, before it was measured and before the rule changes again): 1-D convolutions
    with GroupNorm (statistics per sample, not per batch) and SiLU over noisy copies of 10 fixed 4 x 32 signals,
    Adam."""
    name = "cnn1d-gn"
    example_shape, prototypes = (4, 32), "signals"
    feeding = {"bf16_layer": ["norm.weight", "norm.bias"],
               "corrupted": ["gn1.weight", "gn1.bias", "conv1.weight", "conv1.bias"]}

    @staticmethod
    def build() -> torch.nn.Module:
        return SignalNet()

    @staticmethod
    def optimizer(model) -> torch.optim.Optimizer:
        return torch.optim.Adam(model.parameters(), lr=2e-3)

    @staticmethod
    def change_code(model) -> None:
        """Model-code bug: SiLU replaced by ReLU."""
        model.act = torch.nn.ReLU()


FAMILIES = {family.name: family for family in (GPT2(), Conv())}  # benign pairs and every harmful scenario
ELSEWHERE = {family.name: family for family in (GPT2Unstable(), MLPDecay())}  # benign pairs only, out of sample
# Held out (issue 47): declared before the rule changed again, measured before and after, never tuned on: benign pairs
# and every harmful scenario, reported apart from FAMILIES. llama and cnn1d-gn were added at stop 55, before the rule
# is changed for resnet-bn's false alarms, so that such a change is judged on families it was not made on.
HELD_OUT = {family.name: family for family in (ResNet(), Recurrent(), VisionMoE(), HighRate(), Llama(), Signals())}
HARMFUL_FAMILIES = {**FAMILIES, **HELD_OUT}
BENIGN_FAMILIES = {**FAMILIES, **ELSEWHERE, **HELD_OUT}


# ---- the harmful scenarios


@dataclasses.dataclass(frozen=True)
class Scenario:
    """``culprits(family)``: the parameters a localized bug touches (None: not localized); ``magnitude``: at its
    first step the bug changes magnitudes only, every sign intact."""

    name: str
    category: str
    what: str
    culprit: str | None = None  # the family's attribute naming the touched parameter or layer
    magnitude: bool = False

    def culprits(self, family) -> list[str] | None:
        if self.culprit is None:
            return None
        named = getattr(family, self.culprit)
        return [named + ".weight", named + ".bias"] if self.culprit == "bf16_layer" else [named]

    def feeding(self, family) -> list[str]:
        """For a bug in the forward pass (a corrupted weight, a layer in bf16): the parameters of the layer that
        feeds the touched one. Backpropagation reaches them through the touched layer (its weights transposed), so
        their gradients change first and most (measured on the noise-free pairs: gpt2's corrupted c_proj moves its
        own gradient by 0.7-1.8%, the feeding c_fc's by 8-26%). Reported as a second figure beside the strict one."""
        return family.feeding.get(self.culprit, []) if self.culprit else []


SCENARIOS = (
    Scenario("new batches", "data", "other batches from the bug's step on (another data stream)"),
    Scenario("labels corrupted", "data", "20% of the targets replaced by random classes or tokens"),
    Scenario("learning rate x10", "optimizer", "learning rate x10 from the bug's step"),
    Scenario("weight decay x10", "optimizer", "weight decay x10 from the bug's step"),
    Scenario("model code changed", "model code", "GPT-2: the causal mask dropped; conv: ReLU -> GELU"),
    Scenario("dropout on", "model code", "dropout switched on (p = 0.1 everywhere)"),
    Scenario("norm epsilon", "numerics", "LayerNorm / BatchNorm / RMSNorm / GroupNorm epsilon 1e-5 -> 1e-3"),
    Scenario("one layer in bf16", "numerics", "one layer's matmul in bf16 (GPT-2: h.1.mlp.c_fc; conv: head)",
             culprit="bf16_layer"),
    Scenario("gradients x2", "gradient plumbing", "every gradient x2, as by a wrong world size", magnitude=True),
    Scenario("loss summed", "gradient plumbing", "loss summed instead of averaged", magnitude=True),
    Scenario("gradient zeroed", "gradient plumbing", "one parameter's gradient zeroed", culprit="zeroed"),
    Scenario("weights corrupted", "silent corruption", "4 elements of one weight matrix set to 10x its largest "
             "value at the bug's step", culprit="corrupted"),
    Scenario("exponent bit flip", "silent corruption", "one exponent bit flipped in one gradient element at the "
             "bug's step (the bit worth 2^8, in an element where it is 0: that value x 256)", culprit="flipped",
             magnitude=True),
)
SCENARIO_BY_NAME = {s.name: s for s in SCENARIOS}


# ---- one training


@dataclasses.dataclass(frozen=True)
class RunSpec:
    family: str
    seed: int
    noise: str  # float32, float64, bf16, rounding
    steps: int
    scenario: str | None = None
    bug_from: int | None = None

    @property
    def name(self) -> str:
        bug = "" if self.scenario is None else f"-{self.scenario.replace(' ', '_')}-from{self.bug_from}"
        return f"{self.family}-s{self.seed}-{self.noise}{bug}-{self.steps}steps"

    def key(self) -> dict:
        return {**dataclasses.asdict(self), "recipe": RECIPE, "torch": torch.__version__}


def in_bf16(module: torch.nn.Module) -> None:
    """The layer's matmul on bf16 copies of its input, weight and bias, if any (an explicit cast: autocast would leave
    a float64 model alone), its output cast back."""
    weight_of = (lambda w: w) if isinstance(module, torch.nn.Linear) else (lambda w: w.t())  # GPT-2's Conv1D: x W

    def forward_in_bf16(x):
        bf16 = torch.bfloat16
        bias = None if module.bias is None else module.bias.to(bf16)
        return torch.nn.functional.linear(x.to(bf16), weight_of(module.weight).to(bf16), bias).to(x.dtype)
    module.forward = forward_in_bf16


def flip_exponent_bit(tensor: torch.Tensor, order: torch.Tensor) -> None:
    """Flips the exponent bit worth 2^8 in the first element (in ``order``) where it is 0: that value x 256."""
    values = tensor.detach().view(-1).numpy()  # shares memory with the gradient
    unsigned, mantissa = (np.uint32, 23) if values.dtype == np.float32 else (np.uint64, 52)
    mask = unsigned(1 << (mantissa + 3))
    bits = values.view(unsigned)
    index = next((int(i) for i in order if not bits[i] & mask), None)
    if index is None:
        raise RuntimeError(f"no element of a {tuple(tensor.shape)} gradient has exponent bit 3 clear")
    bits[index] ^= mask


class Training:
    """A run of ``spec``: the clean training of its noise setting, with the scenario's bug from ``bug_from``."""

    def __init__(self, spec: RunSpec):
        self.spec, self.family = spec, BENIGN_FAMILIES[spec.family]
        self.scenario = None if spec.scenario is None else SCENARIO_BY_NAME[spec.scenario]
        torch.manual_seed(spec.seed)  # the initial weights, and dropout once a bug turns it on
        self.model = self.family.build().train()
        if spec.noise == "rounding":
            with torch.no_grad():
                g = generator(spec.seed, "rounding")
                for p in self.model.parameters():
                    sign = torch.randint(2, p.shape, generator=g) * 2.0 - 1.0
                    p.mul_(1 + 2.0 ** -23 * sign)
        if spec.noise == "float64":
            self.model.double()
        self.optimizer = self.family.optimizer(self.model)
        schedule = getattr(self.family, "schedule", None)
        self.schedule = schedule(self.optimizer) if schedule is not None else None
        self.params = dict(self.model.named_parameters())

    def bug_on(self, step: int) -> bool:
        return self.scenario is not None and step >= self.spec.bug_from

    def start_bug(self) -> None:
        """What the bug changes once, before its first step's forward."""
        name, model = self.scenario.name, self.model
        if name in ("learning rate x10", "weight decay x10"):
            key = "lr" if name == "learning rate x10" else "weight_decay"
            for group in self.optimizer.param_groups:
                group[key] *= 10
        elif name == "model code changed":
            self.family.change_code(model)
        elif name == "dropout on":
            for module in model.modules():
                if isinstance(module, torch.nn.Dropout):
                    module.p = 0.1
            for module in model.modules():  # GPT-2's attention reads its dropout from attn_dropout.p
                if hasattr(module, "attn_dropout"):
                    module.attn_dropout.p = 0.1
        elif name == "norm epsilon":
            for module in model.modules():
                if isinstance(module, (torch.nn.LayerNorm, torch.nn.BatchNorm2d, torch.nn.RMSNorm,
                                       torch.nn.GroupNorm)):
                    module.eps = 1e-3
        elif name == "one layer in bf16":
            in_bf16(model.get_submodule(self.family.bf16_layer))
        elif name == "weights corrupted":
            with torch.no_grad():
                weight = self.params[self.family.corrupted].view(-1)
                places = torch.randperm(weight.numel(), generator=generator(self.spec.seed, "corrupt"))[:4]
                weight[places] = 10 * weight.abs().max()

    def data(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        bug = self.scenario.name if self.bug_on(step) else None
        inputs, targets = self.family.batch(self.spec.seed, step, "other" if bug == "new batches" else "train")
        if bug == "labels corrupted":
            g = generator(self.spec.seed, step, "labels")
            wrong = torch.rand(targets.shape, generator=g) < 0.2
            classes = getattr(self.family, "classes", getattr(self.family, "vocab", None))
            targets = torch.where(wrong, torch.randint(classes, targets.shape, generator=g), targets)
        if self.spec.noise == "float64" and inputs.is_floating_point():
            inputs = inputs.double()
        return inputs, targets

    def after_backward(self, step: int) -> None:
        """Bugs in the gradients between backward() and optimizer.step(), where the monitor probes them."""
        name = self.scenario.name
        if name == "gradients x2":
            for p in self.params.values():
                p.grad.mul_(2)
        elif name == "gradient zeroed":
            self.params[self.family.zeroed].grad.zero_()
        elif name == "exponent bit flip" and step == self.spec.bug_from:
            grad = self.params[self.family.flipped].grad
            flip_exponent_bit(grad, torch.randperm(grad.numel(), generator=generator(self.spec.seed, "flip")))

    def step(self, step: int) -> str:
        """One training step; returns a digest of the exact gradients the optimizer steps with."""
        if self.scenario is not None and step == self.spec.bug_from:
            self.start_bug()
        inputs, targets = self.data(step)
        reduction = "sum" if self.bug_on(step) and self.scenario.name == "loss summed" else "mean"
        self.optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.spec.noise == "bf16"):
            loss = self.family.loss(self.model, inputs, targets, reduction)
        loss.backward()
        if self.bug_on(step):
            self.after_backward(step)
        if getattr(self.family, "clip", None):
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.family.clip)
        digest = hashlib.blake2b(digest_size=8)
        for p in self.params.values():
            digest.update(p.grad.detach().numpy().tobytes())
        self.optimizer.step()
        if self.schedule is not None:
            self.schedule.step()
        return digest.hexdigest()


def monitor_config(dump: Path) -> GradProbeConfig:
    return GradProbeConfig(dump_path=str(dump), level="L2", bounds=(-1, 0, 1))


def train(spec: RunSpec, dump: Path, **live) -> dict:
    """Trains ``spec`` into ``dump`` under the real monitor; ``live``: ``baseline=`` and its options."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2 if spec.noise == "threads" else 1)  # another kernel split: the sums' order differs
    try:
        training = Training(spec)
        monitor = GradientMonitor(monitor_config(dump), log_to_mlflow=False, anomaly_flags=False, silent=True,
                                  statistics=[PARAMETER_NORM, *EXPONENT_COUNTS], **live).monitor(
            training.model, training.optimizer)
        start = time.perf_counter()
        digests, step_ends = [], []
        for step in range(spec.steps):
            digests.append(training.step(step))
            step_ends.append(time.perf_counter())
        monitor.stop()
    finally:
        torch.set_num_threads(threads)
    return {"spec": spec.key(), "seconds": time.perf_counter() - start, "gradient_digests": digests,
            "step_ends": step_ends}


# ---- which runs the benchmark needs


def baseline_spec(family: str, seed: int, plan: Plan) -> RunSpec:
    return RunSpec(family, seed, "float32", plan.benign_steps)


def benign_specs(plan: Plan) -> list[RunSpec]:
    return [RunSpec(f, seed, noise, plan.benign_steps) for f in BENIGN_FAMILIES for seed in plan.seeds
            for noise in ("float32",) + NOISES]


def harmful_cases(plan: Plan) -> list[dict]:
    """Every (scenario, family, seed, variant): the bug run and the clean run of the same noise (the truth's)."""
    cases = []
    for family in HARMFUL_FAMILIES:
        for seed in plan.seeds:
            for scenario in plan.scenario_list():
                for variant in VARIANTS:
                    noise = "float32" if variant == "alone" else NOISE_OF_SEED[seed]
                    bug_from = 0 if variant == "from step 0" else plan.bug_step
                    cases.append({"family": family, "seed": seed, "scenario": scenario.name, "variant": variant,
                                  "noise": noise, "bug": RunSpec(family, seed, noise, plan.harmful_steps,
                                                                 scenario.name, bug_from),
                                  "clean": RunSpec(family, seed, noise, plan.benign_steps)})
    return cases


def live_cases(plan: Plan) -> list[dict]:
    seed = plan.seeds[0]
    return [c for c in harmful_cases(plan) if c["seed"] == seed and c["variant"] == "on noise"
            and c["family"] in FAMILIES]


class Work:
    """The work folder: ``dumps/<run>/`` and ``runs/<run>.json`` (written once the dump is complete)."""

    def __init__(self, folder: Path):
        self.folder = folder

    def dump(self, spec: RunSpec) -> Path:
        return self.folder / "dumps" / spec.name

    def record_path(self, spec: RunSpec) -> Path:
        return self.folder / "runs" / f"{spec.name}.json"

    def record(self, spec: RunSpec) -> dict | None:
        path = self.record_path(spec)
        if not path.exists():
            return None
        record = json.loads(path.read_text())
        return record if record["spec"] == spec.key() else None

    def save(self, spec: RunSpec, record: dict) -> None:
        path = self.record_path(spec)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record))


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def machine() -> str:
    return (f"{os.cpu_count()} CPUs ({platform.machine()}), torch {torch.__version__} on "
            f"{torch.get_num_threads()} thread(s), Python {platform.python_version()}")


def generate(work: Work, plan: Plan, note_work: Path | None) -> dict:
    """Trains every run whose complete dump is not in the work folder yet."""
    specs = list(dict.fromkeys(benign_specs(plan) + [c["bug"] for c in harmful_cases(plan)]))
    specs.sort(key=lambda s: (list(BENIGN_FAMILIES).index(s.family), s.seed))  # GPT-2's first seed complete first
    load_before, start, trained = os.getloadavg(), time.perf_counter(), 0
    for index, spec in enumerate(specs, 1):
        if work.record(spec) is None:
            dump = work.dump(spec)
            if dump.exists():
                progress(f"{dump}: incomplete or of another recipe, removed to train it again")
                shutil.rmtree(dump)
            record = train(spec, dump)
            work.save(spec, record)
            trained += 1
            progress(f"generate {index}/{len(specs)}: {spec.name} ({record['seconds']:.1f} s)")
        if note_work is not None and spec.family == "gpt2" and spec.seed == plan.seeds[0] and all(
                work.record(s) is not None for s in specs if s.family == "gpt2" and s.seed == plan.seeds[0]):
            note_work.write_text(f"{work.folder}\n")
            progress(f"GPT-2 seed {plan.seeds[0]} dumps complete: wrote {note_work}")
            note_work = None
    summary = {"runs": len(specs), "trained_now": trained, "seconds_now": time.perf_counter() - start,
               "training_seconds_all_runs": sum(work.record(s)["seconds"] for s in specs),
               "steps_all_runs": sum(s.steps for s in specs), "load_before": load_before,
               "load_after": os.getloadavg(), "machine": machine(), "date": datetime.datetime.now().isoformat()}
    if trained or not (work.folder / "generate.json").exists():  # a call that only found the cache keeps the last
        (work.folder / "generate.json").write_text(json.dumps(summary, indent=1))
    progress(f"generate: {len(specs)} runs ({trained} trained now, {summary['seconds_now']:.0f} s)")
    return summary


# ---- rules, and the live verdict


PRECISION_GIVEN = "noise, precision given"  # the noise rule told the coarser format each pair computed in
PAIR_PRECISION = {"float32": "float32", "float64": "float32", "rounding": "float32", "bf16": "bfloat16",
                  "threads": "float32"}  # by noise


GRADIENTS_ONLY = "noise, gradients only"  # the default rule on the same dumps, the weights' norms left out
NOT_RECORDED = "noise, formats not recorded"  # the default rule, the baseline's recorded compute formats left out
# (as a MindSpore run's, msprobe's dumps or an earlier version's): the first steps judged at bfloat16's rounding


def compare_rules() -> list[str]:
    """The rules ``compare_dumps`` offers: its default first, then msprobe's, then the noise rule told each pair's
    precision (where ``compare_dumps`` takes ``precision=``), then the default rule on the gradients alone, and
    without recorded formats (where monitors record them); only msprobe's before ``rule=``."""
    parameters = inspect.signature(compare_dumps).parameters
    if "rule" not in parameters:
        return ["msprobe"]
    rules = list(dict.fromkeys([parameters["rule"].default, "msprobe"]))
    if "precision" not in parameters:
        return rules
    return rules + [PRECISION_GIVEN, GRADIENTS_ONLY] + ([NOT_RECORDED] if hasattr(directions, "COMPUTE_FORMAT") else [])


def gradients_only(dump: Path, folder: Path) -> Path:
    """``folder/<dump's name>``: ``dump`` without its ``param_norm`` column (its step folders linked): compared
    with it, a rule sees the gradients alone, as recorded without ``statistics=["param_norm"]``."""
    copy = folder / dump.name
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(dump, copy, copy_function=os.link)  # hard links: no data copied
    for path in (copy / "rank0").glob("grad_summary_*.csv"):
        with path.open(newline="", encoding="utf-8-sig") as file:
            rows = list(csv.reader(file))
        column = rows[0].index(PARAMETER_NORM)
        path.unlink()  # a hard link: the original stays as it is
        with path.open("w", newline="", encoding="utf-8-sig") as file:
            csv.writer(file).writerows([row[:column] + row[column + 1:] for row in rows])
    return copy


def formats_unrecorded(dump: Path, folder: Path) -> Path:
    """``folder/<dump's name>``: ``dump`` with its direction archives' ``compute_format`` left out (its other files
    linked): compared with it, the rule knows no pair's precision, as for a run whose monitor did not record it."""
    copy = folder / dump.name
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(dump, copy, copy_function=os.link)  # hard links: no data copied
    for path in copy.glob(f"rank*/step*/{directions.PACKED_FILE_NAME}"):
        with zipfile.ZipFile(path) as archive:
            members = {info.filename: archive.read(info) for info in archive.infolist()}
        path.unlink()  # a hard link: the original stays as it is
        with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
            for name, data in members.items():
                if name != f"{directions.COMPUTE_FORMAT}.npy":
                    archive.writestr(name, data)
    return copy


def live_takes(keyword: str) -> bool:
    """Whether the live verdict (``GradientMonitor(baseline=...)``) takes ``keyword``."""
    try:
        from msprobe_mlflow.sinks.baseline import BaselineOptions
    except ImportError:
        BaselineOptions = None
    return any(keyword in inspect.signature(f).parameters for f in (GradientMonitor.__init__, BaselineOptions) if f)


def rule_options(rule: str, takes_rule: bool, noise: str) -> dict:
    """The keywords of ``rule`` for a pair whose candidate has ``noise`` (what its precision is)."""
    if rule == PRECISION_GIVEN:
        return {"rule": "noise", "precision": PAIR_PRECISION[noise]}
    if rule in (GRADIENTS_ONLY, NOT_RECORDED):
        return {"rule": "noise"}
    return {"rule": rule} if takes_rule else {}


def verdict_of(baseline: Path, candidate: Path, rule: str, noise: str) -> dict:
    result = compare_dumps(baseline, candidate, None, plots=False, progress=False,
                           **rule_options(rule, "rule" in inspect.signature(compare_dumps).parameters, noise))
    rank = result.verdict.ranks[0]
    first_steps = getattr(rank, "first_steps", None)  # the noise rule's note on first steps beyond float32 rounding
    move = getattr(result.ranks[0], "first_exponent_move", None)  # reported beside the verdict, where recorded
    return {"step": rank.first_suspicious_step, "culprits": [t.name for t in rank.parameter_trips],
            "exponents_compared": bool(getattr(result.ranks[0], "exponent_shifts", None)),
            "exponent_move": move.step if move else None,
            "exponent_move_parameters": [name for name, _, _ in move.parameters] if move else [],
            "grade": getattr(rank, "grade", None),  # the noise rule's break or departure (before grades: none)
            "first_steps": first_steps.finest if first_steps else None,
            "first_steps_sixteen_bit": getattr(first_steps, "sixteen_bit", None)}  # the run it says computes so


def live(work: Work, plan: Plan, rules: list[str]) -> dict:
    """The on-noise cases of the first seed trained again with ``baseline=``, per rule the live verdict takes."""
    takes_rule = live_takes("rule")
    rules = [r for r in rules if r not in (GRADIENTS_ONLY, NOT_RECORDED) and
             (r != PRECISION_GIVEN or live_takes("precision"))] \
        if takes_rule else ["msprobe"]
    load_before, start, rows = os.getloadavg(), time.perf_counter(), []
    cases = live_cases(plan)
    for rule in rules:
        for index, case in enumerate(cases, 1):
            spec, baseline = case["bug"], work.dump(baseline_spec(case["family"], case["seed"], plan))
            if work.record(baseline_spec(case["family"], case["seed"], plan)) is None:
                raise SystemExit(f"{baseline}: the baseline dump is missing or incomplete; run generate first")
            dump = work.folder / "live" / rule.replace(" ", "_").replace(",", "") / spec.name
            shutil.rmtree(dump, ignore_errors=True)
            fired = []

            def on_suspicious(verdict, fired=fired):
                fired.append((time.perf_counter(), verdict.first_suspicious_step))
            record = train(spec, dump, baseline=str(baseline), on_suspicious=on_suspicious,
                           **rule_options(rule, takes_rule, spec.noise))
            written = findings_dir(dump, 0) / "verdict.json"
            row = {"family": case["family"], "seed": case["seed"], "scenario": case["scenario"], "rule": rule}
            if written.exists():
                live_step = json.loads(written.read_text())["verdict"]["ranks"][0]["first_suspicious_step"]
            else:  # counted as a live verdict unequal to compare's, and said
                live_step, row["error"] = None, f"{written} not written: the live comparison did not finish"
                progress(row["error"])
            row.update(live_step=live_step, compare_step=verdict_of(baseline, dump, rule, spec.noise)["step"],
                       callbacks=len(fired), same_gradients_as_generated=record["gradient_digests"] == (
                           work.record(spec) or {}).get("gradient_digests"))
            if fired:
                at, step = fired[0]
                end = record["step_ends"][step]
                row.update(latency_ms=(at - end) * 1e3, steps_meanwhile=sum(end < t <= at for t in record["step_ends"]))
            rows.append(row)
            progress(f"live {rule} {index}/{len(cases)}: {spec.name}: live step {live_step}, compare step "
                     f"{row['compare_step']}, callback after {row.get('latency_ms', float('nan')):.0f} ms")
    summary = {"rows": rows, "rule_passed_to_monitor": takes_rule, "seconds": time.perf_counter() - start,
               "date": datetime.datetime.now().isoformat(timespec="seconds"),
               "load_before": load_before, "load_after": os.getloadavg()}
    (work.folder / "live.json").write_text(json.dumps(summary, indent=1))
    return summary


# ---- evaluation


class Truth:
    """First step at which two dumps' recorded gradients differ (CSV bytes, direction bits), memoised per step."""

    def __init__(self, work: Work):
        self.work, self.cache = work, {}

    def step_data(self, spec: RunSpec, step: int) -> tuple:
        key = (spec, step)
        if key not in self.cache:
            dump = self.work.dump(spec)
            directions = read_step_directions(step_dir(dump, 0, step))
            self.cache[key] = (summary_csv_path(dump, 0, step).read_bytes(),
                               {name: (shape, bits.tobytes()) for name, (shape, bits) in directions.items()})
        return self.cache[key]

    def first_difference(self, bug: RunSpec, clean: RunSpec) -> int | None:
        return next((s for s in range(bug.steps) if self.step_data(bug, s) != self.step_data(clean, s)), None)

    def exact_first_difference(self, bug: RunSpec, clean: RunSpec) -> int | None:
        a, b = self.work.record(bug)["gradient_digests"], self.work.record(clean)["gradient_digests"]
        return next((s for s in range(bug.steps) if a[s] != b[s]), None)


def recorded_statistics(dump: Path, step: int, rename: dict[str, str] | None = None) -> dict[str, tuple]:
    """Parameter name (``rename``d where it says) -> the (max, min, norm) of its gradient recorded at ``step``."""
    rename = rename or {}
    with summary_csv_path(dump, 0, step).open(newline="", encoding="utf-8-sig") as file:
        return {rename.get(row["param_name"], row["param_name"]):
                tuple(float(row[statistic]) for statistic in ("max", "min", "norm")) for row in csv.DictReader(file)}


def largest_change(a: dict, b: dict) -> float:
    """The largest difference between two runs' recorded statistics at one step, over the parameters and the
    statistics (max, min, norm), in units of the parameter's gradient norm in ``a`` (0-norm gradients left out)."""
    return max(max(abs(y - x) for x, y in zip(a[name], b[name])) / a[name][2] for name in a if a[name][2] > 0)


def outcome(truth: int, predicted: int | None) -> str:
    if predicted is None:
        return "missed"
    return "exact" if predicted == truth else "early" if predicted < truth else "late"


def package_provenance() -> str:
    """Which msprobe_mlflow judged: where it was imported from, and this repository's commit (and whether the
    package differs from it)."""
    import msprobe_mlflow
    location = Path(msprobe_mlflow.__file__).parent
    repository = Path(__file__).resolve().parent.parent

    def git(*command) -> str:
        return subprocess.run(["git", "-C", str(repository), *command], capture_output=True, text=True).stdout.strip()
    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    if location != repository / "msprobe_mlflow":
        theirs = subprocess.run(["git", "-C", str(location), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip() or "unknown"
        return f"msprobe_mlflow from {location} at {theirs}, not from this repository (at {commit})"
    changed = git("status", "--porcelain", "--", "msprobe_mlflow")
    return f"msprobe_mlflow of this repository at {commit}" + (", with uncommitted changes" if changed else "")


def verdicts(pairs: list[tuple[Path, Path, str, str]], jobs: int) -> list[dict]:
    """``verdict_of`` for every (baseline, candidate, rule, noise), on ``jobs`` processes (CPU-bound)."""
    found = []
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork")) as pool:
        for index, verdict in enumerate(pool.map(verdict_of, *zip(*pairs), chunksize=4), 1):
            found.append(verdict)
            if index % 50 == 0 or index == len(pairs):
                progress(f"evaluate: {index}/{len(pairs)} comparisons")
    return found


def evaluate(work: Work, plan: Plan, rules: list[str], jobs: int) -> dict:
    load_before, start = os.getloadavg(), time.perf_counter()
    for spec in benign_specs(plan) + [c["bug"] for c in harmful_cases(plan)]:
        if work.record(spec) is None:
            raise SystemExit(f"{work.dump(spec)}: missing or incomplete; run generate first")
    truth = Truth(work)
    benign = [{"family": s.family, "seed": s.seed, "noise": s.noise, "steps": s.steps, "spec": s,
               "verdicts": {}}
              for s in benign_specs(plan) if s.noise != "float32"]
    harmful = []
    for case in harmful_cases(plan):
        scenario = SCENARIO_BY_NAME[case["scenario"]]
        row = {k: case[k] for k in ("family", "seed", "scenario", "variant", "noise")}
        row.update(category=scenario.category, magnitude=scenario.magnitude, bug_from=case["bug"].bug_from,
                   culprits=scenario.culprits(HARMFUL_FAMILIES[case["family"]]),
                   feeding=scenario.feeding(HARMFUL_FAMILIES[case["family"]]), spec=case["bug"],
                   truth=truth.first_difference(case["bug"], case["clean"]),
                   exact_truth=truth.exact_first_difference(case["bug"], case["clean"]), verdicts={})
        if row["truth"] is not None:  # issue 47's decision 1: the bug's effect against the pair's own difference
            clean = recorded_statistics(work.dump(case["clean"]), row["truth"])
            row["effect"] = largest_change(clean, recorded_statistics(work.dump(case["bug"]), row["truth"]))
            baseline = work.dump(baseline_spec(case["family"], case["seed"], plan))
            row["pair_difference"] = largest_change(recorded_statistics(baseline, row["truth"]), clean)
        harmful.append(row)
    progress(f"evaluate: truth of {len(harmful)} harmful cases, "
             f"{sum(r['truth'] is None for r in harmful)} invalid ({time.perf_counter() - start:.0f} s)")
    judged = [(row, rule) for row in benign + [r for r in harmful if r["truth"] is not None] for rule in rules]
    baselines = {(f, seed): work.dump(baseline_spec(f, seed, plan))
                 for f in BENIGN_FAMILIES for seed in plan.seeds}
    variants = {GRADIENTS_ONLY: ("gradients-only", gradients_only), NOT_RECORDED: ("unrecorded", formats_unrecorded)}
    baselines_of = {rule: {key: strip(dump, work.folder / name) for key, dump in baselines.items()}
                    for rule, (name, strip) in variants.items() if rule in rules}
    pairs = [(baselines_of.get(rule, baselines)[row["family"], row["seed"]],
              work.dump(row["spec"]), rule, row["spec"].noise) for row, rule in judged]
    for (row, rule), verdict in zip(judged, verdicts(pairs, jobs)):
        if "truth" in row:
            verdict["outcome"] = outcome(row["truth"], verdict["step"])
            if row["culprits"] is not None:
                verdict["culprit_in_top3"] = bool(set(verdict["culprits"][:3]) & set(row["culprits"]))
                verdict["culprit_or_feeding_in_top3"] = bool(set(verdict["culprits"][:3])
                                                             & set(row["culprits"] + row["feeding"]))
        verdict["culprits"] = verdict["culprits"][:5]
        row["verdicts"][rule] = verdict
    for row in benign + harmful:
        del row["spec"]
    live_path = work.folder / "live.json"
    generated = work.folder / "generate.json"
    result = {"command": " ".join(["benchmarks/divergence_benchmark.py"] + sys.argv[1:]),
              "date": datetime.datetime.now().isoformat(timespec="seconds"), "machine": machine(),
              "package": package_provenance(), "plan": dataclasses.asdict(plan), "rules": rules, "scenarios": [
                  dataclasses.asdict(s) for s in plan.scenario_list()],
              "generate": json.loads(generated.read_text()) if generated.exists() else None,
              "live": json.loads(live_path.read_text()) if live_path.exists() else None,
              "benign": benign, "harmful": harmful}
    result["summary"] = {rule: summarize(result, rule, FAMILIES) for rule in rules}
    result["summary_held_out"] = {rule: summarize(result, rule, HELD_OUT) for rule in rules}
    result["evaluate"] = {"seconds": time.perf_counter() - start, "load_before": load_before,
                          "load_after": os.getloadavg()}
    return result


def merge(result: dict, earlier: dict) -> None:
    """Adds ``earlier``'s verdicts (an evaluation of the same plan and trainings) to ``result`` as more rules, so one
    report holds a rule before and after a change side by side; a rule both judged is named after the earlier
    package's commit, and left out where that name is there already. Refuses evaluations of other rows."""
    keys = ("family", "seed", "noise", "scenario", "variant")
    for kind in ("benign", "harmful"):
        if [[row.get(k) for k in keys] for row in result[kind]] != [[row.get(k) for k in keys] for row in earlier[kind]]:
            raise SystemExit(f"--merge: the {kind} rows differ from this evaluation's (another plan or --quick?)")
    commit = earlier["package"].split(";")[0].split(", not from")[0].split(" at ")[-1].split(",")[0]
    names = {rule: f"{rule} at {commit}" if rule in result["rules"] else rule for rule in earlier["rules"]}
    names = {rule: name for rule, name in names.items() if name not in result["rules"]}
    for kind in ("benign", "harmful"):
        for row, before in zip(result[kind], earlier[kind]):
            row["verdicts"].update({names[rule]: verdict for rule, verdict in before["verdicts"].items()
                                    if rule in names})
    result["rules"] += list(names.values())
    result["package"] += "; merged: " + ", ".join(f"`{name}` by {earlier['package']}" for name in names.values())
    for summary, families in (("summary", FAMILIES), ("summary_held_out", HELD_OUT)):
        result[summary].update({name: summarize(result, name, families) for name in names.values()})


def rate(rows: list[dict], rule: str, key: str = "outcome", wanted="exact") -> list[int]:
    judged = [r for r in rows if r["truth"] is not None]
    return [sum(r["verdicts"][rule][key] == wanted for r in judged), len(judged)]


def noted(rows: list[dict], rule: str, sixteen_bit: str | None = None) -> list[int]:
    """How many of ``rows`` the rule's verdict says differ beyond float32 rounding in their first steps (and, given
    ``sixteen_bit``, with that run's gradients in a 16-bit format)."""
    return [sum(r["verdicts"][rule].get("first_steps") is not None
                and (sixteen_bit is None or r["verdicts"][rule].get("first_steps_sixteen_bit") == sixteen_bit)
                for r in rows), len(rows)]


def exponent_evidence(harmful: list[dict], benign: list[dict], rule: str) -> dict | None:
    """How the exponent shift's first move (``compare/exponent_shift.py``: the model's share at zero, the same for
    every rule) fares on its own, as a verdict would: None where the dumps hold no exponent counts."""
    if not any(r["verdicts"][rule].get("exponents_compared") for r in harmful + benign):
        return None
    moves = [(r, r["verdicts"][rule].get("exponent_move")) for r in harmful]
    benign_steps = [r["verdicts"][rule].get("exponent_move") for r in benign]
    return {"benign_moves": [sum(s is not None for s in benign_steps), len(benign)],
            "benign_move_steps": [s for s in benign_steps if s is not None],
            **{kind: [sum(outcome(r["truth"], step) == kind for r, step in moves), len(moves)]
               for kind in ("exact", "early", "late", "missed")},
            "exact_where_verdict_not": [sum(outcome(r["truth"], step) == "exact" for r, step in moves
                                            if r["verdicts"][rule]["outcome"] != "exact"),
                                        sum(r["verdicts"][rule]["outcome"] != "exact" for r, _ in moves)],
            "exact_by_scenario": {name: [sum(outcome(r["truth"], step) == "exact" for r, step in moves
                                             if r["scenario"] == name),
                                         sum(r["scenario"] == name for r, _ in moves)]
                                  for name in dict.fromkeys(r["scenario"] for r, _ in moves)}}


def summarize(result: dict, rule: str, families) -> dict:
    """The rule's figures on ``families``' harmful cases and benign pairs (``elsewhere``: ELSEWHERE's benign pairs,
    for the in-sample families only)."""
    harmful = [r for r in result["harmful"] if r["truth"] is not None and r["family"] in families]
    judged = [(r, r["verdicts"][rule]) for r in harmful]
    benign_rows = [r for r in result["benign"] if r["family"] in families]
    benign = [r["verdicts"][rule]["step"] for r in benign_rows]
    elsewhere = [r["verdicts"][rule]["step"] for r in result["benign"]
                 if r["family"] in ELSEWHERE and families is FAMILIES]
    elsewhere_rows = [r for r in result["benign"] if r["family"] in ELSEWHERE and families is FAMILIES]
    graded = [r for r in benign_rows + elsewhere_rows if r["verdicts"][rule]["step"] is not None]
    off = {kind: [abs(v["step"] - r["truth"]) for r, v in judged if v["outcome"] == kind] for kind in ("early", "late")}
    live_rows = [r for r in (result["live"] or {}).get("rows", []) if r["rule"] == rule]
    latencies = [r["latency_ms"] for r in live_rows if "latency_ms" in r]
    return {
        "exact": rate(harmful, rule),
        "exact_as_break": [sum(v["outcome"] == "exact" and v.get("grade") == "break" for _, v in judged),
                           len(judged)],
        "graded": any(v.get("grade") for _, v in judged),  # the rule grades its verdicts (none did before)
        "benign_pairs": len(benign_rows) + len(elsewhere),
        "benign_breaks": sum(r["verdicts"][rule].get("grade") == "break" for r in graded),
        "benign_departures": sum(r["verdicts"][rule].get("grade") == "departure" for r in graded),
        "benign_threads_alarms": [sum(r["verdicts"][rule]["step"] is not None for r in benign_rows
                                      if r["noise"] == "threads"),
                                  sum(r["noise"] == "threads" for r in benign_rows)],
        "exact_by_variant": {v: rate([r for r in harmful if r["variant"] == v], rule) for v in VARIANTS},
        "exact_by_category": {c: rate([r for r in harmful if r["category"] == c], rule)
                              for c in dict.fromkeys(s.category for s in SCENARIOS)},
        "exact_magnitude_bugs": rate([r for r in harmful if r["magnitude"]], rule),
        "exact_effect_beyond_pair": rate([r for r in harmful if r["effect"] > r["pair_difference"]], rule),
        "exact_effect_within_pair": rate([r for r in harmful if r["effect"] <= r["pair_difference"]], rule),
        "early": len(off["early"]), "steps_early": off["early"], "late": len(off["late"]), "steps_late": off["late"],
        "missed": sum(v["outcome"] == "missed" for _, v in judged),
        "culprit_in_top3": rate([r for r in harmful if r["culprits"] is not None], rule, "culprit_in_top3", True),
        "culprit_or_feeding_in_top3": rate([r for r in harmful if r["culprits"] is not None], rule,
                                           "culprit_or_feeding_in_top3", True),
        "first_steps_noted": {  # the verdict says the first steps differ beyond float32 rounding
            "from_step_0_not_exact": noted([r for r, v in judged if r["variant"] == "from step 0"
                                            and v["outcome"] != "exact"], rule),
            "benign_bf16": noted([r for r in result["benign"] if r["noise"] == "bf16"], rule),
            "benign_bf16_sixteen_bit": noted([r for r in result["benign"] if r["noise"] == "bf16"], rule, "B"),
            "benign_finer": noted([r for r in result["benign"] if r["noise"] != "bf16"], rule)},
        "benign_false_alarms": [sum(step is not None for step in benign), len(benign)],
        "benign_alarm_steps": [step for step in benign if step is not None],
        "elsewhere_false_alarms": [sum(step is not None for step in elsewhere), len(elsewhere)],
        "elsewhere_alarm_steps": [step for step in elsewhere if step is not None],
        "live_equal_to_compare": [sum(r["live_step"] == r["compare_step"] and "error" not in r for r in live_rows),
                                  len(live_rows)],
        "live_latency_ms": [statistics.median(latencies), max(latencies)] if latencies else None,
        "live_steps_meanwhile_max": max((r["steps_meanwhile"] for r in live_rows if "steps_meanwhile" in r),
                                        default=None),
        "exponents": exponent_evidence(harmful, benign_rows + elsewhere_rows, rule),
    }


# ---- the report


def fraction(pair: list[int]) -> str:
    hit, total = pair
    return f"{hit}/{total} ({100 * hit / total:.0f}%)" if total else "n/a"


def alarms(count: list[int], steps: list[int]) -> str:
    return f"{count[0]}/{count[1]}" + (f" ({', '.join(map(str, steps))})" if steps else "")


def steps_off(values: list[int]) -> str:
    return f"{len(values)} (by {statistics.median(values):g} median, {max(values)} at most)" if values else "0"


def table(header: list[str], rows: list[list]) -> list[str]:
    return (["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            + ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows] + [""])


def summary_rows(summary: dict, rules: list[str], live_result: dict | None) -> list[list]:
    """The summary table's rows, one column per rule."""
    rows = [["harmful cases named at the exact step"] + [fraction(summary[r]["exact"]) for r in rules],
            ["... as a *break* (beyond anything rounding can do)"] + [
                fraction(summary[r]["exact_as_break"]) if summary[r].get("graded") else "n/a (not graded)"
                for r in rules]]
    rows += [[f"... {v}"] + [fraction(summary[r]["exact_by_variant"][v]) for r in rules] for v in VARIANTS]
    rows += [["... magnitude-only bugs (signs intact at their step)"]
             + [fraction(summary[r]["exact_magnitude_bugs"]) for r in rules],
             ["... whose effect exceeds the pair's own difference at their step (issue 47's decision 1)"]
             + [fraction(summary[r]["exact_effect_beyond_pair"]) for r in rules],
             ["... whose effect is within it (not counted against the exact-step line)"]
             + [fraction(summary[r]["exact_effect_within_pair"]) for r in rules],
             ["early (steps early)"] + [steps_off(summary[r]["steps_early"]) for r in rules],
             ["late (steps late)"] + [steps_off(summary[r]["steps_late"]) for r in rules],
             ["missed (never suspicious)"] + [summary[r]["missed"] for r in rules],
             ["culprit in the top 3, localized bugs"] + [fraction(summary[r]["culprit_in_top3"]) for r in rules],
             ["... or the layer feeding it (forward-pass bugs show there first)"]
             + [fraction(summary[r]["culprit_or_feeding_in_top3"]) for r in rules],
             ["benign pairs with a false alarm (at steps)"] + [
                 alarms(summary[r]["benign_false_alarms"], summary[r]["benign_alarm_steps"]) for r in rules]]
    if any(summary[r]["elsewhere_false_alarms"][1] for r in rules):
        rows += [[f"... out of sample ({', '.join(ELSEWHERE)}: benign pairs only)"] + [
            alarms(summary[r]["elsewhere_false_alarms"], summary[r]["elsewhere_alarm_steps"]) for r in rules]]
    noted_rows = [("... from step 0, not named at the exact step", "from_step_0_not_exact"),
                  ("... benign pairs finer than bfloat16 (float64, one ulp)", "benign_finer"),
                  ("... benign pairs under bfloat16 autocast", "benign_bf16"),
                  ("... ... naming the autocast run as computing in a 16-bit format", "benign_bf16_sixteen_bit")]
    rows += [["verdict says the first steps differ beyond float32 rounding (`first_steps`)"] + [""] * len(rules)]
    rows += [[label] + [fraction(summary[r]["first_steps_noted"][key]) if r not in ("msprobe", PRECISION_GIVEN)
                        else "n/a" for r in rules] for label, key in noted_rows]
    if live_result:
        rows += [["live verdict equal to compare's"] + [fraction(summary[r]["live_equal_to_compare"]) for r in rules],
                 ["live callback after the suspicious step's end (median, max)"] + [
                     "n/a" if summary[r]["live_latency_ms"] is None else
                     f"{summary[r]['live_latency_ms'][0]:.0f} ms, {summary[r]['live_latency_ms'][1]:.0f} ms; at most "
                     f"{summary[r]['live_steps_meanwhile_max']} step(s) run meanwhile" for r in rules]]
    def graded(rule: str, key: str) -> str:
        alarms = summary[rule]["benign_false_alarms"][0] + summary[rule]["elsewhere_false_alarms"][0]
        if summary[rule]["benign_breaks"] + summary[rule]["benign_departures"] < alarms:
            return f"n/a ({alarms} ungraded alarms)"
        return f"{summary[rule][key]}/{summary[rule]['benign_pairs']}"

    if any(summary[r].get("exponents") for r in rules):
        def evidence(rule: str, key: str) -> str:
            found = summary[rule].get("exponents")
            return "n/a" if not found else alarms(found[key], found["benign_move_steps"]) if key == "benign_moves" \
                else fraction(found[key])
        rows += [["exponent shift moved (`compare`; from 7839ed2 the model's share at zero, before it 1% at zero or "
                  "half a binade in any parameter): benign pairs with a move (at steps)"]
                 + [evidence(r, "benign_moves") for r in rules]] + [
            [f"... harmful cases, the first move {label}"] + [evidence(r, key) for r in rules]
            for key, label in (("exact", "at the exact step"), ("early", "early"), ("late", "late"),
                               ("missed", "never"), ("exact_where_verdict_not",
                                                     "at the exact step where the verdict was not"))]
    rows += [["benign pairs with a *break*"] + [graded(r, "benign_breaks") for r in rules],
             ["benign pairs with a *departure*"] + [graded(r, "benign_departures") for r in rules],
             ["... float32 on 2 threads against 1: pairs with an alarm"] + [
                 alarms(summary[r]["benign_threads_alarms"], []) for r in rules]]
    return rows


def markdown(result: dict) -> str:
    rules, summary, plan = result["rules"], result["summary"], result["plan"]
    generated, live_result = result["generate"] or {}, result["live"]
    valid = [r for r in result["harmful"] if r["truth"] is not None]
    invalid = [r for r in result["harmful"] if r["truth"] is None]
    lines = ["# Divergence benchmark: does the verdict name the step where two trainings part?", "",
             f"Produced by `{result['command']}` on {result['date']}; {result['machine']}; {result['package']}. "
             f"Design and scenarios: "
             f"`benchmarks/divergence_benchmark.py`'s docstring (issue 24, item 7). Rules: "
             + ", ".join(f"`{r}`" for r in rules) + " (each judged the same dumps).", "",
             f"Runs: {generated.get('runs', '?')} trainings ({generated.get('steps_all_runs', '?')} steps, "
             f"{generated.get('training_seconds_all_runs', 0) / 60:.1f} min of training in all; families "
             f"{', '.join(FAMILIES)}, held out {', '.join(HELD_OUT)} (and {', '.join(ELSEWHERE)} for benign pairs "
             f"only), seeds {plan['seeds']}; "
             f"benign pairs {plan['benign_steps']} steps, harmful "
             f"scenarios {plan['harmful_steps']} steps with the bug from step {plan['bug_step']} or 0); "
             f"{len(result['benign'])} benign pairs, {len(result['harmful'])} harmful cases of which "
             f"{len(invalid)} invalid (their gradients never differ from the clean run's). Evaluation took "
             f"{result['evaluate']['seconds']:.0f} s; load average (1, 5, 15 min) before and after: generate "
             f"{load(generated.get('load_before'))} -> {load(generated.get('load_after'))}, evaluate "
             f"{load(result['evaluate']['load_before'])} -> {load(result['evaluate']['load_after'])} (2 CPUs shared "
             f"with other work: durations are indicative).", "",
             "The truth is the first step at which the bug run's recorded gradients (summary CSV bytes, direction "
             "bits) differ from those of the clean run with the same noise; *exact*: the rule's first suspicious "
             "step is that step; *early* includes alarms raised by the noise alone.", "",
             f"## Summary: in sample ({', '.join(FAMILIES)}; out of sample benign pairs: {', '.join(ELSEWHERE)})", ""]
    lines += table(["metric"] + [f"rule `{r}`" for r in rules], summary_rows(summary, rules, live_result))
    lines += [f"## Summary: held out ({', '.join(HELD_OUT)}; never tuned on: the first four declared before the "
              f"rule's grades and its bit-for-bit test changed, llama and cnn1d-gn at stop 55)", ""]
    lines += table(["metric"] + [f"rule `{r}`" for r in rules],
                   summary_rows(result["summary_held_out"], rules, None))
    lines += ["## Exact step by category (in sample)", ""]
    lines += table(["category"] + rules, [[c] + [fraction(summary[r]["exact_by_category"][c]) for r in rules]
                                          for c in summary[rules[0]]["exact_by_category"]])
    lines += ["## Benign pairs (first suspicious step; none: no alarm)", ""]
    lines += table(["family", "seed", "noise", "steps"] + rules,
                   [[r["family"], r["seed"], r["noise"], r["steps"]]
                    + [describe_verdict(r["verdicts"][rule]) for rule in rules] for r in result["benign"]])
    lines += ["## Harmful scenarios: exact step, per variant (seeds together)", ""]
    header, rows = ["scenario", "category", "family", "culprits"], []
    for variant in VARIANTS:
        header += [f"{variant}: {rule}" for rule in rules]
    for scenario in result["scenarios"]:
        for family in HARMFUL_FAMILIES:
            of = [r for r in valid if r["scenario"] == scenario["name"] and r["family"] == family]
            if not of and not any(r["scenario"] == scenario["name"] for r in invalid):
                continue
            row = [scenario["name"] + (" (magnitude)" if scenario["magnitude"] else ""), scenario["category"],
                   family, ", ".join(of[0]["culprits"]) if of and of[0]["culprits"] else "not localized"]
            for variant in VARIANTS:
                in_variant = [r for r in of if r["variant"] == variant]
                row += [fraction(rate(in_variant, rule)).split(" ")[0] for rule in rules]
            rows.append(row)
    lines += table(header, rows)
    missed = [r for r in valid if any(r["verdicts"][rule]["outcome"] != "exact" for rule in rules)]
    lines += ["## Cases some rule did not name at the exact step", "",
              "Truth: the first step the gradients differ; each rule's first suspicious step and its first culprits.",
              ""]
    lines += table(["scenario", "family", "seed", "variant (noise)", "truth"] + rules,
                   [[r["scenario"], r["family"], r["seed"], f"{r['variant']} ({r['noise']})", r["truth"]]
                    + [describe_verdict(r["verdicts"][rule]) for rule in rules] for r in missed])
    if invalid:
        lines += ["## Invalid cases (gradients identical to the clean run's at every step: not counted)", ""]
        lines += table(["scenario", "family", "seed", "variant (noise)"],
                       [[r["scenario"], r["family"], r["seed"], f"{r['variant']} ({r['noise']})"] for r in invalid])
    differs = [r for r in result["harmful"] if r["truth"] != r["exact_truth"]]
    if differs:
        lines += ["## Cases whose exact gradients differ before the recorded ones", ""]
        lines += table(["scenario", "family", "seed", "variant", "recorded", "exact"],
                       [[r["scenario"], r["family"], r["seed"], r["variant"], r["truth"], r["exact_truth"]]
                        for r in differs])
    if live_result:
        lines += ["## Live verdict (`baseline=`, on-noise variant, first seed)", "",
                  f"Run on {live_result['date']}: each on-noise case trained again with `baseline=` (the float32 "
                  f"baseline dump) and an `on_suspicious` callback, "
                  + ("once per rule (`rule=` given to the monitor)" if live_result["rule_passed_to_monitor"] else
                     "with the monitor's only rule, msprobe's")
                  + f"; {live_result['seconds']:.0f} s in all. *Compare step*: `compare_dumps` on the same two "
                  f"dumps with the same rule. *Latency*: the callback's time minus the end of the suspicious step's "
                  f"`optimizer.step()`; *steps meanwhile*: steps that ended in between (a verdict at step 0 comes "
                  f"while the comparison process is still starting).", ""]
        lines += table(["scenario", "family", "rule", "live step", "compare step", "equal", "latency ms",
                        "steps meanwhile", "same gradients as generate"],
                       [[r["scenario"], r["family"], r["rule"], r["live_step"], r["compare_step"],
                         r["live_step"] == r["compare_step"], f"{r['latency_ms']:.0f}" if "latency_ms" in r else "-",
                         r.get("steps_meanwhile", "-"), r["same_gradients_as_generated"]]
                        for r in live_result["rows"]])
    lines += ["Reproduce: `benchmarks/run-divergence` (generate, live, evaluate; the dumps stay in "
              "`/tmp/divergence`, so a second run only evaluates and reruns the live verdicts); "
              "`benchmarks/run-divergence evaluate` judges the cached dumps again.", ""]
    return "\n".join(lines)


def load(averages) -> str:
    return "?" if averages is None else "/".join(f"{a:.1f}" for a in averages)


def describe_verdict(verdict: dict) -> str:
    if verdict["step"] is None:
        return "none"
    shown = [name.removeprefix("transformer.") for name in verdict["culprits"][:3]]
    return f"{verdict['step']}" + (f" ({', '.join(shown)})" if shown else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("phase", nargs="?", default="all", choices=("generate", "live", "evaluate", "all", "report"))
    parser.add_argument("--work", type=Path, default=Path("/tmp/divergence"), help="where the dumps are cached")
    parser.add_argument("--quick", action="store_true", help="1 seed, 3 scenarios, few steps: a dry run; results "
                        "go into --work, not benchmarks/results")
    parser.add_argument("--note-work", type=Path, help="write the work folder's path into this file once the "
                        "first GPT-2 seed's dumps are complete")
    parser.add_argument("--rules", help="comma-separated rules to judge with (default: every rule compare_dumps "
                        "offers, its default first)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count(), help="evaluate's comparison processes")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--merge", type=Path, nargs="+", metavar="JSON", help="earlier evaluations of the same "
                        "trainings (say, by another checkout's package: PYTHONPATH=/that/checkout ... evaluate --out "
                        "DIR): their rules become columns beside this run's, a rule judged already as '<rule> at "
                        "<commit>', one judged already at the same commit left out")
    args = parser.parse_args()
    torch.set_num_threads(1)  # the same bits in every process: the runs are compared bit for bit
    logging.getLogger("msprobe_mlflow").setLevel(logging.ERROR)  # the live verdict's warning, at every live run
    plan = QUICK if args.quick else Plan()
    rules = compare_rules()
    if args.rules:
        unknown = set(args.rules.split(",")) - set(rules)
        if unknown:
            parser.error(f"--rules {args.rules}: {', '.join(sorted(unknown))} not offered by compare_dumps here; "
                         f"it offers {', '.join(rules)}")
        rules = [r for r in rules if r in args.rules.split(",")]
    work = Work(args.work / "quick" if args.quick else args.work)
    work.folder.mkdir(parents=True, exist_ok=True)
    if args.phase in ("generate", "all"):
        generate(work, plan, args.note_work)
    if args.phase in ("live", "all"):
        live(work, plan, rules)
    if args.phase in ("evaluate", "all", "report"):
        if args.phase == "report":  # the last evaluation's verdicts again, summed up by this script's code
            result = json.loads(((work.folder if args.quick else args.out) / "divergence.json").read_text())
            result["summary"] = {rule: summarize(result, rule, FAMILIES) for rule in result["rules"]}
            result["summary_held_out"] = {rule: summarize(result, rule, HELD_OUT) for rule in result["rules"]}
        else:
            result = evaluate(work, plan, rules, args.jobs)
        for earlier in args.merge or ():
            merge(result, json.loads(earlier.read_text()))
        out = work.folder if args.quick else args.out
        out.mkdir(parents=True, exist_ok=True)
        (out / "divergence.json").write_text(json.dumps(result, indent=1))
        (out / "divergence.md").write_text(markdown(result))
        print(markdown(result))
        progress(f"wrote {out / 'divergence.json'} and {out / 'divergence.md'}")


if __name__ == "__main__":
    main()
