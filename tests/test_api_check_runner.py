"""The API checker on real MindSpore 2.10 (CPU) and real torch: its metrics equal a numpy computation of the
formulas on the two frameworks' own outputs, forward and backward; disagreements are errors; what cannot run is a
skip that does not poison later ops; every malformed entry gets its row and the CSVs list every API."""
import json
import math

import mindspore
import numpy as np
import pytest
import torch
from mindspore import mint

from msprobe_mlflow.api_check import check_api_accuracy
from msprobe_mlflow.api_check.results import INCOMPLETE_ENTRY, NO_KERNEL, NOT_MINT, UNKNOWN_API
from msprobe_mlflow.dump import read_csv


# --- the expectation, computed here from docs/api_check.md, "Metrics and verdict" -------------------------------------

def hand_metrics(bench: np.ndarray, tested: np.ndarray) -> tuple[float, float, float]:
    b, t = bench.astype(np.float64).ravel(), tested.astype(np.float64).ravel()
    cosine = (1e-8 + float(b @ t)) / (1e-8 + math.sqrt(float(b @ b)) * math.sqrt(float(t @ t)))
    difference = np.abs(b - t)
    relative = difference / np.where(b == 0, 1e-8, np.abs(b))
    return cosine, float(difference.max()), float(relative.max())


def rebuilt(low, high, shape, dtype=np.float32):
    """An input as the statistics task rebuilds it: uniform in [Min, Max] from a fresh RandomState(42)."""
    values = np.random.RandomState(42).uniform(low, high, shape)
    return np.trunc(values).astype(dtype) if np.issubdtype(dtype, np.integer) else values.astype(dtype)


def rebuilt_bool(shape):
    return np.random.RandomState(42).rand(*shape) > 0.5


def stat(shape, low=-1.0, high=1.0, dtype="Float32"):
    return {"type": "mindspore.Tensor", "dtype": dtype, "shape": list(shape), "Max": high, "Min": low}


def write_dump(folder, data, task="statistics", dump_data_dir=None):
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "api_info.json"
    path.write_text(json.dumps({"task": task, "dump_data_dir": dump_data_dir, "data": data}), encoding="utf-8")
    return path


def rows_by_name(report):
    return {row.name: row for result in report.results for row in result.output_rows()}


# --- statistics task: ops that run on this CPU, forward and backward -----------------------------------------------

def F(name):
    return getattr(mint.nn.functional, name)


# name: (mint function, torch function, inputs as numpy, recorded inputs, kwargs, sensitivity shape and range)
OPS = {
    "Mint.add.0": (mint.add, torch.add, [(-1, 1, (2, 3)), (0, 2, (2, 3))], {}, (-1, 1, (2, 3))),
    "Mint.matmul.0": (mint.matmul, torch.matmul, [(-1, 1, (2, 3)), (-2, 1, (3, 4))], {}, (-1, 1, (2, 4))),
    "Mint.exp.0": (mint.exp, torch.exp, [(-3, 3, (2, 3))], {}, (-1, 1, (2, 3))),
    "MintFunctional.relu.0": (F("relu"), torch.nn.functional.relu, [(-1, 1, (2, 3))], {}, (-1, 2, (2, 3))),
    "MintFunctional.softmax.0": (F("softmax"), torch.nn.functional.softmax, [(-2, 2, (2, 3))], {"dim": -1},
                                 (-1, 1, (2, 3))),
    "MintFunctional.linear.0": (F("linear"), torch.nn.functional.linear,
                                [(-1, 1, (2, 3)), (-1, 0.5, (4, 3)), (0, 1, (4,))], {}, (-1, 1, (2, 4))),
    "Mint.sum.0": (mint.sum, torch.sum, [(-1, 1, (2, 3))], {"dim": 1}, (-1, 1, (2,))),
}


def statistics_data():
    data = {}
    for name, (_, _, inputs, kwargs, sensitivity) in OPS.items():
        data[f"{name}.forward"] = {"input_args": [stat(shape, low, high) for low, high, shape in inputs],
                                   "input_kwargs": {key: {"type": "int", "value": value}
                                                    for key, value in kwargs.items()}}
        data[f"{name}.backward"] = {"input": [stat(sensitivity[2], *sensitivity[:2])]}
    data["Mint.sum.0.forward"]["input_kwargs"]["dtype"] = None  # msprobe writes dtype=mindspore.float32 as null
    data["Mint.mul.0.forward"] = {"input_args": [stat((2, 3)), stat((2, 3), 0, 5, "Int64")], "input_kwargs": {}}
    data["Mint.mul.0.backward"] = {"input": [stat((2, 3), -2, 2)]}
    data["Mint.cat.0.forward"] = {"input_args": [[stat((2, 3)), stat((1, 3), 0, 3)]],
                                  "input_kwargs": {"dim": {"type": "int", "value": 0}}}
    data["Mint.cat.0.backward"] = {"input": [stat((3, 3), -1, 2)]}
    data["Mint.where.0.forward"] = {"input_args": [stat((2, 3), False, True, "Bool"), stat((2, 3)),
                                                   stat((2, 3), 2, 3)], "input_kwargs": {}}
    data["Mint.where.0.backward"] = {"input": [stat((2, 3), -3, 1)]}
    data["Mint.sort.0.forward"] = {"input_args": [stat((4,))], "input_kwargs": {}}  # no CPU kernel in 2.10
    data["Mint.add.1.forward"] = {"input_args": [stat((3,)), stat((3,), 1, 2)], "input_kwargs": {}}
    return data


