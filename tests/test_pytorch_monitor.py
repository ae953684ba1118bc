"""The PyTorch gradient monitor against numpy: gradients are set by hand, one optimizer step is taken, and every
CSV cell and direction bit is compared with a value computed here, independently of the package's statistics."""
import hashlib
import math
import subprocess
import sys
import textwrap
import threading

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from gradient_expectations import INF, NAN, ROUND_TO, assert_row, expected_row, read_rows
from msprobe_mlflow.config import GradProbeConfig
from msprobe_mlflow.directions import read_step_directions
from msprobe_mlflow.exponents import read_exponents
from msprobe_mlflow.pytorch import GradientMonitor, PrecisionDebugger
from msprobe_mlflow.session import ProbeSession
from msprobe_mlflow.statistics_table import exponent_counts


# ---------------------------------------------------------------- models and steps

class TwoLayers(torch.nn.Module):  # its own model: the rows fc1.weight, fc1.bias, fc2.weight (no bias) are checked
    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 3, dtype=dtype)
        self.fc2 = torch.nn.Linear(3, 2, bias=False, dtype=dtype)


def sink_calling(handle) -> SimpleNamespace:
    """The smallest sink: ``handle`` for each step, nothing to flush or close."""
    return SimpleNamespace(handle=handle, flush=lambda: None, close=lambda: None)


def start(dump_path, model, optimizer=None, **config) -> GradientMonitor:
    """A monitor with the local dump only (MLflow logging is tested in the tracking tests)."""
    monitor = GradientMonitor(GradProbeConfig(dump_path=str(dump_path), **config), log_to_mlflow=False)
    return monitor.monitor(model, optimizer)


def set_grads(model: torch.nn.Module, grads: dict) -> None:
    parameters = dict(model.named_parameters())
    for name, values in grads.items():
        parameter = parameters[name]
        parameter.grad = torch.tensor(np.asarray(values, np.float32)).to(parameter.device, parameter.dtype)


def random_grads(model, rng, on_bounds=(-1.0, 0.0, 1.0)) -> dict:
    """Normal values with a few elements exactly on the bounds and an exact zero in every parameter."""
    grads = {}
    for name, parameter in model.named_parameters():
        values = rng.normal(size=parameter.shape).astype(np.float32)
        flat = values.reshape(-1)
        flat[: len(on_bounds)] = on_bounds
        rng.shuffle(flat)
        grads[name] = flat.reshape(parameter.shape)
    return grads


def summary(dump_path, step, rank=0):
    return read_rows(dump_path / f"rank{rank}" / f"grad_summary_{step}.csv")


# ---------------------------------------------------------------- rows against numpy

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("level", ["L0", "L1", "L2"])
@pytest.mark.parametrize("direction_format, device", [("packed", "cpu"), ("npy", "cpu"),
                                                      pytest.param("packed", "cuda", marks=CUDA)])
def test_rows_and_directions_match_numpy_at_each_level_over_two_steps(tmp_path, level, direction_format, device):
    torch.manual_seed(0)
    rng = np.random.default_rng(1)
    model = TwoLayers().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = GradientMonitor(GradProbeConfig(dump_path=str(tmp_path), level=level, direction_format=direction_format),
                              log_to_mlflow=False, statistics=["exponents"] if level == "L2" else []).monitor(
        model, optimizer)
    steps = []
    for _ in range(2):
        grads = random_grads(model, rng)
        set_grads(model, grads)
        optimizer.step()
        steps.append(grads)
    monitor.stop()
    for step, grads in enumerate(steps):
        header, rows = summary(tmp_path, step)
        assert list(rows) == ["fc1.weight", "fc1.bias", "fc2.weight"]
        for name, values in grads.items():
            assert_row(rows[name], header, expected_row(values, level))
        exponents = tmp_path / "rank0" / f"exponents_{step}.npz"
        assert exponents.exists() == (level == "L2")
        if level == "L2":
            names, counts, loss_scale = read_exponents(exponents)
            assert loss_scale is None  # no GradScaler
            assert names == list(grads)
            np.testing.assert_array_equal(counts.full(), [exponent_counts(values) for values in grads.values()])
        step_dir = tmp_path / "rank0" / f"step{step}"
        if level == "L0":
            assert not step_dir.exists()
            continue
        directions = read_step_directions(step_dir)
        for name, values in grads.items():
            assert directions[name][0] == values.shape
            np.testing.assert_array_equal(directions[name][1], np.packbits(values.reshape(-1) > 0))


