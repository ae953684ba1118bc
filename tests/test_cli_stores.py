"""Where the commands read runs from: a server that answers but is not MLflow is named as such (exit 1), a local
store that does not exist is refused without being created (exit 2), and ``--version``."""
from __future__ import annotations

import http.server
import os
import subprocess
import sys
import threading
import tomllib
from pathlib import Path

import pytest

from mlflow_stores import sqlite_uri
from msprobe_mlflow.tracking.run_dump import read_statistics
from msprobe_mlflow.tracking.server import NoTrackingStore
from test_cli import cli
from test_compare_dumps import FLIPS, base_signs, write_ours

REPO = Path(__file__).resolve().parents[1]
RUN_A, RUN_B = "0123456789abcdef0123456789abcdef", "fedcba9876543210fedcba9876543210"


class NotMlflow(http.server.BaseHTTPRequestHandler):
    """A web server that is not MLflow: 404 with an HTML page for every path but those in ``answers``."""

    answers: dict[str, bytes] = {}

    def do_GET(self):
        body = self.answers.get(self.path.split("?")[0])
        if body is None:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):  # no request lines on the test's stderr
        pass


@pytest.fixture
def web_server(request):
    """``http://127.0.0.1:{port}`` of a :class:`NotMlflow` server answering 200 at the paths given by the test's
    ``indirect`` parameter."""
    handler = type("Handler", (NotMlflow,), {"answers": dict.fromkeys(request.param, b"OK")})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join()


@pytest.mark.parametrize("web_server, request_refused", [
    ((), "/health"),  # nothing there: the health check already answers 404
    (("/health",), "/api/2.0/mlflow/experiments/get"),  # a health check of its own, but no MLflow API
], indirect=["web_server"])
@pytest.mark.parametrize("command, arguments", [("compare", [RUN_A, RUN_B]), ("upload", ["dump", "--run-id", RUN_A])])
def test_a_server_that_answers_404_is_named_not_an_mlflow_tracking_server_exit_1(web_server, request_refused,
                                                                                command, arguments, tmp_path):
    (tmp_path / "dump" / "rank0").mkdir(parents=True)
    done = cli(command, *arguments, "--tracking-uri", web_server, cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    server = f"BaseHTTP/0.6 Python/{sys.version.split()[0]}"  # what http.server sends as its Server header
    assert done.stderr == (f"msprobe-mlflow {command}: error: {web_server} is not an MLflow tracking server: GET "
                           f"{web_server}{request_refused} answered HTTP 404 Not Found (Server: {server}), which "
                           f"MLflow never does. Check the URI (--tracking-uri, MLFLOW_TRACKING_URI): the host, the "
                           f"port (another service may hold it) and the path\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dump"]


def cli_without_tracking_uri(*arguments: str, cwd: Path) -> subprocess.CompletedProcess:
    """``msprobe-mlflow ...`` in a fresh process without MLFLOW_TRACKING_URI: MLflow's default store."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("MLFLOW_")}
    return subprocess.run([sys.executable, "-m", "msprobe_mlflow", *arguments], cwd=cwd, capture_output=True,
                          text=True, env=env, timeout=300)


def no_store_message(label: str, location: Path, uri: str | None = None) -> str:
    folder = "" if label.startswith("--run-id") else "no such folder, and "
    return (f"{label}: {folder}no MLflow run with this ID at {uri or f'sqlite:///{location}'}: there is no tracking "
            f"store there (the SQLite file {location} does not exist; nothing was created). Point at the store that "
            f"holds the run with --tracking-uri or MLFLOW_TRACKING_URI (tracking_uri= in Python), e.g. "
            f"sqlite:////path/to/mlflow.db or http://host:5000")


@pytest.mark.parametrize("arguments, label", [
    (["compare", RUN_A, RUN_B], f"A = {RUN_A!r}"),
    (["compare", RUN_A, RUN_B, "--no-mlflow"], f"A = {RUN_A!r}"),
    (["compare", "dump", RUN_B], f"B = {RUN_B!r}"),  # a dump against a run: the run is still read from the store
    (["upload", "dump", "--run-id", RUN_A], f"--run-id {RUN_A}"),
])
def test_reading_runs_from_the_default_store_where_there_is_none_creates_nothing_exit_2(arguments, label, tmp_path):
    write_ours(tmp_path / "dump", {0: base_signs(0)})
    done = cli_without_tracking_uri(*arguments, cwd=tmp_path)  # MLflow's default: sqlite:///mlflow.db here
    assert done.returncode == 2, done.stderr
    assert done.stderr == f"msprobe-mlflow {arguments[0]}: error: {no_store_message(label, tmp_path / 'mlflow.db')}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dump"]


def test_a_sqlite_uri_given_is_refused_naming_the_file_it_names(tmp_path):
    uri = "sqlite:///elsewhere/runs.db"  # relative: to the working folder
    done = cli("compare", RUN_A, RUN_B, "--tracking-uri", uri, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    message = no_store_message(f"A = {RUN_A!r}", tmp_path / "elsewhere/runs.db", uri)
    assert done.stderr == f"msprobe-mlflow compare: error: {message}\n"
    assert list(tmp_path.iterdir()) == []


def test_comparing_two_dumps_into_a_comparison_run_still_creates_the_default_store(tmp_path):
    signs = {step: base_signs(step) for step in FLIPS}
    write_ours(tmp_path / "a", signs)
    write_ours(tmp_path / "b", signs)
    done = cli_without_tracking_uri("compare", "a", "b", "--no-plots", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "comparison run: " in done.stdout
    assert (tmp_path / "mlflow.db").is_file()


def test_read_statistics_of_a_run_in_a_store_that_does_not_exist_is_refused_creating_nothing(tmp_path):
    uri = sqlite_uri(tmp_path, "absent.db")
    with pytest.raises(NoTrackingStore) as refused:
        read_statistics(RUN_A, tracking_uri=uri)
    assert str(refused.value) == no_store_message(f"source = {RUN_A!r}", tmp_path / "absent.db", uri)
    assert list(tmp_path.iterdir()) == []


def test_version_prints_the_packages_version(tmp_path):
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    done = cli("--version", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"msprobe-mlflow {version}\n"


@pytest.mark.parametrize("module, extra", [("transformers", "transformers"), ("lightning", "lightning")])
def test_an_integration_without_its_trainer_names_the_extra_to_install(module, extra, tmp_path):
    """A fresh interpreter where the trainer's package cannot be imported (as if not installed)."""
    blocked = ["transformers"] if module == "transformers" else ["lightning", "pytorch_lightning"]
    code = (f"import sys\nsys.modules.update(dict.fromkeys({blocked!r}))\n"
            f"from msprobe_mlflow.integrations.{module} import GradientProbeCallback\nGradientProbeCallback()\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    assert f'pip install "msprobe-mlflow[{extra}]"' in done.stderr.splitlines()[-1]
    assert done.stderr.splitlines()[-1].startswith("ImportError: ")
