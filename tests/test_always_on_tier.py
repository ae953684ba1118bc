"""The always-on tier: statistics at every probed step, gradient directions only every N steps and after a trigger
(a non-finite gradient appearing, a gradient-norm spike), and every reader of a dump coping with steps that have
no directions."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import mlflow
import numpy as np
import pytest
import torch
from mlflow.tracking import MlflowClient

import msprobe_mlflow
from msprobe_mlflow import GradProbeConfig, compare_dumps
from msprobe_mlflow.compare.engine import CompareInputError
from msprobe_mlflow.directions import read_step_directions
from msprobe_mlflow.monitoring.directions_schedule import DirectionsSchedule
from msprobe_mlflow.dump import (csv_text, findings_dir, indexed_children, rank_dir, read_summary, summary_csv_path,
                                 summary_steps)
from msprobe_mlflow.layout import StatisticsLayout
from msprobe_mlflow.levels import LEVELS
from msprobe_mlflow.pytorch import GradientMonitor
from msprobe_mlflow.sinks.baseline import BaselineOptions, verdict_line
from msprobe_mlflow.tracking.upload import upload_dump
from msprobe_mlflow.torch_kernels.statistics import _device_statistics, launch_step_statistics
from tiny_models import fixed, gaussian, mlp, sgd, sine, total, train

STEPS = 8
NAMES = ["0.weight", "0.bias", "2.weight", "2.bias"]


def monitored_training(dump: Path, steps: int = STEPS, level: str = "L1", **options) -> GradientMonitor:
    """Trains the small model on a fixed data stream with the monitor on; returns the stopped monitor."""
    monitor = GradientMonitor(GradProbeConfig(dump_path=str(dump), level=level), log_to_mlflow=False, **options)
    train(mlp(6, 16, 3), steps, optimizer=sgd(0.05), monitor=monitor, data=gaussian(16, 6, target=sine(3)))
    monitor.stop()
    return monitor


def direction_steps(dump: Path) -> list[int]:
    return indexed_children(rank_dir(dump, 0), "step")


def csv_bytes(dump: Path, step: int) -> bytes:
    return summary_csv_path(dump, 0, step).read_bytes()


# --- the config ---------------------------------------------------------------------------------------------------
def msprobe_config(**grad_probe) -> dict:
    return {"task": "grad_probe", "dump_path": "dump", "rank": [], "step": [],
            "grad_probe": {"grad_level": "L1", "param_list": [], "bounds": [-1, 0, 1], **grad_probe}}


def test_a_config_without_the_tier_keys_records_directions_at_every_step_and_reads_back_unchanged():
    config = GradProbeConfig.from_dict(msprobe_config())
    assert (config.directions_every_n_steps, config.directions_on_anomaly) == (1, False)
    assert config.to_msprobe_dict()["grad_probe"] == msprobe_config()["grad_probe"]
    assert all(DirectionsSchedule.of(config).wants(step) for step in range(20))


def test_the_tier_keys_are_read_from_the_grad_probe_section_and_written_back():
    keys = {"directions_every_n_steps": 50, "directions_on_anomaly": True, "directions_steps_after_anomaly": 3}
    config = GradProbeConfig.from_dict(msprobe_config(**keys))
    assert config.tier_options() == keys
    assert config.to_msprobe_dict()["grad_probe"] == msprobe_config(**keys)["grad_probe"]
    assert GradProbeConfig.from_dict(json.loads(json.dumps(config.to_msprobe_dict()))) == config


@pytest.mark.parametrize("keys, named, accepted", [
    ({"directions_every_n_steps": -1}, "grad_probe.directions_every_n_steps = -1", "an integer >= 0"),
    ({"directions_every_n_steps": "10"}, "grad_probe.directions_every_n_steps = '10'", "an integer >= 0"),
    ({"directions_every_n_steps": True}, "grad_probe.directions_every_n_steps = True", "an integer >= 0"),
    ({"directions_on_anomaly": "yes"}, "grad_probe.directions_on_anomaly = 'yes'", "true or false"),
    ({"directions_steps_after_anomaly": 0}, "grad_probe.directions_steps_after_anomaly = 0", "an integer >= 1"),
    ({"directions_every_n_steps": 0}, "directions_every_n_steps = 0", "set directions_on_anomaly to true"),
    ({"grad_level": "L0", "directions_every_n_steps": 5}, "grad_level 'L0' records none", "use grad_level L1 or L2"),
    ({"directions_every_n_step": 5}, "unknown: directions_every_n_step", "directions_every_n_steps"),
])
def test_bad_tier_values_are_refused_naming_the_key_the_value_and_what_is_accepted(keys, named, accepted):
    with pytest.raises(ValueError) as error:
        GradProbeConfig.from_dict(msprobe_config(**keys), source="config.json")
    assert str(error.value).startswith("config.json: ") and named in str(error.value)
    assert accepted in str(error.value)


def test_monitor_options_override_the_config_and_are_validated_like_it(tmp_path):
    config = GradProbeConfig(dump_path=str(tmp_path), directions_every_n_steps=4)
    monitor = GradientMonitor(config, log_to_mlflow=False, directions_every_n_steps=2)
    assert monitor.config.directions_every_n_steps == 2 and config.directions_every_n_steps == 4
    with pytest.raises(ValueError, match=r"monitor options: grad_probe.directions_steps_after_anomaly = -3"):
        GradientMonitor(config, log_to_mlflow=False, directions_on_anomaly=True, directions_steps_after_anomaly=-3)


# --- the schedule --------------------------------------------------------------------------------------------------
def test_the_schedule_records_directions_at_multiples_of_n():
    schedule = DirectionsSchedule(every_n_steps=3)
    assert [step for step in range(10) if schedule.wants(step)] == [0, 3, 6, 9]


def test_a_trigger_arms_the_k_steps_from_the_next_one_launched():
    schedule = DirectionsSchedule(every_n_steps=0, steps_after_trigger=2)
    assert [schedule.wants(step) for step in range(4)] == [False] * 4
    schedule.trigger()  # found on the writer thread before step 4 is launched
    assert [step for step in range(4, 12) if schedule.wants(step)] == [4, 5]
    schedule.trigger()
    schedule.trigger()  # two triggers before the next launch arm one window
    assert [step for step in range(12, 20) if schedule.wants(step)] == [12, 13]


# --- the statistics without sign bits ------------------------------------------------------------------------------
@pytest.mark.parametrize("level", ["L1", "L2"])
def test_statistics_without_directions_are_those_with_directions(level):
    generator = torch.Generator().manual_seed(0)
    grads = [torch.randn(300, 7, generator=generator), torch.tensor([0.0, float("nan"), -1.5]), torch.zeros(0)]
    names = ["a", "b", "c"]
    full = launch_step_statistics(names, grads, rank=0, step=3, level=level, bounds=(-1, 0, 1))()
    lean = launch_step_statistics(names, grads, rank=0, step=3, level=level, bounds=(-1, 0, 1), directions=False)()
    assert lean.skipped_directions and lean.directions is None
    assert not full.skipped_directions and full.directions.size == (2100 + 7) // 8 + 1
    np.testing.assert_array_equal(lean.values, full.values)
    assert csv_text(lean.csv_rows()) == csv_text(full.csv_rows())  # as text: NaN cells equal
    if level == "L2":
        np.testing.assert_array_equal(lean.bucket_counts, full.bucket_counts)


def test_the_device_path_without_directions_computes_no_sign_bits_and_the_same_statistics():
    grads = [torch.randn(70_000), torch.randn(5, 3), torch.randn(9)]
    norms = torch._foreach_norm(grads)
    bounds = [np.float32(b) for b in (-1, 0, 1)]
    statistics, signs, _ = _device_statistics(grads, norms, LEVELS["L2"], bounds)()
    without = dataclasses.replace(LEVELS["L2"], has_directions=False)
    lean_statistics, lean_signs, _ = _device_statistics(grads, norms, without, bounds)()
    assert lean_signs is None and signs.size == StatisticsLayout("L2", bounds, [g.numel() for g in grads]).signs_length
    np.testing.assert_array_equal(lean_statistics, statistics)


# --- the monitor and its dump --------------------------------------------------------------------------------------
def test_every_nth_step_has_directions_and_every_step_its_statistics_as_a_full_run(tmp_path):
    full = monitored_training(tmp_path / "full", level="L2")
    tier = monitored_training(tmp_path / "tier", level="L2", directions_every_n_steps=3)
    assert full.errors == [] and tier.errors == []
    assert summary_steps(rank_dir(tmp_path / "tier", 0)) == list(range(STEPS))
    assert direction_steps(tmp_path / "tier") == [0, 3, 6]
    for step in range(STEPS):
        assert csv_bytes(tmp_path / "tier", step) == csv_bytes(tmp_path / "full", step)
    for step in (0, 3, 6):
        tier_bits = read_step_directions(tmp_path / "tier" / "rank0" / f"step{step}")
        full_bits = read_step_directions(tmp_path / "full" / "rank0" / f"step{step}")
        assert list(tier_bits) == NAMES
        for name in NAMES:
            np.testing.assert_array_equal(tier_bits[name][1], full_bits[name][1])


def steady_training(dump: Path, factors: dict[int, float], steps: int, **options) -> GradientMonitor:
    """The same gradients at every step (learning rate 0, one batch), multiplied by ``factors[step]`` at some
    steps; ``monitor.flush()`` after each step, so the writer thread has judged it before the next one starts."""
    monitor = GradientMonitor(GradProbeConfig(dump_path=str(dump)), log_to_mlflow=False, silent=True, **options)
    x = torch.randn(16, 6, generator=torch.Generator().manual_seed(1))
    train(mlp(6, 16, 3), steps, optimizer=sgd(0.0), monitor=monitor,
          data=lambda step, _: (x, factors.get(step, 1.0)),  # the target: the step's factor
          loss=lambda output, factor: torch.nn.functional.mse_loss(output, torch.sin(x[:, :3])) * factor,
          after_step=lambda step: monitor.flush())
    monitor.stop()
    return monitor


def test_a_norm_spike_gives_directions_to_the_next_k_steps(tmp_path):
    monitor = steady_training(tmp_path, {6: 1000.0}, 12, directions_every_n_steps=0, directions_on_anomaly=True,
                              directions_steps_after_anomaly=2, spike_window=4)
    assert monitor.errors == []
    assert direction_steps(tmp_path) == [7, 8]
    assert summary_steps(rank_dir(tmp_path, 0)) == list(range(12))
    norms = [read_summary(summary_csv_path(tmp_path, 0, step)).numbers("norm")[0] for step in range(12)]
    assert norms[6] == pytest.approx(1000 * norms[5], rel=1e-5)  # the spike the anomaly flags saw
    assert [f.split(",")[0] for f in (findings_dir(tmp_path, 0) / "anomalies.csv").read_text(
        encoding="utf-8-sig").splitlines()[1:]] == ["6"] * 5  # 4 parameters and the total


def test_non_finite_gradients_arm_directions_once_when_they_appear_not_at_every_step_they_last(tmp_path):
    # lr 0 times a NaN gradient makes the weights NaN: every later gradient is NaN too
    monitor = steady_training(tmp_path, {3: float("nan")}, 10, directions_every_n_steps=5,
                              directions_on_anomaly=True, directions_steps_after_anomaly=2)
    assert monitor.errors == []
    assert direction_steps(tmp_path) == [0, 4, 5]
    assert all(np.isnan(read_summary(summary_csv_path(tmp_path, 0, step)).numbers("norm")).all()
               for step in range(3, 10))


def test_autolog_takes_the_tier_options_and_refuses_bad_ones_at_once(tmp_experiment, tmp_path):
    with pytest.raises(ValueError, match="directions_every_n_steps = 2.5"):
        msprobe_mlflow.autolog(dump_path=str(tmp_path / "dumps"), directions_every_n_steps=2.5)
    msprobe_mlflow.autolog(dump_path=str(tmp_path / "dumps"), directions_every_n_steps=4)
    try:
        with mlflow.start_run() as run:
            train(mlp(6, 16, 3), 6, optimizer=sgd(0.05), data=fixed(torch.ones(2, 6)), loss=total)
    finally:
        msprobe_mlflow.autolog(disable=True)
    assert direction_steps(tmp_path / "dumps" / run.info.run_id) == [0, 4]
    assert MlflowClient().get_run(run.info.run_id).data.params["grad_probe.directions_every_n_steps"] == "4"


# --- MLflow, upload ------------------------------------------------------------------------------------------------
def artifact_tree(client: MlflowClient, run_id: str) -> tuple[list[str], list[str]]:
    """The run's summary CSVs and step folders, as names."""
    entries = client.list_artifacts(run_id, "grad_probe/rank0")
    names = [entry.path.rsplit("/", 1)[-1] for entry in entries]
    return sorted(n for n in names if n.endswith(".csv")), sorted(n for n in names if n.startswith("step"))


