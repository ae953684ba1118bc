"""The local dump's own process (``msprobe_mlflow.dump_process``): steps of many parameters are written there, byte
for byte as the writer thread writes them, and their anomaly flags judged as the flags' sink judges them; a failure
to write is reported as before; a process that ends costs no step and no flag."""
from __future__ import annotations

import os
import signal

import numpy as np
import pytest
import torch

from gradient_expectations import assert_row, expected_row, read_rows
from msprobe_mlflow.anomaly_rule import AnomalyFlags, SpikeRule
from msprobe_mlflow.config import GradProbeConfig
from msprobe_mlflow.directions import read_step_directions
from msprobe_mlflow.dump import findings_dir, read_csv, summary_csv_bytes, summary_csv_path, write_step
from msprobe_mlflow.dump_process import PROCESS_MIN_PARAMETERS, LocalDump, _judged
from msprobe_mlflow.notices import Notices
from msprobe_mlflow.pytorch import GradientMonitor
from msprobe_mlflow.sinks.anomalies import ANOMALIES_FILE_NAME, AnomalySink
from msprobe_mlflow.torch_kernels.statistics import launch_step_statistics

LAYERS = PROCESS_MIN_PARAMETERS // 2 + 3  # a weight and a bias each: just past the threshold


def many_parameters() -> torch.nn.Module:
    return torch.nn.Sequential(*[torch.nn.Linear(3, 2) for _ in range(LAYERS)])


def random_grads(model: torch.nn.Module, rng) -> dict[str, np.ndarray]:
    grads = {}
    for name, parameter in model.named_parameters():
        values = rng.normal(size=parameter.shape).astype(np.float32)
        values.reshape(-1)[0] = 0.0
        parameter.grad = torch.from_numpy(values.copy())
        grads[name] = values
    return grads


class Warnings(Notices):
    def __init__(self):
        super().__init__(silent=True)
        self.said: list[str] = []

    def warn(self, message: str) -> None:
        self.said.append(message)


def step_record(model: torch.nn.Module, step: int, level: str):
    names, grads = zip(*[(name, p.grad) for name, p in model.named_parameters()])
    return launch_step_statistics(list(names), list(grads), rank=0, step=step, level=level, bounds=(-1, 0, 1))()


def files_under(folder) -> dict[str, bytes]:
    return {str(path.relative_to(folder)): path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()}


@pytest.mark.parametrize("level, direction_format", [("L0", "packed"), ("L1", "npy"), ("L2", "packed")])
def test_a_monitor_writes_steps_of_many_parameters_in_the_process_as_numpy_says(tmp_path, level, direction_format):
    rng = np.random.default_rng(0)
    model = many_parameters()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = GradientMonitor(GradProbeConfig(dump_path=str(tmp_path), level=level, bounds=[-1, 0, 1],
                                              direction_format=direction_format), log_to_mlflow=False)
    monitor.monitor(model, optimizer)
    steps = []
    for _ in range(2):
        steps.append(random_grads(model, rng))
        optimizer.step()
    monitor.flush()
    process = monitor._session._local_dump.process
    assert process is not None and process.poll() is None  # the steps went to the process
    monitor.stop()
    assert process.wait(60) == 0 and monitor.errors == []
    for step, grads in enumerate(steps):
        header, rows = read_rows(summary_csv_path(tmp_path, 0, step))
        assert list(rows) == list(grads)
        for name, values in grads.items():
            assert_row(rows[name], header, expected_row(values, level))
        if level != "L0":
            directions = read_step_directions(tmp_path / "rank0" / f"step{step}")
            for name, values in grads.items():
                np.testing.assert_array_equal(directions[name][1], np.packbits(values.reshape(-1) > 0))


@pytest.mark.parametrize("level, direction_format", [("L0", "packed"), ("L1", "packed"), ("L2", "npy")])
def test_the_process_writes_the_bytes_the_writer_thread_writes(tmp_path, level, direction_format):
    model, rng = many_parameters(), np.random.default_rng(1)
    local_dump = LocalDump(str(tmp_path / "process"), direction_format, Warnings())
    for step in range(2):
        random_grads(model, rng)
        record = step_record(model, step, level)
        local_dump.write(record)
        assert local_dump.process is not None and local_dump.process.poll() is None
        assert record.summary_csv == summary_csv_bytes(step_record(model, step, level))  # the CSV came back
        write_step(tmp_path / "thread", step_record(model, step, level), direction_format)
    local_dump.close()
    written = files_under(tmp_path / "process")
    assert written == files_under(tmp_path / "thread") and len(written) >= 2


def test_a_failure_to_write_in_the_process_is_raised_as_it_was_raised_there(tmp_path):
    (tmp_path / "rank0").write_text("a file where the rank folder goes")
    model = many_parameters()
    random_grads(model, np.random.default_rng(2))
    local_dump = LocalDump(str(tmp_path), "packed", Warnings())
    with pytest.raises((FileExistsError, NotADirectoryError)) as raised:
        local_dump.write(step_record(model, 0, "L1"))
    assert "rank0" in str(raised.value)
    assert local_dump.process is not None  # a failed step is not a failed process: the next step goes there too
    local_dump.close()


def test_a_process_that_ended_costs_no_step_the_writer_thread_writes_it_and_says_so(tmp_path):
    model, rng, warnings = many_parameters(), np.random.default_rng(3), Warnings()
    local_dump = LocalDump(str(tmp_path), "packed", warnings)
    random_grads(model, rng)
    local_dump.write(step_record(model, 0, "L2"))
    process = local_dump.process
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    for step in (1, 2):
        random_grads(model, rng)
        record = step_record(model, step, "L2")
        local_dump.write(record)
        assert summary_csv_path(tmp_path, 0, step).read_bytes() == summary_csv_bytes(record)
    assert local_dump.process is None
    assert len(warnings.said) == 1 and "from step 1 on" in warnings.said[0] and "no step is lost" in warnings.said[0]
    local_dump.close()
    assert len(warnings.said) == 1


