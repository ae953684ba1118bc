"""From a step to the operator: two trainings of a small transformer block, the second on a "device" whose GELU
kernel is 1% off from step 3 on (a kernel bug: both runs call the same operators, one result is wrong). Both are
traced at step 3, as ``MSPROBE_MLFLOW_TRACE_STEPS=3 python train.py`` would, then ``msprobe-mlflow locate`` names
the operator.

    python examples/locate_demo.py [--step 3] [--output ./locate_demo]
"""
from __future__ import annotations

import argparse
import subprocess
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from msprobe_mlflow.config import GradProbeConfig
from msprobe_mlflow.pytorch import GradientMonitor


class FaultyGelu(TorchDispatchMode):
    """The faulty device: from ``start_step`` on, every GELU result is 1% too large."""

    def __init__(self):
        super().__init__()
        self.on = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        output = func(*args, **(kwargs or {}))
        return output * 1.01 if self.on and func is torch.ops.aten.gelu.default else output


def train(dump_path: str, step_traced: int, fault: FaultyGelu | None = None, steps: int = 5) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.LayerNorm(64), torch.nn.GELU(),
                                torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    data = torch.randn(steps, 32, 16, generator=torch.Generator().manual_seed(1))
    monitor = GradientMonitor(GradProbeConfig(dump_path=dump_path, level="L1"), log_to_mlflow=False,
                              trace_steps=[step_traced], silent=True)
    with monitor.monitor(model, optimizer):
        for step in range(steps):
            if fault is not None:
                fault.on = step >= step_traced
            optimizer.zero_grad()
            model(data[step]).pow(2).mean().backward()
            optimizer.step()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--step", type=int, default=3)
    parser.add_argument("--output", default="./locate_demo")
    args = parser.parse_args()
    train(f"{args.output}/gpu", args.step)
    with FaultyGelu() as fault:
        train(f"{args.output}/npu", args.step, fault)
    command = ["msprobe-mlflow", "locate", f"{args.output}/gpu", f"{args.output}/npu", "--step", str(args.step)]
    print("$", " ".join(command), flush=True)
    return subprocess.run([sys.executable, "-m", "msprobe_mlflow", *command[1:]]).returncode


if __name__ == "__main__":
    sys.exit(main())
