"""Sub-commands of the ``msprobe-mlflow`` CLI (see ``msprobe_mlflow.commands.cli``) and what they share.

Command modules import heavy libraries (MLflow, torch, MindSpore, matplotlib) inside the command body, so that
``--help`` stays fast.
"""
from __future__ import annotations

import click

from msprobe_mlflow.commands import exit_codes

tracking_uri_option = click.option(
    "--tracking-uri", metavar="URI", envvar="MLFLOW_TRACKING_URI", show_envvar=True,
    help="MLflow tracking URI (default: MLFLOW_TRACKING_URI, else MLflow's default). "
         "Example: --tracking-uri sqlite:///mlflow.db")


def command(name: str, short_help: str):
    """``click.command`` whose ``--help`` ends with the exit codes, stated once for every command."""
    return click.command(name, short_help=short_help, epilog=exit_codes.HELP)
