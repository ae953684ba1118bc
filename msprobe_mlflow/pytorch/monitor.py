"""The PyTorch gradient monitor: an optimizer step pre-hook that probes every monitored gradient.

Unlike msprobe 1.0.3, the step counter counts the monitored optimizer's steps only, every hook is removable
(``stop()``), a second ``monitor()`` does not double count, and a failure in the probe never breaks training (it
is counted in ``errors``, tagged on the run and warned about).

What a step records is what the optimizer applies: with ``optimizer.step(closure)`` (LBFGS, Lightning's automatic
optimization) the probe runs when the closure first returns, before the update; gradients are read after
unscaling and clipping when those happen before ``step()``. Names are the eager model's
(:mod:`msprobe_mlflow.parameter_names`), and DTensor gradients (FSDP2) get their full gradient's statistics
(:mod:`msprobe_mlflow.torch_kernels.sharded`), as do FSDP1's flattened gradients, under the original parameters'
names and shapes (:mod:`msprobe_mlflow.pytorch.fsdp1`).
"""
from __future__ import annotations

import os
from dataclasses import replace

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from msprobe_mlflow.config import GradProbeConfig
from msprobe_mlflow.dump import step_ranges
from msprobe_mlflow.monitoring.options import MonitorOptions
from msprobe_mlflow.monitoring.session_monitor import SessionMonitor
from msprobe_mlflow.parameter_names import eager_named_parameters
from msprobe_mlflow.pytorch import loss_scale
from msprobe_mlflow.pytorch.compute_format import ComputeFormatWatch
from msprobe_mlflow.pytorch.distributed import current_rank, shared_run_id, summary_all_gather, world_size
from msprobe_mlflow.pytorch.fsdp1 import FlatSlot, fsdp1_named_parameters, has_fsdp1
from msprobe_mlflow.monitoring.traced_steps import TracedSteps
from msprobe_mlflow.pytorch.operator_traces import pytorch_traced_steps
from msprobe_mlflow.records import with_compute_format, with_loss_scale, with_parameter_norms
from msprobe_mlflow.session import RankPolicy
from msprobe_mlflow.statistics_table import PARAMETER_NORM
from msprobe_mlflow.torch_kernels.host_copy import start_host_copy
from msprobe_mlflow.torch_kernels.parameter_norms import launch_parameter_norms
from msprobe_mlflow.torch_kernels.sharded import FlatPiece, has_sharded, launch_sharded_statistics
from msprobe_mlflow.torch_kernels.statistics import StatisticsCache, launch_step_statistics
from msprobe_mlflow.vocabulary import FAILED_STEPS_TAG, RECORDED_TAG, TAG_RANGES_LIMIT, rank_tag


# model id -> the monitor watching it, so two monitors never probe one model by accident.
_monitored_models: dict[int, "GradientMonitor"] = {}


