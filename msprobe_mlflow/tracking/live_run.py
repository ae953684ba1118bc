"""The MLflow requests of the live sink (``msprobe_mlflow.sinks.mlflow``), for one run: the sink decides when and
what, this module is how. Values travel as :class:`MetricPoint` (no MLflow type in the sink)."""
from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import mlflow
from mlflow.entities import Metric
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from msprobe_mlflow import __version__
from msprobe_mlflow.config import GradProbeConfig
from msprobe_mlflow.dump import relative_rank_dir, write_steps_archive
from msprobe_mlflow.session import RankPolicy
from msprobe_mlflow.tracking.exponent_images import log_exponent_pictures
from msprobe_mlflow.tracking.runs import log_batched, now_ms, param, tag
from msprobe_mlflow.tracking.upload import (dump_step_metrics, end_run_failed, packed_directions_file, upload_dump,
                                           upload_steps_files)
from msprobe_mlflow.vocabulary import (ARTIFACT_ROOT, CONFIG_FILE_NAME, DUMP_PATH_TAG, FRAMEWORK_TAG, LEVEL_TAG,
                                       OVER_RANKS, RANK_SUMMARY_TAG, RUNNING, VERSION_TAG, WORLD_SIZE_TAG,
                                       rank_status_tag, rank_tag)

REFUSED_CREDENTIALS = {"UNAUTHENTICATED": "401 not authenticated",  # MLflow's error codes for HTTP 401 and 403
                       "PERMISSION_DENIED": "403 permission denied"}


class MetricPoint(NamedTuple):
    """One value of a metric at an MLflow step."""

    key: str
    value: float
    timestamp_ms: int
    step: int


def metric_points(metrics: dict[str, float], step: int, timestamp_ms: int | None = None) -> list[MetricPoint]:
    timestamp_ms = now_ms() if timestamp_ms is None else timestamp_ms
    return [MetricPoint(key, value, timestamp_ms, step) for key, value in metrics.items()]


@dataclass(frozen=True)
class DumpSteps:
    """Steps whose metrics are read from the local dump (``upload``'s :func:`dump_step_metrics`: the values the
    writer thread would have computed from the record) by whoever makes the request: the request process."""

    dump_path: str
    rank: int
    steps: list[int]
    mlflow_step_offset: int = 0
    param_patterns: tuple[str, ...] = ()

    def metric_points(self) -> list[MetricPoint]:
        return [point for step in self.steps for point in metric_points(
            dump_step_metrics(self.dump_path, self.rank, step, self.param_patterns), step + self.mlflow_step_offset)]


def refused_credentials(error: Exception) -> str | None:
    """``401 not authenticated`` or ``403 permission denied`` when ``error`` is the server refusing the credentials."""
    return REFUSED_CREDENTIALS.get(error.error_code) if isinstance(error, MlflowException) else None


def end_active_run_failed(run_ids: set[str]) -> None:
    """Ends the active run FAILED when it is one of ``run_ids`` (MLflow's exit handler would end it FINISHED)."""
    active = mlflow.active_run()
    if active is not None and active.info.run_id in run_ids:
        mlflow.end_run("FAILED")


