"""The PyTorch gradient monitor: an optimizer step pre-hook that probes every monitored gradient.

Unlike msprobe 1.0.3, the step counter counts the monitored optimizer's steps only, every hook is removable
(``stop()``), a second ``monitor()`` does not double count, and a failure in the probe never breaks training.
"""
from __future__ import annotations

import os

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from msprobe_mlflow.config import GradProbeConfig
from msprobe_mlflow.monitoring import SessionMonitor
from msprobe_mlflow.pytorch.distributed import current_rank, shared_run_id, summary_all_gather, world_size
from msprobe_mlflow.pytorch.statistics import launch_step_statistics
from msprobe_mlflow.session import RankPolicy

# model id -> the monitor watching it, so two monitors never probe one model by accident.
_monitored_models: dict[int, "GradientMonitor"] = {}


class GradientMonitor(SessionMonitor):
    """Probes gradients at every step of one optimizer, writes msprobe's dump and logs into MLflow.

    MLflow: into ``run_id``, else the active run (else ``MLFLOW_RUN_ID``); with none, the local dump only. Under
    torch.distributed, every rank logs into rank 0's run (call ``monitor()`` on every rank). ``log_to_mlflow=False``
    turns MLflow off. More outputs: ``metrics_file``, ``sinks`` (see :class:`SessionMonitor`). Use as ``GradientMonitor(config).monitor(model, optimizer)`` ... ``stop()``, or as a context manager.
    """

    def __init__(self, config: GradProbeConfig | str | os.PathLike | dict, **options):
        """``options``: ``run_id``, ``tracking_uri``, ``log_every_n_steps``, ``param_metrics``, ``log_to_mlflow``,
        ``silent``, ``metrics_file``, ``sinks``; the live verdicts' ``baseline``, ``on_suspicious``,
        ``first_threshold``, ``drop_threshold``, ``anomaly_flags``, ``spike_threshold``, ``spike_window`` (see
        :class:`SessionMonitor`)."""
        super().__init__(config, **options)
        self._parameters: list[tuple[str, torch.nn.Parameter]] = []
        self._optimizer: torch.optim.Optimizer | None = None
        self._model_id: int | None = None
        self._hook = None

    def monitor(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> "GradientMonitor":
        """Starts probing ``model``'s gradients at each ``optimizer.step()``.

        Without ``optimizer``, the first optimizer whose ``step()`` updates one of the model's parameters is the
        one counted. Calling it again re-targets the monitor; the step counter goes on.
        """
        other = _monitored_models.get(id(model))
        if other is not None and other is not self:
            raise ValueError("this model is already monitored by another GradientMonitor; call its stop() first")
        self._remove_hook()
        if self._session is None or self._session.closed:  # first: a bad dump_path fails before any hook exists
            self._session = self._open_session("pytorch", RankPolicy.of(self.config, current_rank(), world_size()),
                                               shared_run_id, summary_all_gather)
        self._parameters = [(n, p) for n, p in model.named_parameters() if self.config.wants_param(n)]
        missing = set(self.config.param_list) - {n for n, _ in model.named_parameters()}
        if missing:
            self.notices.warn(f"grad_probe.param_list names parameters the model does not have: {sorted(missing)}")
        self._optimizer = optimizer
        self._model_id = id(model)
        _monitored_models[self._model_id] = self
        if optimizer is not None:
            self._hook = optimizer.register_step_pre_hook(self._on_optimizer_step)
        else:
            self._hook = register_optimizer_step_pre_hook(self._on_optimizer_step)
        return self

    def _owns_model_parameters(self, optimizer: torch.optim.Optimizer) -> bool:
        watched = {id(p) for _, p in self._parameters}
        return any(id(p) in watched for group in optimizer.param_groups for p in group["params"])

    def _on_optimizer_step(self, optimizer, args, kwargs) -> None:
        if self._optimizer is None and self._owns_model_parameters(optimizer):
            self._optimizer = optimizer
        if optimizer is not self._optimizer:
            return
        step, self.step = self.step, self.step + 1
        ranks = self._session.ranks
        try:
            if self.config.wants_step(step) and ranks.probes:
                self._probe(ranks.rank, step)
        except Exception as e:  # observability must never break training
            self.notices.failure("probe", f"probing step {step} failed ({e!r})")

    def _probe(self, rank: int, step: int) -> None:
        names, grads = [], []
        for name, parameter in self._parameters:
            grad = parameter.main_grad if hasattr(parameter, "main_grad") else parameter.grad
            if grad is None:
                continue
            if grad.is_sparse:
                grad = grad.to_dense()
            names.append(name)
            grads.append(grad.detach())
        pending = launch_step_statistics(names, grads, rank=rank, step=step, level=self.config.level,
                                         bounds=self.config.bounds)
        self._session.submit(pending)

    def _remove_hook(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self._model_id is not None and _monitored_models.get(self._model_id) is self:
            del _monitored_models[self._model_id]

    def stop(self) -> None:
        """Removes every hook, writes what is pending and stops the writer thread. Safe to call twice."""
        self._remove_hook()
        if self._session:
            self._session.close()


class PrecisionDebugger:
    """Drop-in for ``msprobe.pytorch.PrecisionDebugger(config_path).monitor(model)`` (task ``grad_probe``).

    Each instance uses its own config; a second debugger on the same model is refused, not silently ignored.
    """

    def __init__(self, config_path: str | os.PathLike, **overrides):
        self.config = GradProbeConfig.from_json(config_path, **overrides)
        self.monitor_ = GradientMonitor(self.config)

    def monitor(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> GradientMonitor:
        return self.monitor_.monitor(model, optimizer)

    def stop(self) -> None:
        self.monitor_.stop()
