"""``msprobe-mlflow api-check``: the MindSpore API accuracy checker (``msprobe_mlflow.api_check``) as a command."""
from __future__ import annotations

from typing import Callable

import click

from msprobe_mlflow.commands import command, tracking_uri_option
from msprobe_mlflow.commands.exit_codes import OK, SUSPICIOUS_RESULT


SKIPS_SHOWN = 10  # per group: a dump of thousands of ops.* calls would bury the summary; the result CSV has all


@command("api-check", short_help="check mindspore.mint APIs recorded by msprobe against torch, and record the "
                                 "verdicts in MLflow")
@click.argument("api_info", metavar="API_INFO_JSON", type=click.Path(exists=True))
@click.option("--output", metavar="DIR", default=".", type=click.Path(file_okay=False),
              help="folder for the two CSVs, created if missing; existing files are never replaced (default: the "
                   "current folder). Example: --output ./api_check_out")
@click.option("--experiment", metavar="NAME",
              help="MLflow experiment of the check's run, created if missing (default: the parent run's, else "
                   "MLflow's current experiment). Example: --experiment api-check")
@click.option("--run-id", "parent_run_id", metavar="PARENT",
              help="nest the check's run under this existing MLflow run, e.g. the training run that was dumped. "
                   "Example: --run-id 3f2a9c...")
@click.option("--no-nested", is_flag=True,
              help="create no nested run per API (for dumps with tens of thousands of calls); the CSVs and the "
                   "summary metrics are still logged")
@click.option("--filter", "api_filter", metavar="REGEX",
              help=r"check only the calls whose name (Mint.add.0) contains a match. "
                   r"Example: --filter '^MintFunctional\.' or --filter 'softmax|linear'")
@click.option("--cosine-threshold", type=float, default=0.99, metavar="X",
              help="an output passes only if its Cosine is above X (default 0.99). Example: --cosine-threshold 0.999")
@click.option("--max-abs-threshold", type=float, default=0.001, metavar="X",
              help="an output passes only if its MaxAbsErr is below X (default 0.001). "
                   "Example: --max-abs-threshold 0.01 for float16 dumps")
@click.option("--workers", type=click.IntRange(min=1), default=1, metavar="N",
              help="replay the calls in N processes (default 1), each taking the next call as soon as it is done; "
                   "up to the number of cores. Example: --workers 4")
