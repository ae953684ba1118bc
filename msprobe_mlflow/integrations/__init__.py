"""Callbacks for the trainers most users run (optional extras: ``pip install "msprobe-mlflow[lightning]"`` or
``[transformers]``): one line in the trainer's callbacks, the run of the trainer's own MLflow logging."""
from __future__ import annotations

import os

from msprobe_mlflow.config import DEFAULT_BOUNDS, GradProbeConfig, load_config


def callback_config(config, run_id: str | None, source: str) -> GradProbeConfig:
    """The callback's ``config`` (as :class:`GradProbeConfig` takes it), or autolog's default: L1, bounds
    ``[-1, 0, 1]``, dump in ``./msprobe_dump/{run_id}``."""
    if config is not None:
        return load_config(config)
    return GradProbeConfig(dump_path=os.path.join("msprobe_dump", run_id or "no-run"), bounds=DEFAULT_BOUNDS,
                           source=source)
