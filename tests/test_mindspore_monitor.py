"""The MindSpore gradient monitor on real MindSpore 2.10 (CPU), in PyNative and in GRAPH_MODE.

Expected values come from the test's own gradients: written out by hand for the small cell, computed with numpy
from the gradients the training loop returns for the MLP.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

from types import SimpleNamespace

import numpy as np
import pytest

ms = pytest.importorskip("mindspore", reason="MindSpore is not installed (the torch-only stage)")
from mindspore import Parameter, Tensor, mint, nn, ops  # noqa: E402

from gradient_expectations import EXPECTED_L1, EXPECTED_L2
from msprobe_mlflow.config import GradProbeConfig
from msprobe_mlflow.directions import read_step_directions
from msprobe_mlflow.dump import exponents_path, read_summary, step_dir, summary_csv_path, summary_steps
from msprobe_mlflow.exponents import read_exponents
from msprobe_mlflow.mindspore import GradientMonitor, PrecisionDebugger
from msprobe_mlflow.statistics_table import exponent_counts

REPO = Path(__file__).resolve().parents[1]
MODES = {"pynative": ms.PYNATIVE_MODE, "graph": ms.GRAPH_MODE}


@pytest.fixture(autouse=True)
def in_tmp_path(tmp_path, monkeypatch):
    """MindSpore writes compiler reports (rank_0/om/...) into the current folder."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture(params=list(MODES))
def mode(request):
    previous = ms.get_context("mode")
    ms.set_context(mode=MODES[request.param])
    yield request.param
    ms.set_context(mode=previous)


def sink_calling(handle) -> SimpleNamespace:
    """The smallest sink: ``handle`` for each step, nothing to flush or close."""
    return SimpleNamespace(handle=handle, flush=lambda: None, close=lambda: None)


def use_mode(name: str) -> None:
    ms.set_context(mode=MODES[name])


@pytest.fixture
def restore_mode():
    previous = ms.get_context("mode")
    yield
    ms.set_context(mode=previous)


def config(dump_path, **fields) -> GradProbeConfig:
    """The expectations here are written for bounds [-1, 0, 1] (a config without bounds gets msprobe's MindSpore
    default: tests/test_mindspore_default_bounds.py)."""
    return GradProbeConfig(dump_path=str(dump_path), **{"bounds": (-1, 0, 1), **fields})


class SmallCell(nn.Cell):
    """``scale`` (a 0-d parameter) then ``fc1`` (weight [2, 3], bias [2]): the optimizer's parameter order."""

    def __init__(self):
        super().__init__()
        self.scale = Parameter(Tensor(1.0, ms.float32), name="scale")
        self.fc1 = nn.Dense(3, 2)


HAND_SET_GRADIENTS = {
    "scale": np.array(-3.0, dtype=np.float32),
    "fc1.weight": np.array([[2.0, -1.0, 0.0], [0.0, 2.0, -4.0]], dtype=np.float32),
    "fc1.bias": np.array([0.1, -0.0], dtype=np.float32),
}

EXPECTED_DIRECTIONS = {"scale": [False], "fc1.weight": [True, False, False, False, True, False],
                       "fc1.bias": [True, False]}


def step_with(optimizer, gradients: dict[str, np.ndarray]) -> None:
    optimizer(tuple(Tensor(gradients[p.name]) for p in optimizer.parameters))


@pytest.mark.parametrize("level, expected", [("L1", EXPECTED_L1), ("L2", EXPECTED_L2)])
def test_hand_set_gradients_give_msprobe_csv_text_and_directions(mode, tmp_path, level, expected):
    optimizer = nn.SGD(SmallCell().trainable_params(), learning_rate=0.0)
    monitor = GradientMonitor(config(tmp_path, level=level), log_to_mlflow=False).monitor(optimizer)
    step_with(optimizer, HAND_SET_GRADIENTS)
    monitor.stop()
    assert summary_csv_path(tmp_path, 0, 0).read_bytes() == expected
    directions = read_step_directions(step_dir(tmp_path, 0, 0))
    assert list(directions) == list(EXPECTED_DIRECTIONS)
    for name, signs in EXPECTED_DIRECTIONS.items():
        shape, bits = directions[name]
        assert shape == HAND_SET_GRADIENTS[name].shape
        assert np.unpackbits(bits, count=len(signs)).astype(bool).tolist() == signs


