"""How a monitor logs to MLflow, importable without importing MLflow (it is imported when a run is looked up)."""
from __future__ import annotations

import os
from dataclasses import dataclass

from msprobe_mlflow.vocabulary import MLFLOW_STEP_OFFSET_TAG  # a run's MLflow step - its training step

__all__ = ["MLFLOW_STEP_OFFSET_TAG", "TrackingOptions"]


@dataclass(frozen=True)
class TrackingOptions:
    """How a monitor logs to MLflow. ``run_id`` None: the active run, else ``MLFLOW_RUN_ID``, else none (the
    local dump only). ``log_every_n_steps`` thins what is sent live; ``upload`` can still send every step.
    ``param_metrics``: parameter names or glob patterns that also get per-parameter metrics.
    ``aggregate_metrics``: rank 0 sends every rank's summary metrics (``tracking.aggregate``); None: from 64 ranks.
    ``archive_every_n_steps``: each rank's files go up as one archive per this many sent steps (1: a file each).
    ``mlflow_step_offset``: MLflow step = training step + this, for a trainer whose own metrics count from 1 (Hugging
    Face Trainer); the dump keeps msprobe's steps, and the run's tag ``MLFLOW_STEP_OFFSET_TAG`` tells ``upload``."""

    run_id: str | None = None
    tracking_uri: str | None = None
    log_every_n_steps: int = 1
    param_metrics: tuple[str, ...] = ()
    aggregate_metrics: bool | None = None
    archive_every_n_steps: int = 1
    mlflow_step_offset: int = 0

    def __post_init__(self):
        for name in ("log_every_n_steps", "archive_every_n_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} = {value!r} is not accepted; expected an integer >= 1")
        offset = self.mlflow_step_offset
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise ValueError(f"mlflow_step_offset = {offset!r} is not accepted; expected an integer >= 0 (MLflow "
                             f"step = training step + this)")
        if self.aggregate_metrics is not None and not isinstance(self.aggregate_metrics, bool):
            raise ValueError(f"aggregate_metrics = {self.aggregate_metrics!r} is not accepted; expected True, False "
                             f"or None (on from 64 ranks)")
        if isinstance(self.param_metrics, str):
            object.__setattr__(self, "param_metrics", (self.param_metrics,))
        object.__setattr__(self, "param_metrics", tuple(self.param_metrics or ()))

    def local_run_id(self) -> str | None:
        if self.run_id:
            return self.run_id
        import mlflow

        active = mlflow.active_run()
        return active.info.run_id if active else os.environ.get("MLFLOW_RUN_ID") or None
