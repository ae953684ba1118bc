"""The exponent pictures: groups, the history they are drawn from (against numpy's counts), the slider's pictures
(nothing after their step), and what a monitored run and ``upload`` put into MLflow (real torch, SQLite MLflow)."""
from __future__ import annotations

import mlflow
import numpy as np
import pytest

from msprobe_mlflow.dump import exponents_path
from msprobe_mlflow.exponent_pictures import MODEL, ExponentHistory, drawn_steps, parameter_groups, pictures
from msprobe_mlflow.exponents import write_exponents
from msprobe_mlflow.statistics_table import EXPONENT_LOW, ExponentCounts, exponent_counts
from msprobe_mlflow.tracking.exponent_images import image_key, log_exponent_pictures, logged_images

GPT2_24 = (["transformer.wte.weight", "transformer.wpe.weight"]
           + [f"transformer.h.{i}.{part}" for i in range(24) for part in ("attn.c_attn.weight", "mlp.c_fc.weight")]
           + ["transformer.ln_f.weight", "lm_head.weight"])


def test_layers_are_joined_into_ranges_until_at_most_eight_groups_hold_every_parameter_once():
    groups = parameter_groups(GPT2_24)
    assert list(groups) == ["transformer", *(f"transformer.h.{i}-{i + 3}" for i in range(0, 24, 4)), "lm_head"]
    assert sorted(i for rows in groups.values() for i in rows) == list(range(len(GPT2_24)))
    assert [GPT2_24[i] for i in groups["transformer.h.4-7"]] == GPT2_24[10:18]
    assert parameter_groups(["conv1.weight", "bn1.weight", "layer1.0.conv1.weight", "layer1.1.conv1.weight",
                             "fc.weight"]) == {"conv1": [0], "bn1": [1], "layer1.0": [2], "layer1.1": [3], "fc": [4]}
    assert parameter_groups([f"head{i}.weight" for i in range(9)]) == {}  # nine groups, no layers to join
    sequential = parameter_groups([f"{i}.weight" for i in range(0, 60, 2)])  # a Sequential's Linear layers
    assert list(sequential) == [f"layer {i}-{i + 6}" for i in range(0, 56, 8)] + ["layer 56-58"]


def test_drawn_steps_are_spread_evenly_from_the_first_to_the_last():
    assert drawn_steps(list(range(9)), 6) == [0, 2, 3, 5, 6, 8]
    assert drawn_steps([3, 7], 6) == [3, 7]
    many = drawn_steps(list(range(0, 10_000, 2)), 500)
    assert len(many) == 500 and many[0] == 0 and many[-1] == 9998 and set(np.diff(many)) <= {20, 22}


def _write_history(dump, names, steps, rng):
    """Exponent files of ``steps``, gradients falling by one exponent a step, NaN and zeros in the first
    parameter; returns numpy's counts per step and parameter."""
    counts = {}
    for step in steps:
        arrays = [(rng.standard_normal(500) * 2.0 ** (-step - i)).astype(np.float32) for i in range(len(names))]
        arrays[0][:7], arrays[0][7:10] = np.nan, 0
        counts[step] = np.array([exponent_counts(a) for a in arrays])
        path = exponents_path(dump, 0, step)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_exponents(path, names, ExponentCounts.of(counts[step]), 2.0 ** (10 - step) if step > 2 else None)
    return counts


def test_the_history_sums_each_groups_counts_as_numpy_counts_them(tmp_path):
    names = ["embed.weight", "layers.0.weight", "layers.0.bias", "layers.1.weight", "head.weight"]
    steps = list(range(0, 12, 2))
    counts = _write_history(tmp_path, names, steps, np.random.default_rng(0))
    history = ExponentHistory.read(tmp_path, 0, steps)
    assert history.steps == steps
    assert list(history.counts) == [MODEL, "embed", "layers.0", "layers.1", "head"]
    for column, step in enumerate(steps):
        assert np.array_equal(history.counts[MODEL][column], counts[step].sum(axis=0))
        assert np.array_equal(history.counts["layers.0"][column], counts[step][1] + counts[step][2])
        assert np.array_equal(history.counts["head"][column], counts[step][4])
    assert history.shifts.tolist() == [0, 0, 6, 4, 2, 0]  # log2 of 2**(10 - step) from step 3 on


