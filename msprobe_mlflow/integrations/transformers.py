"""Hugging Face ``Trainer``: ``Trainer(..., callbacks=[GradientProbeCallback()])`` probes into the Trainer's own
MLflow run (its ``MLflowCallback`` starts it before this callback's ``on_train_begin``).

One record per optimizer step, whatever ``gradient_accumulation_steps``: the monitor watches the optimizer inside
accelerate's wrapper, which steps it only when the gradients are synchronised. Steps: Trainer counts the steps
done, we number them from 0 (the dump's step S is Trainer's ``global_step`` S + 1), so in MLflow the probe's metrics
go at step S + 1, beside Trainer's ``loss`` and ``grad_norm`` of the same step (``mlflow_step_offset``). Trainer
clips before ``step()`` (``max_grad_norm``, 1.0 by default), so the recorded gradients, and ``total_norm``, are the
clipped ones; ``total_norm_before_clipping`` beside it is Trainer's ``grad_norm``, at every step: what
accelerate's ``Accelerator.clip_grad_norm_`` returns to Trainer, whatever accelerate clips with
(:class:`~msprobe_mlflow.integrations.NormsBeforeClipping`); the run's tag ``msprobe_mlflow.gradients_recorded``
names it once the first one is logged.
"""
from __future__ import annotations

import os


try:
    from accelerate import Accelerator
    from transformers import TrainerCallback
except ImportError as missing:
    raise ImportError(f"msprobe_mlflow.integrations.transformers needs Hugging Face transformers and accelerate "
                      f"({missing}): pip install \"msprobe-mlflow[transformers]\"") from missing

from msprobe_mlflow.config import GradProbeConfig
from msprobe_mlflow.integrations import (NormsBeforeClipping, callback_config, checked_callback_config,
                                         with_sink)
from msprobe_mlflow.metrics import NORM_BEFORE_CLIPPING
from msprobe_mlflow.monitoring.options import MonitorOptions
from msprobe_mlflow.pytorch.monitor import GradientMonitor
from msprobe_mlflow.tracking.autologging import active_run_id
from msprobe_mlflow.vocabulary import MLFLOW_STEP_OFFSET_TAG, RECORDED_TAG


class GradientProbeCallback(TrainerCallback):
    """Probes the model's gradients at each optimizer step, from ``on_train_begin`` to ``on_train_end``, into the
    active MLflow run (Trainer's, with ``report_to="mlflow"``), else the local dump only.

    ``config``: as :class:`GradientMonitor` takes it (default: L1 in ``./msprobe_dump/{run_id}``); ``options`` (or
    their keywords): the monitor's, :class:`~msprobe_mlflow.MonitorOptions` (``mlflow_step_offset`` is 1:
    Trainer's step numbers).
    """

    def __init__(self, config: GradProbeConfig | str | os.PathLike | dict | None = None, *,
                 options: MonitorOptions | None = None, **keywords):
        self.config, self.options = checked_callback_config(config, options, keywords, "GradientProbeCallback")
        self.monitor: GradientMonitor | None = None

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        config = callback_config(self.config, active_run_id(), "GradientProbeCallback")
        clipped = f"after clipping (max_grad_norm={args.max_grad_norm})"
        steps = "MLflow step S+1 is the dump's step S"
        norms = None
        if args.max_grad_norm > 0:  # by accelerate, before step()
            norms = NormsBeforeClipping(clips_inside_step=False, clipped_by=Accelerator,
                                        tag=f"{clipped}; {NORM_BEFORE_CLIPPING} is the norm before clipping "
                                            f"(Trainer's grad_norm); {steps}")
        # in MLflow, at Trainer's step numbers: its global_step after the step
        self.monitor = GradientMonitor(config, options=with_sink(self.options, norms), mlflow_step_offset=1)
        self.monitor.monitor(model, getattr(optimizer, "optimizer", optimizer))  # accelerate's wrapper holds it
        self.monitor.tag_run({MLFLOW_STEP_OFFSET_TAG: "1"})
        if norms is not None:
            self.monitor.tag_run({RECORDED_TAG: f"{clipped}; {steps}"})  # the norm before clipping: when logged
            norms.watch(self.monitor, model)

    def on_train_end(self, args, state, control, **kwargs):
        if self.monitor is not None:
            self.monitor.stop()
