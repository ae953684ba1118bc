"""Fast steps move the live sink's MLflow requests to a process of their own (tracking/request_process.py): the run
holds exactly what the thread would have sent, failures keep their text and error code, and a process that dies
loses nothing. Real SQLite store, real child process."""
from __future__ import annotations

import os

import numpy as np
import pytest
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from msprobe_mlflow.config import GradProbeConfig
from msprobe_mlflow.dump import read_summary, summary_csv_path, write_step
from msprobe_mlflow.metrics import step_metrics
from msprobe_mlflow.notices import Notices
from msprobe_mlflow.records import StepRecord
from msprobe_mlflow.session import RankPolicy
from msprobe_mlflow.sinks import mlflow as sink_module
from msprobe_mlflow.sinks.mlflow import settings as sink_settings
from msprobe_mlflow.tracking.live_run import LiveRun, MetricPoint
from msprobe_mlflow.tracking.options import TrackingOptions
from msprobe_mlflow.tracking.request_process import RoundRequests


def record(step: int) -> StepRecord:
    rng = np.random.default_rng(step)
    return StepRecord(rank=0, step=step, level="L1", bounds=(-1, 0, 1), names=["w", "b"], shapes=[(3, 5), (5,)],
                      values=rng.standard_normal((2, 3)).astype(np.float32),
                      directions=np.concatenate([np.packbits(rng.random(15) > 0.5), np.packbits(rng.random(5) > 0.5)]))


def open_sink(experiment_id: str, dump) -> tuple[sink_module.MlflowSink, str]:
    run_id = MlflowClient().create_run(experiment_id).info.run_id
    config = GradProbeConfig(dump_path=str(dump), level="L1")
    return sink_module.MlflowSink(run_id, config, TrackingOptions(run_id), RankPolicy(), framework="pytorch"), run_id


def hand_in(sink: sink_module.MlflowSink, dump, steps: range) -> None:
    """Writes the steps into the local dump, hands them to the sink, and waits until their round is over."""
    for step in steps:
        write_step(dump, record(step))
        sink.handle(record(step))
    sink.flush()


def assert_run_holds_the_dump(run_id: str, dump, steps: range) -> None:
    """Every step's metrics as ``upload`` reads them from the CSV, and every step's CSV byte for byte."""
    client = MlflowClient()
    for key in step_metrics(read_summary(summary_csv_path(dump, 0, 0)), 0):
        history = {m.step: m.value for m in client.get_metric_history(run_id, key)}
        assert history == {s: step_metrics(read_summary(summary_csv_path(dump, 0, s)), 0)[key] for s in steps}
    for step in steps:
        sent = client.download_artifacts(run_id, f"grad_probe/rank0/grad_summary_{step}.csv", str(dump / "sent"))
        assert open(sent, "rb").read() == summary_csv_path(dump, 0, step).read_bytes()


@pytest.fixture
def a_cpu_to_spare(monkeypatch):
    """Whatever this machine's load: the test is about what happens once the requests move."""
    monkeypatch.setattr(sink_settings, "PROCESS_MIN_SPARE_CPUS", float("-inf"))


def test_a_round_of_several_steps_moves_the_requests_to_a_process_and_the_run_holds_every_step(
        tmp_experiment, tmp_path, monkeypatch, a_cpu_to_spare):
    monkeypatch.setattr(sink_settings, "SEND_INTERVAL_SECONDS", 600.0)  # each round is the steps before a flush()
    dump = tmp_path / "dump"
    sink, run_id = open_sink(tmp_experiment, dump)
    hand_in(sink, dump, range(sink_settings.PROCESS_MIN_ROUND_STEPS - 1))  # a round of a few steps: in the thread
    assert sink.requests.process is None
    hand_in(sink, dump, range(sink_settings.PROCESS_MIN_ROUND_STEPS - 1, 10))
    process = sink.requests.process
    assert process is not None and process.poll() is None
    sink.close()
    assert process.wait(timeout=60) == 0  # told to end, it ends by itself
    assert_run_holds_the_dump(run_id, dump, range(10))
    assert MlflowClient().get_run(run_id).data.tags["msprobe_mlflow.rank0.status"] == "finished"


def test_once_moved_the_process_reads_each_steps_metrics_from_the_dump_and_the_writer_thread_computes_none(
        tmp_experiment, tmp_path, monkeypatch, a_cpu_to_spare):
    """The writer thread shares the interpreter lock with training: where the requests run in a process of their
    own, that process reads the metrics from the step's CSV, as upload does (per-parameter ones too)."""
    monkeypatch.setattr(sink_settings, "SEND_INTERVAL_SECONDS", 600.0)
    dump = tmp_path / "dump"
    run_id = MlflowClient().create_run(tmp_experiment).info.run_id
    sink = sink_module.MlflowSink(run_id, GradProbeConfig(dump_path=str(dump), level="L1"),
                                  TrackingOptions(run_id, param_metrics=("w",)), RankPolicy(), framework="pytorch")
    moved = 2 * sink_settings.PROCESS_MIN_ROUND_STEPS
    hand_in(sink, dump, range(1))  # the first round: one step
    hand_in(sink, dump, range(1, moved))  # a round of several: the requests move
    assert sink.requests.process is not None

    def not_here(*_):
        raise AssertionError("a step's metrics were computed on the writer thread")
    monkeypatch.setattr(sink_module, "record_metrics", not_here)
    hand_in(sink, dump, range(moved, 10))
    sink.close()
    assert_run_holds_the_dump(run_id, dump, range(10))
    history = MlflowClient().get_metric_history(run_id, "grad/rank0/param/w/norm")
    read_norm = {s: read_summary(summary_csv_path(dump, 0, s)).numbers("norm")[0] for s in range(10)}
    assert {m.step: m.value for m in history} == read_norm


