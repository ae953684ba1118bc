"""``msprobe-mlflow locate A B``: the first operator of a traced step that differs beyond its inputs and rounding."""
from __future__ import annotations

import click

from msprobe_mlflow.commands import command
from msprobe_mlflow.commands.exit_codes import OK, SUSPICIOUS_RESULT

ROWS_AROUND = 3  # aligned calls printed before and after the finding


@command("locate", short_help="name the first operator of a traced step whose output differs beyond what its "
                              "inputs and rounding explain")
@click.argument("a", metavar="A", type=click.Path(exists=True, file_okay=False))
@click.argument("b", metavar="B", type=click.Path(exists=True, file_okay=False))
@click.option("--step", type=click.IntRange(min=0), default=None, metavar="S",
              help="the traced step to compare (default: the one step both folders hold). Example: --step 120")
@click.option("--rank", type=click.IntRange(min=0), default=None, metavar="R",
              help="the rank to compare (default: the one rank the step holds). Example: --rank 0")
def locate(a: str, b: str, step: int | None, rank: int | None) -> int:
    """Compare two traces of one training step, operator by operator in execution order (the forward, then the
    backward), and name the first operator whose output differs beyond what its inputs' differences and its
    format's rounding explain; or say "drift" when none does (the step's difference is rounding amplified, not a
    bug). A and B are trace folders: ours (a monitor with trace_steps, or MSPROBE_MLFLOW_TRACE_STEPS set) or
    msprobe's data dump (task statistics), holding step<S>/rank<R>/dump.json. Exits with code 3 when an operator
    is named.

    \b
    Examples:
      MSPROBE_MLFLOW_TRACE_STEPS=120 python train.py        # both trainings, each with its dump_path
      msprobe-mlflow locate ./dump_npu/<run>/trace ./dump_gpu/<run>/trace --step 120
    """
    from msprobe_mlflow.locate import locate as locate_step

    found = locate_step(a, b, step=step, rank=rank)
    click.echo(f"A: {found.folders[0]}\nB: {found.folders[1]}")
    judged = [row for row in found.rows if row[1] is not None]
    click.echo(f"{len(found.rows)} operator calls aligned ({len(found.rows) - len(judged)} in one run only)")
    if found.pair is not None:
        index = next(i for i, (pair, _) in enumerate(found.rows) if pair is found.pair)
        for pair, judgement in found.rows[max(0, index - ROWS_AROUND): index + ROWS_AROUND + 1]:
            mark = ">" if pair is found.pair else " "
            inputs = "equal" if judgement is not None and judgement.inputs_bit_equal else \
                f"{judgement.input_difference:.2g}" if judgement is not None else ""
            numbers = "in one run only" if judgement is None else \
                f"inputs {inputs}  output {judgement.output_difference:.2g}  explained up to {judgement.tolerance:.2g}"
            click.echo(f"{mark} {pair.call.name:<48} {numbers}")
    click.echo(found.describe())
    return SUSPICIOUS_RESULT if found.named else OK
