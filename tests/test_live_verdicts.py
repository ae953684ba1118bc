"""The live verdict (``baseline=``) on real torch and a real MLflow store: it says while training what
``msprobe-mlflow compare`` says afterwards, fires ``on_suspicious`` once, and never stops training."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import mlflow
import numpy as np
import pytest
import torch
from mlflow.tracking import MlflowClient

import msprobe_mlflow
from msprobe_mlflow import GradProbeConfig, compare_dumps, compare_runs
from msprobe_mlflow.compare.step import StepComparison, StepLayout
from msprobe_mlflow.compare.verdict import culprit_text
from msprobe_mlflow.directions import read_step_directions
from msprobe_mlflow.dump import findings_dir, read_csv, step_dir, summary_steps
from msprobe_mlflow.pytorch import GradientMonitor
from msprobe_mlflow.sinks.baseline_process import BaselineSink
from mlflow_server import MlflowServer
from mlflow_stores import sqlite_uri
from test_damaged_dumps import flip_a_byte
from tiny_models import fixed, mlp, sgd, total, train

PERTURBED_FROM = 4
STEPS = 8


def small_model() -> torch.nn.Module:
    return mlp(6, 32, 16, 3)


def batches(perturbation: str | None = None):
    """The fixed data stream (targets: the sine of the inputs' first 3 columns); with ``perturbation="data"``, other
    inputs from step ``PERTURBED_FROM`` on."""
    other_data = torch.Generator().manual_seed(2)

    def data(step, generator):
        x = torch.randn(16, 6, generator=generator)
        if perturbation == "data" and step >= PERTURBED_FROM:
            x = torch.randn(16, 6, generator=other_data)
        return x, torch.sin(x[:, :3])
    return data


def training_loop(model, optimizer=None, steps: int = STEPS, perturbation: str | None = None, monitor=None) -> None:
    """Trains ``model`` (SGD at 0.05 unless ``optimizer`` is given) on the fixed data stream; ``perturbation``
    changes the run from step ``PERTURBED_FROM`` on: ``data`` (other inputs), ``learning_rate`` (the update before
    that step is 20 times larger, so the weights, and the gradients, differ from that step), ``parameter`` (one
    weight matrix corrupted just before that step)."""
    def perturb(step, model, optimizer):
        if perturbation == "parameter" and step == PERTURBED_FROM:
            with torch.no_grad():
                model[2].weight.mul_(-1.0)
        optimizer.param_groups[0]["lr"] = 1.0 if perturbation == "learning_rate" and step == PERTURBED_FROM - 1 \
            else 0.05

    train(model, steps, optimizer=optimizer or sgd(0.05), monitor=monitor, data=batches(perturbation),
          before_step=perturb)


def monitored_training(dump: Path, *, steps: int = STEPS, perturbation: str | None = None, param_list=(),
                       level: str = "L1", bounds=(-1, 0, 1), **options) -> GradientMonitor:
    """Trains the small model (:func:`training_loop`) under a monitor with ``options``; returns the monitor, to
    stop."""
    config = GradProbeConfig(dump_path=str(dump), level=level, param_list=param_list, bounds=bounds)
    monitor = GradientMonitor(config, **options)
    training_loop(small_model(), steps=steps, perturbation=perturbation, monitor=monitor)
    return monitor


def run_training(dump: Path, **options) -> tuple[str, GradientMonitor]:
    with mlflow.start_run() as run:
        monitor = monitored_training(dump, **options)
        monitor.stop()
    return run.info.run_id, monitor


def findings(dump: Path) -> dict:
    return json.loads((findings_dir(dump, 0) / "verdict.json").read_text())


def summary_history(run_id: str) -> list[tuple[int, float]]:
    history = MlflowClient().get_metric_history(run_id, "summary_similarity/rank0")
    return sorted((m.step, m.value) for m in history)


def test_a_deterministic_rerun_has_similarity_one_at_every_step_and_no_verdict(tmp_experiment, tmp_path):
    baseline_run, _ = run_training(tmp_path / "baseline")
    calls = []
    run_id, monitor = run_training(tmp_path / "rerun", baseline=baseline_run, on_suspicious=calls.append)
    assert monitor.errors == [] and calls == []
    assert summary_history(run_id) == [(step, 1.0) for step in range(STEPS)]
    tags = MlflowClient().get_run(run_id).data.tags
    assert tags["msprobe_mlflow.live_verdict"] == "consistent"
    assert tags["msprobe_mlflow.baseline"] == baseline_run
    assert "msprobe_mlflow.first_suspicious_step" not in tags
    assert tags["mlflow.note.content"].startswith(
        f"msprobe-mlflow live verdict: no suspicious step in {STEPS} compared step(s) against baseline "
        f"[{baseline_run}](#/runs/{baseline_run})")  # the baseline run linked, as the comparison run links its sources
    assert findings(tmp_path / "rerun")["compared_steps"] == list(range(STEPS))
    for step in range(STEPS):
        rows = read_csv(findings_dir(tmp_path / "rerun", 0) / f"similarities_{step}.csv")
        assert rows[0] == ["param_name", "similarity"] and rows[-1] == ["summary", "1.0"]
        assert [row[0] for row in rows[1:-1]] == ["0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"]


@pytest.mark.parametrize("perturbation", ["data", "learning_rate", "parameter"])
def test_a_perturbation_is_named_at_its_step_while_training_as_compare_names_it_afterwards(
        tmp_experiment, tmp_path, perturbation):
    baseline_run, _ = run_training(tmp_path / "baseline")
    calls, stopped = [], threading.Event()
    with mlflow.start_run() as run:
        with pytest.warns(UserWarning, match=rf"rank 0: step {PERTURBED_FROM} is suspicious against baseline"):
            monitor = monitored_training(tmp_path / "candidate", perturbation=perturbation, baseline=baseline_run,
                                         on_suspicious=lambda verdict: calls.append((verdict, stopped.is_set())))
            monitor.flush()  # every step judged, while the run is still training
            stopped.set()
            monitor.stop()
    [(live, after_stop)] = calls
    assert not after_stop and monitor.errors == []
    afterwards = compare_runs(baseline_run, run.info.run_id)
    assert afterwards.verdict.first_suspicious_step == PERTURBED_FROM
    assert live == afterwards.verdict.ranks[0]  # same step, same summary trip, same parameters in the same order
    assert live.grade == "break"  # the runs agreed bit for bit until the perturbation
    tags = MlflowClient().get_run(run.info.run_id).data.tags
    assert tags["msprobe_mlflow.live_verdict"] == "suspicious"
    assert tags["msprobe_mlflow.first_suspicious_step"] == str(PERTURBED_FROM)
    assert tags["msprobe_mlflow.suspicious_parameters"] == ", ".join(
        culprit_text(t) for t in afterwards.verdict.ranks[0].parameter_trips)
    assert tags["mlflow.note.content"].startswith(
        f"msprobe-mlflow live verdict: suspicious from step {PERTURBED_FROM}, a break against baseline "
        f"[{baseline_run}](#/runs/{baseline_run})")
    live_summary = dict(summary_history(run.info.run_id))
    assert [live_summary[s] for s in afterwards.comparison.ranks[0].steps] == afterwards.comparison.ranks[0].summary
    saved = findings(tmp_path / "candidate")["verdict"]
    assert saved == afterwards.verdict.to_dict()
    artifacts = {a.path for a in MlflowClient().list_artifacts(run.info.run_id, "grad_probe/rank0/findings")}
    assert "grad_probe/rank0/findings/verdict.json" in artifacts
    assert f"grad_probe/rank0/findings/similarities_{STEPS - 1}.csv" in artifacts


def test_a_break_at_the_last_step_is_told_when_training_ends_as_compare_names_it(tmp_experiment, tmp_path):
    """A weight corrupted before the last step moves norms by more than rounding can: no step after it confirms or
    grades it, so the verdict comes when training ends, the same as ``compare``'s afterwards."""
    baseline_run, _ = run_training(tmp_path / "baseline")
    calls = []
    with mlflow.start_run() as run:
        with pytest.warns(UserWarning, match=rf"rank 0: step {PERTURBED_FROM} is suspicious against baseline"):
            monitor = monitored_training(tmp_path / "candidate", steps=PERTURBED_FROM + 1, perturbation="parameter",
                                         baseline=baseline_run, on_suspicious=calls.append)
            monitor.flush()
            assert calls == []  # every step judged; the last one held for a step that never comes
            monitor.stop()
    [live] = calls
    afterwards = compare_runs(baseline_run, run.info.run_id)
    assert live.first_suspicious_step == PERTURBED_FROM and live == afterwards.verdict.ranks[0]
    assert MlflowClient().get_run(run.info.run_id).data.tags["msprobe_mlflow.live_verdict"] == "suspicious"
    assert findings(tmp_path / "candidate")["verdict"] == afterwards.verdict.to_dict()


def test_monitor_returns_with_the_baseline_open_so_a_fast_loop_gets_the_first_verdict_before_its_next_step(
        tmp_path):
    """The comparison process opens the baseline run (importing MLflow, reading the store) and makes its first step
    local before ``monitor()`` returns: the store is moved away as soon as it returns, and every step is still
    compared. The loop waits (60 s at most) for ``on_suspicious`` before the step after the diverging one, as a
    loop that stops at the verdict would; it used to find a process that had not yet opened the baseline."""
    store = sqlite_uri(tmp_path, "baseline.db")
    client = MlflowClient(store)
    experiment = client.create_experiment("baseline", artifact_location=(tmp_path / "artifacts").as_uri())
    baseline_run = client.create_run(experiment).info.run_id
    monitored_training(tmp_path / "baseline", run_id=baseline_run, tracking_uri=store).stop()
    suspicious = threading.Event()
    model = small_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    config = GradProbeConfig(dump_path=str(tmp_path / "candidate"), level="L1")
    monitor = GradientMonitor(config, log_to_mlflow=False, baseline=baseline_run, tracking_uri=store, rule="msprobe",
                              on_suspicious=lambda verdict: suspicious.set())

    def wait_for_the_verdict(step, *_):
        if step == PERTURBED_FROM + 1:
            assert suspicious.wait(60), "no verdict on the diverging step before the next step"

    with pytest.warns(UserWarning, match=f"step {PERTURBED_FROM} is suspicious"):
        monitor.monitor(model, optimizer)
        (tmp_path / "baseline.db").rename(tmp_path / "moved.db")
        train(model, STEPS, optimizer=optimizer, data=batches("data"), before_step=wait_for_the_verdict)
        monitor.stop()
    saved = findings(tmp_path / "candidate")
    assert saved["compared_steps"] == list(range(STEPS)) and saved["steps_not_compared"] == {}
    assert saved["verdict"]["ranks"][0]["first_suspicious_step"] == PERTURBED_FROM


def test_a_comparison_process_that_is_not_ready_in_time_is_said_and_training_starts(tmp_path, monkeypatch):
    """A stand-in interpreter that reads its input and never answers: ``monitor()`` waits its time, warns once,
    and the training and its dump go on."""
    from msprobe_mlflow.sinks import baseline_process

    monitored_training(tmp_path / "baseline", steps=2, log_to_mlflow=False).stop()
    silent = tmp_path / "silent-python"
    silent.write_text("#!/bin/sh\nexec cat > /dev/null\n")
    silent.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(silent))
    monkeypatch.setattr(baseline_process, "READY_WAIT_SECONDS", 0.5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        monitor = monitored_training(tmp_path / "candidate", steps=2, log_to_mlflow=False,
                                     baseline=str(tmp_path / "baseline"))
        monitor.stop()
    messages = [str(w.message) for w in caught if "msprobe-mlflow" in str(w.message)]
    assert any("the live comparison is not ready after 0.5 s (opening baseline " in m for m in messages), messages
    assert monitor.errors == []
    assert summary_steps(tmp_path / "candidate" / "rank0") == [0, 1]


def test_autolog_takes_the_baseline_and_the_callback(tmp_experiment, tmp_path):
    dumps = str(tmp_path / "dumps")
    msprobe_mlflow.autolog(dump_path=dumps)
    try:
        with mlflow.start_run() as baseline_run:
            training_loop(small_model(), None)
        calls = []
        msprobe_mlflow.autolog(dump_path=dumps, baseline=baseline_run.info.run_id, on_suspicious=calls.append)
        with pytest.warns(UserWarning, match=f"step {PERTURBED_FROM} is suspicious"):
            with mlflow.start_run() as run:
                training_loop(small_model(), None, perturbation="data")
    finally:
        msprobe_mlflow.autolog(disable=True)
    assert [verdict.first_suspicious_step for verdict in calls] == [PERTURBED_FROM]
    assert MlflowClient().get_run(run.info.run_id).data.tags["msprobe_mlflow.first_suspicious_step"] == "4"
    with pytest.raises(ValueError, match="on_suspicious is given without baseline="):
        msprobe_mlflow.autolog(on_suspicious=print)
    msprobe_mlflow.autolog(disable=True)


def test_steps_and_parameters_the_baseline_lacks_are_reported_once_and_the_rest_compared(tmp_path):
    names = ["0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"]
    monitored_training(tmp_path / "baseline", steps=5, param_list=names[:-1], log_to_mlflow=False).stop()  # no 4.bias
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        monitor = monitored_training(tmp_path / "candidate", log_to_mlflow=False, baseline=str(tmp_path / "baseline"))
        monitor.stop()
    messages = [str(w.message) for w in caught if "msprobe-mlflow" in str(w.message)]
    assert len(messages) == 2, messages
    assert "rank 0: parameters not compared with the baseline from step 0 (not in the baseline): 4.bias" in messages[0]
    assert "rank 0: step 5 not compared with the baseline: not in the baseline" in messages[1]
    saved = findings(tmp_path / "candidate")
    assert saved["compared_steps"] == [0, 1, 2, 3, 4]
    assert saved["steps_not_compared"] == {"not in the baseline": [5, 6, 7]}
    assert saved["parameters_not_compared"]["not in the baseline"] == ["4.bias"]
    assert saved["verdict"]["suspicious"] is False
    rows = read_csv(findings_dir(tmp_path / "candidate", 0) / "similarities_4.csv")
    assert rows[1:] == [[name, "1.0"] for name in names[:-1]] + [["4.bias", ""], ["summary", "1.0"]]
    assert summary_steps(tmp_path / "candidate" / "rank0") == list(range(STEPS))  # the dump is complete


def test_l2_distributions_over_other_bounds_than_the_baselines_are_said_once_not_compared(tmp_path):
    monitored_training(tmp_path / "baseline", steps=3, level="L2", log_to_mlflow=False).stop()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        monitored_training(tmp_path / "candidate", steps=3, level="L2", bounds=(-2, 0, 2), log_to_mlflow=False,
                           baseline=str(tmp_path / "baseline")).stop()
    messages = [str(w.message) for w in caught if "L2 distributions" in str(w.message)]
    assert len(messages) == 1, messages
    assert "not compared with the baseline: they were counted over other bounds (baseline (-inf, -1], (-1, 0], " \
           "(0, 1], (1, inf); this run (-inf, -2], (-2, 0], (0, 2], (2, inf))" in messages[0]


def test_a_damaged_baseline_step_is_skipped_with_a_warning_naming_the_file(tmp_path):
    monitored_training(tmp_path / "baseline", log_to_mlflow=False).stop()
    damaged = step_dir(tmp_path / "baseline", 0, 2) / "directions.npz"
    damaged.write_bytes(b"not an archive")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        monitor = monitored_training(tmp_path / "candidate", log_to_mlflow=False, baseline=str(tmp_path / "baseline"))
        monitor.stop()
    [warning] = [str(w.message) for w in caught if "msprobe-mlflow" in str(w.message)]
    assert f"step 2 not compared with the baseline: the step cannot be read ({damaged}" in warning
    saved = findings(tmp_path / "candidate")
    assert saved["compared_steps"] == [0, 1, 3, 4, 5, 6, 7] and saved["verdict"]["suspicious"] is False


def test_a_baseline_step_with_one_flipped_byte_is_skipped_by_its_crc_not_compared(tmp_path):
    """The zip stays whole: only the CRC-32 the archive records tells, read on the live verdict's fast path."""
    monitored_training(tmp_path / "baseline", log_to_mlflow=False).stop()
    damaged = flip_a_byte(step_dir(tmp_path / "baseline", 0, 2) / "directions.npz")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        monitored_training(tmp_path / "candidate", log_to_mlflow=False, baseline=str(tmp_path / "baseline")).stop()
    [warning] = [str(w.message) for w in caught if "msprobe-mlflow" in str(w.message)]
    assert f"step 2 not compared with the baseline: the step cannot be read ({damaged}: field bits fails its " \
           f"CRC-32 check" in warning
    assert findings(tmp_path / "candidate")["compared_steps"] == [0, 1, 3, 4, 5, 6, 7]


def test_an_l0_baseline_gets_one_clear_warning_and_training_goes_on(tmp_path):
    config = GradProbeConfig(dump_path=str(tmp_path / "l0"), level="L0")
    with GradientMonitor(config, log_to_mlflow=False) as l0_monitor:
        train(small_model(), 2, optimizer=sgd(0.05), monitor=l0_monitor, data=fixed(torch.ones(2, 6)), loss=total)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        monitor = monitored_training(tmp_path / "candidate", log_to_mlflow=False, baseline=str(tmp_path / "l0"))
        monitor.stop()
    [warning] = [str(w.message) for w in caught if "msprobe-mlflow" in str(w.message)]
    assert "grad_level L0 dump, which records no gradient directions" in warning
    assert "Training goes on" in warning
    assert monitor.errors == []
    assert summary_steps(tmp_path / "candidate" / "rank0") == list(range(STEPS))
    assert sum(findings(tmp_path / "candidate")["steps_not_compared"].values(), []) == list(range(STEPS))


def live_comparison(monitor: GradientMonitor):
    [sink] = [sink for sink in monitor._session.sinks if isinstance(sink, BaselineSink)]
    return sink


def test_the_writer_hands_steps_over_without_waiting_for_a_paused_comparison(tmp_path):
    """The comparison process is paused until every step reached a sink placed after the live verdict: the writer
    never waited for the comparison, which then compares every step from the local dump."""
    monitored_training(tmp_path / "baseline", steps=20, log_to_mlflow=False).stop()
    all_written = threading.Event()
    last = type("LastSink", (), {"handle": lambda self, r: r.step == 19 and all_written.set(),
                                 "flush": lambda self: None, "close": lambda self: None})()
    model = small_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    config = GradProbeConfig(dump_path=str(tmp_path / "candidate"), level="L1")
    monitor = GradientMonitor(config, log_to_mlflow=False, baseline=str(tmp_path / "baseline"), sinks=[last])
    monitor.monitor(model, optimizer)
    process = live_comparison(monitor).process
    os.kill(process.pid, signal.SIGSTOP)
    try:
        training_loop(model, optimizer, steps=20, perturbation="data")
        assert all_written.wait(60), "step 19 never reached the sink after the live verdict"
    finally:
        os.kill(process.pid, signal.SIGCONT)
    with pytest.warns(UserWarning, match=f"step {PERTURBED_FROM} is suspicious"):
        monitor.stop()
    expected = compare_dumps(tmp_path / "baseline", tmp_path / "candidate", None)
    saved = findings(tmp_path / "candidate")
    assert saved["compared_steps"] == list(range(20))
    assert saved["verdict"] == expected.verdict.to_dict()
    for step in (0, 19):
        rows = read_csv(findings_dir(tmp_path / "candidate", 0) / f"similarities_{step}.csv")
        assert float(rows[-1][1]) == expected.ranks[0].summary[step]


def test_a_comparison_process_killed_mid_run_costs_one_warning_and_the_run_says_incomplete(tmp_experiment,
                                                                                            tmp_path):
    baseline_run, _ = run_training(tmp_path / "baseline")
    model = small_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    config = GradProbeConfig(dump_path=str(tmp_path / "candidate"), level="L1")
    with mlflow.start_run() as run, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        monitor = GradientMonitor(config, baseline=baseline_run).monitor(model, optimizer)
        training_loop(model, optimizer, steps=3)
        monitor.flush()
        sink = live_comparison(monitor)
        sink.process.kill()
        assert sink._ended.wait(60), "the sink never saw the process end"  # its warning is given before this
        training_loop(model, optimizer, steps=3)
        monitor.stop()
    messages = [str(w.message) for w in caught if "msprobe-mlflow" in str(w.message)]
    assert any(f"the live comparison process ended unexpectedly (exit code {-signal.SIGKILL})" in m
               for m in messages), messages
    assert len(messages) == 1, messages
    assert monitor.errors == []
    assert summary_history(run.info.run_id) == [(0, 1.0), (1, 1.0), (2, 1.0)]
    tags = MlflowClient().get_run(run.info.run_id).data.tags
    assert tags["msprobe_mlflow.live_verdict"] == "incomplete"
    assert "the live comparison process ended unexpectedly (exit code -9), 3 step(s) not compared" in tags[
        "mlflow.note.content"]
    assert summary_steps(tmp_path / "candidate" / "rank0") == list(range(6))  # the dump is complete


def test_a_comparison_process_that_cannot_start_costs_one_warning_and_training_goes_on(tmp_path, monkeypatch):
    monitored_training(tmp_path / "baseline", log_to_mlflow=False).stop()
    monkeypatch.setattr(sys, "executable", str(tmp_path / "no-python"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        monitor = monitored_training(tmp_path / "candidate", log_to_mlflow=False, baseline=str(tmp_path / "baseline"))
        monitor.stop()
    messages = [str(w.message) for w in caught if "msprobe-mlflow" in str(w.message)]
    assert len(messages) == 1 and "the live comparison process could not start" in messages[0], messages
    assert str(tmp_path / "no-python") in messages[0]
    assert monitor.errors == []
    assert summary_steps(tmp_path / "candidate" / "rank0") == list(range(STEPS))  # the dump is complete


def test_the_comparison_process_ends_when_the_training_process_is_killed(tmp_path):
    """No process is left behind by a training that dies without stop(): the comparison's input closes."""
    monitored_training(tmp_path / "baseline", steps=2, log_to_mlflow=False).stop()
    script = tmp_path / "killed.py"
    script.write_text(f"""
import os, signal, sys, torch
sys.path[:0] = [{str(Path(__file__).parent)!r}, {str(Path(__file__).parent.parent)!r}]
from test_live_verdicts import live_comparison, monitored_training
monitor = monitored_training({str(tmp_path / "candidate")!r}, steps=2, log_to_mlflow=False,
                             baseline={str(tmp_path / "baseline")!r})
monitor.flush()
print(live_comparison(monitor).process.pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
""")
    training = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert training.returncode == -signal.SIGKILL, training.stderr
    comparison_pid = int(training.stdout.split()[-1])
    deadline = time.monotonic() + 60
    while process_runs(comparison_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not process_runs(comparison_pid)


def process_runs(pid: int) -> bool:
    try:
        return "\tZ" not in Path(f"/proc/{pid}/status").read_text().split("State:")[1].split("\n")[0]
    except FileNotFoundError:
        return False


def test_a_comparison_that_fails_at_every_step_is_logged_warned_and_training_goes_on(tmp_path, caplog):
    """The findings folder is a file: writing each step's similarities fails for real, in the comparison process."""
    monitored_training(tmp_path / "baseline", log_to_mlflow=False).stop()
    (tmp_path / "candidate" / "rank0").mkdir(parents=True)
    (tmp_path / "candidate" / "rank0" / "findings").write_text("not a folder")
    with warnings.catch_warnings(record=True) as caught, caplog.at_level("WARNING", logger="msprobe_mlflow"):
        warnings.simplefilter("always")
        monitor = monitored_training(tmp_path / "candidate", log_to_mlflow=False, baseline=str(tmp_path / "baseline"))
        monitor.stop()
    messages = [str(w.message) for w in caught if "msprobe-mlflow" in str(w.message)]
    findings = tmp_path / "candidate" / "rank0" / "findings"
    assert any(f"the live comparison failed {STEPS} time(s); first: step 0: FileExistsError: " in m
               and str(findings) in m for m in messages), messages
    assert any("the live comparison could not finish its findings (FileExistsError: " in m and str(findings) in m
               for m in messages), messages
    assert len(messages) == 2, messages  # the process closed as asked: no "ended unexpectedly"
    logged = [r.getMessage() for r in caplog.records if "the live comparison of step" in r.getMessage()]
    assert len(logged) == STEPS and all("Traceback" in m for m in logged)
    assert monitor.errors == []
    assert summary_steps(tmp_path / "candidate" / "rank0") == list(range(STEPS))  # the dump is complete


def test_bad_options_are_refused_before_training(tmp_path):
    config = GradProbeConfig(dump_path=str(tmp_path), level="L1")
    with pytest.raises(ValueError, match=r"baseline = '\./no/such/dump': no such folder; expected a grad_probe dump"):
        GradientMonitor(config, baseline="./no/such/dump")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"baseline = '.*empty' holds no rank<N> folders; expected a grad_probe"):
        GradientMonitor(config, baseline=str(tmp_path / "empty"))
    with pytest.raises(ValueError, match=r"on_suspicious is given without baseline="):
        GradientMonitor(config, on_suspicious=print)
    with pytest.raises(ValueError, match=r"on_suspicious = 3 is not accepted"):
        GradientMonitor(config, baseline="some-run-id", on_suspicious=3)
    with pytest.raises(ValueError, match=r"first_threshold = 1.5 is not accepted; expected a number between 0 and 1"):
        GradientMonitor(config, baseline="some-run-id", first_threshold=1.5)
    with pytest.raises(ValueError, match=r"needs gradient directions, which grad_probe.grad_level 'L0'"):
        GradientMonitor(config.replace(level="L0"), baseline="some-run-id")


@pytest.mark.server
def test_a_baseline_server_that_dies_mid_run_degrades_to_one_warning_and_the_dump_stays_complete(tmp_path,
                                                                                                  monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the downloaded baseline steps
    server = MlflowServer(tmp_path / "server").start()
    try:
        client = MlflowClient(server.uri)
        baseline_run = client.create_run(client.create_experiment("baseline")).info.run_id
        monitored_training(tmp_path / "baseline", steps=12, run_id=baseline_run, tracking_uri=server.uri).stop()
        model = small_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        monitor = GradientMonitor(GradProbeConfig(dump_path=str(tmp_path / "candidate"), level="L1"),
                                  log_to_mlflow=False, baseline=baseline_run, tracking_uri=server.uri)
        monitor.monitor(model, optimizer)
        data = torch.Generator().manual_seed(1)  # one stream over both calls: the baseline's 12 steps
        train(model, 3, optimizer=optimizer, data=batches(), seed=data)
        monitor.flush()  # steps 0-2 compared against the downloaded baseline
        server.stop()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            train(model, 9, optimizer=optimizer, data=batches(), seed=data)
            monitor.stop()
    finally:
        server.stop()
    [warning] = [str(w.message) for w in caught if "msprobe-mlflow" in str(w.message)]
    assert f"not compared with the baseline: baseline {baseline_run} could not be read at step" in warning
    assert monitor.errors == []
    saved = findings(tmp_path / "candidate")
    compared, skipped = saved["compared_steps"], sum(saved["steps_not_compared"].values(), [])
    assert compared[:3] == [0, 1, 2] and skipped and sorted(compared + skipped) == list(range(12))
    assert saved["verdict"]["suspicious"] is False  # the same data: what was compared agrees
    for step in range(12):  # the local dump is complete
        directions = read_step_directions(step_dir(tmp_path / "candidate", 0, step))
        assert list(directions) == ["0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"]
    assert np.array_equal(*(read_step_directions(step_dir(tmp_path / side, 0, 11))["0.weight"][1]
                            for side in ("baseline", "candidate")))


def test_the_similarities_file_joined_from_name_cells_is_what_the_csv_writer_writes():
    """Names a CSV must quote (a comma, a quote, a line break), one not compared, an empty parameter."""
    import csv
    import io

    names = ["plain.weight", "with,comma", 'with"quote', "line\nbreak", "ünïcode", "empty"]
    layout = StepLayout(names, [(3,), (2, 2), (5,), (1,), (7,), (0,)])
    agreeing, numels = np.array([1, 4, 2, 1, 6, 0]), np.array([3, 4, 5, 1, 7, 0])

    def written_by_csv(rows):
        out = io.StringIO()
        csv.writer(out).writerows([["param_name", "similarity"], *rows])
        return out.getvalue().encode("utf-8-sig")

    every = StepComparison(0, tuple(names), tuple(names), agreeing, numels)
    expected = [[n, a / m if m else 0.0] for n, a, m in zip(names, agreeing.tolist(), numels.tolist())]
    assert every.csv_text(layout) == written_by_csv(expected + [["summary", 14 / 20]])
    some = StepComparison(0, tuple(names[:2]), tuple(names[:2]), agreeing[:2], numels[:2])
    partial = [[n, v if i < 2 else ""] for i, (n, v) in enumerate(expected)]
    assert some.csv_text(layout) == written_by_csv(partial + [["summary", 5 / 7]])
