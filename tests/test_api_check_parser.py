"""Reading msprobe's MindSpore dump: typed records, and for each malformed entry a message that names the key, the
field, the value and what is accepted, without stopping at it."""
import json
import math

import numpy as np
import pytest

from msprobe_mlflow.api_check.inputs import regenerate
from msprobe_mlflow.api_check.parser import TensorArg, ValueArg, read_api_info


def tensor(dtype="Float32", shape=(2, 3), maximum=1.0, minimum=-1.0, **extra):
    return {"type": "mindspore.Tensor", "dtype": dtype, "shape": list(shape), "Max": maximum, "Min": minimum,
            **extra}


def write_dump(folder, data, task="statistics", **top):
    path = folder / "api_info.json"
    path.write_text(json.dumps({"task": task, **top, "data": data}), encoding="utf-8")
    return path


def calls_by_name(path):
    return {call.name: call for call in read_api_info(path).calls}


def test_forward_and_backward_entries_become_one_call(tmp_path):
    path = write_dump(tmp_path, {
        "Mint.add.0.forward": {"input_args": [tensor(), {"type": "float", "value": 2.0}],
                               "input_kwargs": {"alpha": {"type": "int", "value": 1}}, "output": [tensor()]},
        "Mint.add.0.backward": {"input": [tensor()], "output": [tensor()]}})
    call = calls_by_name(path)["Mint.add.0"]
    assert (call.family, call.function, call.has_forward, call.has_backward) == ("Mint", "add", True, True)
    assert call.forward.args == (TensorArg("Float32", (2, 3), 1.0, -1.0), ValueArg("float", 2.0))
    assert call.forward.kwargs == {"alpha": ValueArg("int", 1)}
    assert call.backward.output_grads == (TensorArg("Float32", (2, 3), 1.0, -1.0),)


def test_null_arguments_and_kwargs_are_none(tmp_path):
    path = write_dump(tmp_path, {"MintFunctional.linear.0.forward": {
        "input_args": [tensor(), tensor(shape=(4, 3)), None], "input_kwargs": {"dtype": None}}})
    call = calls_by_name(path)["MintFunctional.linear.0"]
    assert call.forward_problem is None
    assert call.forward.args[2] is None and call.forward.kwargs == {"dtype": None}


def test_list_argument_is_a_tuple_of_arguments(tmp_path):
    path = write_dump(tmp_path, {"Mint.cat.0.forward": {
        "input_args": [[tensor(), tensor(shape=(1, 3))]], "input_kwargs": {"dim": {"type": "int", "value": 0}}}})
    args = calls_by_name(path)["Mint.cat.0"].forward.args
    assert args == ((TensorArg("Float32", (2, 3), 1.0, -1.0), TensorArg("Float32", (1, 3), 1.0, -1.0)),)


def test_slice_and_mindspore_dtype_values(tmp_path):
    path = write_dump(tmp_path, {"Mint.f.0.forward": {"input_args": [
        {"type": "slice", "value": [0, None, 2]}, {"type": "mindspore.dtype", "value": "Float16"}]}})
    assert calls_by_name(path)["Mint.f.0"].forward.args == (ValueArg("slice", slice(0, None, 2)),
                                                           ValueArg("mindspore.dtype", "Float16"))


def test_empty_tensor_may_have_null_statistics(tmp_path):
    path = write_dump(tmp_path, {"Mint.abs.0.forward": {"input_args": [tensor(shape=(0, 3), maximum=None,
                                                                                minimum=None)]}})
    call = calls_by_name(path)["Mint.abs.0"]
    assert call.forward_problem is None and call.forward.args[0].numel == 0


def test_infinite_statistics_are_kept_and_replayed(tmp_path):
    """Max = Infinity: the first element is +inf; Min = -Infinity: the last is -inf. Nothing is known of the finite
    elements but the finite bound, so they take it (0 when neither bound is finite)."""
    inf = math.inf
    path = write_dump(tmp_path, {"Mint.abs.0.forward": {"input_args": [
        tensor(maximum=inf, minimum=-inf), tensor("Float16", maximum=inf, minimum=0.5),
        tensor("BFloat16", maximum=2.0, minimum=-inf), tensor(maximum=-inf, minimum=-inf)]}})
    both, high, low, all_negative = calls_by_name(path)["Mint.abs.0"].forward.args
    assert (both.maximum, both.minimum) == (inf, -inf)
    np.testing.assert_array_equal(regenerate(both), [[inf, 0, 0], [0, 0, -inf]])
    np.testing.assert_array_equal(regenerate(high), [[inf, 0.5, 0.5], [0.5, 0.5, 0.5]])
    np.testing.assert_array_equal(regenerate(low), [[2, 2, 2], [2, 2, -inf]])
    np.testing.assert_array_equal(regenerate(all_negative), np.full((2, 3), -inf))


