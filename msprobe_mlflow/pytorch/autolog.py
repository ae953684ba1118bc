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
import os
import weakref

import mlflow
import torch
from mlflow.utils.autologging_utils import get_autologging_config
from torch.optim.optimizer import register_optimizer_step_pre_hook

from msprobe_mlflow.config import GradProbeConfig
from msprobe_mlflow.integrations import mlflow_logger_run
from msprobe_mlflow.pytorch.distributed import is_distributed, shared_run_id
from msprobe_mlflow.pytorch.monitor import GradientMonitor, _monitored_models

logger = logging.getLogger("msprobe_mlflow")


class TorchAutolog:
    """The hook autolog installed, the monitors it started, and which optimizers it has already looked at."""

    def __init__(self, config: GradProbeConfig, monitor_options: dict, flavor: str):
        self.config = config
        self.monitor_options = monitor_options
        self.flavor = flavor  # MLflow's autologging integration, whose ``silent`` setting the monitors follow
        self.monitors: list[GradientMonitor] = []
        self.seen: set[int] = set()
        self.models: weakref.WeakValueDictionary[int, torch.nn.Module] = weakref.WeakValueDictionary()
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
        active = mlflow.active_run()
        logger_run = mlflow_logger_run(model)
        if logger_run is None and active is None and not is_distributed():
            return  # looked at again at the next step: a run may start later
        self.seen.add(id(optimizer))
        run_id, tracking_uri = logger_run or (active.info.run_id if active else None, None)
        run_id = shared_run_id(run_id)
        config = self.config.replace(dump_path=os.path.join(self.config.dump_path, run_id or "no-run"))
        monitor = GradientMonitor(config, run_id=run_id, tracking_uri=tracking_uri,
                                  silent=get_autologging_config(self.flavor, "silent", False), **self.monitor_options)
        self.monitors.append(monitor.monitor(model, optimizer))  # its hook runs after this one: this step counts

    def stop_monitors(self) -> None:
        monitors, self.monitors = self.monitors, []
        self.seen.clear()
        self.models.clear()
        for monitor in monitors:
            monitor.stop()

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
