"""One rank of a 2-worker MindSpore job (msrun, CPU) with rank-0 aggregated metrics; started by
tests/test_scale_mindspore.py. Every rank logs into the run ``MLFLOW_RUN_ID`` names; rank 0 at ``--tracking-uri``,
rank 1 at a port where no server listens, so its metrics can only reach the run through rank 0's requests."""
from __future__ import annotations

import argparse

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops
from mindspore.communication import get_rank, init

from msprobe_mlflow import GradProbeConfig
from msprobe_mlflow.mindspore import GradientMonitor

NO_SERVER = "http://127.0.0.1:9"


class MLP(nn.Cell):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Dense(4, 8)
        self.fc2 = nn.Dense(8, 2)

    def construct(self, x):
        return self.fc2(ops.relu(self.fc1(x)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dump", required=True)
    parser.add_argument("--tracking-uri", required=True)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    ms.set_context(mode=ms.PYNATIVE_MODE)
    init()
    rank = get_rank()
    ms.set_seed(rank)
    net = MLP()
    optimizer = nn.SGD(net.trainable_params(), learning_rate=0.1)
    monitor = GradientMonitor(GradProbeConfig(dump_path=args.dump, level="L1"),
                              tracking_uri=args.tracking_uri if rank == 0 else NO_SERVER,
                              aggregate_metrics=True).monitor(optimizer)
    loss_fn = nn.MSELoss()
    grad_fn = ms.value_and_grad(lambda x, y: loss_fn(net(x), y), None, optimizer.parameters)
    generator = np.random.default_rng(rank)
    for _ in range(args.steps):
        _, grads = grad_fn(Tensor(generator.standard_normal((6, 4)).astype(np.float32)),
                           Tensor(generator.standard_normal((6, 2)).astype(np.float32)))
        optimizer(grads)
    monitor.stop()
    print(f"RANK {rank} ERRORS {len(monitor.errors)}", monitor.errors, flush=True)


if __name__ == "__main__":
    main()