def test_level_l0_writes_md5_of_float32_bytes_and_no_directions(mode, tmp_path):
    optimizer = nn.SGD(SmallCell().trainable_params(), learning_rate=0.0)
    monitor = GradientMonitor(config(tmp_path, level="L0"), log_to_mlflow=False).monitor(optimizer)
    step_with(optimizer, HAND_SET_GRADIENTS)
    monitor.stop()
    md5 = {name: hashlib.md5(g.astype("<f4").tobytes()).hexdigest() for name, g in HAND_SET_GRADIENTS.items()}
    assert summary_csv_path(tmp_path, 0, 0).read_bytes() == (
        '\ufeffparam_name,MD5,max,min,norm,shape\r\n'
        f'scale,{md5["scale"]},-3.0,-3.0,3.0,[]\r\n'
        f'fc1.weight,{md5["fc1.weight"]},2.0,-4.0,5.0,"[2, 3]"\r\n'
        f'fc1.bias,{md5["fc1.bias"]},0.10000000149011612,-0.0,0.10000000149011612,[2]\r\n').encode("utf-8")
    assert not step_dir(tmp_path, 0, 0).exists()


class MLP(nn.Cell):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Dense(4, 8)
        self.fc2 = nn.Dense(8, 2)

    def construct(self, x):
        return self.fc2(ops.relu(self.fc1(x)))


def train_mlp(style: str, optimizer_name: str, steps: int, monitor_config: GradProbeConfig | None):
    """Trains the MLP; returns each step's gradients (numpy, by name) as the training itself computed them.

    ``direct``: ``value_and_grad`` and ``optimizer(grads)`` from Python; ``jit``: the same step under
    ``@mindspore.jit``; ``cell``: ``TrainOneStepCell(return_grad=True)``. The last two add ``collect()``.
    """
    ms.set_seed(0)
    net = MLP()
    optimizer = {"adam": lambda: nn.Adam(net.trainable_params(), learning_rate=0.01),
                 "sgd": lambda: nn.SGD(net.trainable_params(), learning_rate=0.1),
                 "mint_sgd": lambda: mint.optim.SGD(net.trainable_params(), lr=0.1)}[optimizer_name]()
    monitor = None
    if monitor_config is not None:
        monitor = GradientMonitor(monitor_config, log_to_mlflow=False, statistics=["exponents"]).monitor(optimizer)
    loss_fn = nn.MSELoss()
    if style == "cell":
        train_one_step = nn.TrainOneStepCell(nn.WithLossCell(net, loss_fn), optimizer, return_grad=True)

        def step(x, y):
            return train_one_step(x, y)[1]
    else:
        def forward(x, y):
            return loss_fn(net(x), y)

        grad_fn = ms.value_and_grad(forward, None, optimizer.parameters)

        def step(x, y):
            _, grads = grad_fn(x, y)
            optimizer(grads)
            return grads
        if style == "jit":
            step = ms.jit(step)
    rng = np.random.default_rng(1)
    captured = []
    for _ in range(steps):
        x = Tensor(rng.standard_normal((6, 4)).astype(np.float32))
        y = Tensor(rng.standard_normal((6, 2)).astype(np.float32))
        grads = step(x, y)
        if monitor is not None and style != "direct":
            monitor.collect()
        names = [p.name for p in optimizer.parameters]
        values = grads.values() if isinstance(grads, dict) else grads
        captured.append({name: g.asnumpy().copy() for name, g in zip(names, values)})
    if monitor is not None:
        monitor.stop()
    return captured