@pytest.mark.parametrize("bounds, values", [
    # every element on a bound or just beside one; float32(0.1) equals the float32 bound 0.1
    ((-0.5, 0.1, 0.25), [-0.5, -0.50000006, -0.49999997, 0.1, 0.10000001, 0.25, 0.25000003, 0.0, -0.0, 3.0]),
    ((-1, 0, 1), [-1.0, -1.0000001, 0.0, -0.0, 1.0, 1.0000001, 0.99999994, -0.99999994, 7.0, -7.0]),
    ((0,), [0.0, -0.0, 1e-45, -1e-45, 5.0]),
])
def test_custom_bounds_count_elements_on_a_bound_in_the_bucket_it_closes(tmp_path, bounds, values):
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.zeros(len(values)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    monitor = start(tmp_path, model, optimizer, level="L2", bounds=bounds)
    set_grads(model, {"w": values})
    optimizer.step()
    monitor.stop()
    header, rows = summary(tmp_path, 0)
    assert header[1:len(bounds) + 3] == [f"(-inf, {bounds[0]}]",
                                         *[f"({a}, {b}]" for a, b in zip(bounds, bounds[1:])],
                                         f"({bounds[-1]}, inf)", "=0"]
    assert_row(rows["w"], header, expected_row(values, "L2", bounds))


def test_bounds_on_hand_counted_example(tmp_path):
    # msprobe's documentation example: bounds [-10, 0, 10] and [9.3, 5.4, -1.0, -12.3] give 1, 1, 2, 0.
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.zeros(4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    monitor = start(tmp_path, model, optimizer, level="L2", bounds=(-10, 0, 10))
    set_grads(model, {"w": [9.3, 5.4, -1.0, -12.3]})
    optimizer.step()
    monitor.stop()
    _, rows = summary(tmp_path, 0)
    assert rows["w"][1:6] == ["0.25", "0.25", "0.5", "0.0", "0.0"]


def test_nan_and_infinities(tmp_path):
    model = torch.nn.Module()
    model.mixed = torch.nn.Parameter(torch.zeros(6))
    model.infinite = torch.nn.Parameter(torch.zeros(3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    monitor = start(tmp_path, model, optimizer, level="L2")
    grads = {"mixed": [NAN, INF, -INF, 0.5, -2.0, 0.0], "infinite": [INF, -INF, 1.0]}
    set_grads(model, grads)
    optimizer.step()
    monitor.stop()
    header, rows = summary(tmp_path, 0)
    # NaN and +inf in the last bucket, -inf in the first; max, min and norm NaN when a NaN is present.
    assert rows["mixed"][1:] == [str(2 / 6), str(1 / 6), str(1 / 6), str(2 / 6), str(1 / 6), "nan", "nan", "nan",
                                 "[6]"]
    assert rows["infinite"][1:] == [str(1 / 3), "0.0", "0.3333333333333333", "0.3333333333333333", "0.0",
                                    "inf", "-inf", "inf", "[3]"]
    for name, values in grads.items():
        assert_row(rows[name], header, expected_row(values, "L2"))
    directions = read_step_directions(tmp_path / "rank0" / "step0")
    assert directions["mixed"][1].tolist() == [0b01010000]  # NaN > 0 is False


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("level", ["L0", "L2"])
def test_half_precision_gradients_give_statistics_rounded_to_their_dtype(tmp_path, dtype, level):
    model = TwoLayers(dtype=dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = start(tmp_path, model, optimizer, level=level, bounds=(-0.3, 0.1, 1))
    values = {  # not representable in either dtype; -0.3 and 0.1 also lie on bounds before rounding
        "fc1.weight": np.array([0.1, -0.3, 1.0, 0.7, -0.0, 3.3, -1e-3, 0.0, 0.123, 0.9, -2.5, 1.1], np.float32)
        .reshape(3, 4),
        "fc1.bias": np.array([0.1, 0.1, 0.1], np.float32),
        "fc2.weight": np.array([10.1, -10.3, 0.33, 0.0, -0.0, 100.7], np.float32).reshape(2, 3),
    }
    set_grads(model, values)
    optimizer.step()
    monitor.stop()
    header, rows = summary(tmp_path, 0)
    for name, raw in values.items():
        rounded = ROUND_TO[dtype](raw)
        assert_row(rows[name], header, expected_row(rounded, level, (-0.3, 0.1, 1), dtype))
    # bf16(0.1) = 0.10009765625, not float32(0.1): the values really are the rounded ones
    assert float(rows["fc1.bias"][header.index("max")]) == float(ROUND_TO[dtype](np.float32(0.1)))


def test_float64_gradients_are_compared_in_float64_not_squashed_to_float32(tmp_path):
    # msprobe: (grad == 0) in the gradient's dtype; bucketize against the float32 bounds promoted to float64.
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.zeros(5, dtype=torch.float64))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    monitor = start(tmp_path, model, optimizer, level="L2", bounds=(0, 0.1))
    model.w.grad = torch.tensor([1e-50, -1e-50, 0.0, 0.1, 0.10000000149011613], dtype=torch.float64)
    optimizer.step()
    monitor.stop()
    _, rows = summary(tmp_path, 0)
    # <= 0: -1e-50, 0.0 | (0, float32(0.1)]: 1e-50, 0.1 | above: 0.10000000149011613 | exactly zero: one
    assert rows["w"][1:5] == ["0.4", "0.4", "0.2", "0.2"]


# ---------------------------------------------------------------- which parameters and steps

def test_param_list_keeps_only_the_named_parameters_and_warns_about_unknown_names(tmp_path):
    model = TwoLayers()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.warns(UserWarning, match=r"\['fc3.weight'\]"):
        monitor = start(tmp_path, model, optimizer, level="L1", param_list=("fc2.weight", "fc3.weight"))
    grads = random_grads(model, np.random.default_rng(2))
    set_grads(model, grads)
    optimizer.step()
    monitor.stop()
    header, rows = summary(tmp_path, 0)
    assert list(rows) == ["fc2.weight"]
    assert_row(rows["fc2.weight"], header, expected_row(grads["fc2.weight"], "L1"))
    assert list(read_step_directions(tmp_path / "rank0" / "step0")) == ["fc2.weight"]


def test_param_list_matches_exact_names_not_substrings(tmp_path):
    model = TwoLayers()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.warns(UserWarning):
        monitor = start(tmp_path, model, optimizer, level="L0", param_list=("fc1",))
    set_grads(model, random_grads(model, np.random.default_rng(3)))
    optimizer.step()
    monitor.stop()
    assert summary(tmp_path, 0)[1] == {}


def test_step_filter_counts_every_step_but_writes_only_the_listed_ones(tmp_path):
    model = TwoLayers()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = start(tmp_path, model, optimizer, level="L1", step=(1, 3))
    rng = np.random.default_rng(4)
    grads = []
    for _ in range(5):
        grads.append(random_grads(model, rng))
        set_grads(model, grads[-1])
        optimizer.step()
    monitor.stop()
    assert sorted(p.name for p in (tmp_path / "rank0").iterdir()) == \
        ["grad_summary_1.csv", "grad_summary_3.csv", "step1", "step3", "training_id"]
    for step in (1, 3):
        header, rows = summary(tmp_path, step)
        assert_row(rows["fc1.bias"], header, expected_row(grads[step]["fc1.bias"], "L1"))


@pytest.mark.parametrize("ranks, written", [((), True), ((0,), True), ((1,), False), ((1, 2), False)])
def test_rank_filter_without_distributed_training_treats_the_process_as_rank_0(tmp_path, ranks, written):
    model = TwoLayers()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = start(tmp_path, model, optimizer, level="L0", rank=ranks)
    set_grads(model, random_grads(model, np.random.default_rng(5)))
    optimizer.step()
    monitor.stop()
    assert (tmp_path / "rank0" / "grad_summary_0.csv").exists() == written
    assert not any(p.name.startswith("rank") and p.name != "rank0" for p in tmp_path.iterdir())


class TiedModel(torch.nn.Module):  # its own model: a tied, a frozen and an unused parameter are what is tested
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(5, 2)
        self.frozen = torch.nn.Linear(2, 2)
        self.frozen.requires_grad_(False)
        self.unused = torch.nn.Parameter(torch.ones(3))
        self.head = torch.nn.Linear(2, 5, bias=False)
        self.head.weight = self.embed.weight  # tied: one tensor under two names


def test_tied_parameters_appear_once_under_the_first_name_and_none_grads_are_skipped(tmp_path):
    model = TiedModel()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    monitor = start(tmp_path, model, optimizer, level="L1")
    tokens = torch.tensor([0, 3, 3])
    logits = model.head(model.embed(tokens))  # 'unused' gets no gradient; 'frozen' cannot
    logits.sum().backward()
    expected = model.embed.weight.grad.numpy().copy()
    optimizer.step()
    monitor.stop()
    header, rows = summary(tmp_path, 0)
    assert list(rows) == ["embed.weight"]
    assert_row(rows["embed.weight"], header, expected_row(expected, "L1"))


def test_an_empty_and_a_zero_dimensional_parameter_get_their_rows(tmp_path):
    model = torch.nn.Module()
    model.empty = torch.nn.Parameter(torch.zeros(0, 3))
    model.scalar = torch.nn.Parameter(torch.tensor(0.0))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = start(tmp_path, model, optimizer, level="L2", bounds=(0.5,))
    model.empty.grad = torch.zeros(0, 3)
    model.scalar.grad = torch.tensor(0.75)
    optimizer.step()
    monitor.stop()
    header, rows = summary(tmp_path, 0)
    assert header == ["param_name", "(-inf, 0.5]", "(0.5, inf)", "=0", "max", "min", "norm", "shape"]
    # documented decision for numel 0: max/min nan, norm 0.0, fractions 0 (msprobe's `else 0`)
    assert rows["empty"] == ["empty", "0", "0", "0", "nan", "nan", "0.0", "[0, 3]"]
    assert rows["scalar"] == ["scalar", "0.0", "1.0", "0.0", "0.75", "0.75", "0.75", "[]"]
    directions = read_step_directions(tmp_path / "rank0" / "step0")
    assert directions["empty"][0] == (0, 3) and directions["empty"][1].tolist() == []
    assert directions["scalar"][0] == () and directions["scalar"][1].tolist() == [0b10000000]


def test_sparse_embedding_gradients_are_probed_as_their_dense_values(tmp_path):
    model = torch.nn.Module()
    model.embed = torch.nn.Embedding(5, 3, sparse=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = start(tmp_path, model, optimizer, level="L0")
    tokens = np.array([1, 4, 1])
    weights = np.array([[1.0, -2.0, 0.5], [0.25, 0.0, -1.0], [3.0, 1.0, 1.0]], np.float32)
    (model.embed(torch.from_numpy(tokens)) * torch.from_numpy(weights)).sum().backward()
    assert model.embed.weight.grad.is_sparse
    optimizer.step()
    monitor.stop()
    dense = np.zeros((5, 3), np.float32)
    np.add.at(dense, tokens, weights)  # the repeated token's rows add up
    header, rows = summary(tmp_path, 0)
    assert_row(rows["embed.weight"], header, expected_row(dense, "L0"))


def test_main_grad_is_preferred_to_grad(tmp_path):
    model = TwoLayers()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = start(tmp_path, model, optimizer, level="L1")
    grads = random_grads(model, np.random.default_rng(6))
    set_grads(model, grads)
    main_grad = np.full((3, 4), 0.5, np.float32)
    model.fc1.weight.main_grad = torch.from_numpy(main_grad)  # Megatron's fp32 accumulation buffer
    model.fc2.weight.grad = None
    model.fc2.weight.main_grad = torch.from_numpy(grads["fc2.weight"])
    optimizer.step()
    monitor.stop()
    header, rows = summary(tmp_path, 0)
    assert_row(rows["fc1.weight"], header, expected_row(main_grad, "L1"))
    assert_row(rows["fc2.weight"], header, expected_row(grads["fc2.weight"], "L1"))


def test_names_msprobe_rejects_are_dumped_inside_the_step_folder_and_read_back(tmp_path):
    names = ["a/b", "c:d", "e f", "编码器", "x" * 300]
    model = torch.nn.Module()
    for name in names:
        model.add_module(name, torch.nn.Linear(3, 1, bias=False))
    for direction_format in ("npy", "packed"):
        dump = tmp_path / direction_format
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        monitor = start(dump, model, optimizer, level="L1", direction_format=direction_format)
        grads = {f"{name}.weight": np.array([[i - 1.5, 1.0, -1.0]], np.float32) for i, name in enumerate(names)}
        set_grads(model, grads)
        optimizer.step()
        monitor.stop()
        step_dir = dump / "rank0" / "step0"
        assert all(p.parent == step_dir for p in step_dir.rglob("*"))
        assert list(summary(dump, 0)[1]) == list(grads)
        directions = read_step_directions(step_dir)
        assert sorted(directions) == sorted(grads)
        for name, values in grads.items():
            np.testing.assert_array_equal(directions[name][1], np.packbits(values.reshape(-1) > 0))


# ---------------------------------------------------------------- the step counter and the hook's life

class PairOfModels(torch.nn.Module):  # its own model: two parts, each with an optimizer of its own
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(2, 2)
        self.b = torch.nn.Linear(2, 2)


def steps_written(dump_path, rank=0):
    folder = dump_path / f"rank{rank}"
    return sorted(int(p.stem.split("_")[-1]) for p in folder.glob("grad_summary_*.csv")) if folder.exists() else []


def test_the_step_counts_only_the_monitored_optimizers_steps(tmp_path):
    model = PairOfModels()
    optimizer_a = torch.optim.SGD(model.a.parameters(), lr=0.1)
    optimizer_b = torch.optim.SGD(model.b.parameters(), lr=0.1)
    monitor = start(tmp_path, model, optimizer_a, level="L0")
    seen = []
    for step in range(3):
        for optimizer in (optimizer_b, optimizer_a, optimizer_b):
            set_grads(model, {"a.bias": [step, -step], "b.bias": [9, 9]})
            optimizer.step()
        seen.append(step)
    monitor.stop()
    assert monitor.step == 3 and steps_written(tmp_path) == [0, 1, 2]
    for step in range(3):
        _, rows = summary(tmp_path, step)
        assert rows["a.bias"][2:4] == [str(float(step)), str(float(-step))]  # max, min of a's step `step`


def test_without_an_optimizer_the_one_that_updates_the_model_is_counted(tmp_path):
    model, other_model = PairOfModels(), torch.nn.Linear(2, 2)
    other_optimizer = torch.optim.SGD(other_model.parameters(), lr=0.1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = start(tmp_path, model, level="L0")  # optimizer=None
    for step in range(2):
        other_model.weight.grad = torch.ones(2, 2)
        other_optimizer.step()  # another model's optimizer: not counted
        set_grads(model, {"a.bias": [step, step]})
        optimizer.step()
        other_optimizer.step()
    monitor.stop()
    assert monitor.step == 2 and steps_written(tmp_path) == [0, 1]
    assert summary(tmp_path, 1)[1]["a.bias"][2] == "1.0"


def test_monitor_called_twice_does_not_double_count(tmp_path):
    model = TwoLayers()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = start(tmp_path, model, optimizer, level="L0")
    monitor.monitor(model, optimizer)
    for _ in range(3):
        set_grads(model, random_grads(model, np.random.default_rng(7)))
        optimizer.step()
    monitor.monitor(model)  # re-targeted to 'the model's optimizer': still one hook
    set_grads(model, random_grads(model, np.random.default_rng(8)))
    optimizer.step()
    monitor.stop()
    assert monitor.step == 4 and steps_written(tmp_path) == [0, 1, 2, 3]


def released_at_close(monkeypatch) -> threading.Event:
    """An event set as a session starts closing (``stop()``): a sink waiting on it keeps every step pending
    until ``stop()`` is called."""
    released, close = threading.Event(), ProbeSession.close

    def close_releasing(session):
        released.set()
        close(session)
    monkeypatch.setattr(ProbeSession, "close", close_releasing)
    return released


def test_stop_writes_what_is_pending_then_no_step_is_probed(tmp_path, monkeypatch):
    released, handled = released_at_close(monkeypatch), []

    def blocked_handler(record):
        released.wait(60)  # the disk (or MLflow) is slower than training: steps queue up behind this one
        handled.append(record.step)

    model = TwoLayers()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = GradientMonitor(GradProbeConfig(dump_path=str(tmp_path), level="L1"), log_to_mlflow=False,
                              sinks=[sink_calling(blocked_handler)]).monitor(model, optimizer)
    for _ in range(3):
        set_grads(model, random_grads(model, np.random.default_rng(9)))
        optimizer.step()
    assert handled == []  # every step still pending
    monitor.stop()
    assert handled == [0, 1, 2] and steps_written(tmp_path) == [0, 1, 2]
    for _ in range(2):
        optimizer.step()  # not probed: the step count, kept on this thread, stays
    assert monitor.step == 3 and steps_written(tmp_path) == [0, 1, 2] and handled == [0, 1, 2]
    monitor.stop()  # a second stop is harmless


def test_stop_removes_the_global_hook_of_a_monitor_without_optimizer(tmp_path):
    model = TwoLayers()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    hooks_before = len(sys.modules["torch.optim.optimizer"]._global_optimizer_pre_hooks)
    monitor = start(tmp_path, model, level="L0")
    optimizer.step()
    monitor.stop()
    assert len(sys.modules["torch.optim.optimizer"]._global_optimizer_pre_hooks) == hooks_before
    optimizer.step()
    assert steps_written(tmp_path) == [0]


def test_a_second_monitor_on_the_same_model_is_refused_while_the_first_is_active(tmp_path):
    model = TwoLayers()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    first = start(tmp_path / "first", model, optimizer, level="L0")
    second = GradientMonitor(GradProbeConfig(dump_path=str(tmp_path / "second"), level="L1"), log_to_mlflow=False)
    with pytest.raises(ValueError, match="already monitored"):
        second.monitor(model, optimizer)
    optimizer.step()
    first.stop()
    second.monitor(model, optimizer)  # the new config is used, not ignored
    optimizer.step()
    second.stop()
    assert steps_written(tmp_path / "first") == [0] and steps_written(tmp_path / "second") == [0]
    assert summary(tmp_path / "second", 0)[0] == ["param_name", "max", "min", "norm", "shape"]


def test_precision_debugger_is_msprobes_drop_in_and_honours_each_new_config(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)  # no run: the local dump only
    def config_file(name, level):
        path = tmp_path / f"{name}.json"
        path.write_text(f'{{"task": "grad_probe", "dump_path": "{tmp_path / name}", "rank": [], "step": [],'
                        f' "grad_probe": {{"grad_level": "{level}", "param_list": [], "bounds": [-1, 0, 1]}}}}')
        return path

    model = TwoLayers()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    first = PrecisionDebugger(config_file("first", "L2"))
    first.monitor(model)
    second = PrecisionDebugger(config_file("second", "L0"))
    with pytest.raises(ValueError, match="already monitored"):
        second.monitor(model)
    set_grads(model, random_grads(model, np.random.default_rng(10)))
    optimizer.step()
    first.stop()
    assert summary(tmp_path / "first", 0)[0][1] == "(-inf, -1]"
    assert steps_written(tmp_path / "second") == []


# ---------------------------------------------------------------- failures never break training

def test_an_unwritable_dump_path_is_refused_before_training(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    model = TwoLayers()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = GradientMonitor(GradProbeConfig(dump_path=str(blocker / "dump")), log_to_mlflow=False)
    with pytest.raises(ValueError, match=r"dump_path = '.*a_file/dump' is not a writable folder"):
        monitor.monitor(model, optimizer)
    set_grads(model, random_grads(model, np.random.default_rng(11)))
    optimizer.step()  # no hook was left behind
    assert monitor.step == 0 and blocker.read_text() == "not a folder"


def test_a_failing_disk_loses_that_step_only_and_training_goes_on(tmp_path):
    model = TwoLayers()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = start(tmp_path, model, optimizer, level="L2")
    rng = np.random.default_rng(12)
    grads = []

    def step():
        grads.append(random_grads(model, rng))
        set_grads(model, grads[-1])
        optimizer.step()

    step()
    monitor.flush()
    first_csv = (tmp_path / "rank0" / "grad_summary_0.csv").read_bytes()
    (tmp_path / "rank0" / "step1").write_text("in the way: step 1's folder cannot be created")
    weight_before = model.fc1.weight.detach().clone()
    step()
    step()
    monitor.flush()
    assert not torch.equal(model.fc1.weight, weight_before)  # the optimizer stepped
    assert len(monitor.errors) == 1 and "rank 0 step 1" in monitor.errors[0], monitor.errors
    with pytest.warns(UserWarning, match="1 write failure"):
        monitor.stop()
    assert steps_written(tmp_path) == [0, 2]
    assert (tmp_path / "rank0" / "grad_summary_0.csv").read_bytes() == first_csv
    header, rows = summary(tmp_path, 2)
    assert_row(rows["fc1.weight"], header, expected_row(grads[2]["fc1.weight"], "L2"))


def test_a_failing_handler_is_reported_and_the_local_dump_is_complete(tmp_path):
    def broken_handler(record):
        if record.step == 1:
            raise RuntimeError("handler broke")

    model = TwoLayers()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = GradientMonitor(GradProbeConfig(dump_path=str(tmp_path), level="L1"), log_to_mlflow=False,
                              sinks=[sink_calling(broken_handler)]).monitor(model, optimizer)
    for _ in range(3):
        set_grads(model, random_grads(model, np.random.default_rng(13)))
        optimizer.step()
    monitor.flush()
    assert len(monitor.errors) == 1 and "handler broke" in monitor.errors[0] and "step 1" in monitor.errors[0]
    with pytest.warns(UserWarning, match="handler broke"):
        monitor.stop()
    assert steps_written(tmp_path) == [0, 1, 2]


def test_errors_stay_readable_after_stop_also_those_of_steps_still_pending_at_stop(tmp_path, monkeypatch):
    released = released_at_close(monkeypatch)

    def broken_handler(record):
        released.wait(60)  # still pending when stop() is called
        raise RuntimeError("always broken")

    model = TwoLayers()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = GradientMonitor(GradProbeConfig(dump_path=str(tmp_path), level="L0"), log_to_mlflow=False,
                              sinks=[sink_calling(broken_handler)]).monitor(model, optimizer)
    optimizer.step()
    assert monitor.errors == []  # the step is still pending
    with pytest.warns(UserWarning):
        monitor.stop()
    assert len(monitor.errors) == 1 and "always broken" in monitor.errors[0]


def test_a_gradient_the_probe_cannot_handle_does_not_break_the_step(tmp_path):
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.zeros(2, dtype=torch.complex64))
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    monitor = start(tmp_path, model, optimizer, level="L2")
    model.w.grad = torch.tensor([1 + 1j, -1j], dtype=torch.complex64)
    with pytest.warns(UserWarning, match="probing step 0 failed"):
        optimizer.step()
    monitor.stop()
    assert model.w.detach().tolist() == [-1 - 1j, 1j] and monitor.step == 1


# ---------------------------------------------------------------- the training thread never waits for the host

def count_host_reads(monkeypatch, methods) -> list[str]:
    """Counts calls of ``methods`` of torch.Tensor made on this (the training) thread."""
    training_thread = threading.get_ident()
    calls = []
    for method in methods:
        original = getattr(torch.Tensor, method)

        def counting(self, *args, _original=original, _method=method, **kwargs):
            if threading.get_ident() == training_thread:
                calls.append(_method)
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, method, counting)
    return calls


SCALAR_READS = ("item", "tolist", "cpu", "__bool__", "__float__", "__int__", "__index__")


def test_the_training_thread_makes_no_per_value_host_reads_while_probing(tmp_path, monkeypatch):
    """On the CPU, .numpy() is a zero-copy view (the host path uses it); reading single values is what must not
    happen: .item()/.tolist()/.cpu()/bool()/float() during optimizer.step()."""
    calls = count_host_reads(monkeypatch, SCALAR_READS)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(10)])  # 20 parameters
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model(torch.randn(4, 8)).sum().backward()
    calls.clear()
    optimizer.step()
    baseline = list(calls)  # what the optimizer itself does
    for level in ("L0", "L1", "L2"):
        monitor = start(tmp_path / level, model, optimizer, level=level, bounds=(-0.1, 0, 0.1))
        calls.clear()
        optimizer.step()
        during = list(calls)
        monitor.stop()
        assert during == baseline, f"{level}: {during}"
        assert steps_written(tmp_path / level) == [0]


def test_the_accelerator_path_reads_nothing_on_the_host_until_the_writer_resolves_it(monkeypatch):
    """The path taken for CUDA (and other devices) runs here on CPU tensors: queuing it reads no value at all;
    only the writer thread's resolve step does."""
    from msprobe_mlflow.levels import LEVELS
    from msprobe_mlflow.torch_kernels.statistics import _device_statistics

    calls = count_host_reads(monkeypatch, (*SCALAR_READS, "numpy"))
    grads = [torch.randn(8, 8), torch.randn(8), torch.zeros(0), torch.randn((), dtype=torch.bfloat16)]
    for level in ("L0", "L1", "L2"):
        _device_statistics(grads, torch._foreach_norm(grads), LEVELS[level], [np.float32(0)])
        assert calls == [], f"{level}: {calls}"


@CUDA
def test_on_cuda_the_optimizer_step_returns_while_the_gpu_is_still_busy(tmp_path):
    model = TwoLayers().cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    grads = []

    def step_returns_before_the_gpu_is_done() -> bool:
        """Queues about a second of GPU work (a backward pass, say), steps, and tells whether that work was still
        running when step() returned: a step that waited for the device finds it done."""
        grads.append(random_grads(model, np.random.default_rng(20 + len(grads))))
        set_grads(model, grads[-1])
        torch.cuda.synchronize()
        torch.cuda._sleep(2_000_000_000)
        queued_work_done = torch.cuda.Event()
        queued_work_done.record()
        optimizer.step()
        return not queued_work_done.query()

    step_returns_before_the_gpu_is_done()
    assert step_returns_before_the_gpu_is_done()  # SGD alone does not wait for the GPU
    monitor = start(tmp_path, model, optimizer, level="L2")
    step_returns_before_the_gpu_is_done()  # warms the monitor's caches (kernels, pinned host memory)
    assert step_returns_before_the_gpu_is_done()
    monitor.stop()
    header, rows = summary(tmp_path, 1)
    assert_row(rows["fc1.weight"], header, expected_row(grads[-1]["fc1.weight"], "L2"))  # monitored step 1


# ---------------------------------------------------------------- processes: interpreter exit, distributed ranks

def run_python(code: str, cwd, timeout=120, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_interpreter_exit_writes_the_pending_steps(tmp_path):
    result = run_python(f"""
        import threading, torch
        from types import SimpleNamespace
        from msprobe_mlflow.config import GradProbeConfig
        from msprobe_mlflow.pytorch import GradientMonitor
        from msprobe_mlflow.session import ProbeSession
        model = torch.nn.Linear(3, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        release = threading.Event()
        blocked = SimpleNamespace(handle=lambda record: release.wait(60), flush=lambda: None, close=lambda: None)
        close = ProbeSession.close
        def close_releasing_the_sink(session):  # only closing the session lets steps 1..3 through
            release.set()
            close(session)
        ProbeSession.close = close_releasing_the_sink
        GradientMonitor(GradProbeConfig(dump_path={str(tmp_path)!r}, level="L1"), log_to_mlflow=False,
                        sinks=[blocked]).monitor(model, optimizer)
        for _ in range(4):
            model(torch.ones(1, 3)).sum().backward()
            optimizer.step()
        # no stop(): exiting must still write every step
        """, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert steps_written(tmp_path) == [0, 1, 2, 3]
    assert all((tmp_path / "rank0" / f"step{s}" / "directions.npz").is_file() for s in range(4))


DISTRIBUTED_RANK = """
    import sys, torch, torch.distributed as dist
    from msprobe_mlflow.config import GradProbeConfig
    from msprobe_mlflow.pytorch import GradientMonitor
    rank, store, dump = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    model = torch.nn.Linear(2, 1, bias=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for folder, ranks in (("all", ()), ("only_rank1", (1,))):
        config = GradProbeConfig(dump_path=f"{dump}/{folder}", level="L1", rank=ranks)
        monitor = GradientMonitor(config, log_to_mlflow=False).monitor(model, optimizer)
        model.weight.grad = torch.tensor([[rank + 1.0, -(rank + 1.0)]])
        optimizer.step()
        monitor.stop()
    dist.barrier()
    dist.destroy_process_group()
"""


def test_each_rank_writes_its_own_folder_and_the_rank_filter_applies(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent(DISTRIBUTED_RANK))
    dump = tmp_path / "dump"
    processes = [subprocess.Popen([sys.executable, str(script), str(rank), str(tmp_path / "store"), str(dump)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(2)]
    for process in processes:
        _, stderr = process.communicate(timeout=120)
        assert process.returncode == 0, stderr
    for folder, expected in (("all", [0, 1]), ("only_rank1", [1])):
        assert sorted(int(p.name[4:]) for p in (dump / folder).glob("rank*")) == expected
        for rank in expected:
            _, rows = summary(dump / folder, 0, rank)
            norm = float(np.float32(math.sqrt(2) * (rank + 1)))  # sqrt((r+1)^2 + (r+1)^2)
            assert rows["weight"][1:] == [str(rank + 1.0), str(-(rank + 1.0)), str(norm), "[1, 2]"]


def test_l0_on_the_cpu_hashes_the_gradients_where_they_are(tmp_path):
    """L0 on the CPU hashes each gradient in place in the optimizer's pre-hook (no model-sized snapshot), a
    parameter without a gradient included: the MD5s are those of the gradients the optimizer applied."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = GradientMonitor(GradProbeConfig(dump_path=str(tmp_path), level="L0"), log_to_mlflow=False)
    monitor.monitor(model, optimizer)
    model(torch.randn(2, 4)).sum().backward()
    model[1].bias.grad = None  # this step has fewer gradients than the model has parameters
    optimizer.step()
    monitor.flush()
    assert monitor._cache.free_snapshots == []  # none made (once hashed, a snapshot waits here for the next step)
    monitor.stop()
    header, rows = read_rows(tmp_path / "rank0" / "grad_summary_0.csv")
    assert {name: row[header.index("MD5")] for name, row in rows.items()} == {
        name: hashlib.md5(p.grad.float().numpy().tobytes()).hexdigest()
        for name, p in model.named_parameters() if p.grad is not None}
