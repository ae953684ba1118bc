"""The architecture's seams: a core that imports no framework, the sink protocol, the rank policy, and the
JSON-lines metrics sink as the proof that adding an output is one module."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch

from msprobe_mlflow.config import GradProbeConfig
from msprobe_mlflow.dump import summary_csv_path
from msprobe_mlflow.pytorch import GradientMonitor
from msprobe_mlflow.session import RankPolicy
from msprobe_mlflow.sinks import StepSink

CORE_MODULES = ["msprobe_mlflow.session", "msprobe_mlflow.sinks", "msprobe_mlflow.sinks.jsonl",
                "msprobe_mlflow.metrics", "msprobe_mlflow.records", "msprobe_mlflow.dump",
                "msprobe_mlflow.directions", "msprobe_mlflow.config", "msprobe_mlflow.notices"]


def test_the_core_modules_import_no_mlflow_torch_or_mindspore():
    code = (f"import sys\nfor name in {CORE_MODULES!r}: __import__(name)\n"
            f"print(sorted(m for m in ('mlflow', 'torch', 'mindspore') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_the_rank_policy_says_who_probes_and_who_owns_the_run():
    config = GradProbeConfig(dump_path="unused", rank=[1, 3])
    assert [RankPolicy.of(config, rank, 4).probes for rank in range(4)] == [False, True, False, True]
    assert RankPolicy.of(config, 0, 4).owns_run and not RankPolicy.of(config, 1, 4).owns_run
    assert RankPolicy.of(config, 0, 4).wanted_ranks() == [1, 3]
    assert RankPolicy.of(GradProbeConfig(dump_path="unused"), 2, 3).wanted_ranks() == [0, 1, 2]


class RecordingSink:
    """Remembers what it was handed, and whether the dump already held the step when it was."""

    def __init__(self, dump_path):
        self.dump_path = dump_path
        self.steps, self.step_was_on_disk, self.flushes, self.closes = [], [], 0, 0

    def handle(self, record):
        self.steps.append(record.step)
        self.step_was_on_disk.append(summary_csv_path(self.dump_path, record.rank, record.step).is_file())

    def flush(self):
        self.flushes += 1

    def close(self):
        self.closes += 1


def train_linear(monitor: GradientMonitor, steps: int, nan_at: int | None = None) -> list[dict[str, np.ndarray]]:
    """Sets known gradients on a Linear(3, 2) for each step; returns them by name."""
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    monitor.monitor(model, optimizer)
    generator = np.random.default_rng(5)
    applied = []
    for step in range(steps):
        grads = {name: generator.standard_normal(p.shape).astype(np.float32) for name, p in model.named_parameters()}
        if step == nan_at:
            grads["bias"][0] = np.nan
        for name, parameter in model.named_parameters():
            parameter.grad = torch.from_numpy(grads[name].copy())
        optimizer.step()
        applied.append(grads)
    return applied


def test_a_sink_gets_every_step_after_the_local_dump_holds_it_and_is_flushed_and_closed(tmp_path):
    sink = RecordingSink(tmp_path)
    assert isinstance(sink, StepSink)
    monitor = GradientMonitor(GradProbeConfig(dump_path=str(tmp_path), level="L1"), log_to_mlflow=False,
                              sinks=[sink])
    train_linear(monitor, 3)
    monitor.flush()
    assert sink.flushes == 1 and sink.closes == 0
    monitor.stop()
    monitor.stop()
    assert sink.steps == [0, 1, 2] and all(sink.step_was_on_disk)
    assert sink.closes == 1


def test_a_sink_failing_to_close_is_reported_in_errors(tmp_path):
    class FailsToClose(RecordingSink):
        def close(self):
            raise OSError("disk gone")

    monitor = GradientMonitor(GradProbeConfig(dump_path=str(tmp_path), level="L0"), log_to_mlflow=False,
                              sinks=[FailsToClose(tmp_path)])
    train_linear(monitor, 1)
    with pytest.warns(UserWarning, match="disk gone"):
        monitor.stop()
    assert len(monitor.errors) == 1 and "FailsToClose.close failed" in monitor.errors[0]


def _expected_line(step: int, grads: dict[str, np.ndarray]) -> dict:
    """The JSON line of one step, computed here with numpy from the gradients that were applied."""
    norms = [float(np.float32(np.linalg.norm(g.astype(np.float64)))) for g in grads.values()]
    finite = [g[np.isfinite(g)] for g in grads.values() if np.isfinite(g).all()]
    return {"step": step, "rank": 0, "total_norm": math.sqrt(sum(n * n for n in norms)),
            "max": float(max(f.max() for f in finite)), "min": float(min(f.min() for f in finite))}


def test_the_metrics_file_holds_one_line_per_step_with_the_summary_metrics(tmp_path):
    monitor = GradientMonitor(GradProbeConfig(dump_path=str(tmp_path), level="L1"), log_to_mlflow=False,
                              metrics_file=True)
    applied = train_linear(monitor, 3, nan_at=2)
    monitor.stop()
    lines = [json.loads(line) for line in (tmp_path / "rank0" / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [0, 1, 2]
    for line, grads in zip(lines[:2], applied[:2]):
        expected = _expected_line(line["step"], grads)
        assert line["total_norm"] == pytest.approx(expected["total_norm"], rel=1e-6)
        assert (line["max"], line["min"]) == (pytest.approx(expected["max"]), pytest.approx(expected["min"]))
        assert set(line) == {"step", "rank", "timestamp_ms", "total_norm", "max", "min"} and line["rank"] == 0
        assert isinstance(line["timestamp_ms"], int)
    nan_line = lines[2]  # the bias holds a NaN: its norm is NaN, written as text; max/min skip it
    assert nan_line["total_norm"] == "nan"
    assert nan_line["max"] == pytest.approx(float(applied[2]["weight"].max()))


def test_the_metrics_file_appends_when_monitoring_starts_again(tmp_path):
    config = GradProbeConfig(dump_path=str(tmp_path), level="L0")
    monitor = GradientMonitor(config, log_to_mlflow=False, metrics_file=True)
    for _ in range(2):
        train_linear(monitor, 2)
        monitor.stop()
    lines = (tmp_path / "rank0" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [0, 1, 2, 3]


def test_the_metrics_file_is_off_by_default(tmp_path):
    monitor = GradientMonitor(GradProbeConfig(dump_path=str(tmp_path), level="L1"), log_to_mlflow=False)
    train_linear(monitor, 1)
    monitor.stop()
    assert summary_csv_path(tmp_path, 0, 0).is_file()
    assert not list(tmp_path.rglob("*.jsonl"))