def expected_l2_row(grad: np.ndarray, bounds=(-1, 0, 1)) -> dict:
    """msprobe's L2 statistics of one gradient, with numpy: buckets right-closed over float32 bounds."""
    at_most = [int((grad <= b).sum()) for b in np.float32(bounds)]
    counts = np.diff([0, *at_most, grad.size])
    return {"fractions": [c / grad.size for c in counts] + [int((grad == 0).sum()) / grad.size],
            "max": float(grad.max()), "min": float(grad.min()),
            "norm": float(np.float32(np.sqrt(np.sum(grad.astype(np.float64) ** 2)))), "shape": str(list(grad.shape))}


STYLES = [("pynative", "direct"), ("pynative", "cell"), ("graph", "direct"), ("graph", "jit"), ("graph", "cell")]


@pytest.mark.parametrize("mode_name, style", STYLES)
def test_training_rows_and_directions_equal_numpy_on_the_captured_gradients(restore_mode, tmp_path, mode_name,
                                                                            style):
    use_mode(mode_name)
    captured = train_mlp(style, "adam", 3, config(tmp_path, level="L2"))
    assert summary_steps(tmp_path / "rank0") == [0, 1, 2]
    for step, grads in enumerate(captured):
        table = read_summary(summary_csv_path(tmp_path, 0, step))
        assert [row[0] for row in table.rows] == list(grads)
        for row, grad in zip(table.rows, grads.values()):
            expected = expected_l2_row(grad)
            assert [float(cell) for cell in row[1:6]] == expected["fractions"]
            assert float(row[6]) == expected["max"] and float(row[7]) == expected["min"]
            # float32 accumulation against numpy's float64: equal to within one float32 rounding
            assert abs(float(row[8]) - expected["norm"]) <= np.spacing(np.float32(expected["norm"]))
            assert row[9] == expected["shape"]
        directions = read_step_directions(step_dir(tmp_path, 0, step))
        for name, grad in grads.items():
            shape, bits = directions[name]
            assert shape == grad.shape
            np.testing.assert_array_equal(np.unpackbits(bits, count=grad.size).astype(bool), (grad > 0).ravel())
        names, exponents, _ = read_exponents(exponents_path(tmp_path, 0, step))
        assert names == list(grads)
        np.testing.assert_array_equal(exponents.full(), [exponent_counts(grad) for grad in grads.values()])


@pytest.mark.parametrize("mode_name, style", [("pynative", "direct"), ("graph", "jit")])
def test_mint_optimizers_are_monitored_too(restore_mode, tmp_path, mode_name, style):
    use_mode(mode_name)
    captured = train_mlp(style, "mint_sgd", 2, config(tmp_path, level="L2"))
    for step, grads in enumerate(captured):
        rows = read_summary(summary_csv_path(tmp_path, 0, step)).rows
        assert [row[0] for row in rows] == list(grads) == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
        for row, grad in zip(rows, grads.values()):
            expected = expected_l2_row(grad)
            assert [float(c) for c in row[1:8]] == expected["fractions"] + [expected["max"], expected["min"]]


@pytest.mark.parametrize("mode_name, style", [("pynative", "direct"), ("graph", "cell")])
def test_step_and_param_filters_choose_files_and_rows(restore_mode, tmp_path, mode_name, style):
    use_mode(mode_name)
    captured = train_mlp(style, "sgd", 4, config(tmp_path, level="L1", step=(0, 2),
                                                  param_list=("fc2.weight", "fc1.bias")))
    assert summary_steps(tmp_path / "rank0") == [0, 2]
    for step in (0, 2):
        table = read_summary(summary_csv_path(tmp_path, 0, step))
        assert [row[0] for row in table.rows] == ["fc1.bias", "fc2.weight"]  # optimizer order, not list order
        assert float(table.rows[1][1]) == float(captured[step]["fc2.weight"].max())
        assert list(read_step_directions(step_dir(tmp_path, 0, step))) == ["fc1.bias", "fc2.weight"]


class ManyParameters(nn.Cell):
    def __init__(self, count: int):
        super().__init__()
        self.weights = ms.ParameterTuple(Parameter(Tensor(np.zeros(3, np.float32)), name=f"w{i}")
                                         for i in range(count))