def test_without_an_idle_cpu_the_requests_stay_on_the_thread(tmp_experiment, tmp_path, monkeypatch):
    """A process of its own would compete with training for a CPU: it starts only where one is idle."""
    monkeypatch.setattr(sink_settings, "SEND_INTERVAL_SECONDS", 600.0)
    monkeypatch.setattr(sink_settings, "PROCESS_MIN_SPARE_CPUS", float(len(os.sched_getaffinity(0)) + 1))
    dump = tmp_path / "dump"
    sink, run_id = open_sink(tmp_experiment, dump)
    hand_in(sink, dump, range(10))
    assert sink.requests.process is None
    sink.close()
    assert not sink.requests.used_process
    assert_run_holds_the_dump(run_id, dump, range(10))


def test_a_request_process_that_dies_loses_nothing_and_says_so_once(tmp_experiment, tmp_path, monkeypatch,
                                                                    a_cpu_to_spare):
    monkeypatch.setattr(sink_settings, "SEND_INTERVAL_SECONDS", 600.0)
    monkeypatch.setattr(sink_settings, "PROCESS_MIN_ROUND_STEPS", 1)
    dump = tmp_path / "dump"
    sink, run_id = open_sink(tmp_experiment, dump)
    hand_in(sink, dump, range(3))
    process = sink.requests.process
    process.kill()
    process.wait(timeout=60)
    with pytest.warns(UserWarning) as told:
        hand_in(sink, dump, range(3, 6))  # the round's first request finds it dead: the thread makes them
        assert sink.unsent.steps == set()  # none left for stop() to send
        sink.close()
    messages = [str(w.message) for w in told]
    assert sum("the MLflow request process ended" in m for m in messages) == 1 and len(messages) == 1, messages
    assert sink.requests.process is None
    assert_run_holds_the_dump(run_id, dump, range(6))
    assert MlflowClient().get_run(run_id).data.tags["msprobe_mlflow.rank0.status"] == "finished"


def test_a_request_failing_in_the_process_raises_what_it_raises_in_the_thread(sqlite_store):
    """Same text, same MLflow error code (what tells refused credentials apart), though exceptions need not pickle."""
    no_such_run = LiveRun("0" * 32, sqlite_store[0])
    point = [MetricPoint("grad/rank0/total_norm", 1.0, 0, 0)]
    with pytest.raises(MlflowException) as in_thread:
        RoundRequests(no_such_run, Notices()).log(point)
    remote = RoundRequests(no_such_run, Notices())
    remote.move_to_process()
    try:
        with pytest.raises(MlflowException) as in_process:
            remote.log(point)
    finally:
        remote.close()
    assert in_process.value.error_code == in_thread.value.error_code != "INTERNAL_ERROR"
    assert str(in_process.value) == str(in_thread.value)


def test_the_last_round_at_stop_is_sent_from_the_thread_without_starting_a_process(tmp_experiment, tmp_path,
                                                                                  monkeypatch):
    """A short training's steps all wait for stop(): starting the process then would only delay the end."""
    monkeypatch.setattr(sink_settings, "SEND_INTERVAL_SECONDS", 600.0)
    dump = tmp_path / "dump"
    sink, run_id = open_sink(tmp_experiment, dump)
    hand_in(sink, dump, range(1))  # a round of one step; the next waits 600 s, or for stop()
    for step in range(1, 10):
        write_step(dump, record(step))
        sink.handle(record(step))
    sink.close()  # one round of 9 steps
    assert not sink.requests.used_process
    assert_run_holds_the_dump(run_id, dump, range(10))


def test_a_step_the_local_dump_could_not_write_still_has_its_metrics_logged_with_its_round(
        tmp_experiment, tmp_path, monkeypatch, a_cpu_to_spare):
    """A step whose CSV is not on disk (the local dump failed on it: a full disk) has its metrics computed from its
    record, as before the process read them from the dump: one such step must not keep its round's metrics from the
    run (its files, missing, are left unsent and said so)."""
    monkeypatch.setattr(sink_settings, "SEND_INTERVAL_SECONDS", 600.0)
    dump = tmp_path / "dump"
    sink, run_id = open_sink(tmp_experiment, dump)
    moved = 2 * sink_settings.PROCESS_MIN_ROUND_STEPS
    hand_in(sink, dump, range(1))
    hand_in(sink, dump, range(1, moved))
    assert sink.requests.process is not None
    for step in range(moved, moved + 4):
        if step != moved + 1:  # the local dump wrote every step of the round but this one
            write_step(dump, record(step))
        sink.handle(record(step))
    with pytest.warns(UserWarning):
        sink.flush()
    expected = {s: step_metrics(read_summary(summary_csv_path(dump, 0, s)), 0)["grad/rank0/total_norm"]
                for s in range(moved + 4) if s != moved + 1}
    write_step(tmp_path / "elsewhere", record(moved + 1))  # what the dump would have held: the record's own numbers
    expected[moved + 1] = step_metrics(read_summary(summary_csv_path(tmp_path / "elsewhere", 0, moved + 1)),
                                       0)["grad/rank0/total_norm"]
    history = MlflowClient().get_metric_history(run_id, "grad/rank0/total_norm")
    assert {m.step: m.value for m in history} == expected
    sink.close()
