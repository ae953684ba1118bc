"""api-check on many calls: worker processes give the same report as one process, in dump order; a worker that
dies costs only the call it was running; identical inputs are made once and still behave as separate arguments; a
.npy whose header claims more than the file holds is refused before it is loaded."""
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from msprobe_mlflow.api_check import check_api_accuracy
from msprobe_mlflow.api_check.inputs import InputCache, regenerate
from msprobe_mlflow.api_check.parser import TensorArg
from msprobe_mlflow.api_check.replay import core_shares
from msprobe_mlflow.commands.cli import main as cli

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "mindspore_api_dump" / "statistics" / "api_info.json"


def details(report) -> list[tuple]:
    return [(row.name, row.status, row.message, row.bench_dtype, row.tested_dtype, row.shape, row.cosine,
             row.max_abs_err, row.max_relative_err) for result in report.results for row in result.output_rows()]


def write_dump(folder: Path, data: dict, task: str = "statistics", **extra) -> Path:
    path = folder / "api_info.json"
    path.write_text(json.dumps({"task": task, **extra, "data": data}), encoding="utf-8")
    return path


def test_two_workers_give_the_report_of_one_process_in_dump_order(tmp_path):
    here = check_api_accuracy(EXAMPLE, output_dir=tmp_path / "here", log_to_mlflow=False)
    progress = []
    spread = check_api_accuracy(EXAMPLE, output_dir=tmp_path / "workers", log_to_mlflow=False, workers=2,
                                on_progress=lambda done, total, name: progress.append((done, total)))
    assert [result.name for result in spread.results] == [result.name for result in here.results]
    assert details(spread) == details(here)
    assert progress == [(done, len(here.results)) for done in range(1, len(here.results) + 1)]
    assert spread.details_csv.read_bytes().splitlines()[1:] == here.details_csv.read_bytes().splitlines()[1:]


def fifo_reader(path: Path) -> int:
    """The process ID of the worker that has ``path`` open, once one has."""
    while True:
        for process in Path("/proc").iterdir():
            if not process.name.isdigit() or int(process.name) == os.getpid():
                continue
            try:
                if any(os.readlink(descriptor) == str(path) for descriptor in (process / "fd").iterdir()):
                    return int(process.name)
            except OSError:  # not ours to read, or gone meanwhile
                continue


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="finds the worker through /proc")
def test_a_worker_killed_during_a_call_costs_only_that_call(tmp_path):
    """One input is a named pipe: the worker that opens it waits for data that never comes. The test kills that
    worker (the event: the pipe's writer side opens once a reader has); its call is an error naming how the worker
    ended, and a new worker checks the others."""
    data_dir = tmp_path / "npy"
    data_dir.mkdir()

    def tensor(name, values):
        np.save(data_dir / f"{name}.npy", np.asarray(values, dtype=np.float32))
        return {"type": "mindspore.Tensor", "dtype": "Float32", "shape": [len(values)], "data_name": f"{name}.npy"}

    os.mkfifo(data_dir / "stuck.npy")
    stuck = {"type": "mindspore.Tensor", "dtype": "Float32", "shape": [2], "data_name": "stuck.npy"}
    data = {f"Mint.add.{i}.forward": {"input_args": [tensor(f"x{i}", [i, 1]), tensor(f"y{i}", [1, 2])],
                                      "output": [tensor(f"o{i}", [i + 1, 3])]} for i in range(6)}
    data["Mint.exp.0.forward"] = {"input_args": [stuck], "output": [tensor("e", [1, 1])]}
    dump = write_dump(tmp_path, data, task="tensor", dump_data_dir="npy")
    killed, pinned_to = [], []

    def kill_the_reader():
        with open(data_dir / "stuck.npy", "wb"):  # returns once a worker has opened the pipe to read it
            reader = fifo_reader(data_dir / "stuck.npy")
            pinned_to.append(sorted(os.sched_getaffinity(reader)))
            os.kill(reader, signal.SIGKILL)
            killed.append(reader)

    killer = threading.Thread(target=kill_the_reader)
    killer.start()
    report = check_api_accuracy(dump, output_dir=tmp_path / "out", log_to_mlflow=False, workers=2)
    killer.join()
    assert len(killed) == 1
    assert pinned_to[0] in core_shares(2)  # the worker ran on its own share of the CPUs
    results = {result.name: result for result in report.results}
    assert list(results) == [*(f"Mint.add.{i}" for i in range(6)), "Mint.exp.0"]
    assert results["Mint.exp.0"].status == "error"
    assert results["Mint.exp.0"].message == ("the worker process running this call ended (killed by SIGKILL) "
                                             "before it finished")
    assert [results[f"Mint.add.{i}"].status for i in range(6)] == ["pass"] * 6


def test_workers_get_contiguous_shares_of_the_cpus_and_one_worker_is_not_pinned(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3, 4, 5, 6, 7, 8, 9, 10})
    assert core_shares(3) == [[3, 4], [5, 6, 7], [8, 9, 10]]
    assert core_shares(8) == [[cpu] for cpu in range(3, 11)]
    assert core_shares(10) == [[cpu] for cpu in range(3, 11)] + [[3], [4]]
    assert core_shares(1) == [None]