def test_the_mlflow_sink_and_upload_send_every_csv_and_only_the_directions_recorded(tmp_experiment, tmp_path):
    with mlflow.start_run() as run:
        monitor = GradientMonitor(GradProbeConfig(dump_path=str(tmp_path / "dump")), directions_every_n_steps=3)
        train(mlp(6, 16, 3), 5, optimizer=sgd(0.05), monitor=monitor, data=fixed(torch.ones(2, 6)), loss=total)
        monitor.stop()
    assert monitor.errors == []
    client = MlflowClient()
    expected = ([f"grad_summary_{step}.csv" for step in range(5)], ["step0", "step3"])
    assert artifact_tree(client, run.info.run_id) == expected
    assert len(client.get_metric_history(run.info.run_id, "grad/rank0/total_norm")) == 5
    uploaded = upload_dump(tmp_path / "dump", experiment=tmp_experiment)
    assert uploaded.steps_completed == {0: list(range(5))}
    assert artifact_tree(client, uploaded.run_id) == expected


# --- the comparator and the live verdict ---------------------------------------------------------------------------
def test_compare_takes_the_steps_with_directions_in_both_and_names_the_others(tmp_path):
    monitored_training(tmp_path / "full")
    monitored_training(tmp_path / "tier", directions_every_n_steps=3)
    comparison = compare_dumps(tmp_path / "full", tmp_path / "tier", tmp_path / "out", plots=False)
    (rank,) = comparison.ranks
    assert rank.steps == [0, 3, 6] and rank.summary == [1.0, 1.0, 1.0]
    assert rank.steps_only_in_a == [1, 2, 4, 5, 7] and rank.steps_only_in_b == []
    assert "steps with directions in A only (not compared): 1, 2, 4, 5, 7" in comparison.table()
    saved = json.loads((tmp_path / "out" / "verdict.json").read_text())
    assert saved["ranks"][0]["steps_only_in_a"] == [1, 2, 4, 5, 7]