def test_a_slider_picture_shows_nothing_after_its_step_and_the_same_before(tmp_path):
    names = ["embed.weight", "head.weight"]
    steps = list(range(20))
    _write_history(tmp_path, names, steps, np.random.default_rng(1))
    history = ExponentHistory.read(tmp_path, 0, steps)
    middle, last = pictures(history, MODEL, [9, 19])
    changed = (middle != last).any(axis=2)
    rows, columns = np.flatnonzero(changed.any(axis=1)), np.flatnonzero(changed.any(axis=0))
    assert columns.size > 200  # the steps 10 to 19 hold cells
    inside = (slice(rows[0] + 2, rows[-1] - 1), slice(columns[0] + 2, columns[-1] - 1))  # off the frame's pixels
    assert (middle[inside][changed[inside]] == 255).all()  # blank at step 9 wherever the last picture differs
    assert columns[0] > middle.shape[1] * 0.3  # and the cells of steps 0 to 9 are the same in both


def test_a_lowest_exponent_beyond_the_picture_still_draws(tmp_path):
    """Only zeros and subnormals: the rows go down to float32's least exponents without failing."""
    counts = np.zeros((1, 281), np.int64)
    counts[0, 0], counts[0, -2] = 5, 3  # 5 elements at 2**-150 (clamped), 3 zeros
    path = exponents_path(tmp_path, 0, 0)
    path.parent.mkdir(parents=True)
    write_exponents(path, ["w"], ExponentCounts.of(counts))
    history = ExponentHistory.read(tmp_path, 0, [0])
    assert history.counts[MODEL][0, 0] == 5 and EXPONENT_LOW == -150
    (picture,) = pictures(history, MODEL, [0])
    assert picture.ndim == 3 and picture.shape[2] == 3


torch = pytest.importorskip("torch")


def _train_monitored(config, steps=9, after_step=None):
    """``after_step(step)``: called after each step, the monitor running."""
    from msprobe_mlflow.pytorch import GradientMonitor

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8), torch.nn.ReLU(),
                                torch.nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = GradientMonitor(config, statistics=["exponents"]).monitor(model, optimizer)
    for step in range(steps):
        optimizer.zero_grad()
        model(torch.randn(16, 8)).pow(2).mean().backward()
        optimizer.step()
        if after_step is not None:
            after_step(monitor, step)
    monitor.stop()


def test_a_run_ends_with_each_panels_slider_pictures_and_the_summary_and_upload_adds_none_twice(tmp_experiment,
                                                                                                   tmp_path):
    from msprobe_mlflow import GradProbeConfig
    from msprobe_mlflow.tracking.upload import upload_dump

    dump = tmp_path / "dump"
    with mlflow.start_run() as run:
        _train_monitored(GradProbeConfig(level="L1", dump_path=str(dump)))
    client = mlflow.MlflowClient()
    panels = (MODEL, "layer 0", "layer 2", "layer 4")
    expected = {(image_key(0, index, panel), step) for index, panel in enumerate(panels) for step in (0, 2, 3, 5, 6, 8)}
    assert image_key(0, 1, "layer 0") == "gradient exponents/rank0/1 layer 0"
    assert logged_images(client, run.info.run_id) == expected
    assert "grad_probe/rank0/gradient_exponents.png" in {
        info.path for info in client.list_artifacts(run.info.run_id, "grad_probe/rank0")}
    images = len(client.list_artifacts(run.info.run_id, "images"))
    assert images == 2 * len(expected)  # each a PNG and MLflow's smaller copy
    assert upload_dump(dump, run.info.run_id).files_uploaded == 0  # the pictures and the summary are there
    assert len(client.list_artifacts(run.info.run_id, "images")) == images
    assert log_exponent_pictures(client, run.info.run_id, dump, 0, mlflow_step_offset=100) == 2 * len(expected) + 1
    assert {step for _, step in logged_images(client, run.info.run_id)} == {0, 2, 3, 5, 6, 8, 100, 102, 103, 105,
                                                                             106, 108}


