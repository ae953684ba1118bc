"""fused.in_parallel on torch's own OpenMP threads (msprobe_mlflow.torch_kernels.openmp), and on threads of its own
where torch has fewer threads than asked for."""
import os
import threading
from pathlib import Path

import pytest
import torch

from msprobe_mlflow import GradProbeConfig
from msprobe_mlflow.pytorch import GradientMonitor
from msprobe_mlflow.torch_kernels import fused, openmp

needs_openmp = pytest.mark.skipif(openmp._torch_libgomp() is None, reason="torch does not run on OpenMP here")


@pytest.fixture
def torch_threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def threads_running(items: int, threads: int) -> list[tuple[int, str]]:
    """(native id, thread name) of the thread that ran each item; every item waits until all have started, so
    this returns only if ``items`` threads ran at once."""
    together, ran = threading.Barrier(items, timeout=60), []

    def work(item):
        together.wait()
        ran.append((threading.get_native_id(), threading.current_thread().name))

    fused.in_parallel(work, list(range(items)), threads)
    return ran


@needs_openmp
def test_the_work_runs_on_torchs_waiting_openmp_threads(torch_threads):
    torch_threads(2)
    torch.ones(1 << 22).exp().sum()  # an op torch runs on 2 threads: its OpenMP worker exists and waits
    existing = {int(task) for task in os.listdir("/proc/self/task")}
    ran = threads_running(2, 2)
    names = dict(ran)
    assert threading.get_native_id() in names and len(names) == 2
    (helper,) = set(names) - {threading.get_native_id()}
    assert helper in existing and names[helper] != "msprobe-mlflow-statistics"  # no thread started for the call


@needs_openmp
def test_a_failure_on_torchs_threads_is_raised_on_the_calling_thread(torch_threads):
    torch_threads(2)

    def work(item):
        if item == 3:
            raise ValueError("item 3")

    with pytest.raises(ValueError, match="item 3"):
        fused.in_parallel(work, list(range(6)), 2)


def test_beyond_torchs_threads_it_starts_threads_of_its_own(torch_threads):
    torch_threads(1)
    names = {name for _, name in threads_running(2, 2)}
    assert names == {threading.current_thread().name, "msprobe-mlflow-statistics"}


@pytest.mark.parametrize("threads", [1, 2])
def test_the_statistics_are_the_same_on_either_kind_of_thread(torch_threads, threads, monkeypatch):
    torch_threads(threads)
    arrays = [torch.randn(size, generator=torch.Generator().manual_seed(size)).numpy()
              for size in [fused.PARALLEL_MIN // 2, fused.PARALLEL_MIN // 2 + 13, 5 * fused.BLOCK + 1, 7]]
    offsets = [0]
    for array in arrays[:-1]:
        offsets.append(offsets[-1] + (array.size + 7) // 8)
    results = []
    for parallel in (False, True):
        signs = torch.full((offsets[-1] + 1,), 0xAA, dtype=torch.uint8).numpy()
        with monkeypatch.context() as patch:
            if not parallel:
                patch.setattr(fused, "worker_threads", lambda: 1)
            out = fused.statistics(arrays, [-1, 0, 1], with_counts=True, with_signs=True, sign_offsets=offsets,
                                   signs=signs, with_norms=True, with_exponents=True)
        results.append([*out, signs])
    for one_core, spread in zip(*results):
        assert one_core.tobytes() == spread.tobytes()


def dump_of_training(dump: Path, level: str) -> dict[str, bytes]:
    """Three steps of a model of 2.1M parameters (above fused.PARALLEL_MIN: the pre-hook spreads its work), torch
    on 2 threads; every file under the rank folders but the training's ID."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Tanh(), torch.nn.Linear(1024, 1024))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    with GradientMonitor(GradProbeConfig(dump_path=str(dump), level=level), log_to_mlflow=False,
                         anomaly_flags=False).monitor(model, optimizer) as monitor:
        for step in range(3):
            optimizer.zero_grad()
            model(torch.randn(8, 1024, generator=torch.Generator().manual_seed(step))).square().mean().backward()
            optimizer.step()
    assert not monitor.errors, monitor.errors
    return {str(path.relative_to(dump)): path.read_bytes() for path in sorted(dump.glob("rank*/**/*"))
            if path.is_file() and path.name != "training_id"}


@needs_openmp
@pytest.mark.parametrize("level", ["L0", "L2"])
def test_the_monitors_dump_is_the_same_through_torchs_threads(tmp_path, monkeypatch, torch_threads, level):
    torch_threads(2)
    on_torch_threads, used = openmp.on_torch_threads, []

    def noting_its_use(work, threads):
        used.append(on_torch_threads(work, threads))
        return used[-1]

    monkeypatch.setattr(fused, "on_torch_threads", noting_its_use)
    through_torch = dump_of_training(tmp_path / "torch", level)
    assert used and all(used)  # the pre-hook's MD5s (L0) or kernel (L2) ran on torch's threads
    monkeypatch.setattr(fused, "on_torch_threads", lambda work, threads: False)
    of_its_own = dump_of_training(tmp_path / "own", level)
    assert sorted(through_torch) == sorted(of_its_own) and any(name.endswith(".csv") for name in of_its_own)
    for name, content in of_its_own.items():
        assert through_torch[name] == content, name
