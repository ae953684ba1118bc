"""The monitors' ``statistics=`` option: the opt-in columns of the statistic table (``mean``, ``abs_mean``) in the
summary CSV after ``norm``, and their metrics, on PyTorch (and MindSpore, real), against numpy's means of the
gradients the optimizer applied; none by default (msprobe's columns, byte for byte)."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from msprobe_mlflow import MonitorOptions
from msprobe_mlflow.config import GradProbeConfig
from msprobe_mlflow.dump import exponents_path, read_summary, summary_csv_path
from msprobe_mlflow.exponents import read_exponents
from msprobe_mlflow.pytorch import GradientMonitor
from msprobe_mlflow.statistics_table import exponent_counts
from tiny_models import mlp, train

STATISTICS = ["mean", "abs_mean"]


def expected_columns(grads: dict[str, np.ndarray]) -> dict[str, list[float]]:
    values = [g.astype(np.float64).reshape(-1) for g in grads.values()]
    return {"mean": [float(np.float32(v.mean())) for v in values],
            "abs_mean": [float(np.float32(np.abs(v).mean())) for v in values]}


def train_torch(dump, statistics=STATISTICS, steps: int = 3, weights=None, level: str = "L2") -> list[dict]:
    """Each step's gradients as the optimizer saw them (numpy), in parameter order (``weights``: a list that gets
    each step's parameters as the optimizer saw them)."""
    model = mlp(6, 5, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    seen = []
    optimizer.register_step_pre_hook(lambda *_: seen.append(
        {n: p.grad.detach().numpy().copy() for n, p in model.named_parameters()}))
    if weights is not None:
        optimizer.register_step_pre_hook(lambda *_: weights.append(
            [p.detach().numpy().astype(np.float64) for p in model.parameters()]))
    monitor = GradientMonitor(GradProbeConfig(dump_path=str(dump), level=level, bounds=[-0.1, 0, 0.1]),
                              log_to_mlflow=False, metrics_file=True, statistics=statistics)
    with monitor:
        train(model, steps, optimizer=optimizer, monitor=monitor,
              data=lambda step, _: (torch.linspace(-2, 2, 8 * 6).reshape(8, 6) * (step + 1), None))
    assert monitor.errors == []
    return seen


def test_the_opt_in_columns_hold_each_gradients_mean_and_their_metrics_the_models(tmp_path):
    seen = train_torch(tmp_path)
    lines = [json.loads(line) for line in (tmp_path / "rank0" / "metrics.jsonl").read_text().splitlines()]
    for step, grads in enumerate(seen):
        table = read_summary(summary_csv_path(tmp_path, 0, step))
        assert table.header[-4:] == ["norm", *STATISTICS, "shape"]
        for name, expected in expected_columns(grads).items():
            assert table.numbers(name) == pytest.approx(expected, rel=1e-6, abs=1e-12)
        everything = np.concatenate([g.astype(np.float64).reshape(-1) for g in grads.values()])
        assert lines[step]["mean"] == pytest.approx(everything.mean(), rel=1e-5)  # element-weighted over parameters
        assert lines[step]["abs_mean"] == pytest.approx(np.abs(everything).mean(), rel=1e-5)


def test_without_the_option_the_csv_has_msprobes_columns_and_no_such_metric(tmp_path):
    train_torch(tmp_path, statistics=[], steps=1)
    table = read_summary(summary_csv_path(tmp_path, 0, 0))
    assert not set(STATISTICS) & set(table.header) and table.header[-2:] == ["norm", "shape"]
    line = json.loads((tmp_path / "rank0" / "metrics.jsonl").read_text())
    assert not set(STATISTICS) & set(line)


def test_param_norm_holds_each_parameters_own_norm_before_the_update_last_and_its_total(tmp_path):
    weights = []
    train_torch(tmp_path, statistics=["param_norm", "mean"], weights=weights)
    lines = [json.loads(line) for line in (tmp_path / "rank0" / "metrics.jsonl").read_text().splitlines()]
    for step, parameters in enumerate(weights):
        table = read_summary(summary_csv_path(tmp_path, 0, step))
        assert table.header[-4:] == ["norm", "mean", "param_norm", "shape"]  # the gradient's columns first
        expected = [np.linalg.norm(p.reshape(-1)) for p in parameters]
        assert table.numbers("param_norm") == pytest.approx(expected, rel=1e-6)
        assert lines[step]["param_norm"] == pytest.approx(math.sqrt(sum(n * n for n in expected)), rel=1e-6)
    assert weights[1][0].tolist() != weights[0][0].tolist()  # the weights moved: each step read its own


def test_exponents_below_l2_are_counted_beside_msprobes_csv_with_their_format_metrics(tmp_path):
    seen = train_torch(tmp_path / "asked", statistics=["exponents"], level="L1")
    train_torch(tmp_path / "plain", statistics=[], level="L1")
    lines = [json.loads(line) for line in (tmp_path / "asked" / "rank0" / "metrics.jsonl").read_text().splitlines()]
    for step, grads in enumerate(seen):
        csv = summary_csv_path(tmp_path / "asked", 0, step)
        assert csv.read_bytes() == summary_csv_path(tmp_path / "plain", 0, step).read_bytes()  # msprobe's L1 CSV
        names, counts, _ = read_exponents(exponents_path(tmp_path / "asked", 0, step))
        assert names == list(grads)
        np.testing.assert_array_equal(counts.full(), [exponent_counts(g) for g in grads.values()])
        everything = np.concatenate([g.reshape(-1) for g in grads.values()])
        assert lines[step]["formats/float16 subnormal"] == \
            np.count_nonzero((everything != 0) & (np.abs(everything) < 2.0 ** -14)) / everything.size
    assert not exponents_path(tmp_path / "plain", 0, 0).exists()


def test_param_norm_with_fsdp1_is_refused_before_anything_is_opened(tmp_path):
    """FSDP1's flat parameters hide the original ones' weights: refused in monitor(), no dump folder made."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = FullyShardedDataParallel(torch.nn.Linear(3, 2), device_id=torch.device("cpu"))
        monitor = GradientMonitor(GradProbeConfig(dump_path=str(tmp_path / "dump"), level="L1"), log_to_mlflow=False,
                                  statistics=["param_norm"])
        with pytest.raises(ValueError, match=r"'param_norm' is not supported with FSDP1 .*use FSDP2"):
            monitor.monitor(model)
    finally:
        dist.destroy_process_group()
    assert not (tmp_path / "dump").exists()


@pytest.mark.parametrize("statistics, refused", [
    (["median"], "statistics ['median'] are not known; expected some of: mean, abs_mean, param_norm, exponents"),
    ("mean", "statistics = 'mean' is not accepted; expected a list of names, some of: mean, abs_mean, param_norm, "
             "exponents"),
])
def test_an_unknown_statistic_is_refused_naming_those_accepted(statistics, refused):
    with pytest.raises(ValueError) as error:
        MonitorOptions.of(statistics=statistics)
    assert str(error.value) == refused


@pytest.mark.parametrize("mode", ["pynative", "graph"])
@pytest.mark.parametrize("kind", ["nn", "mint"])
def test_mindspores_monitor_records_each_parameters_norm_before_the_update(tmp_path, monkeypatch, mode, kind):
    ms = pytest.importorskip("mindspore", reason="MindSpore is not installed (the torch-only stage)")
    from mindspore import Tensor, mint, nn
    from msprobe_mlflow.mindspore import GradientMonitor as MindSporeMonitor

    monkeypatch.chdir(tmp_path)  # MindSpore writes compiler reports into the current folder
    previous = ms.get_context("mode")
    ms.set_context(mode=ms.GRAPH_MODE if mode == "graph" else ms.PYNATIVE_MODE)
    try:
        parameters = nn.Dense(3, 2).trainable_params()
        optimizer = nn.SGD(parameters, learning_rate=0.5) if kind == "nn" else mint.optim.SGD(parameters, lr=0.5)
        monitor = MindSporeMonitor({"task": "grad_probe", "dump_path": str(tmp_path / "dump"),
                                    "grad_probe": {"grad_level": "L1"}}, log_to_mlflow=False,
                                   statistics=["param_norm", "mean", "exponents"]).monitor(optimizer)
        weights = []
        for step in range(3):  # the weights each step's optimizer call starts from
            weights.append([np.linalg.norm(p.asnumpy().astype(np.float64)) for p in optimizer.parameters])
            optimizer(tuple(Tensor(np.full(p.shape, step + 1.0, np.float32)) for p in optimizer.parameters))
        monitor.stop()
    finally:
        ms.set_context(mode=previous)
    assert monitor.errors == [] and (weights[1] != weights[0] or kind == "mint")  # mint's SGD: no update on CPU
    for step, expected in enumerate(weights):
        table = read_summary(summary_csv_path(tmp_path / "dump", 0, step))
        assert table.header[-4:] == ["norm", "mean", "param_norm", "shape"]
        assert table.numbers("param_norm") == pytest.approx(expected, rel=1e-6)
        _, counts, _ = read_exponents(exponents_path(tmp_path / "dump", 0, step))  # every element is step + 1
        np.testing.assert_array_equal(counts.full(), [exponent_counts(np.full(p.shape, step + 1.0, np.float32))
                                               for p in optimizer.parameters])


def test_mindspores_monitor_writes_the_same_columns(tmp_path):
    pytest.importorskip("mindspore", reason="MindSpore is not installed (the torch-only stage)")
    from mindspore_training import STEPS, batches, dense, numpy_gradients, sgd_model
    from msprobe_mlflow.mindspore import GradProbeCallback

    callback = GradProbeCallback({"task": "grad_probe", "dump_path": str(tmp_path), "grad_probe": {"grad_level": "L1"}},
                                 log_to_mlflow=False, statistics=STATISTICS)
    sgd_model(dense()).train(1, batches(), callbacks=[callback], dataset_sink_mode=False)
    assert callback.monitor.errors == []
    for step in range(STEPS):
        table = read_summary(summary_csv_path(tmp_path, 0, step))
        assert table.header[-3:] == [*STATISTICS, "shape"]
        for name, expected in expected_columns(numpy_gradients(step)).items():
            assert table.numbers(name) == pytest.approx(expected, rel=1e-5, abs=1e-9)
            assert all(math.isfinite(v) for v in table.numbers(name))
