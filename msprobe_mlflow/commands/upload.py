"""``msprobe-mlflow upload``: send a local gradient dump (ours or msprobe 1.0.3's) into an MLflow run."""
from __future__ import annotations

import argparse

HELP = "upload a gradient dump into an MLflow run (completes a run idempotently, or creates one)"
DESCRIPTION = """\
Uploads a grad_probe dump folder into an MLflow run: per-rank summary metrics for every step,
the grad_summary CSVs and the directions (packed, one archive per rank and step).

Completes a run whose live logging was interrupted (tracking server down): only what the run
lacks is sent, so running it twice adds nothing. Also imports dumps written by msprobe 1.0.3
(boolean .npy directions, either CSV header spelling), so they get the MLflow UI and `compare`.

examples:
  msprobe-mlflow upload ./msprobe_dump/3f2a... --run-id 3f2a...
  msprobe-mlflow upload ./old_msprobe_dump --experiment npu-vs-gpu
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dump_path", help="the dump folder (the one holding rank0/, rank1/, ...)")
    parser.add_argument("--run-id", help="complete this run; without it a new run is created")
    parser.add_argument("--experiment", help="experiment name for a new run (default: MLflow's current one)")
    parser.add_argument("--tracking-uri", help="MLflow tracking URI (default: MLFLOW_TRACKING_URI or "
                                               "sqlite:///mlflow.db)")
    parser.add_argument("--param-metrics", nargs="*", default=(), metavar="PATTERN",
                        help="parameter names or glob patterns that also get per-parameter metrics")


def run(args: argparse.Namespace) -> int:
    from msprobe_mlflow.tracking.upload import upload_dump

    report = upload_dump(args.dump_path, args.run_id, experiment=args.experiment, tracking_uri=args.tracking_uri,
                         param_patterns=tuple(args.param_metrics), progress=True)
    steps = sum(len(s) for s in report.steps_completed.values())
    print(f"run {report.run_id}: {report.metrics_logged} metric values and {report.files_uploaded} files sent "
          f"({steps} step(s) completed)")
    return 0
