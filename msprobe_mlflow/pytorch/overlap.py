"""Gradient statistics computed while backward still runs, so that ``optimizer.step()`` waits for little.

A gradient is final long before ``step()``: the last layers' gradients are ready while backward still runs through
the first. Each monitored parameter's post-accumulate-grad hook puts its gradient into the open bucket, in the
order they become ready; a full bucket goes to a worker thread, which computes its statistics and signs with the
CPU kernel (it releases the GIL). At ``step()`` the training thread computes the last, partly filled bucket (and
any bucket the worker has not started), then keeps a bucket's results only if each of its gradients is still what
they were taken from:

- the same tensor object, same storage and same ``_version`` (in-place ops bump it: a later micro-batch's
  accumulation, ``clip_grad_norm_``'s ``mul_``, ``zero_grad(set_to_none=False)``; ``set_to_none`` or a reassigned
  ``.grad`` gives another object);
- the same float32 norm, bit for bit, computed again at ``step()`` (on two cores): writes that bypass the version
  counter (``GradScaler.unscale_``, ``dist.all_reduce`` of a gradient, ``.data`` in-place ops, extensions' kernels)
  change the norm unless they leave every value as it was (or only permute or negate values, which no training
  stack does to a gradient);
- a finite norm (a NaN or infinite gradient is always computed again), and signs when the step records directions.

Every other gradient is computed at ``step()`` as without the overlap, so the records are the same byte for byte;
only the time they cost the training thread differs. Gradient accumulation: the number of backward passes of the
last probed step is remembered, and only the last pass of a step computes early (a step with more or fewer passes
is still exact: what does not match is computed again). With ``optimizer.step(closure)``, only the first call of the
closure computes early (the probe runs when it returns). Stacks whose gradients are final only after backward,
or not in ``.grad``, keep the path without overlap (:func:`why_off`).
"""
from __future__ import annotations

import dataclasses
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from msprobe_mlflow.compat import foreach_norm, tensor_version
from msprobe_mlflow.layout import EXTREMES, StatisticsLayout
from msprobe_mlflow.levels import LEVELS, Level
from msprobe_mlflow.records import StepRecord, record_from_statistics
from msprobe_mlflow.statistics_table import extra_statistics
from msprobe_mlflow.torch_kernels.fused import PARALLEL_MIN, in_parallel, on_one_core, rank_cores
from msprobe_mlflow.torch_kernels.statistics import StatisticsCache, _launch_group, launch_step_statistics

NOT_ASKED_FOR = ("not asked for (overlap=True turns it on): the pre-hook reads each gradient once at memory speed "
                 "over the rank's cores, as the overlap's check at step() would, so its worker beside backward only "
                 "adds CPU")  # 67M fp32, torch on 1 of 2 cores: L1 1.10x without, 1.15x with; CPU 1.18x, 1.36x
MIN_AVERAGE_ELEMENTS = 1 << 14  # per gradient: a hook costs ~10 us of Python, the kernel that many elements' time
BUCKET_ELEMENTS = 1 << 21  # a bucket goes to the worker once its gradients hold this many elements (8 MB float32)


def why_off(model: torch.nn.Module, parameters: list, *, level: str, writes: bool) -> str | None:
    """Why this monitor computes no statistics early (None: it does). ``parameters``: the monitor's
    ``(name, parameter, FSDP1 slot)`` triples."""
    from torch.nn.parallel import DistributedDataParallel
    from msprobe_mlflow.torch_kernels.sharded import has_sharded

    if not writes:
        return "this rank writes no statistics"
    if level == "L0":
        return "L0 hashes each gradient's bytes in the optimizer's pre-hook, where they are final"
    if any(slot is not None for _, _, slot in parameters):
        return "FSDP1 flat parameters (statistics of pieces of a flat gradient, known only at step())"
    if has_sharded([p for _, p, _ in parameters]):
        return "DTensor parameters (FSDP2): their statistics are collectives, taken at step() on every rank"
    if any(isinstance(m, DistributedDataParallel) for m in model.modules()):
        return "DDP all-reduces the gradients after backward: none is final earlier"
    devices = sorted({p.device.type for _, p, _ in parameters} - {"cpu"})
    if devices:
        return f"gradients on {', '.join(devices)} (the early path runs on the CPU only)"
    if not any(p.requires_grad for _, p, _ in parameters):
        return "no monitored parameter requires a gradient"
    if cores_left_to_a_worker() < 1:  # 67M fp32 on 2 cores, torch on both: 1.5x a step with it, 1.3x without
        return (f"torch's {torch.get_num_threads()} threads use every core of this process: a worker beside them "
                f"would slow backward more than it saves")
    average = sum(p.numel() for _, p, _ in parameters) // len(parameters)
    if average < MIN_AVERAGE_ELEMENTS:  # 512 tensors of 4K elements: 1.9x a step with it, 1.7x without
        return (f"gradients of {average} elements on average: a hook per gradient would cost more than it saves "
                f"(below {MIN_AVERAGE_ELEMENTS})")
    return None


