"""``msprobe_mlflow.autolog()``: gradient probing of any PyTorch model trained inside ``mlflow.start_run()``.

How it finds the model without a line of user code: a global optimizer step pre-hook sees each optimizer's first
step while a run is active and starts a :class:`GradientMonitor` on the outermost module holding that optimizer's
parameters (found once, by walking the live modules), from that step on. Optimizers it has looked at cost one set
lookup per step afterwards. No module hook is installed: a global module hook makes torch warn about, and call it
again for, every compiled model. Under Lightning, the run is the ``MLFlowLogger``'s (it starts no active run).
``mlflow.end_run()`` (patched with MLflow's ``safe_patch``) stops the run's monitors first, so the run ends with
every step uploaded. ``disable=True`` removes the hook and the patches, as for MLflow's own integrations; so does a
second ``autolog()`` call before it installs its own.
"""
from __future__ import annotations

import gc
import logging
import os
import weakref

import mlflow
import mlflow.tracking.fluent
import torch
from mlflow.utils.autologging_utils import autologging_integration, get_autologging_config, safe_patch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from msprobe_mlflow.compare.verdict import DEFAULT_DROP_THRESHOLD, DEFAULT_FIRST_THRESHOLD
from msprobe_mlflow.config import GradProbeConfig, autolog_config
from msprobe_mlflow.integrations import mlflow_logger_run
from msprobe_mlflow.mindspore.autolog import autolog_when_imported
from msprobe_mlflow.pytorch.distributed import is_distributed, shared_run_id
from msprobe_mlflow.pytorch.monitor import GradientMonitor, _monitored_models
from msprobe_mlflow.sinks.anomalies import SpikeRule
from msprobe_mlflow.sinks.baseline import SuspiciousCallback

FLAVOR_NAME = "msprobe_mlflow"
logger = logging.getLogger("msprobe_mlflow")


class _AutologState:
    """The hook autolog installed, the monitors it started, and which optimizers it has already looked at."""

    def __init__(self, config: GradProbeConfig, monitor_options: dict):
        self.config = config
        self.monitor_options = monitor_options
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
                                  silent=get_autologging_config(FLAVOR_NAME, "silent", False), **self.monitor_options)
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


_installed: _AutologState | None = None


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


def autolog(config: GradProbeConfig | str | os.PathLike | dict | None = None, *, level: str | None = None,
            bounds=None, dump_path: str | None = None, log_every_n_steps: int = 1, param_metrics=None,
            metrics_file: bool = False, baseline: str | os.PathLike | None = None,
            on_suspicious: SuspiciousCallback | None = None, first_threshold: float = DEFAULT_FIRST_THRESHOLD,
            drop_threshold: float = DEFAULT_DROP_THRESHOLD, anomaly_flags: bool = True,
            spike_threshold: float = SpikeRule.threshold, spike_window: int = SpikeRule.window,
            directions_every_n_steps: int | None = None, directions_on_anomaly: bool | None = None,
            directions_steps_after_anomaly: int | None = None, aggregate_metrics: bool | None = None,
            archive_every_n_steps: int = 1, disable: bool = False, silent: bool = False) -> None:
    """Probes the gradients of every PyTorch model trained inside ``mlflow.start_run()`` into that run, and of
    every MindSpore ``Model.train`` (``msprobe_mlflow.mindspore.autolog``).

    Args:
        config: msprobe's ``config.json`` path, its dict, or a :class:`GradProbeConfig`; ``level``, ``bounds`` and
            ``dump_path`` override it. Without any, level ``L1``, msprobe's default bounds of the framework
            (``[-1, 0, 1]`` for PyTorch), dump ``./msprobe_dump``.
            Each run's local dump goes to ``{dump_path}/{run_id}``.
        log_every_n_steps: send every n-th probed step to MLflow (the local dump keeps every step).
        param_metrics: parameter names or glob patterns (``"layers.0.*"``) that also get per-parameter metrics.
        metrics_file: also append each step's summary metrics to ``{dump}/rank{R}/metrics.jsonl``.
        baseline: a dump folder or an MLflow run ID to compare each step's gradient directions with while training
            runs (the live verdict); ``on_suspicious(verdict)`` is called once, off the training thread, when the
            comparator's rule (``first_threshold``, ``drop_threshold``) first trips.
        anomaly_flags: flag non-finite gradients and gradient-norm spikes (``spike_threshold``, ``spike_window``:
            see ``msprobe_mlflow.sinks.anomalies.SpikeRule``); on by default.
        directions_every_n_steps, directions_on_anomaly, directions_steps_after_anomaly: the always-on tier
            (``msprobe_mlflow.directions_schedule``): statistics at every step, gradient directions only at steps
            0, N, 2N... and for the given number of steps after a non-finite gradient or a norm spike; None: the
            config's ``grad_probe`` keys (default: directions at every step).
        aggregate_metrics, archive_every_n_steps: scale-out (see :class:`~msprobe_mlflow.monitoring.SessionMonitor`):
            rank 0 sends every rank's summary metrics (default: from 64 ranks), one archive per rank and N steps.
        disable: remove the hook and the patches; monitors already running are stopped (flushed).
        silent: no warnings from msprobe-mlflow; problems go to the ``msprobe_mlflow`` logger only.
    """
    global _installed
    if _installed is not None:  # MLflow's wrapper reverts the patches; the hook and the monitors are ours to undo
        _installed.teardown()
        _installed = None
    monitor_options = dict(
        log_every_n_steps=log_every_n_steps, param_metrics=param_metrics or (), metrics_file=metrics_file,
        baseline=baseline, on_suspicious=on_suspicious, first_threshold=first_threshold,
        drop_threshold=drop_threshold, anomaly_flags=anomaly_flags, spike_threshold=spike_threshold,
        spike_window=spike_window, directions_every_n_steps=directions_every_n_steps,
        directions_on_anomaly=directions_on_anomaly, directions_steps_after_anomaly=directions_steps_after_anomaly,
        aggregate_metrics=aggregate_metrics, archive_every_n_steps=archive_every_n_steps)
    _integration(config, level=level, bounds=bounds, dump_path=dump_path, monitor_options=monitor_options,
                 disable=disable, silent=silent)
    # MindSpore: Model.train gets a GradProbeCallback, from when mindspore.train is imported
    autolog_when_imported(config=config, level=level, bounds=bounds, dump_path=dump_path, disable=disable,
                          silent=silent, **monitor_options)


@autologging_integration(FLAVOR_NAME)
def _integration(config, *, level, bounds, dump_path, monitor_options: dict, disable: bool = False,
                 silent: bool = False) -> None:
    """MLflow's side of :func:`autolog`: stores the configuration, reverts earlier patches and, unless ``disable``,
    runs this body, which installs the hook and the patches."""
    global _installed
    base = autolog_config(config, level=level, bounds=bounds, dump_path=dump_path)
    GradientMonitor(base, **monitor_options)  # refuses a bad option now, not at the first forward
    state = _installed = _AutologState(base, monitor_options)

    def end_run_after_monitors(original, *args, **kwargs):
        state.stop_monitors()
        return original(*args, **kwargs)

    safe_patch(FLAVOR_NAME, mlflow.tracking.fluent, "end_run", end_run_after_monitors)
    safe_patch(FLAVOR_NAME, mlflow, "end_run", end_run_after_monitors)
