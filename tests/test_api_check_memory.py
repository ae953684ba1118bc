"""A call this machine lacks the memory for is ``out_of_memory`` ("not checked: needs N GiB"), told before anything
is allocated, or when a framework fails to allocate: never an ``error`` (issue 48, item 7: a MemoryError for a huge
shape was counted as the model's inaccuracy). Real MindSpore and torch, a real MLflow SQLite store."""
import json

import pytest
from click.testing import CliRunner
from mlflow import MlflowClient

from msprobe_mlflow.api_check import check_api_accuracy
from msprobe_mlflow.api_check.memory import memory_needed
from msprobe_mlflow.api_check.parser import read_api_info
from msprobe_mlflow.commands.cli import main
from msprobe_mlflow.dump import read_csv

HUGE = [2**25, 2**25]  # 2**50 elements: more than any machine's address space, even as float32


def stat(shape, dtype="Float32", low=-1.0, high=1.0):
    return {"type": "mindspore.Tensor", "dtype": dtype, "shape": shape, "Max": high, "Min": low}


def write_dump(folder, data, task="statistics"):
    path = folder / "api_info.json"
    path.write_text(json.dumps({"task": task, "dump_data_dir": "." if task == "tensor" else None, "data": data}),
                    encoding="utf-8")
    return path


def test_the_estimate_is_8_bytes_plus_two_in_the_recorded_dtype_per_element_of_every_recorded_tensor(tmp_path):
    path = write_dump(tmp_path, {
        "Mint.add.0.forward": {"input_args": [stat([2, 3]), stat([4], "BFloat16")],
                               "input_kwargs": {"other": stat([5], "Int64", 0, 3)}, "output": [stat([2, 3])]},
        "Mint.add.0.backward": {"input": [stat([2, 3])], "output": [stat([1], "Bool", False, True)]}})
    [call] = read_api_info(path).calls
    float32, bfloat16, int64, boolean = 8 + 2 * 4, 8 + 2 * 2, 8 + 2 * 8, 8 + 2 * 1
    assert memory_needed(call) == 6 * float32 + 4 * bfloat16 + 5 * int64 + 6 * float32 + 6 * float32 + 1 * boolean


def test_a_tensor_task_file_counts_no_more_elements_than_it_holds(tmp_path):
    """A file claiming 10**9 elements that holds 10 bytes is a damaged file (an error when loaded), not a call too
    big for the machine."""
    (tmp_path / "x.npy").write_bytes(bytes(10))
    tensor = {"type": "mindspore.Tensor", "dtype": "Float32", "shape": [10**9], "data_name": "x.npy"}
    path = write_dump(tmp_path, {"Mint.exp.0.forward": {"input_args": [tensor], "output": [tensor]}}, "tensor")
    [call] = read_api_info(path).calls
    assert memory_needed(call) == 2 * (10 // 4) * (8 + 2 * 4)


def test_a_call_too_big_for_this_machine_is_out_of_memory_and_never_an_error(tmp_path, tmp_sqlite_uri):
    path = write_dump(tmp_path, {
        "Mint.abs.0.forward": {"input_args": [stat(HUGE)], "input_kwargs": {}, "output": [stat(HUGE, low=0.0)]},
        "Mint.abs.1.forward": {"input_args": [stat([2, 3])], "input_kwargs": {}}})
    result = CliRunner().invoke(main, ["api-check", str(path), "--output", str(tmp_path / "out"),
                                       "--tracking-uri", tmp_sqlite_uri, "--experiment", "memory"])
    needed_gib = 2 * 2**50 * (8 + 2 * 4) / 2**30  # input and output, Float32
    message = f"not checked: needs {needed_gib:.1f} GiB of memory (estimated from the recorded shapes and dtypes)"
    assert result.exit_code == 0, result.output
    assert "2 APIs: 1 pass, 0 error, 0 skip, 1 out_of_memory" in result.stdout
    assert f"  Mint.abs.0  {message}, " in result.stdout
    results = read_csv(next((tmp_path / "out").glob("accuracy_checking_result_*.csv")))
    assert results[1][:3] == ["Mint.abs.0", "out_of_memory", ""] and results[1][3].startswith(message)
    client = MlflowClient(tmp_sqlite_uri)
    run = client.get_run(result.stdout.split("MLflow run: ")[1].split()[0])
    assert run.data.metrics["apis_error"] == 0 and run.data.metrics["apis_out_of_memory"] == 1
    assert run.data.metrics["pass_rate"] == 1.0 and run.data.tags["error_apis"] == ""
    [nested] = client.search_runs([run.info.experiment_id], filter_string="tags.status = 'out_of_memory'")
    assert nested.info.run_name == "[out_of_memory] Mint.abs.0"


@pytest.mark.parametrize("task, function", [("statistics", "mindspore.mint.zeros"), ("tensor", "torch.zeros")])
def test_a_framework_that_cannot_allocate_an_output_is_out_of_memory_not_a_skip(tmp_path, task, function):
    """zeros of a recorded size: nothing recorded is big, the framework's allocation fails (MindSpore's in the
    statistics task, torch's in the tensor task, where MindSpore does not run)."""
    entry = {"input_args": [[{"type": "int", "value": n} for n in HUGE]], "input_kwargs": {}, "output": []}
    path = write_dump(tmp_path, {"Mint.zeros.0.forward": entry}, task)
    [result] = check_api_accuracy(path, output_dir=tmp_path / "out", log_to_mlflow=False).results
    assert result.status == "out_of_memory", result.message
    assert result.message.startswith(f"not checked: {function} ran out of memory here: RuntimeError: ")