def test_calls_with_identical_inputs_get_identical_results_and_a_repeated_input_is_two_arguments(tmp_path):
    """mul(x, x) with both arguments recorded alike: the cache hands out one tensor twice, yet each argument gets
    its own gradient in torch and in MindSpore (were they one leaf, torch's gradient would be twice MindSpore's
    and the backward an error); a second identical call gets the same rows."""
    spec = {"type": "mindspore.Tensor", "dtype": "Float32", "shape": [2, 3], "Max": 2.0, "Min": 0.5}
    sensitivity = {"type": "mindspore.Tensor", "dtype": "Float32", "shape": [2, 3], "Max": 1.0, "Min": 1.0}
    data = {}
    for i in range(2):
        data[f"Mint.mul.{i}.forward"] = {"input_args": [spec, spec], "input_kwargs": {}}
        data[f"Mint.mul.{i}.backward"] = {"input": [sensitivity]}
    report = check_api_accuracy(write_dump(tmp_path, data), output_dir=tmp_path / "out", log_to_mlflow=False)
    first, second = report.results
    assert [row.name for row in first.backward.outputs] == ["Mint.mul.0.backward.output.0",
                                                            "Mint.mul.0.backward.output.1"]
    assert [row.status for row in first.output_rows()] == ["pass"] * 3
    assert [row[1:] for row in details(type(report)([first]))] == [row[1:] for row in details(type(report)([second]))]


def test_the_cache_makes_a_tensor_changed_in_place_again_and_keeps_within_its_bytes():
    spec = TensorArg("Float32", (4, 5), maximum=3.0, minimum=-3.0)
    expected = regenerate(spec).astype(np.float32)
    cache = InputCache(max_bytes=2 * 4 * 20)  # room for this one tensor pair
    first = cache.pair(spec, "statistics", "x")
    second = cache.pair(spec, "statistics", "x")
    assert first is not second and first.torch is second.torch  # shared tensors, separate arguments
    first.torch.add_(1)
    third = cache.pair(spec, "statistics", "x")
    np.testing.assert_array_equal(third.torch.numpy(), expected)
    np.testing.assert_array_equal(third.mindspore.asnumpy(), expected)
    other = cache.pair(TensorArg("Float32", (4, 5), maximum=1.0, minimum=0.0), "statistics", "y")
    assert cache.held_bytes == 2 * other.torch.nbytes  # the first was dropped to make room


def test_an_npy_whose_header_claims_more_than_the_file_holds_is_an_error_before_it_is_loaded(tmp_path):
    data_dir = tmp_path / "npy"
    data_dir.mkdir()
    with open(data_dir / "huge.npy", "wb") as f:  # a billion float32 claimed, ten bytes held: np.load takes 4 GB
        np.lib.format.write_array_header_1_0(f, {"descr": "<f4", "fortran_order": False, "shape": (10**9,)})
        f.write(bytes(10))
    tensor = {"type": "mindspore.Tensor", "dtype": "Float32", "shape": [10**9], "data_name": "huge.npy"}
    dump = write_dump(tmp_path, {"Mint.exp.0.forward": {"input_args": [tensor], "output": [tensor]}},
                      task="tensor", dump_data_dir="npy")
    (result,) = check_api_accuracy(dump, output_dir=tmp_path / "out", log_to_mlflow=False).results
    assert result.status == "error"
    assert result.message == (f"Mint.exp.0.forward: input_args[0]: {data_dir / 'huge.npy'}: not a readable .npy "
                              f"file (it holds 10 data bytes, its header's shape [1000000000] needs 4000000000)")


@pytest.mark.parametrize("workers", [0, -1, 1.5, True, "2"])
def test_a_bad_number_of_workers_is_refused_naming_it(tmp_path, workers):
    with pytest.raises(ValueError, match=f"workers = {workers!r} is not accepted; expected a whole number"):
        check_api_accuracy(EXAMPLE, output_dir=tmp_path, log_to_mlflow=False, workers=workers)


def test_the_command_takes_workers_and_refuses_zero(tmp_path):
    result = CliRunner().invoke(cli, ["api-check", str(EXAMPLE), "--no-mlflow", "--workers", "0"])
    assert result.exit_code == 2
    assert "--workers" in result.output and "0" in result.output


def test_the_callers_process_imports_neither_torch_nor_mindspore_when_a_worker_runs_the_calls(tmp_path):
    """A fresh interpreter (launch blocking off) checks the statistics example: MindSpore ran the calls (atan2 has
    no CPU kernel: skip), in the worker; the caller's process never imported torch or MindSpore."""
    code = (f"import sys\nfrom msprobe_mlflow.api_check import check_api_accuracy\n"
            f"report = check_api_accuracy({str(EXAMPLE)!r}, output_dir={str(tmp_path)!r}, log_to_mlflow=False)\n"
            f"print({{result.name: result.status for result in report.results}}['Mint.atan2.0'])\n"
            f"print(sorted(name for name in ('torch', 'mindspore') if name in sys.modules))")
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], env=environment, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[-2:] == ["skip", "[]"]
