"""fused.in_parallel on torch's own OpenMP threads (msprobe_mlflow.pytorch.openmp), and on threads of its own where
torch has fewer threads than asked for."""
import os
import threading

import pytest
import torch

from msprobe_mlflow.pytorch import fused, openmp

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
def test_the_statistics_are_the_same_on_either_kind_of_thread(torch_threads, threads):
    torch_threads(threads)
    arrays = [torch.randn(size, generator=torch.Generator().manual_seed(size)).numpy()
              for size in [fused.PARALLEL_MIN // 2, fused.PARALLEL_MIN // 2 + 13, 5 * fused.BLOCK + 1, 7]]
    offsets = [0]
    for array in arrays[:-1]:
        offsets.append(offsets[-1] + (array.size + 7) // 8)
    results = []
    for parallel in (False, True):
        signs = torch.full((offsets[-1] + 1,), 0xAA, dtype=torch.uint8).numpy()
        if not parallel:
            fused.on_one_core()
        try:
            out = fused.statistics(arrays, [-1, 0, 1], with_counts=True, with_signs=True, sign_offsets=offsets,
                                   signs=signs, with_norms=True)
        finally:
            fused._this_thread.one_core = False
        results.append([*out, signs])
    for one_core, spread in zip(*results):
        assert one_core.tobytes() == spread.tobytes()
