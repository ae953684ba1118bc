"""A dump_path used by two trainings (msprobe's config.json says ``./dump_path``, and scripts are re-run): the second
training sets the first one's steps aside, saying where, and a dump whose parts come from two trainings is refused
by ``upload`` and ``compare``, naming them."""
from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import mlflow
import numpy as np
import pytest
import torch
from click.testing import CliRunner
from mlflow.tracking import MlflowClient

from msprobe_mlflow import GradProbeConfig
from msprobe_mlflow.commands.cli import main
from msprobe_mlflow.compare.engine import compare_dumps
from msprobe_mlflow.dump import read_summary, summary_csv_path, summary_steps, write_csv
from msprobe_mlflow.pytorch import GradientMonitor
from msprobe_mlflow.tracking.upload import upload_dump
from test_tracking_distributed import run_id_of, torchrun
from tiny_models import fixed, gaussian, mlp, total, train

SET_ASIDE = "held another training's steps"


def files_of(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def training_ids(dump: Path) -> tuple[str | None, list[str | None]]:
    """What the dump records: the config's training ID, and each rank folder's (rank0, rank1, ...); None where
    nothing is recorded."""
    config = json.loads((dump / "msprobe_mlflow_config.json").read_text()).get("training_id")
    ranks = sorted(dump.glob("rank*"), key=lambda p: int(p.name[4:]))
    return config, [(r / "training_id").read_text() if (r / "training_id").exists() else None for r in ranks]


def torch_training(dump: Path, steps: int, seed: int, **options) -> list[float]:
    """A real training monitored at L1; returns each step's total gradient norm, computed here with numpy."""
    norms = []

    def record_norm(step, model):
        grads = np.concatenate([p.grad.numpy().ravel() for p in model.parameters()]).astype(np.float64)
        norms.append(float(np.linalg.norm(grads)))

    with GradientMonitor(GradProbeConfig(dump_path=str(dump), level="L1"), **options) as monitor:
        train(mlp(4, 3, 2, seed=seed), steps, monitor=monitor, data=gaussian(5, 4, target=lambda x: torch.zeros(5, 2)),
              seed=None, after_backward=record_norm)
    return norms


def csv_norms(dump: Path) -> list[float]:
    """Each step's total norm as the dump's CSVs give it (the root of the sum of the squared per-row norms)."""
    return [float(np.sqrt(sum(v * v for v in read_summary(summary_csv_path(dump, 0, step)).numbers("norm"))))
            for step in summary_steps(dump / "rank0")]


def set_aside_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if SET_ASIDE in str(w.message)]


def test_a_second_training_in_the_same_dump_path_sets_the_first_aside_and_says_where(tmp_experiment, tmp_path):
    dump = tmp_path / "dump_path"
    with mlflow.start_run():
        first_norms = torch_training(dump, 4, seed=1)
    first_files, (first_id, _) = files_of(dump), training_ids(dump)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with mlflow.start_run():
            second_norms = torch_training(dump, 2, seed=2)
    second_id, rank_ids = training_ids(dump)

    assert summary_steps(dump / "rank0") == [0, 1]  # the second training's steps only, not 0-1 over the first's 0-3
    assert sorted(p.name for p in (dump / "rank0").glob("step*")) == ["step0", "step1"]
    assert csv_norms(dump) == pytest.approx(second_norms, rel=1e-6)
    assert rank_ids == [second_id] and second_id != first_id
    moved = dump / "previous" / first_id
    assert files_of(moved) == first_files  # every byte of the first training, config and ID included
    assert csv_norms(moved) == pytest.approx(first_norms, rel=1e-6)
    [message] = set_aside_warnings(caught)
    assert str(moved) in message and second_id in message


