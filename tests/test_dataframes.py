"""Results as pandas DataFrames for notebooks: a comparison's similarities, a monitored run's statistics."""
from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import mlflow
import numpy as np
import pandas
import pytest
import torch

import msprobe_mlflow
from msprobe_mlflow import GradProbeConfig, compare_dumps, compare_runs, read_statistics
from msprobe_mlflow.pytorch import GradientMonitor
from test_compare_dumps import FLIPS, base_signs, flipped, write_ours
from tiny_models import mlp, sgd, train

REPO = Path(__file__).resolve().parents[1]
BOUNDS = [-1, 0, 1]


@pytest.fixture
def hand_dumps(tmp_path):
    a = {step: base_signs(step) for step in FLIPS}
    b = {step: flipped(a[step], FLIPS[step]) for step in FLIPS}
    return write_ours(tmp_path / "a", a), write_ours(tmp_path / "b", b, "npy")


def test_a_comparison_as_a_dataframe_holds_the_hand_counts(hand_dumps):
    frame = compare_dumps(*hand_dumps, None).to_dataframe()
    assert list(frame.columns) == ["rank", "step", "parameter", "similarity", "agreeing", "numel"]
    # numel: fc.weight 15, NA 7, scale 1, empty 0; B flips fc.weight[4] at step 1, six of fc.weight and scale at 2
    by_hand = {"fc.weight": [15, 14, 9], "NA": [7, 7, 7], "scale": [1, 1, 0], "empty": [0, 0, 0]}
    numels = {"fc.weight": 15, "NA": 7, "scale": 1, "empty": 0}
    expected = [(0, step, name, agreeing[step] / numels[name] if numels[name] else 0.0, agreeing[step], numels[name])
                for step in range(3) for name, agreeing in by_hand.items()]
    assert list(frame.itertuples(index=False, name=None)) == expected
    summary = frame.groupby("step")[["agreeing", "numel"]].sum()
    assert (summary.agreeing / summary.numel).tolist() == [1.0, 22 / 23, 16 / 23]


def test_a_logged_comparison_gives_the_same_dataframe(hand_dumps, sqlite_store, tmp_path):
    experiment = mlflow.create_experiment(f"frames-{uuid.uuid4().hex[:8]}",
                                          artifact_location=str(tmp_path / "artifacts"))
    result = compare_runs(*map(str, hand_dumps), experiment=mlflow.get_experiment(experiment).name, plots=False)
    pandas.testing.assert_frame_equal(result.to_dataframe(), compare_dumps(*hand_dumps, None).to_dataframe())


def train_monitored(dump: Path, steps: int = 2) -> list[dict[str, np.ndarray]]:
    """A small L2 training monitored into ``dump`` (and the active run, if any); returns each step's gradients."""
    grads = []
    monitor = GradientMonitor(GradProbeConfig(dump_path=str(dump), level="L2", bounds=BOUNDS))
    train(mlp(4, 3, 2), steps, optimizer=sgd(0.5), monitor=monitor,
          data=lambda step, generator: (3 * torch.randn(8, 4, generator=generator), torch.ones(8, 2)),
          after_backward=lambda step, model: grads.append(
              {name: p.grad.numpy().copy() for name, p in model.named_parameters()}))
    monitor.stop()
    return grads


def expected_statistics(grads: list[dict[str, np.ndarray]]) -> list[tuple]:
    """Rows computed here with numpy: msprobe's buckets (-inf, -1], (-1, 0], (0, 1], (1, inf) and =0."""
    rows = []
    for step, step_grads in enumerate(grads):
        for name, grad in step_grads.items():
            values = grad.ravel().astype(np.float64)
            at_most = [int((values <= bound).sum()) for bound in BOUNDS]
            counts = np.diff([0, *at_most, values.size]).tolist() + [int((values == 0).sum())]
            rows.append((0, step, name, *[count / values.size for count in counts], float(grad.max()),
                         float(grad.min()), float(np.linalg.norm(values)), grad.shape, grad.size))
    return rows


