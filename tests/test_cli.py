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
from mlflow.tracking import MlflowClient

from msprobe_mlflow.commands.cli import main
from msprobe_mlflow.commands.exit_codes import exit_code_for
from test_compare_dumps import FLIPS, base_signs, write_ours

REPO = Path(__file__).resolve().parents[1]
API_INFO = REPO / "examples" / "mindspore_api_dump" / "tensor" / "api_info.json"
COMMANDS = ["upload", "compare", "show", "locate", "api-check"]


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


def test_upload_to_a_run_that_does_not_exist_exits_2_with_one_line_naming_the_run(tmp_path, tmp_sqlite_uri):
    (tmp_path / "dump" / "rank0").mkdir(parents=True)  # a dump with nothing to send: the run is looked up first
    missing = "0123456789abcdef0123456789abcdef"
    env = {**os.environ, "MLFLOW_TRACKING_URI": tmp_sqlite_uri}
    MlflowClient(env["MLFLOW_TRACKING_URI"]).search_experiments()  # the store exists (tests/test_cli_stores.py: none)
    done = subprocess.run([sys.executable, "-m", "msprobe_mlflow", "upload", str(tmp_path / "dump"), "--run-id",
                           missing], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if "error" in line.lower()]
    assert errors == [f"msprobe-mlflow upload: error: Run with id={missing} not found"]
    assert "Traceback" not in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dump", "mlflow.db"]


