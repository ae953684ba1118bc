"""A JSON-lines file of each step's summary metrics next to the dump, to ``tail -f`` while training runs.

``{dump_path}/rank{R}/metrics.jsonl``, one line per probed step, appended and flushed as the step lands::

    {"step": 3, "rank": 0, "timestamp_ms": 1764570000000, "total_norm": 0.82, "max": 0.11, "min": -0.09, ...}

The keys are the MLflow metric keys without their ``grad/rank{R}/`` prefix; NaN and infinities, which strict JSON
cannot hold, are written as the strings ``"nan"``, ``"inf"`` and ``"-inf"``.
"""
from __future__ import annotations

import json
import math
import time

from msprobe_mlflow.dump import rank_dir
from msprobe_mlflow.metrics import record_metrics
from msprobe_mlflow.records import StepRecord
from msprobe_mlflow.vocabulary import grad_key

FILE_NAME = "metrics.jsonl"


def _json_number(value: float) -> float | str:
    return value if math.isfinite(value) else str(value)


class JsonLinesMetricsSink:
    def __init__(self, dump_path: str, param_patterns: tuple[str, ...] = ()):
        self.dump_path = dump_path
        self.param_patterns = param_patterns
        self._files = {}  # rank -> open file

    def handle(self, record: StepRecord) -> None:
        prefix = grad_key(record.rank)
        line = {"step": record.step, "rank": record.rank, "timestamp_ms": int(time.time() * 1000)}
        line.update((key.removeprefix(prefix), _json_number(value))
                    for key, value in record_metrics(record, self.param_patterns).items())
        if record.rank not in self._files:
            self._files[record.rank] = open(rank_dir(self.dump_path, record.rank) / FILE_NAME, "a", encoding="utf-8")
        file = self._files[record.rank]
        file.write(json.dumps(line) + "\n")
        file.flush()

    def flush(self) -> None:
        """Every line is flushed as it is written."""

    def close(self) -> None:
        for file in self._files.values():
            file.close()
        self._files.clear()