@pytest.mark.timeout(120)
def test_hundreds_of_parameters_and_a_sparse_param_list_compile_in_graph_mode(restore_mode, tmp_path):
    """300 gradients, every other one monitored. A per-parameter Python loop in the graph compiles for minutes
    here (and past a few hundred parameters exceeds MindSpore's call-depth limit, breaking the training graph);
    the probe maps over the tuple instead and compiles in seconds."""
    use_mode("graph")
    optimizer = nn.SGD(ManyParameters(300).trainable_params(), learning_rate=0.0)
    names = [p.name for p in optimizer.parameters]
    monitor = GradientMonitor(config(tmp_path, level="L2", param_list=tuple(names[::2])),
                              log_to_mlflow=False).monitor(optimizer)
    grads = np.random.default_rng(5).standard_normal((300, 3)).astype(np.float32)
    optimizer(ms.mutable(tuple(Tensor(g) for g in grads)))
    monitor.stop()
    rows = read_summary(summary_csv_path(tmp_path, 0, 0)).rows
    assert len(names) == 300 and [row[0] for row in rows] == names[::2]
    for row, grad in zip(rows, grads[::2]):
        assert float(row[6]) == float(grad.max()) and float(row[7]) == float(grad.min())


@pytest.mark.parametrize("ranks, written", [((0,), [0, 1]), ((1, 2), [])])
def test_rank_filter_applies_in_graph_mode(restore_mode, tmp_path, ranks, written):
    use_mode("graph")
    train_mlp("cell", "sgd", 2, config(tmp_path, level="L1", rank=ranks))
    assert summary_steps(tmp_path / "rank0") == written


def test_pynative_and_graph_write_identical_files_for_identical_gradients(restore_mode, tmp_path):
    """The same gradients (with NaN, ±inf, -0.0 and zeros) given to the optimizer eagerly, as a graph of its own
    and inside a @jit step give byte-identical dumps."""
    rng = np.random.default_rng(3)
    steps = []
    for _ in range(3):
        gradients = {"scale": np.float32(rng.standard_normal()),
                     "fc1.weight": rng.standard_normal((2, 3)).astype(np.float32),
                     "fc1.bias": rng.standard_normal(2).astype(np.float32)}
        steps.append(gradients)
    steps[1]["fc1.weight"][0] = [np.nan, np.inf, -0.0]
    steps[2]["fc1.bias"][:] = [-np.inf, 0.0]
    dumps = {}
    for label, mode_name in [("eager", "pynative"), ("graph", "graph"), ("jit", "graph")]:
        use_mode(mode_name)
        optimizer = nn.SGD(SmallCell().trainable_params(), learning_rate=0.0)
        monitor = GradientMonitor(config(tmp_path / label, level="L2", step=(0, 1, 2)),
                                  log_to_mlflow=False, statistics=["exponents"]).monitor(optimizer)
        run_optimizer = optimizer
        if label == "jit":
            @ms.jit
            def run_optimizer(grads):
                return optimizer(grads)
        for gradients in steps:
            # mutable: like gradients a graph computes, not compile-time constants the compiler would fold
            run_optimizer(ms.mutable(tuple(Tensor(gradients[p.name]) for p in optimizer.parameters)))
            monitor.collect()
        monitor.stop()
        dumps[label] = {p.relative_to(tmp_path / label): p.read_bytes()
                        for p in sorted((tmp_path / label / "rank0").rglob("*"))
                        if p.is_file() and p.name != "training_id"}  # each training has its own ID
    assert len(dumps["eager"]) == 10  # three CSVs, direction archives and exponent counts, the flags of NaN and inf
    assert dumps["graph"] == dumps["eager"]
    assert dumps["jit"] == dumps["eager"]
    row = read_summary(tmp_path / "eager" / "rank0" / "grad_summary_1.csv").rows[1]
    assert row[0] == "fc1.weight" and row[6:9] == ["nan", "nan", "nan"]  # NaN makes max, min and norm NaN


