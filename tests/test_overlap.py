"""The overlap (statistics computed during backward, msprobe_mlflow/pytorch/overlap.py) records what the path without
it records, byte for byte: the same training is run with ``overlap=True`` and ``overlap=False`` and every CSV and
direction file is compared, over the ways a gradient changes between backward and ``optimizer.step()``."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import mlflow
import pytest
import torch
from mlflow import MlflowClient

from mlflow_server import free_port
from msprobe_mlflow import GradProbeConfig
from msprobe_mlflow.pytorch import GradientMonitor, overlap

WORKER = Path(__file__).with_name("overlap_worker.py")
STEPS = 4


class Model(torch.nn.Module):
    """Three layers of 64 and one never used: its gradient stays None."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64),
                                          torch.nn.Tanh(), torch.nn.Linear(64, 8))
        self.unused = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.layers(x)


CORES_LEFT_TO_A_WORKER = overlap.cores_left_to_a_worker  # before the fixture below sets it aside


@pytest.fixture(autouse=True)
def small_gradients_overlap_too(monkeypatch):
    """These models are small, and torch may use every core here: the overlap would be off, comparing the path
    without it with itself. The tests of those rules set them back."""
    monkeypatch.setattr(overlap, "MIN_AVERAGE_ELEMENTS", 0)
    monkeypatch.setattr(overlap, "cores_left_to_a_worker", lambda: 1)


def loss_of(model, generator) -> torch.Tensor:
    x, y = torch.randn(16, 32, generator=generator), torch.randn(16, 8, generator=generator)
    return torch.nn.functional.mse_loss(model(x), y)


def train(dump: Path, overlap: bool, how: str, log_to_mlflow: bool = False, **config) -> GradientMonitor:
    """``STEPS`` steps of ``Model`` trained as ``how`` says; returns the stopped monitor."""
    model = Model()
    optimizer = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=3) if how == "lbfgs" else \
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10) if how == "grad_scaler" else None
    monitor = GradientMonitor(GradProbeConfig(dump_path=str(dump), **{"level": "L2", **config}),
                              log_to_mlflow=log_to_mlflow,
                              overlap=overlap).monitor(model, optimizer)
    generator = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=how != "zero_grad_in_place")
        if how == "lbfgs":
            def closure():
                optimizer.zero_grad()
                loss = loss_of(model, generator)
                loss.backward()
                return loss
            optimizer.step(closure)
            continue
        micro_batches = [2, 4, 3, 3][step] if how == "accumulation" else 1
        for _ in range(micro_batches):
            loss = loss_of(model, generator) / micro_batches
            (scaler.scale(loss) if scaler else loss).backward()
        if how == "clip":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        if how == "record_then_clip":
            monitor.record_gradients()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        if how == "data_write":  # bumps no version counter: only the norm check can see it
            model.layers[0].weight.grad.data.mul_(0.5)
        if scaler:
            scaler.step(optimizer)  # unscales in place, bumping no version counter
            scaler.update()
        else:
            optimizer.step()
    monitor.stop()
    assert not monitor.errors, monitor.errors
    return monitor


def dump_files(dump: Path) -> dict[str, bytes]:
    """Every file a run wrote under its rank folders, but the training's ID (each run has its own)."""
    return {str(path.relative_to(dump)): path.read_bytes() for path in sorted(dump.glob("rank*/**/*"))
            if path.is_file() and path.name != "training_id"}


def assert_same_dumps(on: Path, off: Path) -> None:
    mine, reference = dump_files(on), dump_files(off)
    assert sorted(mine) == sorted(reference)
    assert any("step" in name for name in reference) and any(name.endswith(".csv") for name in reference)
    for name in reference:
        assert mine[name] == reference[name], f"{name} differs with the overlap"


# how -> whether early statistics are used: True, False (every gradient changes after its hook), None (it depends
# on whether the worker computes before or after the unversioned write; test_the_check_... checks that case)
HOWS = {"plain": True, "accumulation": True, "zero_grad_in_place": True, "lbfgs": True, "clip": False,
        "record_then_clip": True, "grad_scaler": None, "data_write": None}


@pytest.mark.parametrize("bucket_elements", [1, overlap.BUCKET_ELEMENTS])
@pytest.mark.parametrize("how", HOWS)
def test_the_overlap_records_what_the_step_applies_byte_for_byte(tmp_path, monkeypatch, how, bucket_elements):
    monkeypatch.setattr(overlap, "BUCKET_ELEMENTS", bucket_elements)  # 1: each gradient a bucket of its own
    on = train(tmp_path / "on", True, how)
    off = train(tmp_path / "off", False, how)
    assert (on.overlap, off.overlap) == ("on", "off: overlap=False")
    assert_same_dumps(tmp_path / "on", tmp_path / "off")
    assert off.early_gradients == 0
    if HOWS[how] is not None:
        assert (on.early_gradients > 0) == HOWS[how], on.early_gradients


