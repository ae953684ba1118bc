"""The PyTorch half of ``msprobe_mlflow.autolog()``, installed when torch is imported.

How it finds the model without a line of user code: a global optimizer step pre-hook sees each optimizer's first
step while a run is active and starts a :class:`GradientMonitor` on the outermost module holding that optimizer's
parameters (found once, by walking the live modules), from that step on. Optimizers it has looked at cost one set
lookup per step afterwards. No module hook is installed: a global module hook makes torch warn about, and call it
again for, every compiled model. Under Lightning, the run is the ``MLFlowLogger``'s (it starts no active run).
"""
from __future__ import annotations

import gc
import logging
import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from msprobe_mlflow.config import GradProbeConfig
from msprobe_mlflow.monitoring.options import MonitorOptions
from msprobe_mlflow.pytorch.distributed import current_rank, is_distributed, shared_run_id
from msprobe_mlflow.pytorch.monitor import GradientMonitor, _monitored_models
from msprobe_mlflow.pytorch.trainers import mlflow_logger_run
from msprobe_mlflow.tracking import autologging
from msprobe_mlflow.vocabulary import run_dump_folder

logger = logging.getLogger("msprobe_mlflow")


class TorchAutolog:
    """The hook autolog installed, the monitors it started, and which optimizers it has already looked at."""

    def __init__(self, config: GradProbeConfig, options: MonitorOptions, flavor: str):
        self.config = config
        self.options = options
        self.flavor = flavor  # MLflow's autologging integration, whose ``silent`` setting the monitors follow
        self.monitors: list[GradientMonitor] = []
        self.seen: set[int] = set()
        self.models: weakref.WeakValueDictionary[int, torch.nn.Module] = weakref.WeakValueDictionary()
        self.own_runs: dict[str, str] = {}  # a rank > 0's own active run -> rank 0's run, where its gradients go
        self.hook = register_optimizer_step_pre_hook(self.on_optimizer_step)

    def on_optimizer_step(self, optimizer: torch.optim.Optimizer, args, kwargs) -> None:
        if id(optimizer) in self.seen:
            return
        try:
            self._consider(optimizer)
        except Exception:  # observability must never break training
            self.seen.add(id(optimizer))
            logger.warning("msprobe-mlflow autolog: could not monitor the model of %s", type(optimizer).__name__,
                           exc_info=True)

    def _consider(self, optimizer: torch.optim.Optimizer) -> None:
        model = self.models.get(id(optimizer))
        if model is None:
            model = outermost_model(optimizer)
            if model is None or id(model) in _monitored_models:
                self.seen.add(id(optimizer))
                return
            self.models[id(optimizer)] = model
        active = autologging.active_run_id()
        logger_run = mlflow_logger_run(model)
        if logger_run is None and active is None and not is_distributed():
            return  # looked at again at the next step: a run may start later
        self.seen.add(id(optimizer))
        run_id, tracking_uri = logger_run or (active, None)
        run_id = shared_run_id(run_id)
        config = self.config.replace(dump_path=run_dump_folder(self.config.dump_path, run_id))
        monitor = GradientMonitor(config, options=self.options, run_id=run_id, tracking_uri=tracking_uri,
                                  silent=autologging.silent(self.flavor) or self.options.silent)
        if logger_run is None and active is not None and run_id and active != run_id:
            self.own_runs[active] = run_id
            monitor.notices.warn(
                f"rank {current_rank()} started MLflow run {active} of its own (mlflow.start_run() on "
                f"every rank); under torch.distributed every rank logs into rank 0's run, {run_id}: the gradients go "
                f"there, and run {active} is deleted when it ends if nothing else was logged into it. "
                f"Start the run on rank 0 only: with (mlflow.start_run() if dist.get_rank() == 0 else "
                f"contextlib.nullcontext()):")
        self.monitors.append(monitor.monitor(model, optimizer))  # its hook runs after this one: this step counts

    def stop_monitors(self) -> dict[int, str]:
        """Stops every monitor; returns the ranks they know failed or were killed (the run then ends FAILED)."""
        monitors, self.monitors = self.monitors, []
        self.seen.clear()
        self.models.clear()
        failed = {}
        for monitor in monitors:
            monitor.stop()
            failed.update(monitor.failed_ranks)
        return failed

    def delete_if_empty(self, run_id: str) -> None:
        """After a rank > 0's own run ended: deleted (MLflow's soft delete) when it holds nothing, since its
        gradients went into rank 0's run; kept, and said so, otherwise."""
        into = self.own_runs.pop(run_id, None)
        if into is None:
            return
        if not autologging.delete_if_empty(run_id):
            logger.warning("msprobe-mlflow autolog: rank %d's own run %s holds what the script logged into it, so it "
                           "is kept; the gradients are in rank 0's run %s", current_rank(), run_id, into)
            return
        logger.warning("msprobe-mlflow autolog: deleted the empty run %s that rank %d started (its gradients are in "
                       "rank 0's run %s); restore it with mlflow.MlflowClient().restore_run(%r)", run_id,
                       current_rank(), into, run_id)

    def teardown(self) -> None:
        self.hook.remove()
        self.stop_monitors()



def outermost_model(optimizer: torch.optim.Optimizer) -> torch.nn.Module | None:
    """The outermost live module (a wrapper such as DDP or ``torch.compile``'s, when there is one) holding the
    parameters ``optimizer`` steps: one walk over the garbage collector's objects, once per optimizer."""
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    modules = [m for m in gc.get_objects() if issubclass(type(m), torch.nn.Module)]  # not weakref proxies
    parents = {id(child): module for module in modules for child in module._modules.values() if child is not None}
    roots: dict[int, torch.nn.Module] = {}
    for module in modules:
        if any(id(p) in stepped for p in module._parameters.values() if p is not None):
            climbed = {id(module)}
            while id(module) in parents and id(parents[id(module)]) not in climbed:  # a cycle stops the climb
                module = parents[id(module)]
                climbed.add(id(module))
            roots[id(module)] = module
    return max(roots.values(), key=lambda m: sum(1 for _ in m.parameters()), default=None)
