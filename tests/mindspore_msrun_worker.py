"""One worker of a 2-worker MindSpore job (``msrun``, the CPU's ``mccl`` backend) monitored into one MLflow run;
started by tests/test_mindspore_msrun.py.

Rank 0 starts the run and prints ``RUN_ID <id>``; every rank calls ``monitor()`` and so logs into rank 0's run.
The job trains data-parallel (gradients averaged over the ranks), so both ranks see the same gradients.
``--late-rank 1`` makes rank 1 hang after training, without finishing its monitoring, until rank 0 has tagged
the run with the ranks that did not finish (the ranks then train without the all-reduce). A rank cannot simply
die here: MindSpore's scheduler then stops the whole job about half a minute later, the survivor included.
"""
from __future__ import annotations

import argparse
import time

import mlflow
import numpy as np
import mindspore as ms
from mindspore import Tensor, nn
from mindspore.communication import get_rank, init
from mlflow.tracking import MlflowClient

from msprobe_mlflow import GradProbeConfig
from msprobe_mlflow.mindspore import GradientMonitor

MODES = {"pynative": ms.PYNATIVE_MODE, "graph": ms.GRAPH_MODE}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dump", required=True)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--level", default="L2")
    parser.add_argument("--mode", choices=list(MODES), default="graph")
    parser.add_argument("--late-rank", type=int, default=None)
    args = parser.parse_args()

    ms.set_context(mode=MODES[args.mode])
    init()
    rank = get_rank()
    if args.late_rank is None:
        ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True)
    ms.set_seed(0)
    net = nn.SequentialCell(nn.Dense(8, 16), nn.Tanh(), nn.Dense(16, 4))
    optimizer = nn.SGD(net.trainable_params(), learning_rate=0.05)
    run = mlflow.start_run(run_name="msrun") if rank == 0 else None
    config = GradProbeConfig(dump_path=args.dump, level=args.level)
    monitor = GradientMonitor(config).monitor(optimizer)
    if rank == 0:
        print("RUN_ID", run.info.run_id, flush=True)
    train_step = nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()), optimizer)
    generator = np.random.default_rng(100 + rank)
    for _ in range(args.steps):
        train_step(Tensor(generator.standard_normal((16, 8), np.float32)), Tensor(np.ones((16, 4), np.float32)))
        monitor.collect()  # the optimizer runs inside the compiled step: graph mode needs it
    if rank == args.late_rank:
        wait_until_tagged_missing(monitor.run_id)
    monitor.stop()
    if run is not None:
        mlflow.end_run()


def wait_until_tagged_missing(run_id: str) -> None:
    deadline = time.monotonic() + 300
    while "msprobe_mlflow.missing_ranks" not in MlflowClient().get_run(run_id).data.tags:
        if time.monotonic() > deadline:
            raise SystemExit("rank 0 never tagged the run with its missing ranks")
        time.sleep(0.2)


if __name__ == "__main__":
    main()