@pytest.fixture(scope="module")
def statistics_report(tmp_path_factory):
    folder = tmp_path_factory.mktemp("statistics")
    return check_api_accuracy(write_dump(folder, statistics_data()), output_dir=folder / "out", log_to_mlflow=False)


def mindspore_gradients(function, inputs, kwargs, sensitivity):
    tensors = [mindspore.Tensor(value) for value in inputs]
    gradient = mindspore.ops.GradOperation(get_all=True, sens_param=True)(lambda *a: function(*a, **kwargs))
    return [g.asnumpy() for g in gradient(*tensors, mindspore.Tensor(sensitivity))]


def torch_gradients(function, inputs, kwargs, sensitivity, differentiable):
    leaves = [torch.tensor(value, requires_grad=flag) for value, flag in zip(inputs, differentiable)]
    function(*leaves, **kwargs).backward(torch.from_numpy(sensitivity))
    return [leaf.grad.numpy() for leaf, flag in zip(leaves, differentiable) if flag]


@pytest.mark.parametrize("name", list(OPS))
def test_forward_and_backward_metrics_equal_numpy_on_both_frameworks_outputs(statistics_report, name):
    mint_function, torch_function, inputs, kwargs, (low, high, shape) = OPS[name]
    values = [rebuilt(*spec) for spec in inputs]
    sensitivity = rebuilt(low, high, shape)
    tested = mint_function(*[mindspore.Tensor(v) for v in values], **kwargs).asnumpy()
    bench = torch_function(*[torch.from_numpy(v) for v in values], **kwargs).numpy()
    rows = rows_by_name(statistics_report)
    forward = rows[f"{name}.forward.output.0"]
    assert (forward.cosine, forward.max_abs_err, forward.max_relative_err) == pytest.approx(
        hand_metrics(bench, tested), rel=1e-12, abs=1e-15)
    assert (forward.bench_dtype, forward.tested_dtype, forward.shape) == ("Float32", "Float32", bench.shape)
    tested_grads = mindspore_gradients(mint_function, values, kwargs, sensitivity)
    bench_grads = torch_gradients(torch_function, values, kwargs, sensitivity, [True] * len(values))
    for i, (b, t) in enumerate(zip(bench_grads, tested_grads)):
        row = rows[f"{name}.backward.output.{i}"]
        assert (row.cosine, row.max_abs_err, row.max_relative_err) == pytest.approx(hand_metrics(b, t),
                                                                                      rel=1e-12, abs=1e-15)
        assert row.shape == b.shape
    result = next(r for r in statistics_report.results if r.name == name)
    assert (result.status, result.forward.status, result.backward.status) == ("pass", "pass", "pass")


def test_the_tested_outputs_really_come_from_mindspore(statistics_report):
    """exp and softmax differ by float32 rounding between the frameworks: a checker comparing torch with itself
    would report 0 everywhere."""
    rows = rows_by_name(statistics_report)
    assert rows["Mint.exp.0.forward.output.0"].max_abs_err > 0
    assert rows["MintFunctional.softmax.0.forward.output.0"].max_abs_err > 0


def test_int_tensor_input_gets_no_gradient_row_but_the_float_input_does(statistics_report):
    x, integers = rebuilt(-1, 1, (2, 3)), rebuilt(0, 5, (2, 3), np.int64)
    sensitivity = rebuilt(-2, 2, (2, 3))
    tested = mindspore_gradients(mint.mul, [x, integers], {}, sensitivity)[0]
    bench = torch_gradients(torch.mul, [x, integers], {}, sensitivity, [True, False])[0]
    np.testing.assert_allclose(bench, sensitivity * integers, rtol=1e-6)  # d(x*i)/dx = i
    rows = rows_by_name(statistics_report)
    assert (rows["Mint.mul.0.backward.output.0"].cosine, rows["Mint.mul.0.backward.output.0"].max_abs_err) == \
        pytest.approx(hand_metrics(bench, tested)[:2], rel=1e-12, abs=1e-15)
    assert "Mint.mul.0.backward.output.1" not in rows


def test_bool_input_gets_no_gradient_row_and_the_two_branches_do(statistics_report):
    condition, x, y = rebuilt_bool((2, 3)), rebuilt(-1, 1, (2, 3)), rebuilt(2, 3, (2, 3))
    sensitivity = rebuilt(-3, 1, (2, 3))
    tested = mindspore_gradients(mint.where, [condition, x, y], {}, sensitivity)[1:]
    bench = torch_gradients(torch.where, [condition, x, y], {}, sensitivity, [False, True, True])
    np.testing.assert_array_equal(bench[0], np.where(condition, sensitivity, 0))
    rows = rows_by_name(statistics_report)
    assert "Mint.where.0.backward.output.0" not in rows
    for position, b, t in zip((1, 2), bench, tested):
        row = rows[f"Mint.where.0.backward.output.{position}"]
        assert (row.cosine, row.max_abs_err) == pytest.approx(hand_metrics(b, t)[:2], rel=1e-12, abs=1e-15)
        assert row.status == "pass"


