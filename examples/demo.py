"""The whole story on the embedded SQLite MLflow store: two trainings under ``msprobe_mlflow.autolog()`` (a
baseline, and a copy that goes wrong from a chosen step), then the comparison that names that step.

The perturbed run stands for an NPU-vs-GPU accuracy gap that starts mid-training: from ``--perturb-from`` on, its
data loader yields differently ordered batches (a sampler seeded by mistake), so gradient directions part ways.

    python examples/demo.py [--steps 8] [--perturb-from 4] [--level L2] [--tracking-uri sqlite:///mlflow.db]
"""
from __future__ import annotations

import argparse
import os
import sys

import mlflow
import torch
from mlflow.tracking import MlflowClient

import msprobe_mlflow
from msprobe_mlflow.tracking.experiments import experiment_id_for, run_page_url

EXPERIMENT = "msprobe-mlflow-demo"


def make_data(samples: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(samples, 32, generator=generator)
    y = (x[:, :4].sum(dim=1, keepdim=True) > 0).float()
    return x, y


def train(run_name: str, steps: int, perturb_from: int | None, batch_size: int = 32) -> str:
    """Trains a small MLP inside an MLflow run; autolog does the probing. Returns the run ID."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = make_data()
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(1))
    wrong_order = torch.randperm(len(x), generator=torch.Generator().manual_seed(2))
    with mlflow.start_run(run_name=run_name) as run:
        mlflow.log_params({"steps": steps, "perturb_from": perturb_from, "batch_size": batch_size})
        for step in range(steps):
            indices = wrong_order if perturb_from is not None and step >= perturb_from else order
            batch = indices[(step * batch_size) % len(x):][:batch_size]
            optimizer.zero_grad()
            loss = torch.nn.functional.binary_cross_entropy_with_logits(model(x[batch]), y[batch])
            loss.backward()
            optimizer.step()
            mlflow.log_metric("loss", loss.item(), step=step)
    return run.info.run_id


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps per training (default 8)")
    parser.add_argument("--perturb-from", type=int, default=4, help="first step of the perturbed run to go wrong")
    parser.add_argument("--level", default="L2", choices=["L0", "L1", "L2"], help="probe level (default L2)")
    parser.add_argument("--tracking-uri", default=os.environ.get("MLFLOW_TRACKING_URI", "sqlite:///mlflow.db"),
                        help="MLflow tracking URI (default: the embedded SQLite store sqlite:///mlflow.db)")
    parser.add_argument("--dump-path", default="demo_output/dumps", help="local dumps, one folder per run")
    args = parser.parse_args(argv)
    if not 0 <= args.perturb_from < args.steps:
        parser.error(f"--perturb-from {args.perturb_from} must be a step of the training (0..{args.steps - 1})")

    mlflow.set_tracking_uri(args.tracking_uri)
    experiment_id = experiment_id_for(MlflowClient(), EXPERIMENT)  # created marked as model training
    mlflow.set_experiment(experiment_id=experiment_id)
    msprobe_mlflow.autolog(level=args.level, dump_path=args.dump_path)
    baseline = train("baseline", args.steps, None)
    perturbed = train(f"perturbed from step {args.perturb_from}", args.steps, args.perturb_from)
    msprobe_mlflow.autolog(disable=True)

    result = msprobe_mlflow.compare_runs(baseline, perturbed, run_name=f"compare baseline vs perturbed",
                                         output_dir="demo_output/comparison", progress=False)
    print(f"\nbaseline run  {baseline}   dump {os.path.join(args.dump_path, baseline)}")
    print(f"perturbed run {perturbed}   dump {os.path.join(args.dump_path, perturbed)}")
    print(f"comparison run {result.run_id}   local outputs demo_output/comparison")
    print("\n" + result.verdict.describe())
    found = result.verdict.first_suspicious_step
    print(f"\nfirst suspicious step: {found} (the perturbation started at step {args.perturb_from})")
    store = args.tracking_uri
    print(f"\nOpen the runs in the MLflow UI:\n  mlflow ui --backend-store-uri {store}\n"
          f"then {run_page_url('http://127.0.0.1:5000', experiment_id, result.run_id)}")
    return 0 if found == args.perturb_from else 1


if __name__ == "__main__":
    sys.exit(main())