def cores_left_to_a_worker() -> int:
    """This rank's cores that torch's intra-op threads leave free: the early statistics only gain where their
    worker has one."""
    return rank_cores() - torch.get_num_threads()


@dataclass(eq=False)
class _Bucket:
    """Gradients that became ready one after the other, computed together with ``level`` (its ``has_directions``
    as the step wanted when the bucket opened)."""

    level: Level
    bounds32: list
    extra: tuple = ()  # the opt-in statistics' names
    members: list = field(default_factory=list)  # (parameter index, grad, grad._version, grad.data_ptr())
    elements: int = 0
    result: tuple | None = None  # (statistics, signs, values) as _launch_group gives them; None: failed
    done: threading.Event = field(default_factory=threading.Event)

    def compute(self) -> None:
        try:
            with torch.no_grad():
                self.result = _launch_group([grad for _, grad, _, _ in self.members], self.level, self.bounds32,
                                            extra=extra_statistics(self.extra))()
        except Exception:  # computed again at step(), where a failure is reported as every probe failure is
            self.result = None
        finally:
            self.done.set()

    def norms(self) -> np.ndarray:
        layout = StatisticsLayout(self.level, self.bounds32, [grad.numel() for _, grad, _, _ in self.members],
                                  extra=self.extra)
        return layout.split(self.result[0])[EXTREMES][:, 2].astype(np.float32)


class EarlyStatistics:
    """Post-accumulate-grad hooks on ``parameters`` and the worker thread computing their buckets.

    ``settings()`` (called in the hooks) gives ``(level, bounds32, extra)`` for the step the coming ``step()``
    records, or None when nothing is to be computed early (a step not probed, a closure already probed)."""

    def __init__(self, parameters: list[torch.nn.Parameter], settings: Callable[[], tuple | None]):
        self._settings = settings
        self._open: _Bucket | None = None
        self._buckets: dict[int, _Bucket] = {}  # parameter index -> the bucket holding its latest gradient
        self._passes: dict[int, int] = {}  # parameter index -> hooks fired since the last step
        self._expected_passes = 1
        self._queue: deque = deque()
        self._ready = threading.Condition()
        self.hook_failure: Exception | None = None
        self._handles = [p.register_post_accumulate_grad_hook(lambda p, i=i: self._on_grad(i, p))
                         for i, p in enumerate(parameters) if p.requires_grad]
        self._worker = threading.Thread(target=self._work, name="msprobe-mlflow-overlap", daemon=True)
        self._worker.start()

    def _on_grad(self, index: int, parameter: torch.nn.Parameter) -> None:
        """The hook: must never raise (it runs inside backward)."""
        try:
            grad = parameter.grad
            settings = self._settings()
            if settings is None or grad is None or grad.is_sparse or type(grad) is not torch.Tensor \
                    or grad.device.type != "cpu" or hasattr(parameter, "main_grad"):
                return
            passes = self._passes[index] = self._passes.get(index, 0) + 1
            if self._open is not None and self._buckets.get(index) is self._open:  # a new backward pass: what the
                for member, _, _, _ in self._open.members:  # open bucket holds is superseded, computing it is waste
                    del self._buckets[member]
                self._open = None
            self._buckets.pop(index, None)
            if passes < self._expected_passes:  # an earlier micro-batch: its gradient will be added to
                return
            bucket = self._open
            if bucket is None or (bucket.level, bucket.bounds32, bucket.extra) != settings:
                self._submit()
                bucket = self._open = _Bucket(*settings)
            bucket.members.append((index, grad, tensor_version(grad), grad.data_ptr()))
            bucket.elements += grad.numel()
            self._buckets[index] = bucket
            if bucket.elements >= BUCKET_ELEMENTS:
                self._submit()
        except Exception as e:  # those gradients are computed at step()
            self.hook_failure = self.hook_failure or e

    def _submit(self) -> None:
        if self._open is not None:
            with self._ready:
                self._queue.append(self._open)
                self._ready.notify()
            self._open = None

    def _work(self) -> None:
        on_one_core()  # beside backward, which uses torch's threads
        while True:
            with self._ready:
                while not self._queue:
                    self._ready.wait()
                bucket = self._queue.popleft()
            if bucket is None:
                return
            bucket.compute()

    def take(self) -> dict[int, _Bucket]:
        """At ``step()``: every bucket computed (the open one and those not started, here), by parameter index;
        the hooks start afresh for the next step."""
        if self._open is not None:
            self._open.compute()
            self._open = None
        while True:
            with self._ready:
                bucket = self._queue.pop() if self._queue else None
            if bucket is None:
                break
            bucket.compute()
        buckets, self._buckets = self._buckets, {}
        for bucket in set(buckets.values()):
            bucket.done.wait()
        if self._passes:
            self._expected_passes = max(self._passes.values())
            self._passes = {}
        return buckets

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.take()
        with self._ready:
            self._queue.append(None)
            self._ready.notify()
        self._worker.join()


