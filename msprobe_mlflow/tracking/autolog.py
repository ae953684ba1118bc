"""``msprobe_mlflow.autolog()``: gradient probing of any PyTorch model trained inside ``mlflow.start_run()``.

How it finds the model without a line of user code: a global module forward pre-hook sees the outermost module
whose forward runs while a run is active (a model's forward starts before its children's) and starts a
:class:`GradientMonitor` on it, which binds to the first optimizer that steps its parameters. Modules inside a
monitored model, or without parameters, are remembered and cost one set lookup per forward afterwards.
``mlflow.end_run()`` (patched with MLflow's ``safe_patch``) stops the run's monitors first, so the run ends with
every step uploaded. ``disable=True`` removes the hook and the patches, as for MLflow's own integrations; so does a
second ``autolog()`` call before it installs its own.
"""
from __future__ import annotations

import logging
import os

import mlflow
import mlflow.tracking.fluent
import torch
from mlflow.utils.autologging_utils import autologging_integration, get_autologging_config, safe_patch

from msprobe_mlflow.compare.verdict import DEFAULT_DROP_THRESHOLD, DEFAULT_FIRST_THRESHOLD
from msprobe_mlflow.config import DEFAULT_BOUNDS, GradProbeConfig, load_config
from msprobe_mlflow.pytorch.distributed import is_distributed, shared_run_id
from msprobe_mlflow.pytorch.monitor import GradientMonitor, _monitored_models
from msprobe_mlflow.sinks.anomalies import SpikeRule
from msprobe_mlflow.sinks.baseline import SuspiciousCallback

FLAVOR_NAME = "msprobe_mlflow"
DEFAULT_DUMP_PATH = "msprobe_dump"
logger = logging.getLogger("msprobe_mlflow")


class _AutologState:
    """The hook autolog installed, the monitors it started, and which modules it has already looked at."""

    def __init__(self, config: GradProbeConfig, monitor_options: dict):
        self.config = config
        self.monitor_options = monitor_options
        self.monitors: list[GradientMonitor] = []
        self.seen: set[int] = set()
        self.hook = torch.nn.modules.module.register_module_forward_pre_hook(self.on_forward)

    def on_forward(self, module: torch.nn.Module, args) -> None:
        if id(module) in self.seen:
            return
        try:
            self._consider(module)
        except Exception:  # observability must never break training
            self.seen.add(id(module))
            logger.warning("msprobe-mlflow autolog: could not monitor %s", type(module).__name__, exc_info=True)

    def _consider(self, module: torch.nn.Module) -> None:
        if next(module.parameters(), None) is None or id(module) in _monitored_models:
            self.seen.add(id(module))
            return
        active = mlflow.active_run()
        if active is None and not is_distributed():
            return  # looked at again at the next forward: a run may start later
        run_id = shared_run_id(active.info.run_id if active else None)
        config = self.config.replace(dump_path=os.path.join(self.config.dump_path, run_id or "no-run"))
        monitor = GradientMonitor(config, run_id=run_id, silent=get_autologging_config(FLAVOR_NAME, "silent", False),
                                  **self.monitor_options)
        self.monitors.append(monitor.monitor(module))
        self.seen.update(id(m) for m in module.modules())

    def stop_monitors(self) -> None:
        monitors, self.monitors = self.monitors, []
        self.seen.clear()
        for monitor in monitors:
            monitor.stop()

    def teardown(self) -> None:
        self.hook.remove()
        self.stop_monitors()


_installed: _AutologState | None = None


def autolog(config: GradProbeConfig | str | os.PathLike | dict | None = None, *, level: str | None = None,
            bounds=None, dump_path: str | None = None, log_every_n_steps: int = 1, param_metrics=None,
            metrics_file: bool = False, baseline: str | os.PathLike | None = None,
            on_suspicious: SuspiciousCallback | None = None, first_threshold: float = DEFAULT_FIRST_THRESHOLD,
            drop_threshold: float = DEFAULT_DROP_THRESHOLD, anomaly_flags: bool = True,
            spike_threshold: float = SpikeRule.threshold, spike_window: int = SpikeRule.window,
            directions_every_n_steps: int | None = None, directions_on_anomaly: bool | None = None,
            directions_steps_after_anomaly: int | None = None, disable: bool = False, silent: bool = False) -> None:
    """Probes the gradients of every PyTorch model trained inside ``mlflow.start_run()`` into that run.

    Args:
        config: msprobe's ``config.json`` path, its dict, or a :class:`GradProbeConfig`; ``level``, ``bounds`` and
            ``dump_path`` override it. Without any, level ``L1``, bounds ``[-1, 0, 1]``, dump ``./msprobe_dump``.
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
        disable: remove the hook and the patches; monitors already running are stopped (flushed).
        silent: no warnings from msprobe-mlflow; problems go to the ``msprobe_mlflow`` logger only.
    """
    global _installed
    if _installed is not None:  # MLflow's wrapper reverts the patches; the hook and the monitors are ours to undo
        _installed.teardown()
        _installed = None
    _integration(config, level=level, bounds=bounds, dump_path=dump_path, monitor_options=dict(
        log_every_n_steps=log_every_n_steps, param_metrics=param_metrics or (), metrics_file=metrics_file,
        baseline=baseline, on_suspicious=on_suspicious, first_threshold=first_threshold,
        drop_threshold=drop_threshold, anomaly_flags=anomaly_flags, spike_threshold=spike_threshold,
        spike_window=spike_window, directions_every_n_steps=directions_every_n_steps,
        directions_on_anomaly=directions_on_anomaly, directions_steps_after_anomaly=directions_steps_after_anomaly),
        disable=disable, silent=silent)


@autologging_integration(FLAVOR_NAME)
def _integration(config, *, level, bounds, dump_path, monitor_options: dict, disable: bool = False,
                 silent: bool = False) -> None:
    """MLflow's side of :func:`autolog`: stores the configuration, reverts earlier patches and, unless ``disable``,
    runs this body, which installs the hook and the patches."""
    global _installed
    overrides = {key: value for key, value in (("level", level), ("bounds", bounds), ("dump_path", dump_path))
                 if value is not None}
    if config is None:
        base = GradProbeConfig(**{"dump_path": DEFAULT_DUMP_PATH, "bounds": DEFAULT_BOUNDS, **overrides},
                               source="autolog()")
    else:
        base = load_config(config).replace(**overrides)
    GradientMonitor(base, **monitor_options)  # refuses a bad option now, not at the first forward
    state = _installed = _AutologState(base, monitor_options)

    def end_run_after_monitors(original, *args, **kwargs):
        state.stop_monitors()
        return original(*args, **kwargs)

    safe_patch(FLAVOR_NAME, mlflow.tracking.fluent, "end_run", end_run_after_monitors)
    safe_patch(FLAVOR_NAME, mlflow, "end_run", end_run_after_monitors)
