"""``msprobe-mlflow``: one sub-command per module in ``msprobe_mlflow.commands``, and the one error path.

A command returns its exit code (None for 0). Any exception that ends it, click's usage errors included, becomes
one line on stderr, ``msprobe-mlflow <command>: error: <message>``, and the exit code that
``commands.exit_codes.exit_code_for`` gives it; never a traceback. The package's warnings are one line too.
"""
from __future__ import annotations

import os
import warnings

import click

from msprobe_mlflow import __version__
from msprobe_mlflow.commands import exit_codes
from msprobe_mlflow.commands.api_check import api_check
from msprobe_mlflow.commands.compare import compare
from msprobe_mlflow.commands.locate import locate
from msprobe_mlflow.commands.show import show
from msprobe_mlflow.commands.upload import upload
from msprobe_mlflow.notices import PREFIX, MsprobeMlflowWarning


class CommandGroup(click.Group):
    def invoke(self, ctx: click.Context):
        try:
            with warnings.catch_warnings():
                warnings.showwarning = _say_ours(ctx, warnings.showwarning)
                exit_code = super().invoke(ctx)
        except (click.exceptions.Exit, click.Abort):  # --help, and click's own interrupt handling
            raise
        except Exception as error:
            click.echo(f"{_command_path(ctx)}: error: {exit_codes.error_message(error)}", err=True)
            exit_code = exit_codes.exit_code_for(error)
        ctx.exit(exit_code or exit_codes.OK)


def _command_path(ctx: click.Context) -> str:
    """``msprobe-mlflow <command>``: click knows the sub-command only once it is being invoked."""
    return " ".join(filter(None, (ctx.command_path, ctx.invoked_subcommand)))


def _say_ours(ctx: click.Context, others):
    """The package's warnings as one line each, ``msprobe-mlflow <command>: warning: <message>``, like its errors;
    other libraries' as Python shows them."""
    def show(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, MsprobeMlflowWarning) or f"{os.sep}msprobe_mlflow{os.sep}" in filename:
            click.echo(f"{_command_path(ctx)}: warning: {str(message).removeprefix(PREFIX)}", err=True)
        else:
            others(message, category, filename, lineno, file, line)
    return show


@click.group("msprobe-mlflow", cls=CommandGroup, epilog=exit_codes.HELP,
             context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", prog_name="msprobe-mlflow", message="%(prog)s %(version)s")
def main() -> None:
    """Precision debugging of PyTorch and MindSpore training, recorded in MLflow.

    \b
    Examples:
      msprobe-mlflow upload ./msprobe_dump/3f2a... --run-id 3f2a...
      msprobe-mlflow compare $BASELINE_RUN $CANDIDATE_RUN --fail-on-suspicious
      msprobe-mlflow locate ./dump_a/<run>/trace ./dump_b/<run>/trace --step 120
      msprobe-mlflow api-check dump_path/step0/rank0/dump.json --output api_check_out
    """


for subcommand in (upload, compare, show, locate, api_check):
    main.add_command(subcommand)