def cli(*arguments: str, cwd: Path, **environment: str) -> subprocess.CompletedProcess:
    """``msprobe-mlflow ...`` in a fresh process, with MLflow's own retry settings left at their defaults: a command
    hanging on a dead server fails here by running past the (generous) timeout."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("MLFLOW_HTTP_REQUEST_")}
    return subprocess.run([sys.executable, "-m", "msprobe_mlflow", *arguments], cwd=cwd, capture_output=True,
                          text=True, env={**env, **environment}, timeout=120)


@pytest.mark.parametrize("command, arguments", [
    ("upload", ["dump", "--run-id", "0123456789abcdef0123456789abcdef"]),
    ("upload", ["dump", "--experiment", "imports"]),  # a new run
    ("compare", ["0123456789abcdef0123456789abcdef", "fedcba9876543210fedcba9876543210", "--no-mlflow"]),
    ("compare", ["dump", "dump"]),  # two folders, the comparison run logged
    ("locate", ["0123456789abcdef0123456789abcdef", "dump", "--step", "2"]),  # a side is a run ID
    ("locate", ["dump", "dump"]),  # the step from the pair's comparison, logged as its run
    ("show", ["0123456789abcdef0123456789abcdef"]),
    ("api-check", [str(REPO / "examples/mindspore_api_dump/statistics/api_info.json"),
                   "--output", "out"]),  # before any API runs, before the output folder is made
])
def test_an_unreachable_tracking_server_fails_at_once_exit_1_naming_the_uri_and_the_request(command, arguments,
                                                                                            tmp_path):
    (tmp_path / "dump" / "rank0").mkdir(parents=True)
    uri = f"http://127.0.0.1:{free_port()}"
    done = cli(command, *arguments, "--tracking-uri", uri, cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    assert done.stderr == (f"msprobe-mlflow {command}: error: cannot reach the MLflow tracking server at {uri}: GET "
                           f"{uri}/health (one try, 5 s timeout) failed: [Errno 111] Connection refused. Check the URI "
                           f"(--tracking-uri, MLFLOW_TRACKING_URI) and that the server is running\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dump"]


def test_a_server_that_accepts_and_never_answers_is_said_to_have_timed_out_exit_1(tmp_path):
    with socket.socket() as silent:  # listens, accepts (the kernel's backlog), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        uri = f"http://127.0.0.1:{silent.getsockname()[1]}"
        done = cli("compare", "0123456789abcdef0123456789abcdef", "fedcba9876543210fedcba9876543210",
                   "--tracking-uri", uri, cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    assert done.stderr == (f"msprobe-mlflow compare: error: cannot reach the MLflow tracking server at {uri}: GET "
                           f"{uri}/health (one try, 5 s timeout) failed: timed out, no answer within 5 s (a hung or "
                           f"overloaded server, or another program on that port). Check the URI (--tracking-uri, "
                           f"MLFLOW_TRACKING_URI) and that the server is running\n")


def test_the_readmes_server_down_section_says_how_long_start_run_retries_with_mlflows_own_defaults():
    from mlflow.environment_variables import MLFLOW_HTTP_REQUEST_MAX_RETRIES, MLFLOW_HTTP_REQUEST_TIMEOUT

    readme = (REPO / "docs" / "mlflow.md").read_text(encoding="utf-8")
    section = readme.split("## When the tracking server is down")[1].split("\n## ")[0]
    assert "`mlflow.start_run()`" in section and "about four minutes" in section
    assert f"{MLFLOW_HTTP_REQUEST_MAX_RETRIES.default + 1} tries" in section  # the first and its retries
    assert f"`MLFLOW_HTTP_REQUEST_TIMEOUT` ({MLFLOW_HTTP_REQUEST_TIMEOUT.default} s)" in section
    assert "`MLFLOW_HTTP_REQUEST_MAX_RETRIES=2 MLFLOW_HTTP_REQUEST_TIMEOUT=10`" in section


def test_comparing_two_dumps_without_mlflow_never_asks_the_tracking_server(tmp_path):
    signs = {step: base_signs(step) for step in FLIPS}
    write_ours(tmp_path / "a", signs)
    write_ours(tmp_path / "b", signs)
    done = cli("compare", "a", "b", "--no-mlflow", "--no-plots", cwd=tmp_path,
               MLFLOW_TRACKING_URI=f"http://127.0.0.1:{free_port()}")
    assert done.returncode == 0, done.stderr
    assert "rank 0: no suspicious step" in done.stdout


@pytest.mark.parametrize("command, make, expected", [
    ("upload", None, "DUMP_PATH = 'given': no such folder; expected a grad_probe dump folder"),
    ("upload", "file", "DUMP_PATH = 'given' is a file, not a folder; expected a grad_probe dump folder"),
    ("upload", "folder", "DUMP_PATH = 'given' holds no rank<N> folders; expected a grad_probe dump folder"),
    ("compare", "file", "A = 'given' is a file, not a folder; expected a grad_probe dump folder"),
])
def test_a_dump_path_that_is_not_a_dump_says_what_is_there_and_what_is_expected(command, make, expected, tmp_path,
                                                                                tmp_sqlite_uri, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tmp_sqlite_uri)
    if make == "file":
        (tmp_path / "given").write_text("{}")
    elif make == "folder":
        (tmp_path / "given").mkdir()
    result = CliRunner().invoke(main, [command, "given", *(["run_b"] if command == "compare" else [])])
    assert result.exit_code == 2
    assert result.stderr == (f"msprobe-mlflow {command}: error: {expected} (holding rank0/grad_summary_0.csv, "
                             f"rank0/step0/...)\n")
    assert not (tmp_path / "mlflow.db").exists()  # refused before any store was opened


def test_a_usage_error_is_one_line_and_exits_2():
    result = CliRunner().invoke(main, ["compare", "run_a"])
    assert result.exit_code == 2
    assert result.stderr == "msprobe-mlflow compare: error: Missing argument 'B'.\n"


@pytest.mark.parametrize("command, arguments", [("upload", ["{tmp_path}"]), ("compare", ["run_a", "run_b"]),
                                                ("api-check", [str(API_INFO)])])
def test_tracking_uri_is_taken_from_MLFLOW_TRACKING_URI(command, arguments, tmp_path, tmp_sqlite_uri, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tmp_sqlite_uri)
    arguments = [argument.format(tmp_path=tmp_path) for argument in arguments]
    with main.get_command(None, command).make_context(command, arguments) as context:
        assert context.params["tracking_uri"] == tmp_sqlite_uri


def test_the_tracking_uri_option_wins_over_the_environment(tmp_sqlite_uri, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tmp_sqlite_uri)
    with main.get_command(None, "compare").make_context("compare", ["a", "b", "--tracking-uri", "http://x"]) as ctx:
        assert ctx.params["tracking_uri"] == "http://x"


EXAMPLES = {  # the first example line of each help
    None: "msprobe-mlflow upload ./msprobe_dump/3f2a... --run-id 3f2a...",
    "upload": "msprobe-mlflow upload ./msprobe_dump/3f2a... --run-id 3f2a...",
    "compare": "msprobe-mlflow compare 3f2a...c1 9b7e...04",
    "api-check": "msprobe-mlflow api-check dump_path/step0/rank0/dump.json --run-id $TRAINING_RUN --no-nested",
    "locate": "MSPROBE_MLFLOW_TRACE_STEPS=120 python train.py        # both trainings, each with its dump_path",
    "show": "msprobe-mlflow show 7c1e...      # the comparison run's verdict",
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
                    "locate named an operator, api-check found an API whose status is error"):
        assert meaning in exit_codes
