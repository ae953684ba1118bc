"""``msprobe_mlflow.mindspore.autolog()``: every ``mindspore.train.Model.train`` call gets a
:class:`GradProbeCallback`, with no line of user code. ``msprobe_mlflow.autolog()`` switches it on too, as soon as
``mindspore`` has been imported (MLflow's import hooks), and off with ``disable=True``. (This module is not called
``autolog``: a submodule of that name would shadow the function ``msprobe_mlflow.mindspore.autolog``.)

Why ``Model.train``: it is the one MindSpore training entry point that Python sees whole, in PyNative and
GRAPH_MODE alike, and it knows the optimizer. A custom loop (a ``TrainOneStepCell`` or a ``@jit`` step called by
the user) offers no such place: the optimizer may run inside a compiled graph where no Python hook can see it
step, so such loops use ``GradientMonitor(config).monitor(optimizer)`` (plus ``monitor.collect()`` after each
step in GRAPH_MODE); a run that ends with no ``Model.train`` and no monitor in it says so (``CUSTOM_LOOP``).
MLflow: the active run; with none, the callback starts one for the training and ends it with the training
(MLflow's autologging convention). Each run's dump goes to ``{dump_path}/{run_id}``.

This module imports MindSpore only when the patch is installed: ``msprobe_mlflow.autolog()`` imports it always.
"""
from __future__ import annotations

import inspect
import os

from msprobe_mlflow.config import GradProbeConfig, autolog_config
from msprobe_mlflow.monitoring.options import MonitorOptions
from msprobe_mlflow.notices import Notices
from msprobe_mlflow.tracking import autologging
from msprobe_mlflow.vocabulary import rank_statuses

FLAVOR_NAME = "msprobe_mlflow_mindspore"
CUSTOM_LOOP = ("MLflow run {run_id} ended with no gradients: autolog() probes MindSpore's Model.train only, and "
               "none ran in it. For a custom loop (value_and_grad + optimizer(grads)), add before it: "
               "`from msprobe_mlflow.mindspore import GradientMonitor` and "
               "`monitor = GradientMonitor(\"config.json\").monitor(optimizer)` (GRAPH_MODE: also "
               "`monitor.collect()` after each step)")


def autolog(config: GradProbeConfig | str | os.PathLike | dict | None = None, *, level: str | None = None,
            bounds=None, dump_path: str | None = None, disable: bool = False, silent: bool = False,
            options: MonitorOptions | None = None, **keywords) -> None:
    """Probes the gradients of every ``mindspore.train.Model.train`` into the active MLflow run.

    Args:
        config: msprobe's ``config.json`` path, its dict, or a :class:`GradProbeConfig`; ``level``, ``bounds`` and
            ``dump_path`` override it. Without any: level ``L1``, msprobe's MindSpore default bounds, dump
            ``./msprobe_dump``; each run's dump goes to ``{dump_path}/{run_id}``.
        disable: give ``Model.train`` back its own code (MLflow's ``safe_patch`` reverts it).
        silent: no warnings and no start and end lines from msprobe-mlflow; they go to the ``msprobe_mlflow``
            logger only.
        options: the monitors' (:class:`~msprobe_mlflow.MonitorOptions`), or their keywords.

    A ``Model.train`` whose callbacks already hold a :class:`GradProbeCallback` is left as the user set it.
    """
    _integration(config, level=level, bounds=bounds, dump_path=dump_path,
                 options=MonitorOptions.of(options, **keywords), disable=disable, silent=silent)


@autologging.integration(FLAVOR_NAME)
def _integration(config, *, level, bounds, dump_path, options: MonitorOptions, disable: bool = False,
                 silent: bool = False) -> None:
    """MLflow's side of :func:`autolog`: stores the configuration, reverts the earlier patches and, unless
    ``disable``, runs this body, which patches ``Model.train`` and the end of runs (``CUSTOM_LOOP``)."""
    from mindspore.train import Model

    from msprobe_mlflow.mindspore.callback import GradProbeCallback

    base = autolog_config(config, level=level, bounds=bounds, dump_path=dump_path)
    GradProbeCallback(base, options=options)  # refuses a bad option now, not at the first training
    signature = inspect.signature(Model.train)
    trained_runs: set[str | None] = set()  # the runs active when a Model.train began (None: the callback starts one)

    def train_with_probe(original, model, *args, **kwargs):
        trained_runs.add(autologging.active_run_id())
        bound = signature.bind(model, *args, **kwargs)
        callbacks = bound.arguments.get("callbacks")
        callbacks = [] if callbacks is None else list(callbacks) if isinstance(callbacks, (list, tuple)) \
            else [callbacks]
        if not any(isinstance(callback, GradProbeCallback) for callback in callbacks):
            silent_now = autologging.silent(FLAVOR_NAME) or options.silent
            bound.arguments["callbacks"] = callbacks + [GradProbeCallback(base, dump_per_run=True, options=options,
                                                                          silent=silent_now)]
        return original(*bound.args, **bound.kwargs)

    def say_if_nothing_probed(run_id: str, tags: dict[str, str]) -> None:
        """A run without Model.train and without a monitor's rank statuses: a custom loop autolog cannot see."""
        if run_id not in trained_runs and not rank_statuses(tags):
            Notices(autologging.silent(FLAVOR_NAME) or options.silent).warn(CUSTOM_LOOP.format(run_id=run_id))

    autologging.patch(FLAVOR_NAME, Model, "train", train_with_probe)
    autologging.after_run_end(FLAVOR_NAME, say_if_nothing_probed)


_pending_call: dict | None = None


def autolog_when_imported(**arguments) -> None:
    """:func:`autolog` with ``arguments`` now if ``mindspore`` is imported, else as soon as it is (what
    ``msprobe_mlflow.autolog()`` calls: a PyTorch user never imports MindSpore). The latest call wins.

    The hook is on the top-level package, whose import ends once MindSpore is whole: a hook on ``mindspore.train``
    ran while ``mindspore/__init__.py`` was still importing its submodules, and patching from there imported
    MindSpore modules that need the half-made package (a circular import that killed the interpreter)."""
    global _pending_call
    _pending_call = arguments
    autologging.when_imported(_on_import, "mindspore")


def _on_import(module) -> None:
    if _pending_call is not None:
        autolog(**_pending_call)
