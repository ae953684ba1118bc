"""A PyTorch training whose process ends the way a test asks; started by tests/test_rank_lifecycle.py, alone or
under torchrun. Prints ``RUN_ID <id>`` (rank 0's) once its run exists.

``raise-uncaught``: ``mlflow.start_run()`` without a ``with`` block, the training raises at step 2 and nothing
catches it. ``raise-in-monitor-block``: the training raises inside ``with GradientMonitor(...)``, inside ``with
mlflow.start_run()``. ``raise-with-finally``: ``monitor.stop()`` in a ``finally:`` block, the run not in a ``with``.
``autolog-every-rank``: under torchrun, ``msprobe_mlflow.autolog()`` and every rank runs the README's snippet
(``with mlflow.start_run():``), a 2-step DDP training that ends normally. ``wait-to-be-killed``: 3 steps, then
``TRAINED`` once they are in the dump and the run, and the process waits (for the SIGKILL the test sends).
"""
from __future__ import annotations

import sys

import mlflow
import torch

import msprobe_mlflow
from msprobe_mlflow import GradProbeConfig
from msprobe_mlflow.pytorch import GradientMonitor
from tiny_models import gaussian, mlp, total, train

FAIL_AT = 2


def train_steps(model, optimizer, steps: int, fail_at: int | None = None) -> None:
    """``steps`` training steps; the step ``fail_at``, if any, raises before it starts."""
    def fail(step, *_):
        if step == fail_at:
            raise RuntimeError(f"training fails at step {step} on purpose")

    train(model, steps, optimizer=optimizer, data=gaussian(16, 8), loss=total, seed=0, before_step=fail)


def main(mode: str, dump: str) -> None:
    model = mlp(8, 16, 4)
    config = GradProbeConfig(dump_path=dump, level="L1")
    if mode == "autolog-every-rank":
        import torch.distributed as dist

        dist.init_process_group("gloo")
        model = torch.nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        msprobe_mlflow.autolog(config)
        with mlflow.start_run() as run:  # the README's snippet, copied onto every rank
            train_steps(model, optimizer, 2)
            if dist.get_rank() == 0:
                print("RUN_ID", run.info.run_id, flush=True)
        dist.destroy_process_group()
        return
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    if mode == "raise-in-monitor-block":
        with mlflow.start_run() as run:
            print("RUN_ID", run.info.run_id, flush=True)
            with GradientMonitor(config).monitor(model, optimizer):
                train_steps(model, optimizer, 4, FAIL_AT)
        return
    run = mlflow.start_run()
    print("RUN_ID", run.info.run_id, flush=True)
    monitor = GradientMonitor(config).monitor(model, optimizer)
    if mode == "raise-uncaught":
        train_steps(model, optimizer, 4, FAIL_AT)
    elif mode == "wait-to-be-killed":
        train_steps(model, optimizer, 3)
        monitor.flush()
        print("TRAINED", flush=True)
        sys.stdin.read()  # the test never writes: this process ends by its SIGKILL
    elif mode == "raise-with-finally":
        try:
            train_steps(model, optimizer, 4, FAIL_AT)
        finally:
            monitor.stop()
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main(*sys.argv[1:])