class GradientMonitor(SessionMonitor):
    """Probes gradients at every step of one optimizer, writes msprobe's dump and logs into MLflow.

    ``options`` (or their keywords): :class:`~msprobe_mlflow.MonitorOptions`. Under
    torch.distributed, every rank logs into rank 0's run (call ``monitor()`` on every rank). Use as
    ``GradientMonitor(config).monitor(model, optimizer)`` ... ``stop()``, or as a context manager.
    """

    def __init__(self, config: GradProbeConfig | str | os.PathLike | dict, *, options: MonitorOptions | None = None,
                 **keywords):
        super().__init__(config, options=options, **keywords)
        self._parameters: list[tuple[str, torch.nn.Parameter, FlatSlot | None]] = []
        self._parameter_names: list[str] = []
        self._plain_parameters: list[torch.nn.Parameter] = []
        self._optimizer: torch.optim.Optimizer | None = None
        self._model_id: int | None = None
        self._hook = None
        self._traces: TracedSteps | None = None  # trace_steps: the operator traces, armed by _after_hook
        self._after_hook = None
        self._probe_failures: list[str] = []
        self._failed_steps: list[int] = []
        self._probed_steps = 0
        self._recorded_early: int | None = None  # the step record_gradients() already recorded
        self._unsupported: str | None = None  # why this model's gradients cannot be recorded: each probe fails
        self._cache = StatisticsCache()  # the buffers its steps reuse, released at stop()
        self._formats: ComputeFormatWatch | None = None  # the format each step computed in (autocast, TF32...)
        self._held = None  # the first step's pending record while its format is not known yet (_submit_held)

    def monitor(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> "GradientMonitor":
        """Starts probing ``model``'s gradients at each ``optimizer.step()``.

        Without ``optimizer``, the first optimizer whose ``step()`` updates one of the model's parameters is the
        one counted. Calling it again re-targets the monitor; the step counter goes on.
        """
        other = _monitored_models.get(id(model))
        if other is not None and other is not self:
            raise ValueError("this model is already monitored by another GradientMonitor; call its stop() first")
        if self.options.parameter_norms and has_fsdp1(model):  # before any session or hook exists
            raise ValueError(f"statistics = {list(self.options.statistics)!r}: {PARAMETER_NORM!r} is not supported "
                             f"with FSDP1 (FullyShardedDataParallel); use FSDP2 (torch.distributed.fsdp.fully_shard) "
                             f"or leave {PARAMETER_NORM!r} out")
        plan = self.options.trace.plan()  # a bad MSPROBE_MLFLOW_TRACE_STEPS fails before anything starts
        self._remove_hook()
        if self._session is None or self._session.closed:  # first: a bad dump_path fails before any hook exists
            self._session = self._open_session("pytorch", RankPolicy.of(self.config, current_rank(), world_size()),
                                               shared_run_id, summary_all_gather)
        named = [(n, p, None) for n, p in eager_named_parameters(model)]
        self._unsupported = None
        if has_fsdp1(model):  # its flat parameters stand for the original ones
            try:
                named = fsdp1_named_parameters(model)
            except Exception as e:  # FSDP1's private layout changed: say so, never record the shards as parameters
                self._unsupported = (f"FSDP1 (FullyShardedDataParallel) as monitored here is not supported ({e}): "
                                     f"no gradient is recorded; monitor the FSDP1 root module, or use FSDP2 "
                                     f"(torch.distributed.fsdp.fully_shard)")
                self.notices.warn(self._unsupported)
        self._parameters = [(n, p, slot) for n, p, slot in named if self.config.wants_param(n)]
        self._parameter_names = [n for n, _, _ in self._parameters]
        plain = not any(slot is not None or hasattr(type(p), "main_grad") for _, p, slot in self._parameters)
        self._plain_parameters = [p for _, p, _ in self._parameters] if plain else []  # each gradient in .grad
        missing = set(self.config.param_list) - {n for n, _, _ in named}
        if missing:
            self.notices.warn(f"grad_probe.param_list names parameters the model does not have: {sorted(missing)}")
        self._formats = ComputeFormatWatch(model, [p for _, p, _ in self._parameters])
        self._optimizer = optimizer
        self._model_id = id(model)
        _monitored_models[self._model_id] = self
        if optimizer is not None:
            self._hook = optimizer.register_step_pre_hook(self._on_optimizer_step)
        else:
            self._hook = register_optimizer_step_pre_hook(self._on_optimizer_step)
        if self.recorded_level.has_exponents:  # the scale is read for the format losses only
            loss_scale.watch()  # as long as the hook
        live = self.options.live_verdict
        if (plan.steps or (live is not None and live.trace_on_suspicious)) and self._session.ranks.probes:
            self._traces = pytorch_traced_steps(plan, model, self.config.dump_path, self._session.ranks.rank,
                                                self.notices, self.trace_written)
            self._after_hook = optimizer.register_step_post_hook(self._after_optimizer_step) if optimizer else \
                register_optimizer_step_post_hook(self._after_optimizer_step)
            self._traces.arm(self.step)
        return self

    def _owns_model_parameters(self, optimizer: torch.optim.Optimizer) -> bool:
        watched = {id(p) for _, p, _ in self._parameters}
        return any(id(p) in watched for group in optimizer.param_groups for p in group["params"])

    def _on_optimizer_step(self, optimizer, args, kwargs):
        if self._optimizer is None and self._owns_model_parameters(optimizer):
            self._optimizer = optimizer
        if optimizer is not self._optimizer:
            return None
        step, self.step = self.step, self.step + 1
        if step == self._recorded_early:
            return None
        closure = args[1] if len(args) > 1 else kwargs.get("closure")  # args[0] is the optimizer
        if closure is None:
            self._probe_step(step)
            return None
        return self._after_closure(closure, step, args, kwargs)

    @property
    def baseline(self):
        """The live verdict's options; with ``trace_on_suspicious``, its callback first asks for the next step's
        trace."""
        live = self.options.live_verdict
        if live is None or not live.trace_on_suspicious:
            return live
        user = live.on_suspicious

        def trace_then_call(verdict):
            if self._traces is not None:
                self._traces.request(self.step + 1)  # the step after the one now running
            if user is not None:
                user(verdict)
        return replace(live, on_suspicious=trace_then_call)

    def _after_optimizer_step(self, optimizer, args, kwargs):
        """The update is done: the next step's trace starts here, if it is traced."""
        if optimizer is self._optimizer and self._traces is not None:
            self._traces.arm(self.step)

    def _after_closure(self, closure, step: int, args, kwargs):
        """The step's arguments with ``closure`` wrapped so that the probe runs when it first returns: the
        gradients it leaves are the ones the optimizer applies (LBFGS calls it again for its line search)."""
        probed = False

        def closure_then_probe():
            nonlocal probed
            loss = closure()
            if not probed:
                probed = True
                self._probe_step(step)
            return loss

        if len(args) > 1:
            return (args[0], closure_then_probe, *args[2:]), kwargs
        return args, {**kwargs, "closure": closure_then_probe}

    def record_gradients(self) -> None:
        """Records the gradients as they are now as the coming optimizer step's record (that step then records
        nothing more): call it before ``clip_grad_norm_`` to record the unclipped gradients, whose norm is then the
        run's ``total_norm``, as its tag ``msprobe_mlflow.gradients_recorded`` says."""

        if self._session is None or self._session.closed:
            raise RuntimeError("record_gradients() needs a monitor that is running: call monitor(model) first")
        if self._recorded_early is None:
            self.tag_run({RECORDED_TAG: "at record_gradients(), before clipping: total_norm is the norm before "
                                        "clipping"})
        self._recorded_early = self.step
        self._probe_step(self.step)

    def _probe_step(self, step: int) -> None:
        if self._traces is not None:  # the step's gradients are final: its trace ends before the probe
            self._traces.finish()
        ranks = self._session.ranks
        if not self.config.wants_step(step):
            return
        try:
            self._probe(ranks.rank, step, ranks.probes)
        except Exception as e:  # observability must never break training
            self._report_failure(step, e)

    def _probe(self, rank: int, step: int, writes: bool) -> None:
        unseen_forward = self._formats is not None and self._formats.missed_first_forward()
        compute_format = self._formats.take() if self._formats else None
        self._submit_held(compute_format)
        if self._unsupported:
            raise NotImplementedError(self._unsupported)
        names, grads, indices = self._gradients()
        sharded = has_sharded(grads)  # its statistics are collectives: every rank takes part, written or not
        if not (writes or sharded):
            return
        if not all(dtype.is_floating_point for dtype in {g.dtype for g in grads}):
            unsupported = [f"{n} ({g.dtype})" for n, g in zip(names, grads) if not g.dtype.is_floating_point]
            raise TypeError(f"gradients of {', '.join(unsupported)} have no max/min/sign statistics; expected "
                            f"real floating dtypes (leave such parameters out with grad_probe.param_list)")
        launch = launch_sharded_statistics if sharded else launch_step_statistics
        level = self.recorded_level
        pending = launch(names, grads, rank=rank, step=step, level=level, bounds=self.config.bounds,
                         checksum=self.config.checksum, directions=self.directions_schedule.wants(step),
                         extra=self.options.gradient_statistics, cache=self._cache)
        if self.options.parameter_norms:
            norms, statistics = launch_parameter_norms(names, [self._parameters[i][1] for i in indices]), pending
            pending = lambda: with_parameter_norms(statistics(), norms())  # noqa: E731
        if compute_format is not None:
            measured = pending
            pending = lambda: with_compute_format(measured(), compute_format)  # noqa: E731
        scale = loss_scale.scale_of(self._optimizer) if level.has_exponents else None
        if scale is not None:  # copied with the step's statistics, never waited for here
            scaled, scale_on_host = pending, start_host_copy(scale.detach().float().reshape(1).clone())
            pending = lambda: with_loss_scale(scaled(), float(scale_on_host()[0]))  # noqa: E731
        if writes:
            self._probed_steps += 1
            if unseen_forward:
                self._held = pending
            else:
                self._session.submit(pending)

    def _submit_held(self, compute_format: str | None) -> None:
        """The first step of a monitor attached during it (``autolog()``: at its optimizer step) ran its forward
        unseen: its record waits for the next probed step and takes that step's format, as one training loop
        computes its steps alike; at ``flush()`` or ``stop()`` it goes without one."""
        held, self._held = self._held, None
        if held is not None:
            self._session.submit(held if compute_format is None else
                                 lambda: with_compute_format(held(), compute_format))

    def _gradients(self) -> tuple[list[str], list, list[int]]:
        """The gradients to record now: their names, the gradients (FSDP1: this rank's pieces of the flat ones)
        and their parameters' indices. The usual case, dense gradients in ``.grad`` on every parameter, is a few
        list operations, not a loop in Python."""
        plain = self._plain_parameters
        if plain:
            held = [parameter.grad for parameter in plain]
            if not any(grad is None or grad.is_sparse or grad.requires_grad for grad in held) and \
                    not any("main_grad" in parameter.__dict__ for parameter in plain):
                return self._parameter_names, held, list(range(len(held)))
        names, grads, indices = [], [], []
        for index, (name, parameter, slot) in enumerate(self._parameters):
            if slot is not None:  # FSDP1: this rank's piece of the flattened gradient
                piece, start, capacity = slot.piece(parameter)
                if piece is not None:
                    names.append(name)
                    grads.append(FlatPiece(piece.detach(), slot.shape, start, capacity, slot.group))
                continue
            grad = parameter.main_grad if hasattr(parameter, "main_grad") else parameter.grad
            if grad is None:
                continue
            if grad.is_sparse:
                grad = grad.to_dense()
            names.append(name)
            grads.append(grad.detach() if grad.requires_grad else grad)
            indices.append(index)
        return names, grads, indices

    def _report_failure(self, step: int, error: Exception) -> None:
        """Counted in ``errors``, tagged on the run (the failed steps), warned about once, logged each time."""
        self._probed_steps += 1
        self._failed_steps.append(step)
        self._probe_failures.append(f"probing step {step} failed: {error!r}")
        self.notices.failure("probe", f"probing step {step} failed ({error!r})")
        tag = FAILED_STEPS_TAG if self._session.ranks.world_size == 1 else \
            rank_tag(self._session.ranks.rank, "failed_steps")
        self.tag_run({tag: step_ranges(self._failed_steps, limit=TAG_RANGES_LIMIT)}, step)

    @property
    def errors(self) -> list[str]:
        """Probe failures (training thread), then what the writer thread and the sinks could not do."""
        return self._probe_failures + (self._traces.errors if self._traces else []) + super().errors

    def flush(self) -> None:
        """Waits until every probed step is on disk and delivered by every sink (a held first step included)."""
        self._submit_held(None)
        super().flush()

    def _remove_hook(self) -> None:
        if self._session is not None and not self._session.closed:
            self._submit_held(None)
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
            if self.recorded_level.has_exponents:
                loss_scale.unwatch()
        if self._after_hook is not None:
            self._after_hook.remove()
            self._after_hook = None
        if self._traces is not None:
            self._traces.close()
        if self._formats is not None:
            self._formats.close()
            self._formats = None
        if self._model_id is not None and _monitored_models.get(self._model_id) is self:
            del _monitored_models[self._model_id]

    def stop(self) -> None:
        """Removes every hook, writes what is pending and stops the writer thread. Safe to call twice."""
        self._remove_hook()
        if self._session and not self._session.closed:
            if self._probed_steps and len(self._failed_steps) == self._probed_steps:
                self.notices.warn(f"every probed step ({self._probed_steps}) failed, nothing was recorded; first "
                                  f"failure: {self._probe_failures[0]}")
            self._session.close()
            self._cache.release()


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