def test_regeneration_is_uniform_between_min_and_max_with_seed_42():
    spec = TensorArg("Float32", (2, 3), maximum=3.0, minimum=1.0)
    np.testing.assert_array_equal(regenerate(spec), np.random.RandomState(42).uniform(1.0, 3.0, (2, 3)))
    integers = regenerate(TensorArg("Int64", (4,), maximum=5, minimum=0))
    np.testing.assert_array_equal(integers, np.trunc(np.random.RandomState(42).uniform(0, 5, 4)))
    flags = regenerate(TensorArg("Bool", (5,), maximum=True, minimum=False))
    np.testing.assert_array_equal(flags, np.random.RandomState(42).rand(5) > 0.5)


@pytest.mark.parametrize("argument, field, accepted", [
    (tensor(dtype="Float33"), "input_args[0].dtype", "Float32"),
    (tensor(shape=(2, -1)), "input_args[0].shape", "non-negative integers"),
    (tensor(maximum=None), "input_args[0].Max", "null only for empty tensors"),
    (tensor(maximum="big"), "input_args[0].Max", "a number, Infinity"),
    (tensor(maximum=math.nan), "input_args[0].Max", "a number, Infinity"),
    (tensor(dtype="Int64", maximum=math.inf, minimum=0), "input_args[0].Max", "a finite number for an Int64 tensor"),
    (tensor(maximum=-2.0, minimum=1.0), "input_args[0].Min", "not above Max"),
    ({"type": "numpy.ndarray", "value": 1}, "input_args[0].type", "mindspore.Tensor"),
    ({"type": "int", "value": "3"}, "input_args[0].value", "an integer"),
    ({"type": "slice", "value": [0, 1]}, "input_args[0].value", "[start, stop, step]"),
    ("a string", "input_args[0]", "an object with a type"),
])
def test_malformed_argument_names_key_field_value_and_what_is_accepted(tmp_path, argument, field, accepted):
    path = write_dump(tmp_path, {"Mint.abs.0.forward": {"input_args": [argument]},
                                 "Mint.neg.0.forward": {"input_args": [tensor()]}})
    calls = calls_by_name(path)
    problem = calls["Mint.abs.0"].forward_problem
    assert problem.startswith(f"Mint.abs.0.forward: {field} = ")
    assert accepted in problem
    assert calls["Mint.neg.0"].forward_problem is None  # the next entry still parses


def test_missing_input_args_is_a_problem_of_that_entry(tmp_path):
    path = write_dump(tmp_path, {"Mint.abs.0.forward": {"input_kwargs": {}}})
    assert calls_by_name(path)["Mint.abs.0"].forward_problem == (
        "Mint.abs.0.forward: input_args = None is not accepted; expected a list of arguments")


def test_tensor_task_needs_the_recorded_outputs(tmp_path):
    path = write_dump(tmp_path, {"Mint.abs.0.forward": {"input_args": []}}, task="tensor", dump_data_dir=".")
    assert calls_by_name(path)["Mint.abs.0"].forward_problem == (
        "Mint.abs.0.forward: output = None is not accepted; expected a list of arguments")


def test_unknown_suffix_and_other_families_are_skipped_with_a_reason(tmp_path):
    path = write_dump(tmp_path, {"Mint.add.0.recompute": {}, "Tensor.add.0.forward": {"input_args": []},
                                 "Mint.add.forward": {"input_args": []}})
    calls = calls_by_name(path)
    assert "suffix 'recompute' is not forward or backward" in calls["Mint.add.0.recompute"].skip_reason
    assert "Tensor APIs are not checked" in calls["Tensor.add.0"].skip_reason
    assert "not Family.function.index" in calls["Mint.add"].problem


def npy_input(data_name):
    return {"type": "mindspore.Tensor", "dtype": "Float32", "shape": [2], "data_name": data_name}


def tensor_dump(folder, dump_data_dir, data_name="x.npy"):
    """A tensor-task dump.json in ``folder`` whose one input is ``data_name`` in ``dump_data_dir``."""
    folder.mkdir(parents=True, exist_ok=True)
    return write_dump(folder, {"Mint.abs.0.forward": {"input_args": [npy_input(data_name)], "output": []}},
                      task="tensor", dump_data_dir=dump_data_dir)


def save_npy(folder, name="x.npy"):
    folder.mkdir(parents=True, exist_ok=True)
    np.save(folder / name, np.ones(2, np.float32))


def test_relative_dump_data_dir_resolves_against_the_json_file(tmp_path, monkeypatch):
    save_npy(tmp_path / "dump" / "npy")
    save_npy(tmp_path / "npy")  # also under the current folder: the JSON file's folder is tried first
    tensor_dump(tmp_path / "dump", "npy")
    monkeypatch.chdir(tmp_path)
    dump = read_api_info("dump/api_info.json")
    assert dump.calls[0].forward.args[0].data_path == (tmp_path / "dump" / "npy" / "x.npy").resolve()
    assert dump.dump_data_dir_found == "'npy', relative to the JSON file's folder"