def test_compiled_steps_without_collect_keep_the_last_one_and_warn(restore_mode, tmp_path):
    use_mode("graph")
    ms.set_seed(0)
    net = MLP()
    optimizer = nn.SGD(net.trainable_params(), learning_rate=0.1)
    monitor = GradientMonitor(config(tmp_path, level="L1"), log_to_mlflow=False).monitor(optimizer)
    train_one_step = nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()), optimizer)
    x, y = Tensor(np.ones((6, 4), np.float32)), Tensor(np.zeros((6, 2), np.float32))
    for _ in range(3):
        train_one_step(x, y)
    with pytest.warns(UserWarning, match="call monitor.collect"):
        monitor.stop()
    assert summary_steps(tmp_path / "rank0") == [2]
    assert monitor.lost_steps == 2 and monitor.step == 3


def test_a_graph_compiled_before_monitor_is_reported(restore_mode, tmp_path):
    use_mode("graph")
    net = nn.Dense(4, 2)
    optimizer = nn.SGD(net.trainable_params(), learning_rate=0.1)
    train_one_step = nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()), optimizer)
    x, y = Tensor(np.ones((6, 4), np.float32)), Tensor(np.zeros((6, 2), np.float32))
    train_one_step(x, y)  # compiled now, without the probe; MindSpore reuses this graph
    monitor = GradientMonitor(config(tmp_path, level="L1"), log_to_mlflow=False).monitor(optimizer)
    with pytest.warns(UserWarning, match="call monitor\\(\\) before the first train step"):
        for _ in range(3):
            train_one_step(x, y)
            monitor.collect()
    monitor.stop()
    assert summary_steps(tmp_path / "rank0") == []


def test_stop_gives_the_optimizer_back_and_nothing_more_is_written(mode, tmp_path):
    optimizer = nn.SGD(SmallCell().trainable_params(), learning_rate=0.0)
    parameter_names = list(optimizer.parameters_dict())
    monitor = GradientMonitor(config(tmp_path, level="L1"), log_to_mlflow=False).monitor(optimizer)
    assert isinstance(optimizer, nn.SGD) and list(optimizer.parameters_dict()) == parameter_names
    step_with(optimizer, HAND_SET_GRADIENTS)
    monitor.stop()
    monitor.stop()
    assert type(optimizer) is nn.SGD
    step_with(optimizer, HAND_SET_GRADIENTS)
    assert summary_steps(tmp_path / "rank0") == [0]
    assert monitor.step == 1


def test_a_second_monitor_on_the_same_optimizer_is_refused(tmp_path):
    optimizer = nn.SGD(SmallCell().trainable_params(), learning_rate=0.0)
    first = GradientMonitor(config(tmp_path / "a"), log_to_mlflow=False).monitor(optimizer)
    with pytest.raises(ValueError, match="already monitored"):
        GradientMonitor(config(tmp_path / "b"), log_to_mlflow=False).monitor(optimizer)
    first.stop()


def test_a_failing_handler_never_breaks_training(tmp_path):
    def broken_handler(record):
        raise RuntimeError("disk full")

    optimizer = nn.SGD(SmallCell().trainable_params(), learning_rate=0.0)
    monitor = GradientMonitor(config(tmp_path, level="L1"), log_to_mlflow=False,
                              sinks=[sink_calling(broken_handler)]).monitor(optimizer)
    step_with(optimizer, HAND_SET_GRADIENTS)
    step_with(optimizer, HAND_SET_GRADIENTS)
    with pytest.warns(UserWarning, match="2 write failure"):
        monitor.stop()
    assert len(monitor.errors) == 2 and "disk full" in monitor.errors[0]
    assert summary_steps(tmp_path / "rank0") == [0, 1]


