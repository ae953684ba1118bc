"""``msprobe-mlflow api-check``: the MindSpore API accuracy checker (``mindspore.check_api_accuracy``) as a command."""
from __future__ import annotations

import argparse
import sys

from msprobe_mlflow.progress import ProgressLine

HELP = "check mindspore.mint APIs recorded by msprobe against torch, and record the verdicts in MLflow"
DESCRIPTION = """\
Runs every Mint / MintFunctional call recorded in an msprobe MindSpore dump (api_info.json or dump.json, task
"statistics" or "tensor") in MindSpore (tested) and in torch (benchmark), forward and backward, and compares the
outputs: an API passes when every output has Cosine > 0.99 and MaxAbsErr < 0.001. Writes msprobe's
accuracy_checking_details_{stamp}.csv and accuracy_checking_result_{stamp}.csv, and records one MLflow run for
the check (the CSVs, APIs passed/failed/skipped, pass rate) with one nested run per API (its metrics, and the
tags status and message).

Exit status: 0 when no API failed, 1 when at least one failed, 2 when the dump cannot be read or MLflow refuses.

example:
  msprobe-mlflow api-check examples/mindspore_api_dump/statistics/api_info.json --output api_check_out \\
      --experiment api-check --filter '^Mint(Functional)?\\.(add|matmul)\\.'
"""

EXIT_FAILED = 1
EXIT_BAD_INPUT = 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("api_info", metavar="API_INFO_JSON",
                        help="msprobe's MindSpore dump file (a relative dump_data_dir in it is taken relative to "
                             "this file). Example: dump_path/step0/rank0/dump.json")
    parser.add_argument("--output", metavar="DIR", default=".",
                        help="folder for the two CSVs, created if missing; existing files are never replaced "
                             "(default: the current folder). Example: --output ./api_check_out")
    parser.add_argument("--experiment", metavar="NAME",
                        help="MLflow experiment of the check's run, created if missing (default: the parent run's, "
                             "else MLflow's current experiment). Example: --experiment api-check")
    parser.add_argument("--run-id", metavar="PARENT", dest="parent_run_id",
                        help="nest the check's run under this existing MLflow run, e.g. the training run that was "
                             "dumped. Example: --run-id 3f2a9c...")
    parser.add_argument("--no-nested", dest="nested", action="store_false",
                        help="create no nested run per API (for dumps with tens of thousands of calls); the CSVs "
                             "and the summary metrics are still logged")
    parser.add_argument("--filter", metavar="REGEX", dest="api_filter",
                        help=r"check only the calls whose name (Mint.add.0) contains a match. "
                             r"Example: --filter '^MintFunctional\.' or --filter 'softmax|linear'")
    parser.add_argument("--cosine-threshold", type=float, default=0.99, metavar="X",
                        help="an output passes only if its Cosine is above X (default 0.99). "
                             "Example: --cosine-threshold 0.999")
    parser.add_argument("--max-abs-threshold", type=float, default=0.001, metavar="X",
                        help="an output passes only if its MaxAbsErr is below X (default 0.001). "
                             "Example: --max-abs-threshold 0.01 for float16 dumps")
    parser.add_argument("--tracking-uri", metavar="URI",
                        help="MLflow tracking URI (default: MLFLOW_TRACKING_URI, else MLflow's default). "
                             "Example: --tracking-uri sqlite:///mlflow.db")
    parser.add_argument("--no-mlflow", dest="log_to_mlflow", action="store_false",
                        help="only write the CSVs; log nothing to MLflow")


def _progress_callback():
    """``on_progress(done, total, name)`` drawing the shared progress line (plain lines in logs)."""
    lines = []

    def on_progress(done: int, total: int, name: str) -> None:
        if not lines:
            lines.append(ProgressLine("api-check", total, enabled=True))
        lines[0].advance(done - lines[0].done, name)
        if done == total:
            lines[0].close()
    return on_progress


def _print_failures(report) -> None:
    failures = report.failures
    if not failures:
        return
    width = max(len("API"), *(len(result.name) for result in failures))
    print(f"\n{'API':<{width}}  forward  backward  message")
    for result in failures:
        forward = result.forward.status if result.forward is not None else ""
        backward = result.backward.status if result.backward is not None else ""
        print(f"{result.name:<{width}}  {forward:<7}  {backward:<8}  {result.message}")


def run(args: argparse.Namespace) -> int:
    from mlflow.exceptions import MlflowException

    from msprobe_mlflow.api_check import check_api_accuracy
    from msprobe_mlflow.api_check.metrics import ERROR, PASS, SKIP

    try:
        report = check_api_accuracy(args.api_info, output_dir=args.output, experiment=args.experiment,
                                    parent_run_id=args.parent_run_id, nested=args.nested,
                                    api_filter=args.api_filter, cosine_threshold=args.cosine_threshold,
                                    max_abs_threshold=args.max_abs_threshold, log_to_mlflow=args.log_to_mlflow,
                                    tracking_uri=args.tracking_uri, on_progress=_progress_callback())
    except ValueError as error:
        print(f"msprobe-mlflow api-check: error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except MlflowException as error:
        print(f"msprobe-mlflow api-check: MLflow error: {error.message} (the CSVs are in {args.output})",
              file=sys.stderr)
        return EXIT_BAD_INPUT
    _print_failures(report)
    print(f"\n{len(report.results)} APIs: {report.count(PASS)} passed, {report.count(ERROR)} failed, "
          f"{report.count(SKIP)} skipped")
    print(f"details: {report.details_csv}\nresult:  {report.result_csv}")
    if report.run_id is not None:
        print(f"MLflow run: {report.run_id}")
    return EXIT_FAILED if report.count(ERROR) else 0
