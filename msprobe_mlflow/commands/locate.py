"""``msprobe-mlflow locate A B``: the first operator of a traced step that differs beyond its inputs and rounding."""
from __future__ import annotations

import click

from msprobe_mlflow.commands import command, tracking_uri_option
from msprobe_mlflow.commands.exit_codes import OK, SUSPICIOUS_RESULT

ROWS_AROUND = 3  # aligned calls printed before and after the finding


@command("locate", short_help="name the first operator of a traced step whose output differs beyond what its "
                              "inputs and rounding explain")
@click.argument("a", metavar="A")
@click.argument("b", metavar="B")
@click.option("--step", type=click.IntRange(min=0), default=None, metavar="S",
              help="the traced step to compare (default: the pair's first suspicious step, from a comparison of A "
                   "and B; for bare trace folders, the one step both hold). Example: --step 120")
@click.option("--rank", type=click.IntRange(min=0), default=None, metavar="R",
              help="the rank to compare (default: the first rank the verdict flags, else the one rank traced). "
                   "Example: --rank 0")
@tracking_uri_option
@click.option("--no-mlflow", is_flag=True,
              help="log nothing: print the finding only (run IDs as sources still need the tracking store)")
@click.option("--cache-dir", metavar="DIR", type=click.Path(file_okay=False),
              help="where traces downloaded from a tracking server are cached by run ID (default "
                   "~/.cache/msprobe-mlflow/runs)")
def locate(a: str, b: str, step: int | None, rank: int | None, tracking_uri: str | None, no_mlflow: bool,
           cache_dir: str | None) -> int:
    """Compare two traces of one training step, operator by operator in execution order (the forward, then the
    backward), and name the first operator whose output differs beyond what its inputs' differences and its
    format's rounding explain; or say "drift" when none does (the step's difference is rounding amplified, not a
    bug), or "near tie" where a ReLU passed a gradient element in one run only. A and B are MLflow run IDs,
    monitors' dump folders or trace folders (ours, or msprobe's data dump of task statistics:
    step<S>/rank<R>/dump.json). A run gets its traces with trace_steps=[S] or MSPROBE_MLFLOW_TRACE_STEPS set.
    The finding is logged as a run nested under the pair's comparison run (folders that need no comparison log
    nothing, and say so). Exits with code 3 when an operator is named.

    \b
    Examples:
      MSPROBE_MLFLOW_TRACE_STEPS=120 python train.py        # both trainings, each with its dump_path
      msprobe-mlflow locate $GPU_RUN $NPU_RUN               # the step: the pair's first suspicious one
      msprobe-mlflow locate ./dump_gpu ./dump_npu --step 120 --no-mlflow
    """
    from pathlib import Path

    from msprobe_mlflow.tracking.locate_run import locate as locate_step
    from msprobe_mlflow.tracking.server import require_tracking_server

    if not (Path(a).exists() and Path(b).exists()) or (step is None and not no_mlflow):
        require_tracking_server(tracking_uri)  # a side is a run ID, or the pair's comparison run is logged
    result = locate_step(a, b, step=step, rank=rank, tracking_uri=tracking_uri, cache_dir=cache_dir,
                         log_run=not no_mlflow)
    found = result.localization
    click.echo(f"step {result.step}, rank {result.rank}\nA: {found.folders[0]}\nB: {found.folders[1]}")
    judged = [row for row in found.rows if row[1] is not None]
    click.echo(f"{len(found.rows)} operator calls aligned ({len(found.rows) - len(judged)} in one run only)")
    if not result.run_id and not no_mlflow:
        click.echo("not logged in MLflow: these folders needed no tracking store (run IDs, or dumps without --step, "
                   "log it)")
    if found.pair is not None:
        index = next(i for i, (pair, _) in enumerate(found.rows) if pair is found.pair)
        for pair, judgement in found.rows[max(0, index - ROWS_AROUND): index + ROWS_AROUND + 1]:
            click.echo(f"{'>' if pair is found.pair else ' '} {pair.call.name:<48} {_numbers(judgement)}")
    click.echo(result.describe())
    if result.side_hint:
        click.echo(result.side_hint)
    if result.run_id:
        click.echo(f"logged: run {result.run_id}" + (f", nested under the comparison run {result.comparison_run_id}"
                                                      if result.comparison_run_id else ""))
    return SUSPICIOUS_RESULT if found.named else OK


def _numbers(judgement) -> str:
    if judgement is None:
        return "in one run only"
    inputs = "equal" if judgement.inputs_bit_equal else f"{judgement.input_difference:.2g}"
    return f"inputs {inputs}  output {judgement.output_difference:.2g}  explained up to {judgement.tolerance:.2g}"