def test_a_monitor_started_again_keeps_its_own_steps_in_place(tmp_path):
    """stop() then monitor() again is the same training: its step counter goes on, its steps stay."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = GradientMonitor(GradProbeConfig(dump_path=str(tmp_path / "dump"), level="L0"), log_to_mlflow=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            train(model, 2, optimizer=optimizer, monitor=monitor, data=gaussian(4, 3), loss=total, seed=None)
            monitor.stop()
    assert summary_steps(tmp_path / "dump" / "rank0") == [0, 1, 2, 3]
    assert not (tmp_path / "dump" / "previous").exists() and set_aside_warnings(caught) == []


def test_an_msprobe_1_0_3_dump_in_the_dump_path_is_set_aside_too(tmp_path):
    """msprobe's own dumps record no training: they go under previous/before-<the new training's ID>/."""
    dump = tmp_path / "dump_path"
    write_csv(dump / "rank0" / "grad_summary_0.csv", [["Param_name", "Max", "Min", "Norm", "Shape"],
                                                      ["fc.bias", 1.0, -1.0, 1.5, [2]]])
    old = files_of(dump)
    with pytest.warns(UserWarning, match=SET_ASIDE) as caught:
        torch_training(dump, 1, seed=3, log_to_mlflow=False)
    new_id, _ = training_ids(dump)
    moved = dump / "previous" / f"before-{new_id}"
    assert files_of(moved) == old
    assert str(moved) in set_aside_warnings(caught)[0]
    assert read_summary(summary_csv_path(dump, 0, 0)).column("param_name") == \
        ["0.weight", "0.bias", "2.weight", "2.bias"]


def mix(kind: str, a: Path, b: Path, mixed: Path) -> None:
    """A dump made of two trainings' parts, as older versions or hands leave them."""
    shutil.copytree(a, mixed)
    if kind == "steps over steps":  # what a reused dump_path held before: B's steps 0-1 over A's 0-3
        shutil.copytree(b / "rank0", mixed / "rank0", dirs_exist_ok=True)
    elif kind == "rank beside rank":
        shutil.copytree(b / "rank0", mixed / "rank1")
    else:  # a writer that records no ID rewrote the config
        config = json.loads((mixed / "msprobe_mlflow_config.json").read_text())
        del config["training_id"]
        (mixed / "msprobe_mlflow_config.json").write_text(json.dumps(config))


EXPECTED_OWNERS = {
    "steps over steps": "({a}: msprobe_mlflow_config.json; {b}: rank0)",
    "rank beside rank": "({a}: msprobe_mlflow_config.json, rank0; {b}: rank1)",
    "config without ID": "(no training ID: msprobe_mlflow_config.json; {a}: rank0)",
}


@pytest.fixture(params=list(EXPECTED_OWNERS))
def mixed_dump(request, tmp_path) -> tuple[Path, Path, str]:
    """(the mixed dump, a clean dump, the message part naming the trainings and their parts)."""
    a, b, mixed = tmp_path / "a", tmp_path / "b", tmp_path / "mixed"
    torch_training(a, 4, seed=1, log_to_mlflow=False)
    torch_training(b, 2, seed=2, log_to_mlflow=False)
    mix(request.param, a, b, mixed)
    owners = EXPECTED_OWNERS[request.param].format(a=training_ids(a)[0], b=training_ids(b)[0])
    return mixed, a, f"holds the steps of 2 trainings {owners}; compare and upload take one training's dump"


def test_upload_refuses_a_dump_of_two_trainings_naming_them_and_sends_nothing(tmp_experiment, mixed_dump):
    mixed, _, owners = mixed_dump
    client = MlflowClient()
    run_id = client.create_run(tmp_experiment).info.run_id
    with pytest.raises(ValueError) as refused:
        upload_dump(mixed, run_id)
    assert str(refused.value).startswith(f"dump_path = {str(mixed)!r} {owners}")
    result = CliRunner().invoke(main, ["upload", str(mixed), "--run-id", run_id])
    assert result.exit_code == 2
    assert f"msprobe-mlflow upload: error: DUMP_PATH = {str(mixed)!r} {owners}" in result.output
    run = client.get_run(run_id)
    assert run.data.metrics == {} and client.list_artifacts(run_id) == []