@pytest.mark.parametrize("config", [dict(level="L1", directions_every_n_steps=2), dict(level="L1", step=[1, 3]),
                                    dict(level="L2", bounds=[-0.01, 0.0, 0.01]), dict(level="L2", param_list=[
                                        "layers.2.weight", "layers.4.bias"])])
def test_the_overlap_keeps_the_directions_schedule_the_steps_and_the_parameters_chosen(tmp_path, config):
    on = train(tmp_path / "on", True, "plain", **config)
    train(tmp_path / "off", False, "plain", **config)
    assert_same_dumps(tmp_path / "on", tmp_path / "off")
    assert on.early_gradients > 0


@pytest.mark.parametrize("two_cores_from", [overlap.PARALLEL_MIN, 0])  # 0: the check's norms on two threads
def test_the_check_keeps_only_buckets_whose_gradients_are_unchanged_since_computed(monkeypatch, two_cores_from):
    """Computed during backward, then each gradient changed in one way after its statistics were taken."""
    monkeypatch.setattr(overlap, "BUCKET_ELEMENTS", 1)
    monkeypatch.setattr(overlap, "PARALLEL_MIN", two_cores_from)
    model = Model()
    parameters = list(model.layers.parameters())
    with_signs = (overlap.step_level("L2", True), [torch.tensor(b).float().numpy() for b in (-1.0, 0.0, 1.0)], ())
    early = overlap.EarlyStatistics(parameters, lambda: with_signs)

    def nan_into(parameter):  # a NaN gradient is never trusted, whether the worker computed before the NaN or after
        parameter.grad.data.view(-1)[0] = float("nan")

    nan_after_ours = parameters[3].register_post_accumulate_grad_hook(nan_into)
    loss_of(model, torch.Generator().manual_seed(1)).backward()
    buckets = early.take()  # every bucket computed
    assert sorted(buckets) == list(range(6)) and len(set(buckets.values())) == 6
    grads = [p.grad for p in parameters]

    def usable(directions=True) -> list[int]:
        return sorted(k for positions, _ in overlap.usable_parts(buckets, list(range(6)), grads, directions)
                      for k in positions)

    assert usable() == [0, 1, 2, 4, 5]
    grads[0].data.mul_(0.5)  # no version bump: the norm shows it
    with torch.no_grad():
        grads[1].add_(1.0)  # a version bump
    grads[2] = grads[2].clone()  # another object, equal values
    assert usable() == [4, 5]
    early.close()
    nan_after_ours.remove()
    early = overlap.EarlyStatistics(parameters, lambda: (overlap.step_level("L2", False), with_signs[1], ()))
    loss_of(model, torch.Generator().manual_seed(2)).backward()  # accumulated into the same gradients
    buckets, grads = early.take(), [p.grad for p in parameters]
    assert usable(directions=False) == [0, 1, 2, 4, 5] and usable(directions=True) == []  # 3: NaN still
    assert overlap.usable_parts(buckets, [0, 1, 2, 4, 5], grads[:3] + grads[4:], False) != []
    early.close()


def test_the_checks_norms_on_two_cores_are_each_tensors_own(monkeypatch):
    threads, both_halves = set(), threading.Barrier(2, timeout=60)

    def foreach_norm_noting_the_thread(tensors):
        threads.add(threading.get_ident())
        return torch._foreach_norm(tensors)

    def foreach_norm_of_a_half(tensors):  # returns once both halves run at once, each on a thread of its own
        both_halves.wait()
        return foreach_norm_noting_the_thread(tensors)

    monkeypatch.setattr(overlap, "foreach_norm", foreach_norm_of_a_half)
    generator = torch.Generator().manual_seed(3)
    tensors = [torch.randn(size, generator=generator) * (k + 1)
               for k, size in enumerate([3, 1 << 19, 7, 1 << 18, 1 << 19, 5, 1])]
    alone = [torch._foreach_norm([tensor])[0] for tensor in tensors]
    together = overlap.norms_on_two_cores(tensors)
    assert len(threads) == 2  # the helper took the second half
    assert torch.equal(torch.stack(together), torch.stack(alone))
    monkeypatch.setattr(overlap, "foreach_norm", foreach_norm_noting_the_thread)
    threads.clear()
    assert torch.equal(torch.stack(overlap.norms_on_two_cores(tensors[:3])), torch.stack(alone[:3]))
    assert len(threads) == 1  # too few elements to be worth a thread


def test_the_worker_computes_on_one_core_and_the_step_on_the_ranks_cores(tmp_path, monkeypatch):
    """Beside backward the worker takes one core; in the pre-hook, where training waits, the statistics may use
    this rank's cores even when torch was given fewer threads."""
    from msprobe_mlflow.torch_kernels import fused

    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)  # as a user's torch.set_num_threads(1) leaves it
    monkeypatch.setattr(fused, "rank_cores", lambda: 3)
    monkeypatch.setattr(fused, "PARALLEL_MIN", 0)  # these gradients are small
    monkeypatch.setattr(overlap, "BUCKET_ELEMENTS", 1)  # every gradient a bucket the worker computes
    threads_by_caller = {}
    in_parallel = fused.in_parallel

    def in_parallel_noting_the_threads(work, items, threads):
        threads_by_caller.setdefault(threading.current_thread().name, set()).add(threads)
        return in_parallel(work, items, threads)

    monkeypatch.setattr(fused, "in_parallel", in_parallel_noting_the_threads)
    on, off = train(tmp_path / "on", True, "plain"), train(tmp_path / "off", False, "plain")
    assert on.early_gradients > 0 and off.early_gradients == 0
    assert threads_by_caller["msprobe-mlflow-overlap"] == {1}
    assert threads_by_caller["MainThread"] == {3}  # the path without the overlap, and take() at step()
    assert_same_dumps(tmp_path / "on", tmp_path / "off")


