"""``GradProbeCallback``: the gradient monitor for ``mindspore.train.Model.train(..., callbacks=[...])``, with no other
line in the user's code, in PyNative and GRAPH_MODE alike.

When training begins it attaches a :class:`GradientMonitor` to the model's optimizer; after each step it collects
the step (what graph mode needs: the optimizer runs inside the compiled step); when training ends, or fails, it
stops the monitor, so every probed step is written and sent. MLflow follows MLflow's autologging convention: the
steps go into the active run (or ``run_id=``, or ``MLFLOW_RUN_ID``); with none, the callback starts a run when
training begins and ends it when training ends (only a run it started, and only on rank 0: under ``msrun`` every
rank logs into rank 0's run).

Dataset sink mode: on CPU MindSpore trains without sink (it says so at INFO level) and every step is collected.
Where the data is sunk (Ascend, GPU), MindSpore returns to Python once per ``sink_size`` steps, so only the last
step of each sink can be collected: the callback warns when training begins.
"""
from __future__ import annotations

import os
from datetime import datetime

from mindspore import nn
from mindspore.experimental.optim import Optimizer as ExperimentalOptimizer
from mindspore.train import Callback, RunContext

from msprobe_mlflow.config import GradProbeConfig, load_config
from msprobe_mlflow.mindspore.distributed import current_rank, shared_run_id
from msprobe_mlflow.mindspore.monitor import GradientMonitor
from msprobe_mlflow.monitoring.options import MonitorOptions
from msprobe_mlflow.session import outcome_of
from msprobe_mlflow.vocabulary import AUTOLOGGING_TAG, run_dump_folder


class GradProbeCallback(Callback):
    """``Model.train(epochs, dataset, callbacks=[GradProbeCallback(config)])`` probes every step's gradients.

    ``config``: msprobe's ``config.json`` path, its dict or a :class:`GradProbeConfig`. ``options`` (or their
    keywords): the monitor's, :class:`~msprobe_mlflow.MonitorOptions`.
    ``dump_per_run``: the dump goes to ``{dump_path}/{run_id}`` (``no-run`` without one), so that trainings into
    several runs keep separate dumps (what autolog does). ``monitor`` is the current :class:`GradientMonitor`.
    """

    def __init__(self, config: GradProbeConfig | str | os.PathLike | dict, *, dump_per_run: bool = False,
                 options: MonitorOptions | None = None, **keywords):
        self.config = load_config(config)
        self.dump_per_run = dump_per_run
        self.monitor = GradientMonitor(self.config, options=options, **keywords)  # a bad one fails now, not mid-run
        self.options = self.monitor.options
        self._started_run = None

    def on_train_begin(self, run_context: RunContext) -> None:
        cb_params = run_context.original_args()
        optimizer = training_optimizer(cb_params)
        if optimizer is None:
            self.monitor.notices.warn("Model.train has no optimizer this callback can find (neither Model(..., "
                                      "optimizer=) nor an optimizer cell inside the train network); gradients are "
                                      "not monitored")
            return
        self._warn_if_sunk(cb_params)
        self._start_run_if_none(cb_params.get("network"))  # the user's network (Model(network, ...))
        if self.dump_per_run:
            run_id = shared_run_id(self.monitor.tracking.local_run_id() if self.monitor.tracking else None)
            config = self.config.replace(dump_path=run_dump_folder(self.config.dump_path, run_id))
            self.monitor = GradientMonitor(config, options=self.options, run_id=run_id)
        try:
            # the train network's mixed precision; the user's network names the traced steps' cells
            self.monitor.monitor(optimizer, network=cb_params.get("train_network"),
                                 traced_network=cb_params.get("network"))
        except ValueError as e:  # already monitored (by the user's own monitor, say): training goes on without us
            self.monitor.notices.warn(f"GradProbeCallback does not monitor this training: {e}")

    def on_train_step_end(self, run_context: RunContext) -> None:
        self.monitor.collect()

    def on_train_end(self, run_context: RunContext) -> None:
        self._finish()

    def __exit__(self, kind, error, traceback) -> None:
        """Model.train leaves its callbacks' context also when training fails: the steps so far are kept, this
        rank is tagged ``failed`` (``killed`` for Ctrl-C) with the exception, and the run ends FAILED."""
        if kind is not None:
            self.monitor.end_as(*outcome_of(error))
        self._finish(failed=kind is not None)

    def _warn_if_sunk(self, cb_params) -> None:
        sink_size = cb_params.get("sink_size", 1)
        if cb_params.get("dataset_sink_mode") and sink_size != 1 and not self.config.step:
            steps = "all the steps of an epoch" if sink_size == -1 else f"{sink_size} steps"
            self.monitor.notices.warn(f"dataset sink mode: MindSpore returns to Python once per sink of {steps} "
                                      f"(sink_size={sink_size}), so only the last step of each sink is probed; "
                                      f"for every step, train with sink_size=1 or dataset_sink_mode=False")

    def _start_run_if_none(self, network: nn.Cell | None) -> None:
        """MLflow's autologging convention: a run when none is active, ended with the training. Not with
        ``tracking_uri=`` (a run MLflow's fluent API does not track: pass ``run_id=`` there), not on ranks > 0."""
        tracking = self.monitor.tracking
        if tracking is None or tracking.tracking_uri or tracking.local_run_id() or current_rank() != 0:
            return
        from msprobe_mlflow.tracking.autologging import start_run

        try:
            self._started_run = start_run(run_name(network), {AUTOLOGGING_TAG: "msprobe_mlflow"})
        except Exception as e:  # observability must never break training
            self.monitor.notices.failure("start_run", f"could not start an MLflow run ({e!r}); the gradients go "
                                                      f"to the local dump only")

    def _finish(self, failed: bool = False) -> None:
        """Stops the monitor (every step written and sent), then ends the run this callback started: FAILED when
        this training or another rank's failed (``failed_ranks``). Idempotent."""
        self.monitor.stop()
        run_id, self._started_run = self._started_run, None  # the ID of the run this callback started
        if run_id is None:
            return
        status = "FAILED" if failed or self.monitor.failed_ranks else "FINISHED"
        from msprobe_mlflow.tracking.autologging import end_run

        try:
            end_run(run_id, status)  # the user may have switched runs meanwhile: theirs is left alone
        except Exception as e:  # observability must never break training
            self.monitor.notices.failure("end_run", f"could not end MLflow run {run_id} ({e!r})")


def run_name(network: nn.Cell | None) -> str:
    """``{network class}-{start time to the millisecond}`` (``Net-20250101-120000.123``): MLflow's own names come
    from Python's ``random``, which ``mindspore.set_seed`` seeds, so every training would get the same one (and
    drawing one would move the user's random state)."""
    now = datetime.now()
    name = type(network).__name__ if network is not None else "Model"
    return f"{name}-{now:%Y%m%d-%H%M%S}.{now.microsecond // 1000:03d}"


def training_optimizer(cb_params) -> nn.Cell | None:
    """The optimizer ``Model.train`` steps: ``Model(..., optimizer=)``, else the first optimizer cell inside the
    train network (a ``Model`` built on a ``TrainOneStepCell``)."""
    optimizer = cb_params.get("optimizer")
    if optimizer is not None:
        return optimizer
    network = cb_params.get("train_network")
    if network is None:
        return None
    return next((cell for _, cell in network.cells_and_names()
                 if isinstance(cell, (nn.Optimizer, ExperimentalOptimizer))), None)