def test_compare_refuses_a_dump_of_two_trainings_naming_them(mixed_dump, tmp_path):
    mixed, clean, owners = mixed_dump
    with pytest.raises(ValueError) as refused:
        compare_dumps(clean, mixed, tmp_path / "out")
    assert str(refused.value).startswith(f"dump_b = {str(mixed)!r} {owners}")
    result = CliRunner().invoke(main, ["compare", str(mixed), str(clean), "--output", str(tmp_path / "out")])
    assert result.exit_code == 2
    assert f"A = {str(mixed)!r} {owners}" in result.output
    assert not (tmp_path / "out").exists()


def test_the_set_aside_training_and_the_new_one_each_upload_as_one(tmp_experiment, tmp_path):
    dump = tmp_path / "dump_path"
    torch_training(dump, 4, seed=1, log_to_mlflow=False)
    first_id, _ = training_ids(dump)
    with pytest.warns(UserWarning, match=SET_ASIDE):
        torch_training(dump, 2, seed=2, log_to_mlflow=False)
    client = MlflowClient()
    for folder, steps in ((dump, [0, 1]), (dump / "previous" / first_id, [0, 1, 2, 3])):
        report = upload_dump(folder, experiment=mlflow.get_experiment(tmp_experiment).name)
        assert report.steps_completed == {0: steps}
        assert [m.step for m in client.get_metric_history(report.run_id, "grad/rank0/total_norm")] == steps


def test_the_ranks_of_a_job_share_rank_0s_training_id_and_set_aside_together(sqlite_store, tmp_path):
    uri, _ = sqlite_store
    dump = tmp_path / "dump"
    first = torchrun(uri, "--dump", str(dump), "--steps", "4", "--level", "L1")
    run_id_of(first)
    first_id, first_ranks = training_ids(dump)
    first_files = files_of(dump)
    second = torchrun(uri, "--dump", str(dump), "--steps", "2", "--level", "L1")
    run_id_of(second)
    assert [summary_steps(dump / f"rank{r}") for r in (0, 1)] == [[0, 1], [0, 1]]
    second_id, second_ranks = training_ids(dump)
    assert first_ranks == [first_id, first_id] and second_ranks == [second_id, second_id] and first_id != second_id
    assert files_of(dump / "previous" / first_id) == first_files
    assert second.stderr.count(SET_ASIDE) == 1  # rank 0 set both rank folders aside and said so, once
    assert str(dump / "previous" / first_id) in second.stderr


def test_a_mindspore_training_sets_an_earlier_one_aside_in_the_same_way(tmp_path):
    ms = pytest.importorskip("mindspore", reason="MindSpore is not installed (the torch-only stage)")
    from mindspore import Parameter, Tensor, nn

    from msprobe_mlflow.mindspore import GradientMonitor as MindSporeMonitor

    previous_mode = ms.get_context("mode")
    ms.set_context(mode=ms.PYNATIVE_MODE)
    dump = tmp_path / "dump_path"
    rng = np.random.default_rng(5)

    def training(steps: int) -> list[np.ndarray]:
        """Real MindSpore SGD steps (learning rate 0) fed gradients drawn here; returns them."""
        optimizer = nn.SGD([Parameter(Tensor(np.zeros(6, np.float32)), name="w")], learning_rate=0.0)
        gradients = [rng.standard_normal(6).astype(np.float32) for _ in range(steps)]
        monitor = MindSporeMonitor(GradProbeConfig(dump_path=str(dump), level="L1"), log_to_mlflow=False)
        monitor.monitor(optimizer)
        for gradient in gradients:
            optimizer((Tensor(gradient),))
        monitor.stop()
        return gradients

    try:
        first = training(4)
        first_files, (first_id, _) = files_of(dump), training_ids(dump)
        with pytest.warns(UserWarning, match=SET_ASIDE) as caught:
            second = training(2)
    finally:
        ms.set_context(mode=previous_mode)
    assert summary_steps(dump / "rank0") == [0, 1]
    second_id, rank_ids = training_ids(dump)
    assert rank_ids == [second_id] and second_id != first_id
    for folder, gradients in ((dump, second), (dump / "previous" / first_id, first)):
        assert [float(read_summary(summary_csv_path(folder, 0, s)).numbers("norm")[0]) for s in
                summary_steps(folder / "rank0")] == pytest.approx([np.linalg.norm(g) for g in gradients], rel=1e-6)
    assert files_of(dump / "previous" / first_id) == first_files
    assert str(dump / "previous" / first_id) in set_aside_warnings(caught)[0]


