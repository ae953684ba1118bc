"""What every ``msprobe-mlflow`` command shares: the exit-code policy, one-line errors, --tracking-uri from the
environment, and a --help with examples and the exit codes."""
import os
import socket
import subprocess
import sys
from pathlib import Path

import click
import pytest
import requests
from click.testing import CliRunner
from mlflow.exceptions import MlflowException, RestException
from mlflow.protos.databricks_pb2 import RESOURCE_DOES_NOT_EXIST

from msprobe_mlflow.cli import main
from msprobe_mlflow.commands.exit_codes import exit_code_for

REPO = Path(__file__).resolve().parents[1]
API_INFO = REPO / "examples" / "mindspore_api_dump" / "tensor" / "api_info.json"
COMMANDS = ["upload", "compare", "api-check"]


def rest_error(error_code: str, message: str = "refused") -> RestException:
    """What MLflow's REST client raises for a server's JSON error answer."""
    return RestException({"error_code": error_code, "message": message})


@pytest.mark.parametrize("error, expected", [
    (ValueError("dump_a = 'x': no such folder"), 2),
    (FileNotFoundError(2, "No such file or directory", "x.json"), 2),
    (click.UsageError("Missing argument 'B'."), 2),
    (MlflowException("Run with id=abc not found", error_code=RESOURCE_DOES_NOT_EXIST), 2),  # a SQLite store's
    (MlflowException.invalid_parameter_value("experiment name is empty"), 2),
    (rest_error("RESOURCE_DOES_NOT_EXIST", "Run 'abc' not found"), 2),
    (rest_error("INVALID_PARAMETER_VALUE"), 2),
    (rest_error("PERMISSION_DENIED"), 2),
    (rest_error("INTERNAL_ERROR"), 1),
    (rest_error("TEMPORARILY_UNAVAILABLE"), 1),
    (MlflowException("API request to http://mlflow:5000 failed with exception ConnectionError"), 1),
    (requests.ConnectionError("Connection refused"), 1),
    (RuntimeError("unforeseen"), 1),
])
def test_exit_code_policy(error, expected):
    """0 done, 1 operational failure, 2 bad input, 3 a suspicious result (returned by the command, not raised)."""
    assert exit_code_for(error) == expected


def free_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_upload_to_a_run_that_does_not_exist_exits_2_with_one_line_naming_the_run(tmp_path):
    (tmp_path / "dump" / "rank0").mkdir(parents=True)  # a dump with nothing to send: the run is looked up first
    missing = "0123456789abcdef0123456789abcdef"
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db"}
    done = subprocess.run([sys.executable, "-m", "msprobe_mlflow", "upload", str(tmp_path / "dump"), "--run-id",
                           missing], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if "error" in line.lower()]
    assert errors == [f"msprobe-mlflow upload: error: Run with id={missing} not found"]
    assert "Traceback" not in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dump", "mlflow.db"]


def test_an_unreachable_tracking_server_exits_1(tmp_path):
    (tmp_path / "rank0").mkdir()
    result = CliRunner().invoke(main, ["upload", str(tmp_path), "--run-id", "abc", "--tracking-uri",
                                       f"http://127.0.0.1:{free_port()}"],
                                env={"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"})
    assert result.exit_code == 1
    assert result.stderr.startswith("msprobe-mlflow upload: error: API request to http://127.0.0.1:")
    assert result.stderr.count("\n") == 1


def test_comparing_a_run_on_an_unreachable_tracking_server_exits_1_not_as_a_mistyped_source():
    result = CliRunner().invoke(main, ["compare", "run_a", "run_b", "--no-mlflow", "--tracking-uri",
                                       f"http://127.0.0.1:{free_port()}"],
                                env={"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"})
    assert result.exit_code == 1
    assert result.stderr.startswith("msprobe-mlflow compare: error: API request to http://127.0.0.1:")


def test_a_usage_error_is_one_line_and_exits_2(tmp_path):
    result = CliRunner().invoke(main, ["upload", str(tmp_path / "missing")])
    assert result.exit_code == 2
    assert result.stderr == (f"msprobe-mlflow upload: error: Invalid value for 'DUMP_PATH': Directory "
                             f"'{tmp_path / 'missing'}' does not exist.\n")


@pytest.mark.parametrize("command, arguments", [("upload", ["{tmp_path}"]), ("compare", ["run_a", "run_b"]),
                                                ("api-check", [str(API_INFO)])])
def test_tracking_uri_is_taken_from_MLFLOW_TRACKING_URI(command, arguments, tmp_path, monkeypatch):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    arguments = [argument.format(tmp_path=tmp_path) for argument in arguments]
    with main.get_command(None, command).make_context(command, arguments) as context:
        assert context.params["tracking_uri"] == uri


def test_the_tracking_uri_option_wins_over_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///elsewhere.db")
    with main.get_command(None, "compare").make_context("compare", ["a", "b", "--tracking-uri", "http://x"]) as ctx:
        assert ctx.params["tracking_uri"] == "http://x"


EXAMPLES = {  # the first example line of each help
    None: "msprobe-mlflow upload ./msprobe_dump/3f2a... --run-id 3f2a...",
    "upload": "msprobe-mlflow upload ./msprobe_dump/3f2a... --run-id 3f2a...",
    "compare": "msprobe-mlflow compare 3f2a...c1 9b7e...04",
    "api-check": "msprobe-mlflow api-check dump_path/step0/rank0/dump.json --run-id $TRAINING_RUN --no-nested",
}


@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_help_shows_an_example_and_the_exit_codes(command):
    result = CliRunner().invoke(main, [*filter(None, [command]), "--help"])
    assert result.exit_code == 0
    lines = [line.strip() for line in result.stdout.splitlines()]
    assert lines[lines.index("Examples:") + 1] == EXAMPLES[command]
    exit_codes = " ".join(lines[lines.index("Exit codes:") + 1:])
    for meaning in ("0  done", "1  operational failure: the tracking server cannot be reached", "2  bad input:",
                    "3  suspicious or failing result: compare --fail-on-suspicious found a suspicious step, "
                    "api-check found an API whose status is error"):
        assert meaning in exit_codes