@tracking_uri_option
@click.option("--no-mlflow", is_flag=True, help="only write the CSVs; log nothing to MLflow")
def api_check(api_info: str, output: str, experiment: str | None, parent_run_id: str | None, no_nested: bool,
              api_filter: str | None, cosine_threshold: float, max_abs_threshold: float, workers: int,
              tracking_uri: str | None, no_mlflow: bool) -> int:
    """Runs every Mint / MintFunctional call recorded in an msprobe MindSpore dump (API_INFO_JSON: api_info.json
    or dump.json, task "statistics" or "tensor"; a relative dump_data_dir in it is taken relative to this file's
    folder, else to the current folder (msprobe writes it relative to the folder the training ran in), else to a
    folder above this file; or a folder holding exactly one, also below it as msprobe lays it out:
    dump_path/step0/rank0/dump.json) in MindSpore (tested) and in torch (benchmark), forward and backward, and
    compares the outputs. It needs both installed (the extras [torch] and [mindspore]). Each API gets msprobe's
    status: pass (every output has Cosine > 0.99 and MaxAbsErr < 0.001), error or skip; or out_of_memory, not
    checked because this machine lacks the memory the call needs (never counted as an error). Writes msprobe's
    accuracy_checking_details_{stamp}.csv and accuracy_checking_result_{stamp}.csv, and records one MLflow run for
    the check (the CSVs, the number of APIs per status, the pass rate, the tag error_apis) in --experiment (else
    the --run-id parent's, else MLflow's current experiment), with one nested run per API (its metrics, and the
    tags status and message). The summary lists the APIs with status error, the skipped ones grouped by why (most
    often no MindSpore kernel on this device: the platform, not the model), then those out of memory. The command
    exits with code 3 when at least one API has status error.

    \b
    Examples:
      msprobe-mlflow api-check dump_path/step0/rank0/dump.json --run-id $TRAINING_RUN --no-nested
      msprobe-mlflow api-check dump_path --no-mlflow   # the one dump.json below it
      msprobe-mlflow api-check examples/mindspore_api_dump/statistics/api_info.json --output api_check_out \\
          --experiment api-check --filter '^Mint(Functional)?\\.(add|matmul)\\.'
    """
    from msprobe_mlflow.api_check import check_api_accuracy
    from msprobe_mlflow.api_check.metrics import ERROR, OUT_OF_MEMORY, STATUSES
    report = check_api_accuracy(api_info, output_dir=output, experiment=experiment, parent_run_id=parent_run_id,
                                nested=not no_nested, api_filter=api_filter, cosine_threshold=cosine_threshold,
                                max_abs_threshold=max_abs_threshold, log_to_mlflow=not no_mlflow,
                                tracking_uri=tracking_uri, on_progress=_progress_line(), workers=workers)
    _print_errors(report.with_status(ERROR))
    for group, results in report.skips_by_group().items():
        _print_listed(f"skip ({len(results)}): {group or 'other'}", results)
    if report.count(OUT_OF_MEMORY):
        _print_listed(f"{OUT_OF_MEMORY} ({report.count(OUT_OF_MEMORY)}): not checked, this machine lacks the memory "
                      "(not a finding about your model)", report.with_status(OUT_OF_MEMORY))
    counts = ", ".join(f"{report.count(status)} {status}" for status in STATUSES)
    click.echo(f"\n{len(report.results)} APIs: {counts}")
    click.echo(f"dump:    {report.api_info}")
    if report.dump_data_dir is not None:
        click.echo(f"tensors: {report.dump_data_dir} (dump_data_dir {report.dump_data_dir_found})")
    click.echo(f"details: {report.details_csv}\nresult:  {report.result_csv}")
    if report.run_id is not None:
        click.echo(f"MLflow run: {report.run_id}")
    return SUSPICIOUS_RESULT if report.count(ERROR) else OK


def _progress_line() -> Callable[[int, int, str], None]:
    """``on_progress(done, total, name)`` drawing the shared ProgressLine (in logs too), made at the first call,
    when the number of calls is known."""
    from msprobe_mlflow.progress import ProgressLine

    line = None

    def on_progress(done: int, total: int, name: str) -> None:
        nonlocal line
        if line is None:
            line = ProgressLine("api-check", total, enabled=True)
        line.advance(done - line.done, name)
        if done == total:
            line.close()
    return on_progress


def _print_errors(errors: list) -> None:
    """The APIs whose status is error, one line each."""
    if not errors:
        return
    width = max(len("API"), *(len(result.name) for result in errors))
    click.echo(f"\n{'API':<{width}}  forward  backward  message")
    for result in errors:
        forward = result.forward.status if result.forward is not None else ""
        backward = result.backward.status if result.backward is not None else ""
        click.echo(f"{result.name:<{width}}  {forward:<7}  {backward:<8}  {result.message}")


def _print_listed(title: str, results: list) -> None:
    """APIs under a title (the skipped ones of a group, those out of memory), one line each (``SKIPS_SHOWN`` at
    most)."""
    click.echo(f"\n{title}")
    width = max(len(result.name) for result in results[:SKIPS_SHOWN])
    for result in results[:SKIPS_SHOWN]:
        click.echo(f"  {result.name:<{width}}  {result.message}")
    if len(results) > SKIPS_SHOWN:
        click.echo(f"  ... and {len(results) - SKIPS_SHOWN} more (the result CSV lists them all)")