def test_precision_debugger_reads_msprobe_config_with_integer_bounds(restore_mode, tmp_path):
    use_mode("graph")
    config_path = tmp_path / "config.json"
    config_path.write_text('{"task": "grad_probe", "dump_path": "%s", "rank": [], "step": [1], '
                           '"grad_probe": {"grad_level": "L2", "param_list": [], "bounds": [-1, 0, 1]}}'
                           % (tmp_path / "dump").as_posix())
    debugger = PrecisionDebugger(str(config_path))
    ms.set_seed(0)
    net = MLP()
    optimizer = nn.SGD(net.trainable_params(), learning_rate=0.1)
    debugger.monitor(optimizer)
    train_one_step = nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()), optimizer)
    for _ in range(3):
        train_one_step(Tensor(np.ones((6, 4), np.float32)), Tensor(np.zeros((6, 2), np.float32)))
        debugger.step()
    debugger.stop()
    assert summary_steps(tmp_path / "dump" / "rank0") == [1]
    assert read_summary(summary_csv_path(tmp_path / "dump", 0, 1)).header[:6] == [
        "param_name", "(-inf, -1]", "(-1, 0]", "(0, 1]", "(1, inf)", "=0"]


EXIT_SCRIPT = textwrap.dedent("""
    import sys
    import numpy as np
    import mindspore as ms
    from mindspore import Tensor, nn
    from msprobe_mlflow.mindspore import GradientMonitor

    ms.set_context(mode=ms.GRAPH_MODE)
    net = nn.Dense(4, 2)
    optimizer = nn.SGD(net.trainable_params(), learning_rate=0.1)
    monitor = GradientMonitor({"task": "grad_probe", "dump_path": sys.argv[1], "grad_probe": {"grad_level": "L1"}},
                              log_to_mlflow=False).monitor(optimizer)
    train_one_step = nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()), optimizer)
    for _ in range(3):
        train_one_step(Tensor(np.ones((6, 4), np.float32)), Tensor(np.zeros((6, 2), np.float32)))
        if sys.argv[2] == "collect":
            monitor.collect()
    if sys.argv[3] == "stop":
        monitor.stop()
    print("training done")
""")