def test_tuple_input_is_run_and_each_of_its_tensors_gets_a_gradient(statistics_report):
    x, y = rebuilt(-1, 1, (2, 3)), rebuilt(0, 3, (1, 3))
    sensitivity = rebuilt(-1, 2, (3, 3))
    tested = mint.cat((mindspore.Tensor(x), mindspore.Tensor(y)), dim=0).asnumpy()
    bench = torch.cat((torch.from_numpy(x), torch.from_numpy(y)), dim=0).numpy()
    rows = rows_by_name(statistics_report)
    assert rows["Mint.cat.0.forward.output.0"].cosine == pytest.approx(hand_metrics(bench, tested)[0], rel=1e-12)
    # d cat / d x is the first two rows of the sensitivity, d cat / d y the last one
    assert rows["Mint.cat.0.backward.output.0"].shape == (2, 3)
    assert rows["Mint.cat.0.backward.output.1"].shape == (1, 3)
    assert rows["Mint.cat.0.backward.output.1"].status == "pass"


def test_kernel_missing_on_this_cpu_is_a_skip_that_does_not_poison_the_next_op(statistics_report):
    results = {result.name: result for result in statistics_report.results}
    sort = results["Mint.sort.0"]
    assert (sort.status, sort.forward.status) == ("skip", "skip")
    assert sort.message.startswith("MindSpore cannot run mindspore.mint.sort here: RuntimeError: ")
    assert "unregistered" in sort.message
    assert results["Mint.add.1"].status == "pass"


# --- 0-d tensors: every reduced loss's output, so every loss function's backward input ------------------------------

LOSSES = {  # the loss functions of mint.nn.functional with CPU kernels in MindSpore 2.10: (mint, torch, inputs)
    "MintFunctional.smooth_l1_loss.0": (F("smooth_l1_loss"), torch.nn.functional.smooth_l1_loss,
                                        [(-1, 1, (2, 3), np.float32), (0, 2, (2, 3), np.float32)]),
    "MintFunctional.binary_cross_entropy.0": (F("binary_cross_entropy"), torch.nn.functional.binary_cross_entropy,
                                              [(0.1, 0.9, (2, 3), np.float32), (0, 1, (2, 3), np.float32)]),
    "MintFunctional.nll_loss.0": (F("nll_loss"), torch.nn.functional.nll_loss,
                                  [(-2, 0, (2, 3), np.float32), (0, 3, (2,), np.int64)]),
}
DTYPE_NAMES = {np.float32: "Float32", np.int64: "Int64"}
LOSS_SENSITIVITY = 0.25  # recorded as a 0-d tensor: shape [], Max = Min = 0.25


@pytest.fixture(scope="module")
def zero_d_report(tmp_path_factory):
    data = {}
    for name, (_, _, inputs) in LOSSES.items():
        data[f"{name}.forward"] = {"input_args": [stat(shape, low, high, DTYPE_NAMES[dtype])
                                                  for low, high, shape, dtype in inputs], "input_kwargs": {}}
        data[f"{name}.backward"] = {"input": [stat((), LOSS_SENSITIVITY, LOSS_SENSITIVITY)]}
    data["Mint.mul.0.forward"] = {"input_args": [stat((2, 3)), stat((), 2, 3)], "input_kwargs": {}}
    data["Mint.mul.0.backward"] = {"input": [stat((2, 3))]}
    folder = tmp_path_factory.mktemp("zero_d")
    return check_api_accuracy(write_dump(folder, data), output_dir=folder / "out", log_to_mlflow=False)


@pytest.mark.parametrize("name", list(LOSSES))
def test_a_loss_output_and_its_backward_input_stay_0_d_in_both_frameworks(zero_d_report, name):
    mint_function, torch_function, inputs = LOSSES[name]
    values = [rebuilt(low, high, shape, dtype) for low, high, shape, dtype in inputs]
    sensitivity = np.array(LOSS_SENSITIVITY, dtype=np.float32)
    tested = mint_function(*map(mindspore.Tensor, values)).asnumpy()
    bench = torch_function(*map(torch.from_numpy, values)).numpy()
    rows = rows_by_name(zero_d_report)
    forward = rows[f"{name}.forward.output.0"]
    assert (forward.shape, forward.status) == ((), "pass")
    assert (forward.cosine, forward.max_abs_err) == pytest.approx(hand_metrics(bench, tested)[:2], rel=1e-12,
                                                                  abs=1e-15)
    differentiable = [dtype == np.float32 for *_, dtype in inputs]
    bench_grads = torch_gradients(torch_function, values, {}, sensitivity, differentiable)
    tested_grads = [grad for grad, flag in zip(mindspore_gradients(mint_function, values, {}, sensitivity),
                                               differentiable) if flag]
    assert len(bench_grads) == len(tested_grads) == sum(differentiable)
    for i, (b, t) in enumerate(zip(bench_grads, tested_grads)):
        row = rows[f"{name}.backward.output.{i}"]
        assert (row.shape, row.status) == (b.shape, "pass")
        assert (row.cosine, row.max_abs_err) == pytest.approx(hand_metrics(b, t)[:2], rel=1e-12, abs=1e-15)