def test_statistics_of_a_dump_are_one_row_per_rank_step_and_parameter(tmp_path):
    grads = train_monitored(tmp_path / "dump")
    frame = read_statistics(tmp_path / "dump")
    assert list(frame.columns) == ["rank", "step", "parameter", "(-inf, -1]", "(-1, 0]", "(0, 1]", "(1, inf)", "=0",
                                   "max", "min", "norm", "shape", "numel"]
    expected = expected_statistics(grads)
    assert [row[:3] for row in frame.itertuples(index=False, name=None)] == [row[:3] for row in expected]
    assert any(0 < fraction < 1 for row in expected for fraction in row[3:7])  # the buckets are exercised
    for row, wanted in zip(frame.itertuples(index=False, name=None), expected):
        assert row[3:11] == pytest.approx(wanted[3:11], rel=1e-6), row[2]
        assert row[11:] == wanted[11:]


def test_statistics_of_a_run_equal_those_of_its_dump(sqlite_store, tmp_path):
    experiment = mlflow.create_experiment(f"frames-{uuid.uuid4().hex[:8]}",
                                          artifact_location=str(tmp_path / "artifacts"))
    with mlflow.start_run(experiment_id=experiment) as run:
        train_monitored(tmp_path / "dump", steps=3)
    from_run = read_statistics(run.info.run_id)
    assert sorted(set(from_run.step)) == [0, 1, 2]
    pandas.testing.assert_frame_equal(from_run, read_statistics(tmp_path / "dump"))


def test_statistics_of_an_unknown_run_are_refused_naming_it(sqlite_store):
    with pytest.raises(ValueError, match="source = 'no-such-run': no such folder, and no MLflow run with this ID"):
        read_statistics("no-such-run")


def test_importing_the_package_or_comparing_loads_no_pandas(hand_dumps):
    code = ("import sys, msprobe_mlflow\n"
            f"msprobe_mlflow.compare_dumps({str(hand_dumps[0])!r}, {str(hand_dumps[1])!r}, None)\n"
            "print('pandas' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
    assert "read_statistics" in msprobe_mlflow.__all__


def test_the_verdicts_trips_as_a_dataframe(hand_dumps):
    comparison = compare_dumps(*hand_dumps, None)
    rank = comparison.verdict.ranks[0]
    assert rank.suspicious and rank.parameter_trips
    frame = comparison.trips_dataframe()
    assert list(frame.columns) == ["rank", "step", "parameter", "reason", "score", "similarity", "expected", "grade",
                                   "detail"]
    trips = ([rank.summary_trip] if rank.summary_trip else []) + rank.parameter_trips
    assert frame.parameter.tolist() == (["summary"] if rank.summary_trip else []) + \
        [t.name for t in rank.parameter_trips]
    assert frame.step.tolist() == [rank.first_suspicious_step] * len(trips)
    assert frame.reason.tolist() == [t.reason for t in trips] and set(frame.grade) == {rank.grade}


def test_verdict_json_names_the_runs_compared(sqlite_store, tmp_path):
    experiment = mlflow.create_experiment(f"frames-{uuid.uuid4().hex[:8]}",
                                          artifact_location=str(tmp_path / "artifacts"))
    runs = []
    for name in ("a", "b"):
        with mlflow.start_run(experiment_id=experiment) as run:
            train_monitored(tmp_path / name, steps=2)
        runs.append(run.info.run_id)
    compare_runs(*runs, output_dir=tmp_path / "out", plots=False)
    written = json.loads((tmp_path / "out" / "verdict.json").read_text())
    assert (written["run_a"], written["run_b"]) == tuple(runs)
    compare_dumps(tmp_path / "a", tmp_path / "b", tmp_path / "folders", plots=False)
    assert "run_a" not in json.loads((tmp_path / "folders" / "verdict.json").read_text())
