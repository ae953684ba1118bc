"""A real ``mlflow server`` on 127.0.0.1 for tests: started, stopped and restarted on the same port and stores;
with ``basic_auth_env`` and ``extra_args=["--app-name", "basic-auth"]``, behind MLflow's basic authentication."""
from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from mlflow_stores import sqlite_uri


def basic_auth_env(folder: Path, database_uri: str, admin_username: str, admin_password: str) -> dict[str, str]:
    """The environment of ``mlflow server --app-name basic-auth``: an auth config (``MLFLOW_AUTH_CONFIG_PATH``) whose
    users live in ``database_uri``, ``default_permission = READ`` (a user edits only what they created or were
    granted), the admin created at first start, the static secret key the auth app needs for CSRF, and verified
    credentials cached for 60 s (each check is a deliberately slow password hash: uncached, every metric batch and
    artifact of a training pays it)."""
    Path(folder).mkdir(parents=True, exist_ok=True)
    config = Path(folder) / "basic_auth.ini"
    config.write_text("[mlflow]\n"
                      "default_permission = READ\n"
                      f"database_uri = {database_uri}\n"
                      f"admin_username = {admin_username}\n"
                      f"admin_password = {admin_password}\n"
                      "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
                      "auth_cache_ttl_seconds = 60\n")
    config.chmod(0o600)
    return {"MLFLOW_AUTH_CONFIG_PATH": str(config), "MLFLOW_FLASK_SERVER_SECRET_KEY": secrets.token_hex(16)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MlflowServer:
    """``mlflow server --workers 1`` with proxied artifacts; ``backend_uri`` defaults to SQLite in ``folder``, the
    artifacts' destination to ``folder/artifacts`` (an ``s3://`` URI works with ``MLFLOW_S3_ENDPOINT_URL`` in
    ``env``)."""

    def __init__(self, folder: Path, backend_uri: str | None = None, extra_args: list[str] = (),
                 env: dict[str, str] | None = None, artifacts_destination: str | None = None):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.backend_uri = backend_uri or sqlite_uri(self.folder, "server.db")
        self.artifacts_destination = artifacts_destination or str(self.folder / "artifacts")
        self.extra_args = list(extra_args)
        self.env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", **(env or {})}
        self.process: subprocess.Popen | None = None

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 120) -> "MlflowServer":
        command = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(self.port),
                   "--workers", "1", "--backend-store-uri", self.backend_uri, "--serve-artifacts",
                   "--artifacts-destination", self.artifacts_destination, *self.extra_args]
        self.log = open(self.folder / "server.log", "ab")
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, env=self.env,
                                        start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"mlflow server exited: {(self.folder / 'server.log').read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as response:
                    if response.status == 200:
                        return self
            except OSError:
                time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"mlflow server did not answer in {timeout} s")

    def stop(self) -> None:
        """Kills the whole process group (the server and its uvicorn worker)."""
        if self.process and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        self.process = None
        if getattr(self, "log", None):
            self.log.close()
