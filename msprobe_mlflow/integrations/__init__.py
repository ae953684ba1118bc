"""Callbacks for the trainers most users run (optional extras: ``pip install "msprobe-mlflow[lightning]"`` or
``[transformers]``): one line in the trainer's callbacks, the run of the trainer's own MLflow logging. This module
imports neither trainer: autolog uses it to find Lightning's run."""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

from msprobe_mlflow.config import DEFAULT_BOUNDS, GradProbeConfig, load_config
from msprobe_mlflow.parameter_names import wrapper_chain

if TYPE_CHECKING:
    import torch

# Where a callback says what the recorded gradients are (after clipping: not what the trainer's own norm shows).
RECORDED_TAG = "msprobe_mlflow.gradients_recorded"


def checked_callback_config(config, options: dict, source: str) -> GradProbeConfig | None:
    """The callback's ``config`` loaded, and the monitor's ``options`` checked, when the callback is made: a
    mistake found at ``on_train_begin`` would come after the trainer opened its MLflow run, leaving an empty one."""
    from msprobe_mlflow.pytorch.monitor import GradientMonitor  # torch: the callbacks' own dependency

    loaded = None if config is None else load_config(config)
    GradientMonitor(callback_config(loaded, None, source), **options)  # checks only: opens no session, no run
    return loaded


def callback_config(config, run_id: str | None, source: str) -> GradProbeConfig:
    """The callback's ``config`` (as :class:`GradProbeConfig` takes it), or autolog's default: L1, bounds
    ``[-1, 0, 1]``, dump in ``./msprobe_dump/{run_id}``."""
    if config is not None:
        return load_config(config)
    return GradProbeConfig(dump_path=os.path.join("msprobe_dump", run_id or "no-run"), bounds=DEFAULT_BOUNDS,
                           source=source)


def mlflow_logger_run(model: "torch.nn.Module") -> tuple[str | None, str | None] | None:
    """``(run_id, tracking_uri)`` of the ``MLFlowLogger`` of the Lightning trainer ``model`` (or the module its
    wrappers wrap) is attached to; None without one. Ranks other than 0 get ``(None, uri)``: Lightning logs on rank 0
    only."""
    trainer = next((t for m in wrapper_chain(model) if (t := getattr(m, "_trainer", None)) is not None), None)
    for logger in getattr(trainer, "loggers", None) or []:
        if type(logger).__name__ == "MLFlowLogger":
            return logger.run_id, getattr(logger, "_tracking_uri", None)
    return None
