"""Is the tracking server there? Asked once, quickly, by a command before it does any work with MLflow.

MLflow's client retries a request that cannot connect, with back-off, for minutes (``MLFLOW_HTTP_REQUEST_MAX_RETRIES``
and ``MLFLOW_HTTP_REQUEST_TIMEOUT``), then reports urllib3's text: right for training, which must ride out a
restart, wrong for a command, whose user mistyped a URI or forgot to start the server. Training does not call this.
"""
from __future__ import annotations

import re
from urllib.parse import urlparse

CHECK_TIMEOUT_SECONDS = 5
HEALTH_ENDPOINT = "/health"  # what `mlflow server` answers without credentials


class TrackingServerUnreachable(ConnectionError):
    """An operational failure (exit code 1): the server did not answer at all."""


def require_tracking_server(tracking_uri: str | None) -> None:
    """Raises :class:`TrackingServerUnreachable`, naming the URI and the request tried, when ``tracking_uri`` (None:
    MLflow's current one) is an ``http(s)`` server that does not answer one ``GET /health`` within
    ``CHECK_TIMEOUT_SECONDS`` (no retries). Any HTTP answer counts as reachable: credentials and statuses are the
    later requests' business. Other stores (SQLite, a folder, Databricks) are not checked."""
    import mlflow
    from mlflow.exceptions import MlflowException
    from mlflow.utils.credentials import get_default_host_creds
    from mlflow.utils.rest_utils import http_request

    uri = tracking_uri or mlflow.get_tracking_uri()
    if urlparse(uri).scheme not in ("http", "https"):
        return
    try:  # MLflow's own request: the same TLS settings, proxies and credentials as the command's requests
        http_request(get_default_host_creds(uri), HEALTH_ENDPOINT, "GET", max_retries=0, backoff_factor=0,
                     timeout=CHECK_TIMEOUT_SECONDS, raise_on_status=False)
    except MlflowException as error:
        reason = _short_reason(error.__cause__ or error.__context__ or error)
        raise TrackingServerUnreachable(
            f"cannot reach the MLflow tracking server at {uri}: GET {uri.rstrip('/')}{HEALTH_ENDPOINT} (one try, "
            f"{CHECK_TIMEOUT_SECONDS} s timeout) failed: {reason}. Check the URI (--tracking-uri, "
            f"MLFLOW_TRACKING_URI) and that the server is running") from None


def _short_reason(error: BaseException) -> str:
    """``[Errno 111] Connection refused`` rather than urllib3's paragraph; the exception's name when there is none."""
    found = re.search(r"\[Errno -?\d+\] [^'\")]+", str(error))
    if found:
        return found.group(0).strip()
    return f"no answer within {CHECK_TIMEOUT_SECONDS} s" if "timeout" in type(error).__name__.lower() \
        else type(error).__name__
