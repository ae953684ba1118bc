"""``msprobe_mlflow.autolog()``: gradient probing of any PyTorch model trained inside ``mlflow.start_run()``, and
of every MindSpore ``Model.train``.

Each framework's half is installed when that framework is imported (MLflow's import hooks), so neither is imported
here and a MindSpore-only or PyTorch-only install has what it needs: PyTorch's optimizer hook in
``pytorch/autolog.py``, MindSpore's ``Model.train`` patch in ``mindspore/autologging.py``. ``mlflow.end_run()``
(patched with MLflow's ``safe_patch``) stops the run's monitors first, so the run ends with every step uploaded.
``disable=True`` removes the hook and the patches, as for MLflow's own integrations; so does a second
``autolog()`` call before it installs its own.
"""
from __future__ import annotations

import os

import mlflow
import mlflow.tracking.fluent
from mlflow.utils.autologging_utils import autologging_integration, safe_patch
from mlflow.utils.import_hooks import register_post_import_hook

from msprobe_mlflow.compare.verdict import DEFAULT_DROP_THRESHOLD, DEFAULT_FIRST_THRESHOLD, DEFAULT_RULE
from msprobe_mlflow.config import GradProbeConfig, autolog_config
from msprobe_mlflow.mindspore.autologging import autolog_when_imported
from msprobe_mlflow.monitoring import SessionMonitor
from msprobe_mlflow.sinks.anomalies import SpikeRule
from msprobe_mlflow.sinks.baseline import SuspiciousCallback

FLAVOR_NAME = "msprobe_mlflow"
_installed = None  # the PyTorch half (pytorch.autolog.TorchAutolog), once torch is imported
_waiting_for_torch: tuple | None = None  # its (config, monitor options) until then


def autolog(config: GradProbeConfig | str | os.PathLike | dict | None = None, *, level: str | None = None,
            bounds=None, dump_path: str | None = None, log_every_n_steps: int = 1, param_metrics=None,
            metrics_file: bool = False, baseline: str | os.PathLike | None = None,
            on_suspicious: SuspiciousCallback | None = None, first_threshold: float = DEFAULT_FIRST_THRESHOLD,
            drop_threshold: float = DEFAULT_DROP_THRESHOLD, rule: str = DEFAULT_RULE, anomaly_flags: bool = True,
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
            comparator's ``rule`` (``"noise"``, the default, or ``"msprobe"`` with ``first_threshold`` and
            ``drop_threshold``) first finds a step suspicious.
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
    global _installed, _waiting_for_torch
    _waiting_for_torch = None
    if _installed is not None:  # MLflow's wrapper reverts the patches; the hook and the monitors are ours to undo
        _installed.teardown()
        _installed = None
    monitor_options = dict(
        log_every_n_steps=log_every_n_steps, param_metrics=param_metrics or (), metrics_file=metrics_file,
        baseline=baseline, on_suspicious=on_suspicious, first_threshold=first_threshold,
        drop_threshold=drop_threshold, rule=rule, anomaly_flags=anomaly_flags, spike_threshold=spike_threshold,
        spike_window=spike_window, directions_every_n_steps=directions_every_n_steps,
        directions_on_anomaly=directions_on_anomaly, directions_steps_after_anomaly=directions_steps_after_anomaly,
        aggregate_metrics=aggregate_metrics, archive_every_n_steps=archive_every_n_steps)
    _integration(config, level=level, bounds=bounds, dump_path=dump_path, monitor_options=monitor_options,
                 disable=disable, silent=silent)
    # MindSpore: Model.train gets a GradProbeCallback, from when mindspore is imported
    autolog_when_imported(config=config, level=level, bounds=bounds, dump_path=dump_path, disable=disable,
                          silent=silent, **monitor_options)


@autologging_integration(FLAVOR_NAME)
def _integration(config, *, level, bounds, dump_path, monitor_options: dict, disable: bool = False,
                 silent: bool = False) -> None:
    """MLflow's side of :func:`autolog`: stores the configuration, reverts earlier patches and, unless ``disable``,
    runs this body, which installs PyTorch's hook (now, or when torch is imported) and the patches."""
    global _waiting_for_torch
    base = autolog_config(config, level=level, bounds=bounds, dump_path=dump_path)
    SessionMonitor(base, **monitor_options)  # refuses a bad option now, not at the first step
    _waiting_for_torch = (base, monitor_options)
    register_post_import_hook(_on_torch_import, "torch", overwrite=True)  # called at once if torch is imported

    def end_run_after_monitors(original, *args, **kwargs):
        """The monitors stop first; a run whose ranks failed ends FAILED; a rank > 0's own run, empty since its
        gradients went into rank 0's, is deleted once ended (``TorchAutolog.delete_if_empty``)."""
        if _installed is None:
            return original(*args, **kwargs)
        ending = mlflow.active_run()
        if _installed.stop_monitors():
            args, kwargs = ("FAILED",), {}
        result = original(*args, **kwargs)
        if ending is not None:
            _installed.delete_if_empty(ending.info.run_id)
        return result

    safe_patch(FLAVOR_NAME, mlflow.tracking.fluent, "end_run", end_run_after_monitors)
    safe_patch(FLAVOR_NAME, mlflow, "end_run", end_run_after_monitors)


def _on_torch_import(torch_module) -> None:
    global _installed, _waiting_for_torch
    if _waiting_for_torch is not None:  # not disabled since
        from msprobe_mlflow.pytorch.autolog import TorchAutolog

        _installed = TorchAutolog(*_waiting_for_torch, FLAVOR_NAME)
        _waiting_for_torch = None