def test_compare_refuses_a_dump_none_of_whose_steps_has_directions_saying_why(tmp_path):
    monitored_training(tmp_path / "full", steps=3)
    steady_training(tmp_path / "none", {}, 3, directions_every_n_steps=0, directions_on_anomaly=True)
    assert summary_steps(rank_dir(tmp_path / "none", 0)) == [0, 1, 2] and direction_steps(tmp_path / "none") == []
    with pytest.raises(CompareInputError, match="always-on tier dump none of whose steps recorded them"):
        compare_dumps(tmp_path / "full", tmp_path / "none", None)


def test_the_live_verdict_compares_the_steps_with_directions_and_lists_the_others(tmp_path):
    monitored_training(tmp_path / "baseline")
    monitor = monitored_training(tmp_path / "tier", baseline=str(tmp_path / "baseline"), directions_every_n_steps=3)
    assert monitor.errors == []
    verdict = json.loads((findings_dir(tmp_path / "tier", 0) / "verdict.json").read_text())
    assert verdict["compared_steps"] == [0, 3, 6]
    assert verdict["steps_without_directions"] == [1, 2, 4, 5, 7]
    assert verdict["steps_not_compared"] == {}
    assert sorted(p.name for p in findings_dir(tmp_path / "tier", 0).glob("similarities_*.csv")) == [
        "similarities_0.csv", "similarities_3.csv", "similarities_6.csv"]


def test_a_full_run_against_a_tier_baseline_reports_the_steps_the_baseline_has_no_directions_for(tmp_path):
    monitored_training(tmp_path / "baseline", directions_every_n_steps=4)
    monitor = monitored_training(tmp_path / "full", baseline=str(tmp_path / "baseline"), silent=True)
    verdict = json.loads((findings_dir(tmp_path / "full", 0) / "verdict.json").read_text())
    assert monitor.errors == []
    assert verdict["compared_steps"] == [0, 4]
    assert verdict["steps_not_compared"] == {"not in the baseline": [1, 2, 3, 5, 6, 7]}


def test_the_run_description_counts_the_steps_without_directions_apart_from_those_not_compared():
    line = verdict_line(BaselineOptions("0123abcd", rule="msprobe"), None, compared=3, not_compared=1,
                        without_directions=5)
    assert line == ("msprobe-mlflow live verdict: no suspicious step in 3 compared step(s) against baseline "
                    "[0123abcd](#/runs/0123abcd) (msprobe's rule: first < 0.97, drop > 0.03); 1 step(s) not compared; 5 step(s) probed without "
                    "directions (always-on tier)")
