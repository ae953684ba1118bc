"""The monitor options as one checked object (``msprobe_mlflow.MonitorOptions``): the keywords and the
object make the same monitor and the same dump, keywords beside ``options=`` change those, every bad or unknown
option is refused naming it, its value and what is accepted, autolog refuses what it chooses itself, and
docs/options.md lists exactly the options there are (real torch and MLflow)."""
from __future__ import annotations

import re
from pathlib import Path

import mlflow
import pytest
import torch
from mlflow.tracking import MlflowClient

import msprobe_mlflow
from msprobe_mlflow import MonitorOptions
from msprobe_mlflow.config import GradProbeConfig
from msprobe_mlflow.monitoring.directions_schedule import TierOptions
from msprobe_mlflow.monitoring.options import KEYWORDS
from msprobe_mlflow.pytorch import GradientMonitor
from msprobe_mlflow.anomaly_rule import SpikeRule
from msprobe_mlflow.sinks.anomalies import AnomalyOptions
from msprobe_mlflow.sinks.baseline import BaselineOptions
from msprobe_mlflow.tracking.options import TrackingOptions
from tiny_models import fixed, mlp, total, train

DOCS = Path(__file__).resolve().parents[1] / "docs" / "options.md"
SOME = dict(log_every_n_steps=3, param_metrics=["0.*"], aggregate_metrics=False, archive_every_n_steps=2,
            anomaly_flags=False, spike_threshold=5.0, spike_window=8, directions_every_n_steps=2,
            metrics_file=True, silent=True, tracking_uri="sqlite:///elsewhere.db")


class CountingSink:
    def __init__(self):
        self.steps = []

    def handle(self, record):
        self.steps.append(record.step)

    def flush(self):
        pass

    def close(self):
        pass


def test_the_keywords_fill_the_groups_and_come_back_unchanged():
    options = MonitorOptions.of(**SOME)
    assert options.tracking == TrackingOptions(tracking_uri="sqlite:///elsewhere.db", log_every_n_steps=3,
                                               param_metrics=("0.*",), aggregate_metrics=False,
                                               archive_every_n_steps=2)
    assert options.anomalies == AnomalyOptions(anomaly_flags=False, spike_threshold=5.0, spike_window=8)
    assert options.tier == TierOptions(directions_every_n_steps=2)
    assert (options.live_verdict, options.metrics_file, options.silent) == (None, True, True)
    assert options.changed() == {**SOME, "param_metrics": ("0.*",)}
    assert MonitorOptions.of(**options.keywords()) == options


def test_one_spike_rule_flags_spikes_and_triggers_the_tier_flags_off_or_on():
    flags_off = AnomalyOptions(anomaly_flags=False, spike_threshold=5.0, spike_window=8)
    assert flags_off.rule == SpikeRule(5.0, 8) and flags_off.flag_rule is None
    assert AnomalyOptions().flag_rule == AnomalyOptions().rule == SpikeRule(7.0, 50)


def test_a_monitor_made_from_keywords_or_from_the_object_holds_the_same_options(tmp_path):
    config = GradProbeConfig(dump_path=str(tmp_path))
    by_keywords = GradientMonitor(config, **SOME)
    by_object = GradientMonitor(config, options=MonitorOptions.of(**SOME))
    assert by_keywords.options == by_object.options == MonitorOptions.of(**SOME)
    assert by_keywords.tracking.log_every_n_steps == 3 and by_keywords.config.directions_every_n_steps == 2
    assert GradientMonitor(config, log_to_mlflow=False).tracking is None


def test_keywords_beside_options_change_those_options_only():
    options = MonitorOptions.of(log_every_n_steps=3, metrics_file=True)
    changed = MonitorOptions.of(options, log_every_n_steps=5, silent=True)
    assert changed.changed() == {"log_every_n_steps": 5, "metrics_file": True, "silent": True}
    assert options.tracking.log_every_n_steps == 3  # the object given is left as it was
    assert MonitorOptions.of(options) is options