def test_a_run_records_its_trainings_id_and_upload_refuses_another_trainings_dump_into_it(tmp_experiment, tmp_path):
    client = MlflowClient()
    with mlflow.start_run() as run:
        torch_training(tmp_path / "first", 2, seed=1)
    first_id, _ = training_ids(tmp_path / "first")
    assert client.get_run(run.info.run_id).data.tags["msprobe_mlflow.training_id"] == first_id
    torch_training(tmp_path / "second", 3, seed=2, log_to_mlflow=False)
    second_id, _ = training_ids(tmp_path / "second")
    before = client.get_run(run.info.run_id).data

    with pytest.raises(ValueError) as refused:
        upload_dump(tmp_path / "second", run.info.run_id)
    assert str(refused.value) == (
        f"--run-id {run.info.run_id} holds training {first_id} (its tag msprobe_mlflow.training_id); dump_path = "
        f"{str(tmp_path / 'second')!r} is training {second_id}: give the run that training logged into, or leave out "
        f"--run-id to upload it into a new run")
    result = CliRunner().invoke(main, ["upload", str(tmp_path / "second"), "--run-id", run.info.run_id])
    assert result.exit_code == 2 and f"is training {second_id}" in result.output
    after = client.get_run(run.info.run_id).data
    assert after.metrics == before.metrics and after.tags == before.tags  # nothing sent
    assert [m.step for m in client.get_metric_history(run.info.run_id, "grad/rank0/total_norm")] == [0, 1]

    upload_dump(tmp_path / "first", run.info.run_id)  # its own training: completes it, as before
    new = upload_dump(tmp_path / "second")  # a run of its own, which records the training
    assert client.get_run(new.run_id).data.tags["msprobe_mlflow.training_id"] == second_id
    untagged = client.create_run(tmp_experiment).info.run_id  # a run made by hand takes the dump and its ID
    upload_dump(tmp_path / "second", untagged)
    assert client.get_run(untagged).data.tags["msprobe_mlflow.training_id"] == second_id
    assert len(client.get_metric_history(untagged, "grad/rank0/total_norm")) == 3


def test_a_rank_folder_holding_only_a_trace_is_set_aside_too(tmp_path):
    """A training that traced step 0 and probed nothing yet (it died, or probes later steps): the next training in
    the dump path sets its trace aside rather than writing its own trace of step 0 over it."""
    dump = tmp_path / "dump"
    first = GradProbeConfig(dump_path=str(dump), level="L1", step=[50])  # probes nothing within 2 steps
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with GradientMonitor(first, log_to_mlflow=False, trace_steps=[0]) as monitor:
        train(model, 2, optimizer=optimizer, monitor=monitor, data=fixed(torch.ones(1, 4)), loss=total)
    first_trace = files_of(dump / "rank0" / "trace")
    assert first_trace and not summary_steps(dump / "rank0")
    first_id = (dump / "rank0" / "training_id").read_text()
    with pytest.warns(UserWarning, match=SET_ASIDE):
        torch_training(dump, 2, seed=1, trace_steps=[0])
    assert files_of(dump / "previous" / first_id / "rank0" / "trace") == first_trace  # kept whole, elsewhere
    assert files_of(dump / "rank0" / "trace") != first_trace
