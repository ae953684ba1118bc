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

from msprobe_mlflow.config import GradProbeConfig, autolog_config
from msprobe_mlflow.mindspore.autologging import autolog_when_imported
from msprobe_mlflow.monitoring.options import MonitorOptions
from msprobe_mlflow.tracking import autologging

FLAVOR_NAME = "msprobe_mlflow"
NOT_FOR_AUTOLOG = ("run_id", "tracking_uri", "log_to_mlflow", "sinks")  # autolog's choice: each training's run
_installed = None  # the PyTorch half (pytorch.autolog.TorchAutolog), once torch is imported
_waiting_for_torch: tuple | None = None  # its (config, monitor options) until then


def autolog(config: GradProbeConfig | str | os.PathLike | dict | None = None, *, level: str | None = None,
            bounds=None, dump_path: str | None = None, disable: bool = False, silent: bool = False,
            options: MonitorOptions | None = None, **keywords) -> None:
    """Probes the gradients of every PyTorch model trained inside ``mlflow.start_run()`` into that run, and of
    every MindSpore ``Model.train`` (``msprobe_mlflow.mindspore.autolog``).

    Args:
        config: msprobe's ``config.json`` path, its dict, or a :class:`GradProbeConfig`; ``level``, ``bounds`` and
            ``dump_path`` override it. Without any, level ``L1``, msprobe's default bounds of the framework
            (``[-1, 0, 1]`` for PyTorch), dump ``./msprobe_dump``.
            Each run's local dump goes to ``{dump_path}/{run_id}``.
        disable: remove the hook and the patches; monitors already running are stopped (flushed).
        silent: no warnings and no start and end lines from msprobe-mlflow; they go to the ``msprobe_mlflow``
            logger only.
        options: the monitors' (:class:`~msprobe_mlflow.MonitorOptions`), or their keywords, but for
            those autolog chooses itself (``NOT_FOR_AUTOLOG``).
    """
    global _installed, _waiting_for_torch
    options = MonitorOptions.of(options, **keywords)
    chosen = sorted(set(options.changed()) & set(NOT_FOR_AUTOLOG))
    if chosen:
        raise TypeError(f"autolog() does not take {', '.join(chosen)}: it logs each training into that training's "
                        f"own run, with a monitor of its own; for a given run or sink, use "
                        f"GradientMonitor(config, {chosen[0]}=...).monitor(model)")
    _waiting_for_torch = None
    if _installed is not None:  # MLflow's wrapper reverts the patches; the hook and the monitors are ours to undo
        _installed.teardown()
        _installed = None
    _integration(config, level=level, bounds=bounds, dump_path=dump_path, options=options, disable=disable,
                 silent=silent)
    # MindSpore: Model.train gets a GradProbeCallback, from when mindspore is imported
    autolog_when_imported(config=config, level=level, bounds=bounds, dump_path=dump_path, disable=disable,
                          silent=silent, options=options)


@autologging.integration(FLAVOR_NAME)
def _integration(config, *, level, bounds, dump_path, options: MonitorOptions, disable: bool = False,
                 silent: bool = False) -> None:
    """MLflow's side of :func:`autolog`: stores the configuration, reverts earlier patches and, unless ``disable``,
    runs this body, which installs PyTorch's hook (now, or when torch is imported) and the patches."""
    global _waiting_for_torch
    base = autolog_config(config, level=level, bounds=bounds, dump_path=dump_path)
    options.applied_to(base)  # refuses what cannot work with the config now, not at the first step
    _waiting_for_torch = (base, options)
    autologging.when_imported(_on_torch_import, "torch")  # called at once if torch is imported

    def end_run_after_monitors(original, *args, **kwargs):
        """The monitors stop first; a run whose ranks failed ends FAILED; a rank > 0's own run, empty since its
        gradients went into rank 0's, is deleted once ended (``TorchAutolog.delete_if_empty``)."""
        if _installed is None:
            return original(*args, **kwargs)
        ending = autologging.active_run_id()
        if _installed.stop_monitors():
            args, kwargs = ("FAILED",), {}
        result = original(*args, **kwargs)
        if ending is not None:
            _installed.delete_if_empty(ending)
        return result

    autologging.patch_end_run(FLAVOR_NAME, end_run_after_monitors)


def _on_torch_import(torch_module) -> None:
    global _installed, _waiting_for_torch
    if _waiting_for_torch is not None:  # not disabled since
        from msprobe_mlflow.pytorch.autolog import TorchAutolog

        _installed = TorchAutolog(*_waiting_for_torch, FLAVOR_NAME)
        _waiting_for_torch = None
