"""``locate`` on MLflow runs: the step from the pair's verdict, the traces from the runs, and the finding as a run
nested under the comparison run, linked from its description; the rerun line when a run lacks the step's trace."""
import csv
import shlex

import mlflow
import pytest
from click.testing import CliRunner
from mlflow import MlflowClient

import msprobe_mlflow
from msprobe_mlflow.commands.cli import main
from msprobe_mlflow.config import GradProbeConfig
from msprobe_mlflow.pytorch import GradientMonitor
from tests.tiny_transformer import FaultyKernel, train_monitored

STEPS = 4


def training_run(dump, name: str, trace_steps, fault: FaultyKernel | None = None) -> str:
    """A monitored training in its own MLflow run, its fault armed from step 2 on; returns the run ID."""
    monitor = GradientMonitor(GradProbeConfig(dump_path=str(dump), level="L1"), trace_steps=trace_steps,
                              silent=True)
    with mlflow.start_run(run_name=name) as run:
        train_monitored(monitor, STEPS, fault, fault_steps=range(2, STEPS))
        monitor.stop()
    return run.info.run_id


@pytest.fixture
def runs(tmp_experiment, tmp_path):
    return (training_run(tmp_path / "a", "gpu", [2]),
            training_run(tmp_path / "b", "npu", [2], FaultyKernel("gelu", 1, error=1e-2)))


def test_locate_on_runs_takes_the_pairs_first_suspicious_step_and_nests_its_run(runs):
    result = msprobe_mlflow.locate(*runs)
    assert (result.step, result.rank) == (2, 0)
    assert result.localization.pair.b.name == "Aten.gelu.default.1.forward"
    client = MlflowClient()
    located, comparison = client.get_run(result.run_id), client.get_run(result.comparison_run_id)
    tags = located.data.tags
    assert tags["mlflow.parentRunId"] == result.comparison_run_id
    assert located.info.run_name == "locate step 2 rank 0"
    assert (tags["msprobe_mlflow.locate.finding"], tags["msprobe_mlflow.locate.operator"],
            tags["msprobe_mlflow.locate.module"], tags["msprobe_mlflow.locate.phase"]) == \
        ("operator", "Aten.gelu.default.1.forward", "h.1.mlp.1", "forward")
    assert tags["msprobe_mlflow.locate.call_site"].startswith("tiny_transformer.py:")
    assert located.data.metrics["locate/output_difference"] > located.data.metrics["locate/tolerance"]
    assert comparison.data.tags["msprobe_mlflow.compare.first_suspicious_step"] == "2"
    description = comparison.data.tags["mlflow.note.content"]
    assert description.startswith("**Located** ([locate step 2 rank 0](#/experiments/") and result.run_id in \
        description.split("\n")[0]
    assert f"next, the operator: msprobe-mlflow locate {runs[0]} {runs[1]} --step 2\n" in description
    rows = list(csv.DictReader(open(client.download_artifacts(result.run_id, "locate/ops.csv"))))
    named = [row for row in rows if row["judgement"].startswith("named")]
    assert [row["name_b"] for row in named] == ["Aten.gelu.default.1.forward"]
    assert [a.path for a in client.list_artifacts(result.run_id, "locate")] == ["locate/differences.png",
                                                                                "locate/ops.csv"]
    # a line of an earlier version ("**Operator**") is replaced by the next locate's, not kept beneath it
    client.set_tag(result.comparison_run_id, "mlflow.note.content", "**Operator** (earlier): x\n\n" +
                   description.split("\n\n", 1)[1])
    again = msprobe_mlflow.locate(*runs, step=2)
    assert again.comparison_run_id == result.comparison_run_id
    lines = client.get_run(result.comparison_run_id).data.tags["mlflow.note.content"].split("\n")
    assert lines[0].startswith("**Located** ([locate step 2 rank 0]") and again.run_id in lines[0]
    assert not any(line.startswith(("**Operator**", "**Located**")) for line in lines[1:])


def test_a_run_without_the_steps_trace_says_how_to_get_one(tmp_experiment, tmp_path):
    a = training_run(tmp_path / "a", "gpu", [1])
    b = training_run(tmp_path / "b", "npu", [1], FaultyKernel("gelu", 1, error=1e-2))
    with pytest.raises(ValueError, match=f"A: run {a} has no trace of step 2 of rank 0 \\(its traced steps: "
                                         f"\\[1\\]\\); rerun that training with MSPROBE_MLFLOW_TRACE_STEPS=2"):
        msprobe_mlflow.locate(a, b)


def test_the_command_on_runs_prints_the_finding_and_the_run_and_exits_3(runs):
    result = CliRunner().invoke(main, ["locate", *runs, "--step", "2", "--tracking-uri",
                                       mlflow.get_tracking_uri()])
    assert result.exit_code == 3, result.output
    assert "step 2, rank 0" in result.output and "> Aten.gelu.default.1.forward" in result.output
    logged = result.output.strip().splitlines()[-1]
    assert logged.startswith("logged: run ") and "nested under the comparison run" not in logged  # none yet


def local_dump(dump, fault: FaultyKernel | None = None) -> str:
    """A monitored training into a local dump only, its fault armed from step 2 on."""
    monitor = GradientMonitor(GradProbeConfig(dump_path=str(dump), level="L1"), log_to_mlflow=False, silent=True)
    train_monitored(monitor, STEPS, fault, fault_steps=range(2, STEPS))
    monitor.stop()
    return str(dump)


def test_compare_ends_with_the_locate_command_that_names_the_operator(tmp_path, monkeypatch):
    """From the verdict to the operator in one printed command: how to trace the step while the dumps hold no
    trace of it, then the command alone, which names the faulty kernel."""
    def compare(folder):
        dumps = local_dump(folder / "a"), local_dump(folder / "b", FaultyKernel("gelu", 1, error=1e-2))
        result = CliRunner().invoke(main, ["compare", *dumps, "--no-mlflow"])
        assert result.exit_code == 0, result.output
        return result.output.split("next, the operator: ", 1)[1].splitlines()

    untraced = compare(tmp_path / "untraced")
    assert untraced[0].endswith(" --step 2 --no-mlflow")
    assert "rerun each with MSPROBE_MLFLOW_TRACE_STEPS=2" in untraced[1]
    monkeypatch.setenv("MSPROBE_MLFLOW_TRACE_STEPS", "2")  # the same trainings again, as the line says
    traced = compare(tmp_path / "traced")
    assert "MSPROBE_MLFLOW_TRACE_STEPS" not in "\n".join(traced)
    command = shlex.split(traced[0])
    assert command[:2] == ["msprobe-mlflow", "locate"]
    located = CliRunner().invoke(main, command[1:])
    assert located.exit_code == 3, located.output
    assert "Aten.gelu.default.1.forward" in located.output