def test_a_baseline_run_is_looked_up_where_the_monitor_logs_unless_told_otherwise():
    here = MonitorOptions(tracking=TrackingOptions(tracking_uri="sqlite:///a.db"), live_verdict=BaselineOptions("abc"))
    there = MonitorOptions.of(tracking_uri="sqlite:///a.db", baseline="abc")
    assert here == there and here.live_verdict.tracking_uri == "sqlite:///a.db"
    elsewhere = BaselineOptions("abc", tracking_uri="sqlite:///b.db")
    assert MonitorOptions(live_verdict=elsewhere, tracking=here.tracking).live_verdict is elsewhere


def monitored_training(dump: Path, steps: int = 3, **how) -> GradientMonitor:
    """A few steps of a small model on fixed, growing inputs, under a monitor made with ``how``; returns it stopped."""
    with GradientMonitor(GradProbeConfig(dump_path=str(dump), level="L1"), log_to_mlflow=False, **how) as monitor:
        train(mlp(4, 3, 2), steps, monitor=monitor,
              data=lambda step, _: (torch.linspace(-1, 1, 8 * 4).reshape(8, 4) * (step + 1), None))
    return monitor


def dump_files(dump: Path) -> dict[str, bytes]:
    """The step files (the training ID, different in every training, left out)."""
    return {str(path.relative_to(dump)): path.read_bytes() for path in sorted((dump / "rank0").rglob("*"))
            if path.is_file() and path.name not in ("training_id", "metrics.jsonl")}


def test_a_training_with_the_object_writes_what_the_keywords_write(tmp_path):
    sinks = CountingSink(), CountingSink()
    monitored_training(tmp_path / "keywords", directions_every_n_steps=2, metrics_file=True, sinks=[sinks[0]])
    monitored_training(tmp_path / "object", options=MonitorOptions.of(directions_every_n_steps=2, metrics_file=True,
                                                                      sinks=[sinks[1]]))
    written = dump_files(tmp_path / "object")
    assert written == dump_files(tmp_path / "keywords")
    assert sorted(name for name in written if name.endswith("directions.npz")) == [
        "rank0/step0/directions.npz", "rank0/step2/directions.npz"]  # the tier: steps 0 and 2 only
    for dump in ("keywords", "object"):
        assert len((tmp_path / dump / "rank0" / "metrics.jsonl").read_text().splitlines()) == 3
    assert sinks[0].steps == sinks[1].steps == [0, 1, 2]


@pytest.mark.parametrize("make", [
    lambda: MonitorOptions.of(log_every_n_step=2),
    lambda: GradientMonitor(GradProbeConfig(dump_path="dump"), log_every_n_step=2),
    lambda: msprobe_mlflow.autolog(log_every_n_step=2),
], ids=["of", "monitor", "autolog"])
def test_an_unknown_option_is_refused_naming_the_closest_and_every_accepted_one(make):
    with pytest.raises(TypeError) as error:
        make()
    message = str(error.value)
    assert message.startswith("'log_every_n_step' is not an option of the gradient monitor; did you mean "
                              "'log_every_n_steps'? Accepted: aggregate_metrics, anomaly_flags, ")
    assert all(name in message for name in KEYWORDS)


REMOVED_OVERLAP = ("overlap was removed: the step kernel reads gradients at memory speed, so computing during "
                   "backward was slower on every measured setting")


@pytest.mark.parametrize("make", [
    lambda: MonitorOptions.of(overlap=True),
    lambda: MonitorOptions.of(log_every_n_step=2, overlap=False),
    lambda: GradientMonitor(GradProbeConfig(dump_path="dump"), overlap=True),
    lambda: GradientMonitor(GradProbeConfig(dump_path="dump"), options=MonitorOptions.of(silent=True), overlap=False),
    lambda: msprobe_mlflow.autolog(overlap=True),
], ids=["of", "of-beside-a-misspelling", "monitor", "monitor-beside-options", "autolog"])
def test_overlap_is_refused_saying_it_was_removed_and_why(make):
    with pytest.raises(TypeError) as error:
        make()
    assert str(error.value).startswith(REMOVED_OVERLAP) and "overlap" not in KEYWORDS