class LiveRun:
    """One run's client and the requests the live sink makes into it."""

    def __init__(self, run_id: str, tracking_uri: str | None):
        self.run_id = run_id
        self.client = MlflowClient(tracking_uri)

    @property
    def tracking_uri(self) -> str:
        return self.client.tracking_uri

    def describe(self, config: GradProbeConfig, ranks: RankPolicy, framework: str, every_rank: bool) -> None:
        """The run's start: ranks ``running`` (``every_rank``: rank 0 tags them all), this rank's dump path; on the
        rank that owns the run, the run's tags, the config's params and ``grad_probe/config.json``."""
        dump_path = os.path.abspath(config.dump_path)
        if every_rank:  # under aggregation: rank 0 tags every rank, and logs the distributions over the ranks
            tags = [tag(rank_status_tag(rank), RUNNING) for rank in range(ranks.world_size)]
            tags.append(tag(RANK_SUMMARY_TAG, OVER_RANKS))
        else:
            tags = [tag(rank_status_tag(ranks.rank), RUNNING), tag(rank_tag(ranks.rank, "dump_path"), dump_path)]
        params = []
        if ranks.owns_run:
            tags += [tag(key, value) for key, value in (
                (FRAMEWORK_TAG, framework), (LEVEL_TAG, config.level), (VERSION_TAG, __version__),
                (WORLD_SIZE_TAG, ranks.world_size), (DUMP_PATH_TAG, dump_path))]
            msprobe = config.to_msprobe_dict()
            params = [param(f"grad_probe.{key}", value if isinstance(value, str) else json.dumps(value))
                      for key, value in (
                ("level", config.level), ("bounds", msprobe["grad_probe"]["bounds"]),
                ("param_list", msprobe["grad_probe"]["param_list"]), ("rank", msprobe["rank"]),
                ("step", msprobe["step"]), ("direction_format", config.direction_format),
                *config.tier_options().items())]
        log_batched(self.client, self.run_id, params=params, tags=tags)
        if ranks.owns_run:
            with tempfile.TemporaryDirectory() as scratch:
                path = Path(scratch) / CONFIG_FILE_NAME
                path.write_text(json.dumps(msprobe, indent=2), encoding="utf-8")
                self.client.log_artifact(self.run_id, str(path), ARTIFACT_ROOT)

    def log(self, metrics: list[MetricPoint] = (), tags: dict[str, str] | None = None,
            in_dump: DumpSteps | None = None) -> None:
        """``metrics`` and ``tags``, and the metrics of the steps ``in_dump`` names, read from the local dump."""
        metrics = [*metrics, *(in_dump.metric_points() if in_dump else ())]
        log_batched(self.client, self.run_id, metrics=[Metric(*point) for point in metrics],
                    tags=[tag(key, value) for key, value in (tags or {}).items()])

    def set_tag(self, key: str, value: str) -> None:
        self.client.set_tag(self.run_id, key, value)

    def tags(self) -> dict[str, str]:
        return self.client.get_run(self.run_id).data.tags

    def send_step_files(self, dump_path: str, rank: int, steps: list[int]) -> None:
        upload_steps_files(self.client, self.run_id, dump_path, rank, steps)

    def send_archive(self, dump_path: str, rank: int, steps: list[int]) -> None:
        """``steps``' files as one ``steps_{ranges}.zip`` under ``grad_probe/rank{R}/``."""
        with tempfile.TemporaryDirectory() as scratch:
            archive = write_steps_archive(dump_path, rank, steps, Path(scratch), packed_directions_file)
            self.client.log_artifact(self.run_id, str(archive), f"{ARTIFACT_ROOT}/{relative_rank_dir(rank)}")

    def send_dump_file(self, dump_path: str, path: Path) -> None:
        """A file inside the dump folder, into the ``grad_probe/`` folder that mirrors its own."""
        relative = path.resolve().parent.relative_to(Path(dump_path).resolve())
        self.client.log_artifact(self.run_id, str(path), "/".join((ARTIFACT_ROOT, *relative.parts)))

    def upload(self, dump_path: str, rank: int, steps: set[int], param_patterns, mlflow_step_offset: int) -> None:
        """``steps`` of ``rank`` from the local dump, as ``msprobe-mlflow upload`` sends them but the pictures (the
        sink draws those once, at the end)."""
        upload_dump(dump_path, self.run_id, tracking_uri=self.tracking_uri, ranks=[rank], steps=steps,
                    param_patterns=param_patterns, mlflow_step_offset=mlflow_step_offset, pictures=False)

    def send_exponent_pictures(self, dump_path: str, rank: int, mlflow_step_offset: int,
                               first_and_latest: bool = False) -> None:
        log_exponent_pictures(self.client, self.run_id, dump_path, rank, mlflow_step_offset, first_and_latest)

    def end_failed(self, news: dict[int, str], reason: str = "") -> list[int]:
        """Tags ``news`` (``{rank: status}``) and ends the run FAILED when a rank failed (``upload.end_run_failed``)."""
        return end_run_failed(self.client, self.run_id, news, reason)
