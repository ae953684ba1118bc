"""MLflow housekeeping in one place: the runs this package creates, batched logging within MLflow's limits, and
timestamps. The limits come from ``mlflow.utils.validation``, so they follow the installed MLflow."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from mlflow.entities import Metric, Param, RunTag
from mlflow.tracking import MlflowClient
from mlflow.utils.time import get_current_time_millis
from mlflow.utils.validation import (MAX_ENTITIES_PER_BATCH, MAX_METRICS_PER_BATCH, MAX_PARAM_VAL_LENGTH,
                                     MAX_PARAMS_TAGS_PER_BATCH, MAX_TAG_VAL_LENGTH)


def now_ms() -> int:
    """The timestamp of every value this package logs."""
    return get_current_time_millis()


def clipped(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters, ending in ``...`` when cut."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def param(key: str, value: object) -> Param:
    return Param(key, clipped(str(value), MAX_PARAM_VAL_LENGTH))


def tag(key: str, value: object) -> RunTag:
    return RunTag(key, clipped(str(value), MAX_TAG_VAL_LENGTH))


def log_batched(client: MlflowClient, run_id: str, metrics: list[Metric] = (), params: list[Param] = (),
                tags: list[RunTag] = ()) -> None:
    """Sends everything in as few synchronous ``log_batch`` requests as MLflow's per-request limits allow."""
    metrics, params, tags = list(metrics), list(params), list(tags)
    while metrics or params or tags:
        params_now = params[:MAX_PARAMS_TAGS_PER_BATCH]
        tags_now = tags[:MAX_PARAMS_TAGS_PER_BATCH]
        room = min(MAX_METRICS_PER_BATCH, MAX_ENTITIES_PER_BATCH - len(params_now) - len(tags_now))
        metrics_now = metrics[:room]
        client.log_batch(run_id, metrics=metrics_now, params=params_now, tags=tags_now, synchronous=True)
        metrics, params, tags = metrics[len(metrics_now):], params[len(params_now):], tags[len(tags_now):]


@contextmanager
def created_run(client: MlflowClient, experiment_id: str, *, run_name: str | None = None,
                tags: dict[str, str] | None = None) -> Iterator[str]:
    """A new run for the block's work, ending FINISHED, or FAILED when the block raises."""
    run_id = client.create_run(experiment_id, run_name=run_name, tags=tags).info.run_id
    try:
        yield run_id
    except BaseException:
        client.set_terminated(run_id, "FAILED")
        raise
    client.set_terminated(run_id, "FINISHED")