@pytest.mark.parametrize("collect, ending, written", [("collect", "stop", [0, 1, 2]), ("no-collect", "no-stop", [2])])
def test_a_graph_mode_process_exits_cleanly_with_or_without_stop(tmp_path, collect, ending, written):
    """Without stop(), interpreter exit collects the last step and writes what is pending; nothing hangs."""
    script = tmp_path / "train.py"
    script.write_text(EXIT_SCRIPT)
    result = subprocess.run([sys.executable, str(script), str(tmp_path / "dump"), collect, ending], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "training done" in result.stdout and "Traceback" not in result.stderr
    assert summary_steps(tmp_path / "dump" / "rank0") == written


WARNINGS_SCRIPT = textwrap.dedent("""
    import sys
    sys.path[:0] = [sys.argv[1], sys.argv[2]]
    from pathlib import Path
    from mindspore_training import assert_steps_match_numpy, batches, dense, sgd_model
    from msprobe_mlflow.mindspore import GradProbeCallback

    net = dense()
    callback = GradProbeCallback({"task": "grad_probe", "dump_path": "dump", "grad_probe": {"grad_level": sys.argv[3]}},
                                 log_to_mlflow=False)
    sgd_model(net).train(1, batches(), callbacks=callback, dataset_sink_mode=False)
    assert_steps_match_numpy(Path("dump"), [p.name for p in net.trainable_params()])
    print("training done")
""")


@pytest.mark.parametrize("level", ["L0", "L2"])  # between them, every statistic the probe computes
def test_a_monitored_pynative_training_prints_no_mindspore_warning(tmp_path, level):
    """The probe's compiled statistics once used ``mint.reshape``, which makes MindSpore warn (``The mint interface
    reshape was called ... may produce unexpected results``) in every monitored training."""
    script = tmp_path / "train.py"
    script.write_text(WARNINGS_SCRIPT)
    result = subprocess.run([sys.executable, str(script), str(REPO / "tests"), str(REPO), level], cwd=tmp_path,
                            capture_output=True, text=True, timeout=300, env={**os.environ, "GLOG_v": "2"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "training done" in result.stdout
    assert [line for line in result.stderr.splitlines() if "WARNING" in line or "Warning" in line] == []


@pytest.mark.parametrize("mode_name, style", [("pynative", "direct"), ("graph", "jit")])
def test_a_dynamic_loss_scalers_scale_is_read_at_each_optimizer_call(restore_mode, tmp_path, mode_name, style):
    """The loop of MindSpore's mixed-precision guide: the loss scaled, the gradients unscaled before the optimizer
    and the scale adjusted after it (doubled at every finite step here). The exponent files carry the scale each
    step's gradients were unscaled from (the format losses read the gradients at it), eagerly and under @jit."""
    from mindspore.amp import DynamicLossScaler, all_finite

    use_mode(mode_name)
    ms.set_seed(0)
    net, loss_fn = MLP(), nn.MSELoss()
    optimizer = nn.SGD(net.trainable_params(), learning_rate=0.01)
    scaler = DynamicLossScaler(1024.0, 2, 1)
    monitor = GradientMonitor(config(tmp_path, level="L1"), log_to_mlflow=False,
                              statistics=["exponents"]).monitor(optimizer, loss_scaler=scaler)

    def forward(x, y):  # a def: graph mode compiles no lambda given inline
        return scaler.scale(loss_fn(net(x), y))
    grad_fn = ms.value_and_grad(forward, None, optimizer.parameters)

    def step(x, y):
        _, grads = grad_fn(x, y)
        grads = scaler.unscale(grads)
        finite = all_finite(grads)
        optimizer(grads)
        scaler.adjust(finite)
        return finite
    step = ms.jit(step) if style == "jit" else step
    rng = np.random.default_rng(1)
    used = []
    for _ in range(3):
        used.append(float(scaler.scale_value.asnumpy()))
        step(Tensor(rng.standard_normal((6, 4)).astype(np.float32)),
             Tensor(rng.standard_normal((6, 2)).astype(np.float32)))
        monitor.collect()
    monitor.stop()
    assert used == [1024.0, 2048.0, 4096.0]
    assert [read_exponents(exponents_path(tmp_path, 0, s))[2] for s in range(3)] == used


def test_a_loss_scaler_without_a_scale_is_refused_naming_what_is_accepted(tmp_path):
    optimizer = nn.SGD(MLP().trainable_params(), learning_rate=0.01)
    with pytest.raises(TypeError, match="loss_scaler = 1024.0 is not accepted; expected a mindspore.amp loss scaler"):
        GradientMonitor(config(tmp_path), log_to_mlflow=False).monitor(optimizer, loss_scaler=1024.0)


def test_another_loss_scaler_for_the_optimizer_already_probed_is_said_to_be_ignored(tmp_path):
    from mindspore.amp import StaticLossScaler

    optimizer = nn.SGD(MLP().trainable_params(), learning_rate=0.01)
    scaler = StaticLossScaler(128.0)
    monitor = GradientMonitor(config(tmp_path), log_to_mlflow=False, statistics=["exponents"])
    monitor.monitor(optimizer, loss_scaler=scaler)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same scaler again: nothing to say
        monitor.monitor(optimizer, loss_scaler=scaler)
    with pytest.warns(UserWarning, match=r"called again for the optimizer it probes, with another loss_scaler"):
        monitor.monitor(optimizer, loss_scaler=StaticLossScaler(64.0))
    monitor.stop()


def test_a_loss_scaler_without_exponent_counts_is_said_to_go_unread(tmp_path):
    from mindspore.amp import StaticLossScaler

    optimizer = nn.SGD(MLP().trainable_params(), learning_rate=0.01)
    monitor = GradientMonitor(config(tmp_path), log_to_mlflow=False)
    with pytest.warns(UserWarning, match=r"loss_scaler is read for the format losses, which need statistics="):
        monitor.monitor(optimizer, loss_scaler=StaticLossScaler(128.0))
    monitor.stop()