def test_a_0_d_input_stays_0_d_and_gets_a_0_d_gradient(zero_d_report):
    rows = rows_by_name(zero_d_report)
    assert rows["Mint.mul.0.forward.output.0"].shape == (2, 3)
    assert rows["Mint.mul.0.backward.output.1"].shape == ()  # d(x * s)/ds = sum(sensitivity * x), a 0-d tensor
    assert all(rows[name].status == "pass" for name in rows if name.startswith("Mint.mul.0"))


# --- non-finite inputs: replayed, and compared exactly -------------------------------------------------------------

@pytest.fixture(scope="module")
def infinite_report(tmp_path_factory):
    folder = tmp_path_factory.mktemp("infinite")
    data = {"Mint.exp.0.forward": {"input_args": [stat((2, 3), -1, math.inf)], "input_kwargs": {}},
            "Mint.exp.0.backward": {"input": [stat((2, 3))]}}
    return check_api_accuracy(write_dump(folder, data), output_dir=folder / "out", log_to_mlflow=False)


def test_a_recorded_infinity_reaches_both_frameworks_and_the_finite_elements_are_measured(infinite_report):
    x = np.array([math.inf, -1, -1, -1, -1, -1], dtype=np.float32).reshape(2, 3)
    sensitivity = rebuilt(-1, 1, (2, 3))
    tested = mint.exp(mindspore.Tensor(x)).asnumpy()
    bench = torch.exp(torch.from_numpy(x)).numpy()
    assert bench[0, 0] == tested[0, 0] == math.inf  # exp(inf): what the real run saw
    finite = np.isfinite(bench)
    rows = rows_by_name(infinite_report)
    forward = rows["Mint.exp.0.forward.output.0"]
    assert forward.status == "pass"
    assert (forward.cosine, forward.max_abs_err) == pytest.approx(hand_metrics(bench[finite], tested[finite])[:2],
                                                                  rel=1e-12, abs=1e-15)
    backward = rows["Mint.exp.0.backward.output.0"]  # sensitivity * exp(x): -inf where the sensitivity is negative
    assert sensitivity[0, 0] < 0 and backward.status == "pass"


# --- tensor task: recorded outputs against torch --------------------------------------------------------------------

def npy(folder, name, values):
    np.save(folder / name, np.asarray(values))
    return name


def recorded(folder, name, values, dtype="Float32"):
    values = np.asarray(values)
    return {"type": "mindspore.Tensor", "dtype": dtype, "shape": list(values.shape),
            "data_name": npy(folder, f"{name}.npy", values)}


LOSS_X, LOSS_Y = np.array([[0.5, -1.5, 2.0], [0.1, 0.0, -0.3]]), np.array([[0.0, 0.0, 0.5], [0.6, -0.2, 0.4]])


def smooth_l1(x, y):
    """torch's smooth_l1_loss (beta 1, mean), in float64: 0.5 d^2 where |d| < 1, |d| - 0.5 elsewhere."""
    d = np.abs(x - y)
    return np.where(d < 1, 0.5 * d ** 2, d - 0.5).mean()


def smooth_l1_gradient(x, y, sensitivity=LOSS_SENSITIVITY):
    """d smooth_l1 / dx times the sensitivity: d where |d| < 1, sign(d) elsewhere, over the element count."""
    d = x - y
    return sensitivity * np.where(np.abs(d) < 1, d, np.sign(d)) / d.size


NLL_X, NLL_TARGET = np.array([[-0.5, -1.0, -2.0], [-1.5, -0.2, -0.7]]), np.array([0, 2])


def nll(x, target):
    """torch's nll_loss (mean): minus the mean of each row's value at its target."""
    return -x[np.arange(len(target)), target].mean()


def nll_gradient(x, target, sensitivity=LOSS_SENSITIVITY):
    gradient = np.zeros_like(x)
    gradient[np.arange(len(target)), target] = -sensitivity / len(target)
    return gradient


