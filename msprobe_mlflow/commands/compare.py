"""``msprobe-mlflow compare A B``: direction similarity of two runs or dumps, a verdict, a comparison run."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

HELP = "compare the gradient directions of two runs (or dump folders) and log the comparison run"
DESCRIPTION = """\
Compares the gradient directions (signs) of two trainings, step by step: for each rank, parameter and step present
in both, similarity = elements whose sign agrees / elements. The summary per step weighs parameters by size.
A and B are each an MLflow run ID (a run logged by autolog(), GradientMonitor or 'msprobe-mlflow upload') or a
grad_probe dump folder (ours, or msprobe 1.0.3's). Dumps must be grad_level L1 or L2 (L0 has no directions).

Verdict: a step is suspicious when, for any parameter or the summary, the first compared step's similarity is
below --first-threshold, or the similarity drops by more than --drop-threshold from one compared step to the next.
The first suspicious step per rank is printed with the parameters that fell most.

Outputs: a new MLflow run 'compare <A> vs <B>' (metric summary_similarity/rank<R> over training steps, the
verdict as tags and metrics, artifacts grad_compare/rank<R>/similarities.csv, plots, verdict.json), and with
--output the same files locally. Exit code: 0, 2 for bad input, 3 with --fail-on-suspicious when a suspicious
step is found.

examples:
  msprobe-mlflow compare 3f2a...c1 9b7e...04
  msprobe-mlflow compare ./dump_baseline ./dump_candidate --no-mlflow --output ./compare_out
  msprobe-mlflow compare $BASELINE_RUN $CANDIDATE_RUN --tracking-uri http://mlflow:5000 --fail-on-suspicious
"""

EXIT_BAD_INPUT = 2
EXIT_SUSPICIOUS = 3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("a", metavar="A", help="the baseline: an MLflow run ID or a dump folder")
    parser.add_argument("b", metavar="B", help="the run to check against it: an MLflow run ID or a dump folder")
    parser.add_argument("--output", metavar="DIR",
                        help="also keep the outputs in DIR (rank<R>/similarities.csv, plots, verdict.json); an "
                             "earlier comparison there is replaced, anything else is refused. Example: --output "
                             "./compare_out")
    parser.add_argument("--experiment", metavar="NAME",
                        help="experiment of the comparison run (created if missing; default: the experiment of "
                             "the first source run). Example: --experiment grad-compare")
    parser.add_argument("--run-name", metavar="NAME",
                        help="name of the comparison run (default: 'compare <A> vs <B>'). Example: --run-name "
                             "'bf16 vs fp32'")
    parser.add_argument("--tracking-uri", metavar="URI",
                        help="MLflow tracking URI (default: MLFLOW_TRACKING_URI, else MLflow's default). Example: "
                             "--tracking-uri sqlite:///mlflow.db")
    parser.add_argument("--first-threshold", type=float, default=0.97, metavar="X",
                        help="a first compared step with similarity below X is suspicious (default 0.97). "
                             "Example: --first-threshold 0.95")
    parser.add_argument("--drop-threshold", type=float, default=0.03, metavar="X",
                        help="a drop of more than X from one compared step to the next is suspicious (default "
                             "0.03). Example: --drop-threshold 0.05")
    parser.add_argument("--no-mlflow", action="store_true",
                        help="log no comparison run: print (and with --output write) the result only; run IDs "
                             "as sources still need the tracking store")
    parser.add_argument("--fail-on-suspicious", action="store_true",
                        help=f"exit with code {EXIT_SUSPICIOUS} when a suspicious step is found (for CI pipelines)")
    parser.add_argument("--per-param-plots", action="store_true",
                        help="also draw one similarity curve per parameter (slow for large models)")
    parser.add_argument("--no-plots", action="store_true", help="draw no pictures (CSV and verdict only)")
    parser.add_argument("--cache-dir", metavar="DIR",
                        help="where runs downloaded from a tracking server are cached by run ID (default "
                             "~/.cache/msprobe-mlflow/runs)")


def _print_result(comparison, run_id: str | None, run_url: str | None, tracking_uri: str | None,
                  experiment_id: str | None = None) -> None:
    print(comparison.table())
    print()
    print(comparison.verdict.describe())
    if comparison.output_dir is not None:
        print(f"\noutputs: {comparison.output_dir}")
    if run_id:
        print(f"\ncomparison run: {run_id}")
        if run_url:
            print(f"open: {run_url}")
        else:
            print(f"open: mlflow ui --backend-store-uri {tracking_uri}")
            print(f"      then http://127.0.0.1:5000/#/experiments/{experiment_id}/runs/{run_id}")


def run(args: argparse.Namespace) -> int:
    from msprobe_mlflow.compare.engine import compare_dumps

    options = dict(first_threshold=args.first_threshold, drop_threshold=args.drop_threshold,
                   plots=not args.no_plots, per_param_plots=args.per_param_plots)
    try:
        if args.no_mlflow and Path(args.a).is_dir() and Path(args.b).is_dir():
            comparison = compare_dumps(args.a, args.b, args.output, **options)
            _print_result(comparison, None, None, None)
            verdict = comparison.verdict
        else:
            from mlflow.exceptions import MlflowException

            from msprobe_mlflow.tracking.comparison_run import compare_runs

            try:
                result = compare_runs(args.a, args.b, tracking_uri=args.tracking_uri, experiment=args.experiment,
                                      run_name=args.run_name, output_dir=args.output, cache_dir=args.cache_dir,
                                      log_run=not args.no_mlflow, **options)
            except MlflowException as e:
                print(f"msprobe-mlflow compare: MLflow error: {e.message}", file=sys.stderr)
                return 1
            _print_result(result.comparison, result.run_id, result.run_url(), result.tracking_uri,
                          result.experiment_id)
            verdict = result.verdict
    except ValueError as e:
        print(f"msprobe-mlflow compare: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return EXIT_SUSPICIOUS if args.fail_on_suspicious and verdict.suspicious else 0
