"""Trains a small MindSpore MLP twice, in PyNative mode and in GRAPH_MODE, with the gradient monitor logging into
MLflow (an SQLite store in the output folder): two runs with the same metrics and the same ``grad_probe/``
artifacts as a PyTorch run.

PyNative needs nothing but ``monitor(optimizer)``. In GRAPH_MODE the optimizer runs inside the compiled
``TrainOneStepCell``, so the loop adds one line after each train step: ``monitor.collect()``.

    python examples/mindspore_monitor.py [--output DIR] [--steps 6] [--level L2]
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import mindspore as ms
import mlflow
import numpy as np
from mindspore import Tensor, nn, ops

from msprobe_mlflow.config import GradProbeConfig
from msprobe_mlflow.mindspore import GradientMonitor

EXPERIMENT = "msprobe-mlflow-mindspore-example"
MODES = {"pynative": ms.PYNATIVE_MODE, "graph": ms.GRAPH_MODE}


class MLP(nn.Cell):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Dense(16, 32)
        self.fc2 = nn.Dense(32, 1)

    def construct(self, x):
        return self.fc2(ops.relu(self.fc1(x)))


def batches(steps: int, batch_size: int = 32):
    rng = np.random.default_rng(0)
    for _ in range(steps):
        x = rng.standard_normal((batch_size, 16)).astype(np.float32)
        y = (x[:, :4].sum(axis=1, keepdims=True) > 0).astype(np.float32)
        yield Tensor(x), Tensor(y)


def train(mode: str, steps: int, level: str, dump_path: Path) -> str:
    """One training in ``mode`` inside an MLflow run; returns the run ID."""
    ms.set_context(mode=MODES[mode])
    ms.set_seed(0)
    net = MLP()
    optimizer = nn.Adam(net.trainable_params(), learning_rate=0.01)
    loss_fn = nn.BCEWithLogitsLoss()
    with mlflow.start_run(run_name=f"mindspore-{mode}") as run:
        monitor = GradientMonitor(GradProbeConfig(dump_path=str(dump_path), level=level)).monitor(optimizer)
        if mode == "pynative":
            def forward(x, y):
                return loss_fn(net(x), y)

            grad_fn = ms.value_and_grad(forward, None, optimizer.parameters)
            for step, (x, y) in enumerate(batches(steps)):
                loss, grads = grad_fn(x, y)
                optimizer(grads)  # probed here: nothing else to add
                mlflow.log_metric("loss", float(loss.asnumpy()), step=step)
        else:
            train_one_step = nn.TrainOneStepCell(nn.WithLossCell(net, loss_fn), optimizer)
            for step, (x, y) in enumerate(batches(steps)):
                loss = train_one_step(x, y)
                monitor.collect()  # the one extra line graph mode needs
                mlflow.log_metric("loss", float(loss.asnumpy()), step=step)
        monitor.stop()
    return run.info.run_id


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, default=None,
                        help="folder for the SQLite store (mlflow.db), its artifacts and the local dumps "
                             "(default: a new temporary folder), e.g. --output mindspore_example")
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per training (default 6)")
    parser.add_argument("--level", default="L2", choices=["L0", "L1", "L2"], help="probe level (default L2)")
    args = parser.parse_args(argv)
    output = (args.output or Path(tempfile.mkdtemp(prefix="msprobe-mlflow-mindspore-"))).resolve()
    output.mkdir(parents=True, exist_ok=True)

    tracking_uri = f"sqlite:///{output / 'mlflow.db'}"
    mlflow.set_tracking_uri(tracking_uri)
    if mlflow.get_experiment_by_name(EXPERIMENT) is None:  # artifacts beside the store, not in the current folder
        mlflow.create_experiment(EXPERIMENT, artifact_location=(output / "artifacts").as_uri())
    mlflow.set_experiment(EXPERIMENT)
    for mode in MODES:
        run_id = train(mode, args.steps, args.level, output / "dumps" / mode)
        print(f"{mode:9} run {run_id}   local dump {output / 'dumps' / mode}")
    print(f"\nOpen the runs in the MLflow UI:\n  mlflow ui --backend-store-uri {tracking_uri}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