def usable_parts(buckets: dict[int, _Bucket], indices: list[int], grads: list[torch.Tensor],
                 directions: bool) -> list[tuple[list[int], tuple]]:
    """The buckets whose every gradient is still what its statistics were taken from (see the module docstring),
    as ``(positions in grads, result)`` parts for :meth:`StatisticsLayout.merge`. ``grads``: the step's gradients
    as the parameters hold them (not detached copies), ``indices[k]`` the parameter index of ``grads[k]``."""
    position = {index: k for k, index in enumerate(indices)}
    candidates = []
    for bucket in set(buckets.values()):
        if bucket.result is None or (directions and not bucket.level.has_directions):
            continue
        positions = [position.get(index) for index, _, _, _ in bucket.members]
        if all(k is not None and buckets.get(index) is bucket and grads[k] is grad and tensor_version(grad) == version
               and grad.data_ptr() == pointer
               for k, (index, grad, version, pointer) in zip(positions, bucket.members)):
            candidates.append((positions, bucket))
    if not candidates:
        return []
    with torch.no_grad():
        now = norms_on_two_cores([grads[k] for positions, _ in candidates for k in positions])
    now = torch.stack(now).float().numpy().view(np.uint32)
    parts, start = [], 0
    for positions, bucket in candidates:
        early, start = bucket.norms(), start + len(positions)
        mine = now[start - len(positions):start]
        if np.isfinite(early).all() and np.array_equal(early.view(np.uint32), mine):
            parts.append((positions, bucket.result))
    return parts


def norms_on_two_cores(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """:func:`foreach_norm` of ``tensors``, about half of their elements on a helper thread: at ``step()`` the
    overlap's worker is idle, so a core is free (:func:`why_off`), and reading every gradient once more runs at
    memory speed, which two cores exceed (67M float32 in training: 11 ms against 13 ms). Each norm is the same."""
    ends = np.cumsum([tensor.numel() for tensor in tensors])
    if len(tensors) < 2 or ends[-1] < PARALLEL_MIN:
        return foreach_norm(tensors)
    split = min(int(np.searchsorted(ends, ends[-1] / 2)) + 1, len(tensors) - 1)
    halves, norms = [tensors[:split], tensors[split:]], [[], []]

    def norms_of(half: int) -> None:
        norms[half] = foreach_norm(halves[half])

    in_parallel(norms_of, [0, 1], 2)
    return norms[0] + norms[1]


def step_level(level: str, directions: bool) -> Level:
    """What a step records at ``level``: its signs only when the directions schedule wants them."""
    return LEVELS[level] if directions else dataclasses.replace(LEVELS[level], has_directions=False)


def launch_with_early(names: list[str], grads: list[torch.Tensor], parts: list, *, rank: int, step: int,
                      level: str, bounds: tuple, directions: bool, extra=(),
                      cache: StatisticsCache | None = None) -> Callable[[], StepRecord]:
    """:func:`launch_step_statistics` for CPU gradients some of which ``parts`` (from :func:`usable_parts`) already
    hold: the others are computed now, the whole merged into parameter order on the writer thread."""
    if not parts:
        return launch_step_statistics(names, grads, rank=rank, step=step, level=level, bounds=bounds,
                                      directions=directions, extra=extra, cache=cache)
    recorded = step_level(level, directions)
    covered = {k for positions, _ in parts for k in positions}
    rest = [k for k in range(len(grads)) if k not in covered]
    if rest:
        bounds32 = [np.float32(b) for b in bounds]
        parts = parts + [(rest, _launch_group([grads[k] for k in rest], recorded, bounds32,
                                              extra=extra_statistics(extra))())]
    layout = StatisticsLayout(recorded, bounds, [g.numel() for g in grads], extra=extra)
    shapes = [g.shape for g in grads]

    def resolve() -> StepRecord:
        statistics, signs, _ = layout.merge(parts)
        return record_from_statistics(rank=rank, step=step, level=level, bounds=bounds, names=names, shapes=shapes,
                                      statistics=statistics, signs=signs, directions=directions, extra=extra)

    return resolve
