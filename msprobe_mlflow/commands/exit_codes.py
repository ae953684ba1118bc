"""The exit codes of every ``msprobe-mlflow`` command, and the one mapping from an exception to its code.

0 done; 1 an operational failure (the tracking server cannot be reached, answers with a server error or is not
MLflow, or something unforeseen broke); 2 bad input, which the user can fix on the command line or in the files, or
a package the command needs that is not installed (``ModuleNotFoundError``: the user installs it); 3 a suspicious or
failing result, which the command found rather than failed at.
"""
from __future__ import annotations

import sys

import click

OK, OPERATIONAL_FAILURE, BAD_INPUT, SUSPICIOUS_RESULT = 0, 1, 2, 3

HELP = """\b
Exit codes:
  0  done
  1  operational failure: the tracking server cannot be reached, answers with a server error, or is
     not an MLflow tracking server
  2  bad input: a missing or malformed file, a wrong option, a run or experiment MLflow does not know
     (or no store at all), a parameter or credentials MLflow refuses; or a package the command needs
     is not installed (api-check without torch: the message names the extra)
  3  suspicious or failing result: compare --fail-on-suspicious found a suspicious step, locate named
     an operator, api-check found an API whose status is error"""

# Paths the user named, or asked us to write to. Any other OSError (a full disk; a refused connection: requests'
# errors are OSErrors) is operational.
PATH_ERRORS = (FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError)
# The HTTP status of an MLflow error code, when it is the user's to fix: 400 an invalid parameter, 401 and 403
# refused credentials, 404 no such run, experiment or endpoint. Server errors (5xx, and the INTERNAL_ERROR of a
# server that cannot be reached), conflicts (409) and rate limits (429) are operational.
MLFLOW_BAD_INPUT_STATUSES = (400, 401, 403, 404)


def exit_code_for(error: Exception) -> int:
    """The policy above, for an exception that ended a command."""
    if isinstance(error, click.ClickException):
        return error.exit_code  # 2 for click's usage errors
    if _is_mlflow_error(error):
        return BAD_INPUT if error.get_http_status_code() in MLFLOW_BAD_INPUT_STATUSES else OPERATIONAL_FAILURE
    if isinstance(error, (ValueError, ModuleNotFoundError, *PATH_ERRORS)):
        return BAD_INPUT
    return OPERATIONAL_FAILURE


def error_message(error: Exception) -> str:
    """One line; an unforeseen exception keeps its type's name, which says where to look."""
    if isinstance(error, click.ClickException):
        message = error.format_message()
    elif isinstance(error, (ValueError, OSError, ModuleNotFoundError)) or _is_mlflow_error(error):
        message = str(error)
    else:
        message = f"{type(error).__name__}: {error}"
    return " ".join(message.split())


def _is_mlflow_error(error: Exception) -> bool:
    """``isinstance(error, MlflowException)`` (``RestException`` included), without importing MLflow for an error
    raised before anything imported it."""
    exceptions = sys.modules.get("mlflow.exceptions")
    return exceptions is not None and isinstance(error, exceptions.MlflowException)
