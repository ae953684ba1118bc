"""One worker of a 2-worker MindSpore job (``msrun``, the CPU's ``mccl`` backend) monitored into one MLflow run;
started by tests/test_mindspore_msrun.py. Rank 0 prints ``RUN_ID <id>`` at the end.

``--trainer loop``: rank 0 starts the run; every rank runs its own loop over a ``TrainOneStepCell`` with
``GradientMonitor(config).monitor(optimizer)`` and ``collect()``, data-parallel (gradients averaged over the ranks),
so both ranks see the same gradients. ``--trainer model``: ``Model.train`` with ``GradProbeCallback`` on every rank
and no run started by the script: the callback starts it on rank 0. ``--late-rank 1`` (with ``model``) makes rank 1
hang at the end of training, before its monitoring ends, until rank 0 has tagged the run with the ranks that did
not finish. A rank cannot simply die here: MindSpore's scheduler then stops the whole job about half a minute
later, the survivor included.
"""
from __future__ import annotations

import argparse
import time

import mlflow
import numpy as np
import mindspore as ms
from mindspore import Tensor, dataset, nn
from mindspore.communication import get_rank, init
from mindspore.train import Callback, Model
from mlflow.tracking import MlflowClient

from msprobe_mlflow import GradProbeConfig
from msprobe_mlflow.mindspore import GradientMonitor, GradProbeCallback

MODES = {"pynative": ms.PYNATIVE_MODE, "graph": ms.GRAPH_MODE}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dump", required=True)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--level", default="L2")
    parser.add_argument("--mode", choices=list(MODES), default="graph")
    parser.add_argument("--trainer", choices=["loop", "model"], default="loop")
    parser.add_argument("--late-rank", type=int, default=None)
    parser.add_argument("--raise-at", type=int, nargs=2, default=None, metavar=("RANK", "STEP"))
    args = parser.parse_args()

    ms.set_context(mode=MODES[args.mode])
    init()
    if args.late_rank is None:
        ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True)
    ms.set_seed(0)
    net = nn.SequentialCell(nn.Dense(8, 16), nn.Tanh(), nn.Dense(16, 4))
    optimizer = nn.SGD(net.trainable_params(), learning_rate=0.05)
    config = GradProbeConfig(dump_path=args.dump, level=args.level)
    inputs = np.random.default_rng(100 + get_rank()).standard_normal((16 * args.steps, 8)).astype(np.float32)
    labels = np.ones((16 * args.steps, 4), np.float32)
    if args.trainer == "loop":
        run_id = train_in_loop(net, optimizer, config, inputs, labels)
    else:
        callback = GradProbeCallback(config)
        callbacks = [callback] if args.late_rank != get_rank() else [WaitUntilTaggedMissing(callback), callback]
        if args.raise_at is not None and args.raise_at[0] == get_rank():
            callbacks.append(RaiseAtStep(args.raise_at[1]))
        data = dataset.NumpySlicesDataset({"x": inputs, "y": labels}, shuffle=False).batch(16)
        Model(net, loss_fn=nn.MSELoss(), optimizer=optimizer).train(1, data, callbacks=callbacks,
                                                                     dataset_sink_mode=False)
        run_id = callback.monitor.run_id
    if get_rank() == 0:
        print("RUN_ID", run_id, flush=True)


def train_in_loop(net, optimizer, config, inputs, labels) -> str:
    run = mlflow.start_run(run_name="msrun") if get_rank() == 0 else None
    monitor = GradientMonitor(config).monitor(optimizer)
    train_step = nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()), optimizer)
    for start in range(0, len(inputs), 16):
        train_step(Tensor(inputs[start:start + 16]), Tensor(labels[start:start + 16]))
        monitor.collect()  # the optimizer runs inside the compiled step: graph mode needs it
    monitor.stop()
    if run is not None:
        mlflow.end_run()
    return monitor.run_id


class RaiseAtStep(Callback):
    """Training fails on this rank at step ``step`` (0-based), after that step's gradients were probed."""

    def __init__(self, step: int):
        self.step = step

    def on_train_step_end(self, run_context) -> None:
        if run_context.original_args().cur_step_num - 1 == self.step:
            raise RuntimeError(f"training fails at step {self.step} on purpose")


class WaitUntilTaggedMissing(Callback):
    """Holds the end of training (before the probe's callback ends its monitoring) until rank 0 gave up waiting."""

    def __init__(self, probe: GradProbeCallback):
        self.probe = probe

    def on_train_end(self, run_context) -> None:
        deadline = time.monotonic() + 300
        while "msprobe_mlflow.missing_ranks" not in MlflowClient().get_run(self.probe.monitor.run_id).data.tags:
            if time.monotonic() > deadline:
                raise SystemExit("rank 0 never tagged the run with its missing ranks")
            time.sleep(0.2)


if __name__ == "__main__":
    main()
