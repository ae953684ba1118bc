"""``trace_steps`` on the PyTorch monitor: the traced step's forward and backward (not the optimizer's update, not
the probe) in the dump folder and the MLflow run, the environment variable and msprobe's config.json, training
untouched, and ``locate`` on two monitored trainings."""
import json
import threading

import mlflow
import pytest
import torch
from mlflow import MlflowClient

import msprobe_mlflow
from msprobe_mlflow.config import GradProbeConfig
from msprobe_mlflow.localization import OPERATOR, locate_traces as locate
from msprobe_mlflow.pytorch import GradientMonitor
from msprobe_mlflow.trace.files import read_trace, trace_folder
from msprobe_mlflow.trace.options import TRACE_STEPS_VARIABLE
from tests.tiny_transformer import FaultyKernel, train, train_monitored

STEPS = 4


def monitored(dump, fault: FaultyKernel | None = None, **options):
    """Trains ``STEPS`` steps under a monitor; returns the monitor. ``fault`` is armed at step 2."""
    monitor = GradientMonitor(GradProbeConfig(dump_path=str(dump), level="L1"), **options)
    train_monitored(monitor, STEPS, fault, fault_steps={2})
    monitor.stop()
    assert monitor.errors == []
    return monitor


def test_the_traced_step_is_in_the_dump_folder_and_the_run(tmp_experiment, tmp_path):
    with mlflow.start_run() as run:
        monitored(tmp_path / "dump", trace_steps=[2])
    root = tmp_path / "dump" / "rank0" / "trace"
    assert sorted(p.name for p in root.iterdir()) == ["step2"]
    calls = read_trace(trace_folder(tmp_path / "dump", step=2)).calls
    names = [c.name for c in calls]
    assert "Aten.gelu.default.1.forward" in names and "Aten.gelu_backward.default.1.backward" in names
    assert names[-1].endswith(".backward")  # the step ends with the backward: no optimizer update, no probe
    assert not any("addcdiv" in n or "_foreach" in n or "aminmax" in n for n in names)
    client = MlflowClient()
    artifacts = [a.path for a in client.list_artifacts(run.info.run_id, "grad_probe/rank0/trace/step2/rank0")]
    assert sorted(artifacts) == [f"grad_probe/rank0/trace/step2/rank0/{f}" for f in
                                 ("construct.json", "dump.json", "stack.json")]
    assert client.get_run(run.info.run_id).data.tags["msprobe_mlflow.traced_steps"] == "2"


def test_tracing_changes_nothing_the_training_computes(tmp_path):
    monitored(tmp_path / "plain", log_to_mlflow=False)
    monitored(tmp_path / "traced", log_to_mlflow=False, trace_steps=[0, 2])
    for step in range(STEPS):
        name = f"rank0/grad_summary_{step}.csv"
        assert (tmp_path / "plain" / name).read_bytes() == (tmp_path / "traced" / name).read_bytes()


def test_the_environment_variable_traces_an_unchanged_script(tmp_path, monkeypatch):
    monkeypatch.setenv(TRACE_STEPS_VARIABLE, "1,3")
    monitored(tmp_path / "dump", log_to_mlflow=False)
    assert sorted(p.name for p in (tmp_path / "dump" / "rank0" / "trace").iterdir()) == ["step1", "step3"]
    monkeypatch.setenv(TRACE_STEPS_VARIABLE, "one")
    with pytest.raises(ValueError, match=f"{TRACE_STEPS_VARIABLE}='one' is not accepted; expected steps such as"):
        monitored(tmp_path / "bad", log_to_mlflow=False)


def test_msprobe_config_json_is_taken_as_it_is(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"task": "statistics", "dump_path": "ignored", "step": [1], "level": "L1",
                                  "statistics": {"scope": [], "list": ["gelu"], "data_mode": ["all"]}}))
    monitored(tmp_path / "dump", log_to_mlflow=False, trace_config=str(config))
    calls = read_trace(trace_folder(tmp_path / "dump", step=1)).calls
    assert calls and {c.operator for c in calls} == {"Aten.gelu.default", "Aten.gelu_backward.default"}
    config.write_text(json.dumps({"task": "tensor", "step": [1]}))
    with pytest.raises(ValueError, match="task is 'tensor'; a trace is msprobe's data dump with task 'statistics'"):
        GradientMonitor(GradProbeConfig(dump_path=str(tmp_path / "x")), trace_config=str(config))


def test_locate_names_the_faulty_kernel_between_two_monitored_trainings(tmp_path):
    monitored(tmp_path / "a", log_to_mlflow=False, trace_steps=[2])
    monitored(tmp_path / "b", FaultyKernel("mm", 3, "backward", error=1e-2), log_to_mlflow=False, trace_steps=[2])
    found = locate(tmp_path / "a", tmp_path / "b", step=2)
    assert (found.kind, found.pair.b.name) == (OPERATOR, "Aten.mm.default.3.backward")
    with pytest.raises(ValueError, match=f"no trace of step 3; its traced steps: \\[2\\]. Rerun the training with "
                                         f"{TRACE_STEPS_VARIABLE}=3"):
        locate(tmp_path / "a", tmp_path / "b", step=3)


def test_a_trace_left_unfinished_is_said_and_nothing_is_written(tmp_path):
    monitor = GradientMonitor(GradProbeConfig(dump_path=str(tmp_path)), log_to_mlflow=False, trace_steps=[0])
    model = torch.nn.Linear(3, 2)
    monitor.monitor(model, torch.optim.SGD(model.parameters(), lr=0.1))
    model(torch.ones(1, 3)).sum().backward()
    with pytest.warns(UserWarning, match="the trace of step 0 was not written: monitoring stopped before"):
        monitor.stop()
    assert not (tmp_path / "rank0" / "trace").exists()


def test_trace_on_suspicious_traces_the_step_after_the_live_verdict_trips(tmp_path):
    """The baseline traced every step; the candidate's kernel goes wrong at step 2, its live verdict trips, and the
    step after is traced: locate then compares the first traced step at or after the suspicious one."""
    steps = 7
    baseline = GradientMonitor(GradProbeConfig(dump_path=str(tmp_path / "a"), level="L1"), log_to_mlflow=False,
                               trace_steps=list(range(steps)), silent=True)
    train(steps, on_step=lambda step, phase, model: step == 0 and phase == "start" and baseline.monitor(model))
    baseline.stop()
    tripped = threading.Event()
    candidate = GradientMonitor(GradProbeConfig(dump_path=str(tmp_path / "b"), level="L1"), log_to_mlflow=False,
                                baseline=str(tmp_path / "a"), trace_on_suspicious=True,
                                on_suspicious=lambda verdict: tripped.set(), silent=True)
    fault = FaultyKernel("gelu", 1, error=1e-2)

    def on_step(step, phase, model):
        if step == 0 and phase == "start":
            candidate.monitor(model)
        if step == 4 and phase == "start":
            assert tripped.wait(120), "the live verdict never tripped"  # the training reads the flag, as users do
        fault.armed = step >= 2
        fault.calls = 0

    with fault:
        train(steps, on_step=on_step)
    candidate.stop()
    traced = sorted(int(p.name[4:]) for p in (tmp_path / "b" / "rank0" / "trace").iterdir())
    assert len(traced) == 1 and 2 < traced[0] < steps
    result = msprobe_mlflow.locate(tmp_path / "a", tmp_path / "b", log_run=False)
    assert result.step == traced[0]
    assert result.localization.pair.b.name == "Aten.gelu.default.1.forward"