def test_while_training_runs_each_panel_gets_a_picture_at_the_latest_step(tmp_experiment, tmp_path, monkeypatch):
    """A user watching a long run sees its pictures before it ends: drawn when due (here after every round) at the
    first and the last step in the dump; the run's end adds the slider's spread steps."""
    from msprobe_mlflow import GradProbeConfig
    from msprobe_mlflow.sinks.mlflow import settings

    monkeypatch.setattr(settings, "PICTURE_SECONDS", 0.0)
    client, seen = mlflow.MlflowClient(), {}

    def look_at_step_4(monitor, step):
        if step == 4:
            monitor.flush()  # the steps so far are sent, and the round's pictures drawn
            seen["images"] = logged_images(client, run.info.run_id)

    panels = (MODEL, "layer 0", "layer 2", "layer 4")
    with mlflow.start_run() as run:
        _train_monitored(GradProbeConfig(level="L1", dump_path=str(tmp_path / "dump")), after_step=look_at_step_4)
    assert {(image_key(0, index, panel), step) for index, panel in enumerate(panels) for step in (0, 4)} \
        <= seen["images"]  # the first step too: MLflow's slider opens at step 0
    assert {step for _, step in seen["images"]} <= set(range(5))  # never a step the training had not reached
    spread = {(image_key(0, index, panel), step) for index, panel in enumerate(panels) for step in (0, 2, 3, 5, 6, 8)}
    assert logged_images(client, run.info.run_id) >= spread | seen["images"]


def test_the_sinks_request_process_draws_the_latest_pictures_as_the_thread_would(tmp_experiment, tmp_path):
    """Once fast steps moved the sink's requests to a process of their own, the drawing happens there too, off the
    interpreter training shares."""
    from msprobe_mlflow import GradProbeConfig
    from msprobe_mlflow.notices import Notices
    from msprobe_mlflow.tracking.live_run import LiveRun
    from msprobe_mlflow.tracking.request_process import RoundRequests

    dump = tmp_path / "dump"
    _train_monitored(GradProbeConfig(level="L1", dump_path=str(dump)), steps=4)  # no active run: a local dump
    run_id = mlflow.MlflowClient().create_run(tmp_experiment).info.run_id
    requests = RoundRequests(LiveRun(run_id, mlflow.get_tracking_uri()), Notices())
    requests.move_to_process()
    try:
        requests.send_exponent_pictures(str(dump), 0, 0, True)
        assert requests.process is not None and requests.process.poll() is None  # it answered; still there
    finally:
        requests.close()
    panels = (MODEL, "layer 0", "layer 2", "layer 4")
    assert logged_images(mlflow.MlflowClient(), run_id) == {(image_key(0, i, panel), step) for i, panel in
                                                            enumerate(panels) for step in (0, 3)}


def test_a_stop_out_of_drain_time_leaves_the_pictures_to_upload(tmp_experiment, tmp_path, monkeypatch):
    """Drawing and sending pictures after stop()'s drain time, or to a server that failed, would hold the job's
    exit: the unsent steps' warning names upload, which draws them."""
    from msprobe_mlflow import GradProbeConfig
    from msprobe_mlflow.sinks.mlflow import settings
    from msprobe_mlflow.tracking.upload import upload_dump

    monkeypatch.setattr(settings, "DRAIN_SECONDS", 0.0)
    monkeypatch.setattr(settings, "SEND_INTERVAL_SECONDS", 600.0)  # the steps wait in the queue past stop()
    dump = tmp_path / "dump"
    with mlflow.start_run() as run, pytest.warns(UserWarning, match="msprobe-mlflow upload"):
        _train_monitored(GradProbeConfig(level="L1", dump_path=str(dump)))
    client = mlflow.MlflowClient()
    assert logged_images(client, run.info.run_id) == set()
    upload_dump(dump, run.info.run_id)
    assert {step for _, step in logged_images(client, run.info.run_id)} == {0, 2, 3, 5, 6, 8}


def test_a_run_without_exponent_counts_gets_no_pictures(tmp_experiment, tmp_path):
    from msprobe_mlflow import GradProbeConfig
    from msprobe_mlflow.pytorch import GradientMonitor

    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with mlflow.start_run() as run:
        monitor = GradientMonitor(GradProbeConfig(level="L1", dump_path=str(tmp_path / "dump"))).monitor(
            model, optimizer)
        model(torch.randn(3, 4)).sum().backward()
        optimizer.step()
        monitor.stop()
    client = mlflow.MlflowClient()
    assert logged_images(client, run.info.run_id) == set()
    assert "grad_probe/rank0/gradient_exponents.png" not in {
        info.path for info in client.list_artifacts(run.info.run_id, "grad_probe/rank0")}
