"""Is the tracking server there, and is it MLflow? Is the local store there? Asked once, quickly, by a command
before it does any work with MLflow.

MLflow's client retries a request that cannot connect, with back-off, for minutes (``MLFLOW_HTTP_REQUEST_MAX_RETRIES``
and ``MLFLOW_HTTP_REQUEST_TIMEOUT``), then reports urllib3's text: right for training, which must ride out a
restart, wrong for a command, whose user mistyped a URI or forgot to start the server. Training does not call this.
A local store (SQLite, a folder) that does not exist is created by MLflow when opened, empty, after ~10 s of
migrations: a command that reads runs from it refuses it instead.
"""
from __future__ import annotations

import json
import os
import re
import sys
from urllib.parse import urlparse

CHECK_TIMEOUT_SECONDS = 5
HEALTH_ENDPOINT = "/health"  # what `mlflow server` answers without credentials
# An API request every MLflow server answers with JSON, even when the experiment is gone (a JSON 404).
API_ENDPOINT, API_PARAMS = "/api/2.0/mlflow/experiments/get", {"experiment_id": "0"}
POINT_AT_STORE = "--tracking-uri or MLFLOW_TRACKING_URI (tracking_uri= in Python)"


class TrackingServerUnreachable(ConnectionError):
    """An operational failure (exit code 1): the server did not answer at all."""


class NotATrackingServer(ConnectionError):
    """An operational failure (exit code 1, as an unreachable server): something answers at the URI, but not
    MLflow (an HTTP 404 without MLflow's JSON error)."""


class NoTrackingStore(ValueError):
    """Bad input (exit code 2): runs to read from a local store that does not exist."""


def tracking_uri_if_imported() -> str | None:
    """MLflow's current tracking URI when this process has imported MLflow (where it would look a run up), else
    None, without importing it."""
    mlflow = sys.modules.get("mlflow")
    return mlflow.get_tracking_uri() if mlflow is not None else None


def require_tracking_server(tracking_uri: str | None) -> None:
    """Raises :class:`TrackingServerUnreachable`, naming the URI and the request tried, when ``tracking_uri`` (None:
    MLflow's current one) is an ``http(s)`` server that does not answer one ``GET /health`` within
    ``CHECK_TIMEOUT_SECONDS`` (no retries), and :class:`NotATrackingServer` when ``/health`` or the API answers an
    HTTP 404 that is not MLflow's (MLflow answers ``/health``, and its API's 404s are JSON errors). Any other answer
    counts: credentials and statuses are the later requests' business. Other stores (SQLite, a folder, Databricks)
    are not checked."""
    import mlflow
    from mlflow.exceptions import MlflowException
    from mlflow.utils.credentials import get_default_host_creds
    from mlflow.utils.rest_utils import http_request

    uri = tracking_uri or mlflow.get_tracking_uri()
    if urlparse(uri).scheme not in ("http", "https"):
        return
    for endpoint, params in ((HEALTH_ENDPOINT, None), (API_ENDPOINT, API_PARAMS)):
        request = f"GET {uri.rstrip('/')}{endpoint}"
        try:  # MLflow's own request: the same TLS settings, proxies and credentials as the command's requests
            response = http_request(get_default_host_creds(uri), endpoint, "GET", max_retries=0, backoff_factor=0,
                                    timeout=CHECK_TIMEOUT_SECONDS, raise_on_status=False, params=params)
        except MlflowException as error:
            reason = _short_reason(error.__cause__ or error.__context__ or error)
            raise TrackingServerUnreachable(
                f"cannot reach the MLflow tracking server at {uri}: {request} (one try, {CHECK_TIMEOUT_SECONDS} s "
                f"timeout) failed: {reason}. Check the URI (--tracking-uri, MLFLOW_TRACKING_URI) and that the "
                f"server is running") from None
        if response.status_code == 404 and not _is_json(response.text):
            server = response.headers.get("Server")
            raise NotATrackingServer(
                f"{uri} is not an MLflow tracking server: {request} answered HTTP 404 {response.reason}"
                f"{f' (Server: {server})' if server else ''}, which MLflow never does. Check the URI "
                f"(--tracking-uri, MLFLOW_TRACKING_URI): the host, the port (another service may hold it) and the "
                f"path")


def require_existing_store(tracking_uri: str | None, label: str, maybe_folder: bool = True) -> None:
    """Raises :class:`NoTrackingStore`, naming the run (``label``, e.g. ``A = '3f2a...'``; ``maybe_folder``: it
    could have named a dump folder), the URI and the file or folder looked for, when a run is to be read from
    ``tracking_uri`` (None: MLflow's current one, by default ``sqlite:///mlflow.db`` in the current folder) and it
    is a SQLite file or a folder that does not exist: opening it would create an empty store (``get_run``'s "no
    MLflow run with this ID", after seconds of migrations, and a stray ``mlflow.db``)."""
    import mlflow

    uri = tracking_uri or mlflow.get_tracking_uri()
    location = _local_store_path(uri)
    if location is None or os.path.exists(location):
        return
    kind = "SQLite file" if uri.startswith("sqlite:") else "folder"
    raise NoTrackingStore(
        f"{label}: {'no such folder, and ' if maybe_folder else ''}no MLflow run with this ID at {uri}: there is "
        f"no tracking store there (the {kind} {os.path.abspath(location)} does not exist; nothing was created). "
        f"Point at the store that holds the run with {POINT_AT_STORE}, e.g. sqlite:////path/to/mlflow.db or "
        f"http://host:5000")


def _local_store_path(uri: str) -> str | None:
    """The SQLite file or the folder a local store URI names; None for any other store (and in-memory SQLite)."""
    scheme = urlparse(uri).scheme
    if scheme == "sqlite":
        from sqlalchemy.engine import make_url

        database = make_url(uri).database
        return None if database in (None, "", ":memory:") else database
    if scheme in ("", "file"):
        from mlflow.utils.uri import local_file_uri_to_path

        return local_file_uri_to_path(uri)
    return None


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _short_reason(error: BaseException) -> str:
    """``[Errno 111] Connection refused`` rather than urllib3's paragraph; ``timed out`` when no answer came in time
    (a server that accepts and never answers: requests reports that read timeout, retries off, as a
    ``ConnectionError``); else the exception's name."""
    found = re.search(r"\[Errno -?\d+\] [^'\")]+", str(error))
    if found:
        return found.group(0).strip()
    if "timeout" in type(error).__name__.lower() or "timed out" in str(error).lower():
        return f"timed out, no answer within {CHECK_TIMEOUT_SECONDS} s (a hung or overloaded server, or another " \
               f"program on that port)"
    return type(error).__name__