@pytest.fixture(scope="module")
def tensor_report(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tensor")
    data_dir = folder / "dump_tensor_data"
    data_dir.mkdir()
    f32 = lambda values: np.array(values, dtype=np.float32)  # noqa: E731
    t = lambda name, values, dtype="Float32": recorded(data_dir, name, values, dtype)  # noqa: E731
    x = [[1.0, 2.0], [3.0, 5.0]]
    softmax_last = np.exp(f32(x)) / np.exp(f32(x)).sum(axis=1, keepdims=True)
    np.save(data_dir / "object.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    data = {
        "Mint.add.0.forward": {"input_args": [t("a0x", f32([1, 2, 3])), t("a0y", f32([10, 20, 30]))],
                               "input_kwargs": {}, "output": [t("a0o", f32([11, 22, 33]))]},
        "Mint.add.0.backward": {"input": [t("a0s", f32([1, -1, 2]))],
                                "output": [t("a0g0", f32([1, -1, 2])), t("a0g1", f32([1, -1, 2]))]},
        # the recorded output is off by one in its last element
        "Mint.mul.0.forward": {"input_args": [t("m0x", f32([1, 2, 3])), t("m0y", f32([2, 2, 2]))],
                               "input_kwargs": {}, "output": [t("m0o", f32([2, 4, 7]))]},
        # the recorded kwarg (dim=0) is not the one the recorded output was computed with (dim=-1)
        "MintFunctional.softmax.0.forward": {"input_args": [t("s0x", f32(x))],
                                             "input_kwargs": {"dim": {"type": "int", "value": 0}},
                                             "output": [t("s0o", softmax_last)]},
        "Mint.where.0.forward": {"input_args": [t("w0c", np.array([True, False, True]), "Bool"),
                                                t("w0x", f32([1, 2, 3])), t("w0y", f32([4, 5, 6]))],
                                 "input_kwargs": {}, "output": [t("w0o", f32([1, 5, 3]))]},
        "Mint.where.0.backward": {"input": [t("w0s", f32([1, 2, 3]))],
                                  "output": [None, t("w0g1", f32([1, 0, 3])), t("w0g2", f32([0, 2, 0]))]},
        "Mint.mul.1.forward": {"input_args": [t("m1x", f32([1, 2, 3])), t("m1i", np.array([4, 5, 6]), "Int64")],
                               "input_kwargs": {}, "output": [t("m1o", f32([4, 10, 18]))]},
        "Mint.mul.1.backward": {"input": [t("m1s", f32([1, 1, 1]))],
                                "output": [t("m1g0", f32([4, 5, 6])), t("m1g1", np.zeros(3, np.int64), "Int64")]},
        # a reduced loss: 0-d output, 0-d sensitivity; the recorded values are the numpy formula's
        "MintFunctional.smooth_l1_loss.0.forward": {"input_args": [t("l0x", f32(LOSS_X)), t("l0y", f32(LOSS_Y))],
                                                    "input_kwargs": {}, "output": [t("l0o", f32(smooth_l1(LOSS_X,
                                                                                                          LOSS_Y)))]},
        "MintFunctional.smooth_l1_loss.0.backward": {
            "input": [t("l0s", f32(LOSS_SENSITIVITY))],
            "output": [t("l0gx", f32(smooth_l1_gradient(LOSS_X, LOSS_Y))),
                       t("l0gy", f32(-smooth_l1_gradient(LOSS_X, LOSS_Y)))]},
        # backward output lists one gradient for two tensors: the Int64 target needs none
        "MintFunctional.nll_loss.0.forward": {"input_args": [t("n0x", f32(NLL_X)), t("n0t", NLL_TARGET, "Int64")],
                                              "input_kwargs": {}, "output": [t("n0o", f32(nll(NLL_X, NLL_TARGET)))]},
        "MintFunctional.nll_loss.0.backward": {"input": [t("n0s", f32(LOSS_SENSITIVITY))],
                                               "output": [t("n0g", f32(nll_gradient(NLL_X, NLL_TARGET)))]},
        # null: the real run computed no gradient for the second input
        "Mint.add.1.forward": {"input_args": [t("a1x", f32([1, 2])), t("a1y", f32([3, 4]))], "input_kwargs": {},
                               "output": [t("a1o", f32([4, 6]))]},
        "Mint.add.1.backward": {"input": [t("a1s", f32([1, 2]))], "output": [t("a1g0", f32([1, 2])), None]},
        # ambiguous: a float tensor beyond the end of the list, a gradient beyond the last tensor
        "Mint.mul.2.forward": {"input_args": [t("m2x", f32([1, 2, 3])), t("m2y", f32([2, 2, 2]))],
                               "input_kwargs": {}, "output": [t("m2o", f32([2, 4, 6]))]},
        "Mint.mul.2.backward": {"input": [t("m2s", f32([1, 1, 1]))], "output": [t("m2g0", f32([2, 2, 2]))]},
        "Mint.exp.0.forward": {"input_args": [t("e0x", f32([0, 0]))], "input_kwargs": {},
                               "output": [t("e0o", f32([1, 1]))]},
        "Mint.exp.0.backward": {"input": [t("e0s", f32([1, 2]))],
                                "output": [t("e0g", f32([1, 2])), t("e0z", f32([0, 0]))]},
        "Mint.neg.0.forward": {"input_args": [{"type": "mindspore.Tensor", "dtype": "Float32", "shape": [3],
                                               "data_name": "missing.npy"}], "output": []},
        "Mint.neg.1.forward": {"input_args": [{"type": "mindspore.Tensor", "dtype": "Float32", "shape": [1],
                                               "data_name": "object.npy"}], "output": []},
        "Mint.neg.2.forward": {"input_args": [{**t("n2x", f32([1, 2])), "shape": [3]}], "output": []},
        "Mint.neg.3.forward": {"input_args": [{"type": "mindspore.Tensor", "dtype": "Float32", "shape": [1],
                                               "data_name": "../api_info.json"}], "output": []},
    }
    path = write_dump(folder, data, task="tensor", dump_data_dir="dump_tensor_data")
    return check_api_accuracy(path, output_dir=folder / "out", log_to_mlflow=False)


def test_recorded_outputs_and_gradients_that_match_torch_pass(tensor_report):
    rows = rows_by_name(tensor_report)
    for name in ("Mint.add.0.forward.output.0", "Mint.add.0.backward.output.0", "Mint.add.0.backward.output.1"):
        assert (rows[name].cosine, rows[name].max_abs_err, rows[name].status) == (pytest.approx(1.0), 0.0, "pass")


def test_a_recorded_0_d_loss_and_its_0_d_sensitivity_match_the_numpy_formula(tensor_report):
    rows = rows_by_name(tensor_report)
    names = ["MintFunctional.smooth_l1_loss.0.forward.output.0", "MintFunctional.smooth_l1_loss.0.backward.output.0",
             "MintFunctional.smooth_l1_loss.0.backward.output.1"]
    assert [(rows[name].shape, rows[name].status) for name in names] == [((), "pass"), ((2, 3), "pass"),
                                                                          ((2, 3), "pass")]
    assert all(rows[name].max_abs_err < 1e-6 for name in names)


def test_backward_uses_the_recorded_sensitivity(tensor_report):
    """The recorded gradients of add are the recorded sensitivity [1, -1, 2], not ones: they only match torch if
    torch was given that sensitivity."""
    assert rows_by_name(tensor_report)["Mint.add.0.backward.output.1"].max_abs_err == 0.0


def test_perturbed_recorded_output_is_an_error_with_hand_computed_metrics(tensor_report):
    row = rows_by_name(tensor_report)["Mint.mul.0.forward.output.0"]
    cosine = (1e-8 + (2 * 2 + 4 * 4 + 6 * 7)) / (1e-8 + math.sqrt(4 + 16 + 36) * math.sqrt(4 + 16 + 49))
    assert (row.cosine, row.max_abs_err, row.max_relative_err) == pytest.approx((cosine, 1.0, 1 / 6), rel=1e-12)
    assert (row.status, row.message) == ("error", "max absolute difference is greater than threshold: 0.001")


def test_wrong_recorded_kwarg_is_an_error(tensor_report):
    x = np.array([[1.0, 2.0], [3.0, 5.0]])
    by_column = np.exp(x) / np.exp(x).sum(axis=0, keepdims=True)  # what torch computes with dim=0
    by_row = np.exp(x) / np.exp(x).sum(axis=1, keepdims=True)  # what was recorded
    row = rows_by_name(tensor_report)["MintFunctional.softmax.0.forward.output.0"]
    assert row.status == "error"
    assert row.max_abs_err == pytest.approx(np.abs(by_column - by_row).max(), rel=1e-6)


def test_tensor_task_int_and_bool_inputs_get_no_gradient_rows(tensor_report):
    rows = rows_by_name(tensor_report)
    assert [name for name in rows if name.startswith(("Mint.where.0.backward", "Mint.mul.1.backward"))] == [
        "Mint.where.0.backward.output.1", "Mint.where.0.backward.output.2", "Mint.mul.1.backward.output.0"]
    assert all(rows[name].status == "pass" for name in rows if name.startswith(("Mint.where.0", "Mint.mul.1")))


def test_a_gradient_list_shorter_than_the_tensors_is_compared_by_position(tensor_report):
    rows = rows_by_name(tensor_report)
    nll_rows = [name for name in rows if name.startswith("MintFunctional.nll_loss.0.backward")]
    assert nll_rows == ["MintFunctional.nll_loss.0.backward.output.0"]  # the Int64 target needs no gradient
    assert rows[nll_rows[0]].status == "pass" and rows[nll_rows[0]].max_abs_err < 1e-6
    assert next(r for r in tensor_report.results if r.name == "MintFunctional.nll_loss.0").status == "pass"


def test_a_null_gradient_is_an_input_without_gradient_and_gets_no_row(tensor_report):
    rows = rows_by_name(tensor_report)
    assert [name for name in rows if name.startswith("Mint.add.1.backward")] == ["Mint.add.1.backward.output.0"]
    assert next(r for r in tensor_report.results if r.name == "Mint.add.1").status == "pass"


def test_an_ambiguous_gradient_list_is_an_error_naming_the_tensor_or_the_entry(tensor_report):
    rows = rows_by_name(tensor_report)
    assert rows["Mint.mul.2.backward.output.0"].status == "pass"  # listed, compared by position
    unlisted = rows["Mint.mul.2.backward.output.1"]
    assert unlisted.status == "error"
    assert unlisted.message.startswith("Mint.mul.2.backward: output[1] is missing, the gradient of positional "
                                       "tensor 1 (Float32 [3]); which tensor each listed gradient belongs to is "
                                       "ambiguous")
    assert rows["Mint.exp.0.backward.output.0"].status == "pass"
    extra = rows["Mint.exp.0.backward.output.1"]
    assert extra.status == "error"
    assert extra.message.startswith("Mint.exp.0.backward: output[1] is a gradient, but the forward has only 1 "
                                    "positional tensors; which tensor each listed gradient belongs to is ambiguous")


@pytest.mark.parametrize("name, message", [
    ("Mint.neg.0", "missing.npy: not a readable .npy file"),
    ("Mint.neg.1", "allow_pickle=False"),
    ("Mint.neg.2", "n2x.npy has shape [2] but the dump records [3]"),
    ("Mint.neg.3", "input_args[0].data_name = '../api_info.json' leads outside"),
])
def test_bad_tensor_files_are_errors_naming_the_file_and_field(tensor_report, name, message):
    result = next(r for r in tensor_report.results if r.name == name)
    assert result.status == "error"
    assert result.message.startswith(f"{name}.forward: input_args[0]")
    assert message in result.message


# --- malformed entries: each its row, the run completes ------------------------------------------------------------

MALFORMED = {
    "Mint.abs.0.forward": {"input_args": [stat((2, 3))]},
    "MintFunctional.linear.1.forward": {"input_args": [stat((2, 3)), stat((4, 3)), None], "input_kwargs": {}},
    "Mint.abs.1.forward": {"input_args": [{**stat((0, 3)), "Max": None, "Min": None}]},
    "Mint.abs.2.forward": {"input_args": [stat((2, 3), -math.inf, math.inf)]},
    "Mint.abs.3.forward": {"input_args": [{**stat((2, 3)), "Max": None}]},
    "Mint.abs.4.forward": {"input_args": [stat((2, 3), dtype="Float33")]},
    "Mint.no_such_function.0.forward": {"input_args": [stat((2, 3))]},
    "Mint.exp.1.backward": {"input": [stat((2, 3))]},
    "Mint.exp.2.forward": {"input_args": [stat((2, 3))]},
    "Mint.add.9.inplace": {"input_args": []},
    "Tensor.add.0.forward": {"input_args": [stat((2, 3)), stat((2, 3))]},
    "Mint.add.bad.forward": {"input_args": []},
}
EXPECTED = {  # API name in the result CSV: (forward, backward, overall status, a piece of the message)
    "Mint.abs.0": ("pass", "", "pass", ""),
    "MintFunctional.linear.1": ("pass", "", "pass", ""),
    "Mint.abs.1": ("pass", "", "pass", ""),
    "Mint.abs.2": ("pass", "", "pass", ""),
    "Mint.abs.3": ("error", "", "error", "Mint.abs.3.forward: input_args[0].Max = None is not accepted"),
    "Mint.abs.4": ("error", "", "error", "Mint.abs.4.forward: input_args[0].dtype = 'Float33' is not accepted"),
    "Mint.no_such_function.0": ("skip", "", "skip", "neither mindspore.mint.no_such_function (MindSpore "),
    "Mint.exp.1": ("", "skip", "skip", "Mint.exp.1.forward is missing"),
    "Mint.exp.2": ("pass", "", "pass", ""),
    "Mint.add.9.inplace": ("skip", "skip", "skip", "suffix 'inplace' is not forward or backward"),
    "Tensor.add.0": ("skip", "", "skip", "Tensor APIs are not checked"),
    "Mint.add.bad": ("error", "", "error", "is not Family.function.index"),
}


@pytest.fixture(scope="module")
def malformed_report(tmp_path_factory):
    folder = tmp_path_factory.mktemp("malformed")
    return check_api_accuracy(write_dump(folder, MALFORMED), output_dir=folder / "out", log_to_mlflow=False)


def test_every_api_of_a_malformed_dump_is_in_the_result_csv_with_its_status(malformed_report):
    rows = read_csv(malformed_report.result_csv)
    assert rows[0] == ["API Name", "Forward Test Success", "Backward Test Success", "Message"]
    assert [row[0] for row in rows[1:]] == list(EXPECTED)
    for name, forward, backward, message in rows[1:]:
        expected_forward, expected_backward, _, expected_message = EXPECTED[name]
        assert (forward, backward) == (expected_forward, expected_backward), name
        assert expected_message in message, name


def test_every_api_of_a_malformed_dump_has_a_details_row(malformed_report):
    rows = read_csv(malformed_report.details_csv)
    assert rows[0] == ["API Name", "Bench Dtype", "Tested Dtype", "Shape", "Cosine", "MaxAbsErr", "MaxRelativeErr",
                       "Status", "Message"]
    for name, (_, _, status, message) in EXPECTED.items():
        mine = [row for row in rows[1:] if row[0] == name or row[0].startswith(name + ".")]
        assert mine and all(row[7] == status for row in mine), name
        assert all(message in row[8] for row in mine), name


def test_details_row_formats_shape_as_tuple_and_metrics_as_float_reprs(malformed_report):
    rows = {row[0]: row for row in read_csv(malformed_report.details_csv)[1:]}
    empty = rows["Mint.abs.1.forward.output.0"]
    assert empty[1:8] == ["Float32", "Float32", "(0, 3)", "1.0", "0.0", "0.0", "pass"]
    skipped = rows["Mint.no_such_function.0.forward"]
    assert skipped[1:8] == ["", "", "", "", "", "", "skip"]


def test_results_keep_the_dump_order_and_statuses(malformed_report):
    assert [(r.name, r.status) for r in malformed_report.results] == [(n, e[2]) for n, e in EXPECTED.items()]


def test_each_skip_is_grouped_by_why(malformed_report, statistics_report):
    groups = {name: [result.name for result in results]
              for name, results in malformed_report.skips_by_group().items()}
    assert groups == {UNKNOWN_API: ["Mint.no_such_function.0"],
                      INCOMPLETE_ENTRY: ["Mint.exp.1", "Mint.add.9.inplace"], NOT_MINT: ["Tensor.add.0"]}
    assert {result.name: result.skip_group for result in statistics_report.with_status("skip")} == {
        "Mint.sort.0": NO_KERNEL}
    assert {result.skip_group for result in malformed_report.results + statistics_report.results
            if result.status != "skip"} == {""}


def test_an_api_neither_framework_has_is_said_to_be_so_not_blamed_on_torch(malformed_report):
    (unknown,) = [result for result in malformed_report.results if result.name == "Mint.no_such_function.0"]
    assert unknown.message == (f"neither mindspore.mint.no_such_function (MindSpore {mindspore.__version__}) nor "
                               f"torch.no_such_function (torch {torch.__version__}) exists: check the name "
                               f"Mint.no_such_function.0 in the dump")


def test_a_key_whose_suffix_is_neither_side_has_its_status_in_both_cells_of_the_result_csv(malformed_report):
    rows = {row[0]: row for row in read_csv(malformed_report.result_csv)[1:]}
    assert rows["Mint.add.9.inplace"][1:3] == ["skip", "skip"]


def test_forward_entries_without_input_kwargs_run_without_keywords_and_are_named_in_one_warning(tmp_path):
    path = write_dump(tmp_path, {"Mint.abs.0.forward": {"input_args": [stat((2, 3))]},
                                 "Mint.sum.0.forward": {"input_args": [stat((2, 3))],
                                                        "input_kwargs": {"dim": {"type": "int", "value": 1}}},
                                 "Mint.exp.0.forward": {"input_args": [stat((2, 3))]}})
    with pytest.warns(UserWarning) as said:
        report = check_api_accuracy(path, output_dir=tmp_path / "out", log_to_mlflow=False)
    assert [str(w.message) for w in said if "input_kwargs" in str(w.message)] == [
        "msprobe-mlflow: 2 forward entries have no input_kwargs and are run without keyword arguments: "
        "Mint.abs.0.forward, Mint.exp.0.forward. msprobe writes input_kwargs in every forward entry ({} when there "
        "are none); if the training passed keyword arguments (dim=, dtype=...), these checks are not of its calls"]
    assert [(result.name, result.status) for result in report.results] == [
        ("Mint.abs.0", "pass"), ("Mint.sum.0", "pass"), ("Mint.exp.0", "pass")]


def test_thresholds_are_options(tmp_path):
    path = write_dump(tmp_path, {"Mint.exp.0.forward": {"input_args": [stat((2, 3), -3, 3)]}})
    strict = check_api_accuracy(path, output_dir=tmp_path / "out", log_to_mlflow=False, max_abs_threshold=0.0)
    assert strict.results[0].status == "error"  # MaxAbsErr < 0 can never hold
    lenient = check_api_accuracy(path, output_dir=tmp_path / "out", log_to_mlflow=False, cosine_threshold=-2.0,
                                 max_abs_threshold=math.inf, api_filter="exp")
    assert lenient.results[0].status == "pass"


@pytest.mark.parametrize("option", ["cosine_threshold", "max_abs_threshold"])
def test_a_nan_threshold_is_refused_before_anything_is_written(option, tmp_path):
    path = write_dump(tmp_path, {"Mint.exp.0.forward": {"input_args": [stat((2, 3))]}})
    with pytest.raises(ValueError, match=f"^{option} = nan is not accepted; expected a number$"):
        check_api_accuracy(path, output_dir=tmp_path / "out", log_to_mlflow=False, **{option: math.nan})
    assert not (tmp_path / "out").exists()


def test_filter_keeps_only_matching_calls_and_bad_filter_is_refused(tmp_path):
    path = write_dump(tmp_path, {"Mint.exp.0.forward": {"input_args": [stat((2, 3))]},
                                 "Mint.abs.0.forward": {"input_args": [stat((2, 3))]}})
    report = check_api_accuracy(path, output_dir=tmp_path / "out", log_to_mlflow=False, api_filter=r"^Mint\.abs")
    assert [r.name for r in report.results] == ["Mint.abs.0"]
    with pytest.raises(ValueError, match=r"api_filter = '\(' is not a regular expression"):
        check_api_accuracy(path, output_dir=tmp_path / "out", log_to_mlflow=False, api_filter="(")


def test_csvs_never_replace_existing_files(tmp_path):
    path = write_dump(tmp_path, {"Mint.abs.0.forward": {"input_args": [stat((2,))]}})
    first = check_api_accuracy(path, output_dir=tmp_path / "out", log_to_mlflow=False)
    second = check_api_accuracy(path, output_dir=tmp_path / "out", log_to_mlflow=False)
    assert len({first.details_csv, second.details_csv, first.result_csv, second.result_csv}) == 4
    assert first.details_csv.exists() and second.details_csv.exists()
    written = first.details_csv.read_bytes()
    assert written.startswith(b"\xef\xbb\xbfAPI Name,") and written.endswith(b"\r\n")
