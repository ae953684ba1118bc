"""MLflow stores for tests: where a test's SQLite store lies, as a tracking URI (the fixtures that make one current
are in tests/conftest.py: ``sqlite_store``, ``tmp_experiment``, ``tmp_sqlite_uri``)."""
from __future__ import annotations

from pathlib import Path


def sqlite_uri(folder: str | Path, file: str = "mlflow.db") -> str:
    """The tracking URI of the SQLite store ``folder/file``: ``sqlite:///`` followed by the file's path."""
    return f"sqlite:///{Path(folder) / file}"