def test_msprobes_dump_data_dir_relative_to_the_training_folder_is_found_from_there(tmp_path, monkeypatch):
    """msprobe writes dump_data_dir relative to the folder the training ran in (its dump_path as configured)."""
    training = tmp_path / "training"
    save_npy(training / "dump_path" / "step0" / "rank0" / "dump_tensor_data")
    path = tensor_dump(training / "dump_path" / "step0" / "rank0", "./dump_path/step0/rank0/dump_tensor_data")
    monkeypatch.chdir(training)
    dump = read_api_info(path)
    assert dump.dump_data_dir == training / "dump_path" / "step0" / "rank0" / "dump_tensor_data"
    assert dump.dump_data_dir_found == "'./dump_path/step0/rank0/dump_tensor_data', relative to the current folder"
    assert dump.calls[0].forward.args[0].data_path == dump.dump_data_dir / "x.npy"


def test_msprobes_dump_data_dir_is_found_from_another_folder_in_a_folder_above_the_json_file(tmp_path, monkeypatch):
    training = tmp_path / "training"
    save_npy(training / "dump_path" / "step0" / "rank0" / "dump_tensor_data")
    path = tensor_dump(training / "dump_path" / "step0" / "rank0", "dump_path/step0/rank0/dump_tensor_data")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    dump = read_api_info(path)
    assert dump.dump_data_dir == training / "dump_path" / "step0" / "rank0" / "dump_tensor_data"
    assert dump.dump_data_dir_found == ("'dump_path/step0/rank0/dump_tensor_data', relative to a folder above the "
                                        "JSON file")


def test_a_dump_data_dir_holding_none_of_the_files_is_refused_naming_every_folder_tried(tmp_path, monkeypatch):
    folder = tmp_path / "dump_path" / "step0" / "rank0"
    path = tensor_dump(folder, "dump_tensor_data")
    save_npy(folder / "dump_tensor_data", "other.npy")  # the folder is there, the dump's file is not
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    with pytest.raises(ValueError) as raised:
        read_api_info(path)
    tried = [f"{folder / 'dump_tensor_data'} (relative to the JSON file's folder)",
             f"{tmp_path / 'elsewhere' / 'dump_tensor_data'} (relative to the current folder)",
             *(f"{above / 'dump_tensor_data'} (relative to a folder above the JSON file)" for above in folder.parents)]
    assert str(raised.value) == (
        f"{path}: dump_data_dir = 'dump_tensor_data' is not accepted: no folder it may mean holds any of the dump's "
        f"1 tensor files (the first: x.npy); tried {', '.join(tried)}; expected the folder of the .npy files, "
        "absolute or relative to the JSON file's folder or to the folder the training ran in (msprobe writes it so: "
        "run the check from there)")


def test_an_absolute_dump_data_dir_is_taken_as_it_is(tmp_path):
    save_npy(tmp_path / "npy")
    dump = read_api_info(tensor_dump(tmp_path / "dump", str(tmp_path / "npy")))
    assert dump.dump_data_dir == tmp_path / "npy"
    assert dump.dump_data_dir_found == f"{str(tmp_path / 'npy')!r}, absolute"


@pytest.mark.parametrize("data_name, reason", [("../secret.npy", "leads outside"),
                                               ("/etc/passwd", "is an absolute path")])
def test_data_name_outside_dump_data_dir_is_refused(tmp_path, data_name, reason):
    save_npy(tmp_path / "npy")  # the dump's other input: dump_data_dir holds one of its files
    path = write_dump(tmp_path, {"Mint.abs.0.forward": {"input_args": [npy_input(data_name)]},
                                 "Mint.abs.1.forward": {"input_args": [npy_input("x.npy")]}},
                      task="tensor", dump_data_dir="npy")
    problem = calls_by_name(path)["Mint.abs.0"].forward_problem
    assert f"input_args[0].data_name = {data_name!r} {reason}" in problem


@pytest.mark.parametrize("content, message", [
    ("not json", "is not a JSON file"),
    (json.dumps({"task": "grad_probe", "data": {}}), "task = 'grad_probe' is not accepted"),
    (json.dumps({"task": "tensor", "data": {}}), "dump_data_dir = None is not accepted"),
    (json.dumps({"task": "statistics", "data": []}), "data = [] is not accepted"),
])
def test_a_file_that_is_not_a_dump_is_refused_as_a_whole(tmp_path, content, message):
    path = tmp_path / "api_info.json"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(ValueError, match="api_info.json: ") as raised:
        read_api_info(path)
    assert message in str(raised.value)
