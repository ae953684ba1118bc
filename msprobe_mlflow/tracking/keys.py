"""MLflow key rules: one invalid key rejects a whole ``log_batch``, so every key is sanitised before sending."""
from __future__ import annotations

import re

MAX_KEY_LENGTH = 250
_NOT_ALLOWED = re.compile(r"[^/\w.\- :]")


def metric_key(*parts: str) -> str:
    """``parts`` joined with ``/``, characters outside MLflow's ``[/\\w.\\- :]`` replaced by ``_``, cut to 250."""
    key = _NOT_ALLOWED.sub("_", "/".join(parts))
    key = re.sub(r"/{2,}", "/", key)
    return key[:MAX_KEY_LENGTH]


def bucket_metric_name(label: str) -> str:
    """``(-1, 0]`` -> ``fraction/-1_to_0``; ``=0`` -> ``zero_fraction``."""
    if label == "=0":
        return "zero_fraction"
    low, high = (part.strip() for part in label.strip("(]) ").split(","))
    return f"fraction/{low}_to_{high}"