@pytest.mark.parametrize("keywords, refused", [
    ({"log_every_n_steps": 0}, "log_every_n_steps = 0 is not accepted; expected an integer >= 1"),
    ({"mlflow_step_offset": -1}, "mlflow_step_offset = -1 is not accepted; expected an integer >= 0"),
    ({"silent": "yes"}, "silent = 'yes' is not accepted; expected True or False"),
    ({"metrics_file": 1}, "metrics_file = 1 is not accepted; expected True or False"),
    ({"log_to_mlflow": None}, "log_to_mlflow = None is not accepted; expected True or False"),
    ({"sinks": [print]}, "sinks = [<built-in function print>] is not accepted; expected a list of objects with "
                         "handle(record), flush() and close()"),
    ({"spike_window": 3}, "spike_window = 3 is not accepted; expected an integer >= 4"),
    ({"directions_every_n_steps": -1}, "monitor options: grad_probe.directions_every_n_steps = -1 is not accepted; "
                                       "expected an integer >= 0"),
    ({"directions_on_anomaly": False, "directions_every_n_steps": 0}, "monitor options: "
     "grad_probe.directions_every_n_steps = 0 records directions only after an anomaly"),
    ({"rule": "strict"}, "rule = 'strict' is not accepted; expected one of 'noise', 'msprobe'"),
    ({"precision": "fp32"}, "precision = 'fp32' is not accepted; expected one of 'float64', 'float32', 'tf32', "
                            "'float16', 'bfloat16'"),
    ({"precision": "float32", "rule": "msprobe"}, "precision = 'float32' applies to the noise rule only"),
    ({"baseline": "./no/such/dump"}, "baseline = './no/such/dump': no such folder"),
    ({"on_suspicious": print}, "on_suspicious is given without baseline="),
])
def test_a_bad_value_is_refused_naming_the_option_the_value_and_what_is_accepted(keywords, refused):
    with pytest.raises(ValueError) as error:
        MonitorOptions.of(**keywords)
    assert str(error.value).startswith(refused)


def test_a_group_of_the_wrong_kind_and_a_config_it_cannot_work_with_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"^tracking = \{'run_id': 'x'\} is not accepted; expected a TrackingOptions$"):
        MonitorOptions(tracking={"run_id": "x"})
    with pytest.raises(ValueError, match=r"^options = \{'silent': True\} is not accepted; expected a MonitorOptions$"):
        GradientMonitor(GradProbeConfig(dump_path=str(tmp_path)), options={"silent": True})
    with pytest.raises(ValueError, match=r"grad_level 'L0' records none; use grad_level L1 or L2"):
        GradientMonitor(GradProbeConfig(dump_path=str(tmp_path), level="L0"), directions_every_n_steps=4)


@pytest.mark.parametrize("keywords", [{"run_id": "abc"}, {"log_to_mlflow": False},
                                      {"options": MonitorOptions.of(sinks=[CountingSink()])}])
def test_autolog_refuses_what_it_chooses_itself(keywords):
    with pytest.raises(TypeError, match=r"^autolog\(\) does not take (run_id|log_to_mlflow|sinks): it logs each "):
        msprobe_mlflow.autolog(**keywords)


def test_autolog_takes_the_object(tmp_experiment, tmp_path):
    try:
        msprobe_mlflow.autolog(dump_path=str(tmp_path / "dump"), options=MonitorOptions.of(log_every_n_steps=2))
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        with mlflow.start_run() as run:
            train(model, 4, optimizer=optimizer, data=fixed(torch.ones(2, 3)), loss=total)
    finally:
        msprobe_mlflow.autolog(disable=True)
    history = MlflowClient().get_metric_history(run.info.run_id, "grad/rank0/total_norm")
    assert [m.step for m in history] == [0, 2]  # every 2nd step sent, the dump keeps all 4
    assert len(list((tmp_path / "dump" / run.info.run_id / "rank0").glob("grad_summary_*.csv"))) == 4


def test_the_options_table_lists_every_option_once():
    rows = re.findall(r"^\| `(\w+)` \|", DOCS.read_text(encoding="utf-8"), flags=re.M)
    assert sorted(rows) == sorted(KEYWORDS) and len(rows) == len(set(rows))
