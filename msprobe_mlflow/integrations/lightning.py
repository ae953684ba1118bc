"""Lightning: ``Trainer(logger=MLFlowLogger(...), callbacks=[GradientProbeCallback()])`` probes into the logger's run.

``MLFlowLogger`` creates its run with ``MlflowClient.create_run``: no run is active, so nothing that looks for the
active run finds it. :func:`~msprobe_mlflow.pytorch.trainers.mlflow_logger_run` finds it from the model (autolog uses
it too). Under automatic optimization Lightning calls ``optimizer.step(closure)`` with a closure that runs the
training step, the backward and the gradient clipping; the monitor probes when that closure returns, so a record
holds the accumulated, clipped gradients the optimizer applies, one record per optimizer step whatever
``accumulate_grad_batches``; with ``gradient_clip_val`` (by norm), ``total_norm_before_clipping`` beside
``total_norm`` is the norm Lightning clipped them from (:class:`~msprobe_mlflow.integrations.NormsBeforeClipping`).
"""
from __future__ import annotations

import os

import torch

from msprobe_mlflow.config import GradProbeConfig
from msprobe_mlflow.integrations import NormsBeforeClipping, callback_config, checked_callback_config, with_sink
from msprobe_mlflow.metrics import NORM_BEFORE_CLIPPING
from msprobe_mlflow.monitoring.options import MonitorOptions
from msprobe_mlflow.pytorch.monitor import GradientMonitor
from msprobe_mlflow.pytorch.trainers import mlflow_logger_run
from msprobe_mlflow.vocabulary import RECORDED_TAG

try:
    from lightning.pytorch import Callback
except ImportError:  # the older package name, or no Lightning (the callback then refuses to start)
    try:
        from pytorch_lightning import Callback
    except ImportError:
        Callback = object


class GradientProbeCallback(Callback):
    """Probes the LightningModule's gradients at each optimizer step into the ``MLFlowLogger``'s run (else the
    active run), from ``on_train_start`` to ``on_train_end``.

    ``config``: as :class:`GradientMonitor` takes it (default: L1 in ``./msprobe_dump/{run_id}``); ``options`` (or
    their keywords): the monitor's, :class:`~msprobe_mlflow.MonitorOptions`.
    """

    def __init__(self, config: GradProbeConfig | str | os.PathLike | dict | None = None, *,
                 options: MonitorOptions | None = None, **keywords):
        if Callback is object:
            raise ImportError('GradientProbeCallback needs Lightning: pip install "msprobe-mlflow[lightning]"')
        self.config, self.options = checked_callback_config(config, options, keywords, "GradientProbeCallback")
        self.monitor: GradientMonitor | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        run_id, tracking_uri = mlflow_logger_run(pl_module) or (None, None)
        config = callback_config(self.config, run_id, "GradientProbeCallback")
        optimizer = trainer.optimizers[0] if len(trainer.optimizers) == 1 else None
        by_norm = (trainer.gradient_clip_algorithm or "norm") == "norm"  # Lightning's default
        clipped = f"after clipping (gradient_clip_val={trainer.gradient_clip_val}{'' if by_norm else ', by value'})"
        norms = None
        if trainer.gradient_clip_val and by_norm:  # in the closure, with torch.nn.utils.clip_grad_norm_
            norms = NormsBeforeClipping(clips_inside_step=True, clipped_by=torch.nn.utils,
                                        tag=f"{clipped}; {NORM_BEFORE_CLIPPING} is the norm before clipping")
        self.monitor = GradientMonitor(config, options=with_sink(self.options, norms), run_id=run_id,
                                       tracking_uri=tracking_uri)
        self.monitor.monitor(pl_module, optimizer)
        if trainer.gradient_clip_val:
            self.monitor.tag_run({RECORDED_TAG: clipped})
        if norms is not None:  # the norm before clipping: tagged when logged
            norms.watch(self.monitor, pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        if self.monitor is not None:
            self.monitor.stop()

    def on_exception(self, trainer, pl_module, exception) -> None:
        self.on_train_end(trainer, pl_module)