def test_steps_of_few_parameters_stay_on_the_writer_thread(tmp_path):
    model = torch.nn.Sequential(*[torch.nn.Linear(3, 2) for _ in range(PROCESS_MIN_PARAMETERS // 2 - 1)])
    random_grads(model, np.random.default_rng(4))
    local_dump = LocalDump(str(tmp_path), "packed", Warnings())
    record = step_record(model, 0, "L1")
    local_dump.write(record)
    assert local_dump.process is None and not local_dump._in_thread
    assert summary_csv_path(tmp_path, 0, 0).read_bytes() == summary_csv_bytes(record)


def train_with_faults(dump, faults: dict, steps: int, kill_after: int | None = None, in_process: bool = True):
    """SGD on many parameters with random gradients; ``faults``: step -> (parameter, "nan" or "zero"). The local
    dump's process judges the anomaly flags (or, ``in_process=False``, the flags' sink does: the rule is not given
    to the process); ``kill_after``: the process is killed after that step."""
    rng = np.random.default_rng(5)
    model = many_parameters()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    monitor = GradientMonitor(GradProbeConfig(dump_path=str(dump), level="L1"), log_to_mlflow=False, silent=True,
                              spike_window=8).monitor(model, optimizer)
    if not in_process:
        monitor._session._local_dump.spike_rule = None
    parameters = dict(model.named_parameters())
    for step in range(steps):
        random_grads(model, rng)
        name, kind = faults.get(step, (None, None))
        if name:
            parameters[name].grad.fill_(float("nan") if kind == "nan" else 0.0)
        optimizer.step()
        if step == kill_after:
            monitor.flush()
            os.kill(monitor._session._local_dump.process.pid, signal.SIGKILL)
    monitor.flush()
    sink = next(sink for sink in monitor._session.sinks if isinstance(sink, AnomalySink))
    monitor.stop()
    return monitor, sink


def flag_rows(dump) -> list[list[str]]:
    return read_csv(findings_dir(dump, 0) / ANOMALIES_FILE_NAME)


def test_the_process_judges_the_anomaly_flags_as_the_flags_sink_would(tmp_path):
    faults = {10: ("3.weight", "zero"), 12: ("7.bias", "nan")}
    monitor, sink = train_with_faults(tmp_path / "process", faults, 14)
    assert monitor.errors == []
    assert sink.flags.parameters.rows == {}  # the sink judged no step: the process did
    rows = flag_rows(tmp_path / "process")
    assert ["10", "parameter", "3.weight", "collapse"] in [row[:4] for row in rows]
    assert ["12", "parameter", "7.bias", "nonfinite"] in [row[:4] for row in rows]
    _, sink = train_with_faults(tmp_path / "thread", faults, 14, in_process=False)
    assert len(sink.flags.parameters.rows) == 2 * LAYERS  # judged by the sink, as for steps of few parameters
    assert flag_rows(tmp_path / "thread") == rows  # the same flags, bands and all


def test_when_the_process_ends_the_flags_sink_judges_the_next_steps_from_fresh_windows(tmp_path):
    monitor, sink = train_with_faults(tmp_path, {7: ("2.bias", "nan")}, 9, kill_after=4)
    assert ["7", "parameter", "2.bias", "nonfinite"] in [row[:4] for row in flag_rows(tmp_path)]
    assert monitor.errors == []
    assert sink.flags.parameters.column == 4  # steps 5 to 8 entered its windows, none before the process ended


def test_a_failure_judging_in_the_process_is_the_flags_failure_not_the_dumps(tmp_path):
    model = many_parameters()
    random_grads(model, np.random.default_rng(6))
    record = step_record(model, 3, "L1")
    record.values = record.values[:-1]  # one parameter short: the rule cannot read the norms
    judged = _judged(record, AnomalyFlags(SpikeRule()))
    assert isinstance(judged, RuntimeError) and "step 3" in str(judged)
    record.anomaly_flags = judged
    with pytest.raises(RuntimeError, match="step 3's anomaly flags"):
        AnomalyFlags(SpikeRule()).flags_of(record)
    warnings = Warnings()  # the flags' sink counts it as its own failure and says so at the end
    sink = AnomalySink(SpikeRule(), str(tmp_path), 0, notices=warnings)
    sink.handle(record)
    sink.close()
    assert len(sink._worker.errors) == 1 and "step 3's anomaly flags" in sink._worker.errors[0]
    assert len(warnings.said) == 1 and "the anomaly flags failed 1 time(s)" in warnings.said[0]


def test_a_process_that_cannot_start_costs_no_step_the_writer_thread_writes_them_and_says_so(tmp_path, monkeypatch):
    def cannot_start(module):
        raise OSError(24, "Too many open files")

    monkeypatch.setattr("msprobe_mlflow.dump_process.start_module_process", cannot_start)
    model, rng, warnings = many_parameters(), np.random.default_rng(7), Warnings()
    local_dump = LocalDump(str(tmp_path), "packed", warnings)
    for step in (0, 1):
        random_grads(model, rng)
        record = step_record(model, step, "L1")
        local_dump.write(record)
        assert summary_csv_path(tmp_path, 0, step).read_bytes() == summary_csv_bytes(record)
    assert local_dump.process is None and local_dump._in_thread
    assert len(warnings.said) == 1 and "could not start" in warnings.said[0] and "Too many open files" in \
        warnings.said[0] and "no step is lost" in warnings.said[0]
    local_dump.close()