def test_l0_and_the_option_say_why_the_overlap_is_off_in_the_runs_tags(tmp_experiment, tmp_path):
    with pytest.raises(ValueError, match="overlap = 'yes' is not accepted; expected True or False"):
        GradientMonitor(GradProbeConfig(dump_path=str(tmp_path / "x")), overlap="yes")
    for dump, level, tag in [("l0", "L0", "off: L0 hashes each gradient's bytes in the optimizer's pre-hook, where they are final"),
                             ("l1", "L1", "on")]:
        with mlflow.start_run() as run, warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            monitor = train(tmp_path / dump, True, "plain", log_to_mlflow=True, level=level)
        about_the_overlap = [str(w.message) for w in said if "overlap=True" in str(w.message)]
        assert about_the_overlap == ([] if tag == "on" else [f"msprobe-mlflow: overlap=True, but the overlap is "
                                                             f"{tag.replace('off:', 'off here:')}"])
        assert monitor.overlap == tag
        assert MlflowClient().get_run(run.info.run_id).data.tags["msprobe_mlflow.overlap"] == tag
        assert (monitor.early_gradients > 0) == (tag == "on")


def torchrun(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                           "127.0.0.1", "--master-port", str(free_port()), str(WORKER), *args],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done.stdout


@pytest.mark.parametrize("stack, status", [
    ("ddp", "off: DDP all-reduces the gradients after backward: none is final earlier"),
    ("allreduce", "on"),
    ("fsdp2", "off: DTensor parameters (FSDP2): their statistics are collectives, taken at step() on every rank")])
def test_distributed_stacks_record_the_same_with_the_overlap_or_fall_back_and_say_so(tmp_path, stack, status):
    outputs = {overlap: torchrun("--stack", stack, "--dump", str(tmp_path / overlap), "--overlap", overlap)
               for overlap in ("on", "off")}
    assert outputs["on"].count(f"OVERLAP {status} EARLY") == 2, outputs["on"]
    if status != "on":
        assert outputs["on"].count("EARLY 0") == 2
    assert outputs["off"].count("OVERLAP off: overlap=False EARLY 0") == 2, outputs["off"]
    assert_same_dumps(tmp_path / "on", tmp_path / "off")


def test_the_overlap_is_off_unless_asked_for_and_the_run_says_why(tmp_path):
    """Where every rule would allow it (this module's fixture), the overlap still waits for ``overlap=True``."""
    model = Model()
    by_default = GradientMonitor(GradProbeConfig(dump_path=str(tmp_path / "default"), level="L1"),
                                 log_to_mlflow=False).monitor(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert by_default.overlap == f"off: {overlap.NOT_ASKED_FOR}"
    by_default.stop()
    asked = train(tmp_path / "asked", True, "plain")
    assert asked.overlap == "on" and asked.early_gradients > 0


def test_small_gradients_take_the_path_without_overlap_and_say_why(tmp_path, monkeypatch):
    """A hook per gradient costs more than the statistics of a small one: below MIN_AVERAGE_ELEMENTS on average,
    the overlap is off, with the reason, and the records are the same."""
    monkeypatch.setattr(overlap, "MIN_AVERAGE_ELEMENTS", 1 << 14)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    monitor = GradientMonitor(GradProbeConfig(dump_path=str(tmp_path), level="L1"), log_to_mlflow=False)
    monitor.monitor(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert monitor.overlap == ("off: gradients of 2080 elements on average: a hook per gradient would cost more "
                               "than it saves (below 16384)")
    monitor.stop()


def test_no_worker_beside_torch_threads_that_use_every_core(tmp_path, monkeypatch):
    """A worker thread competing with torch's intra-op threads for the cores slows backward: with as many torch
    threads as the process has cores, the overlap is off, saying why."""
    monkeypatch.setattr(overlap, "cores_left_to_a_worker", CORES_LEFT_TO_A_WORKER)
    monkeypatch.setattr(torch, "get_num_threads", lambda: len(os.sched_getaffinity(0)))
    model = torch.nn.Linear(256, 256)
    monitor = GradientMonitor(GradProbeConfig(dump_path=str(tmp_path), level="L1"), log_to_mlflow=False)
    monitor.monitor(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert monitor.overlap.startswith("off: torch's ") and "use every core of this process" in monitor.overlap
    monitor.stop()
