"""Security review of inputs: every path built from data stays in its folder, nothing is unpickled, and a planted
link, a pickled array or a hostile run record is refused, naming the file and field, before anything is written
or sent.

Where data become paths: parameter names (direction ``.npy`` files, comparison plots), ``data_name`` of the API
checker's dumps, run IDs and artifact paths of a downloaded run (the cache), and the files of a dump folder that
``upload`` and ``compare`` read. Each test attacks one of them through the public entry point.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from mlflow.entities import Run, RunData, RunInfo
from mlflow.tracking import MlflowClient

from mlflow_stores import sqlite_uri
from msprobe_mlflow import GradProbeConfig
from msprobe_mlflow.api_check.parser import read_api_info
from msprobe_mlflow.compare.engine import compare_dumps
from msprobe_mlflow.directions import read_step_directions
from msprobe_mlflow.dump import write_step
from msprobe_mlflow.pytorch import GradientMonitor
from msprobe_mlflow.records import StepRecord
from msprobe_mlflow.tracking.run_dump import RunDumpError, RunDumpListing, fetch_run_dump
from msprobe_mlflow.tracking.upload import upload_dump
from tiny_models import gaussian, train

SECRET = b"secret-token-7f3a"  # content that must never reach MLflow


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("store")


@pytest.fixture(scope="module")
def tracking_uri(store):
    return sqlite_uri(store)


@pytest.fixture(scope="module")
def experiment_id(store, tracking_uri):
    return MlflowClient(tracking_uri).create_experiment("security", artifact_location=str(store / "artifacts"))


@pytest.fixture
def empty_run(tracking_uri, experiment_id):
    client = MlflowClient(tracking_uri)
    return client, client.create_run(experiment_id).info.run_id


def files_under(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() or p.is_symlink())


def assert_run_is_empty(client: MlflowClient, run_id: str) -> None:
    """Nothing half-sent: no metric, no artifact, and the secret nowhere in the run's artifact folder."""
    run = client.get_run(run_id)
    assert run.data.metrics == {} and client.list_artifacts(run_id) == []
    artifacts = Path(run.info.artifact_uri.removeprefix("file://"))  # a folder of the module's store
    assert not artifacts.exists() or not any(SECRET in p.read_bytes() for p in files_under(artifacts))


# --- parameter names become file names ----------------------------------------------------------------------
class NamedParameters(torch.nn.Module):
    """A model whose parameter names are hostile file names (torch forbids only '.' and the empty name)."""

    def __init__(self, names: list[str]):
        super().__init__()
        for number, name in enumerate(names):
            self.register_parameter(name, torch.nn.Parameter(torch.linspace(-1, 1, 3 + number)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum((p * x[: p.numel()] ** 2 - p.sin()).sum() for p in self.parameters())


HOSTILE_TORCH_NAMES = ["/etc/passwd", "\\windows\\system32", "a" * 300, "é" * 200, "nul\x00byte", " ", "~root"]


def test_hostile_parameter_names_stay_in_the_step_folder_and_come_back_unchanged(tmp_path):
    model = NamedParameters(HOSTILE_TORCH_NAMES)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    config = GradProbeConfig(dump_path=str(tmp_path / "dump"), level="L1", direction_format="npy")
    monitor = GradientMonitor(config, log_to_mlflow=False).monitor(model, optimizer)
    optimizer.zero_grad()
    model(torch.linspace(-2, 2, 20)).backward()
    by_hand = {name: np.packbits(p.grad.numpy() > 0) for name, p in model.named_parameters()}
    optimizer.step()
    monitor.stop()

    assert [p.name for p in tmp_path.iterdir()] == ["dump"]  # nothing written beside the dump
    step_folder = tmp_path / "dump/rank0/step0"
    for path in files_under(tmp_path / "dump"):
        assert path.resolve().is_relative_to((tmp_path / "dump").resolve()) and not path.is_symlink()
    for path in files_under(step_folder):
        assert path.parent == step_folder and len(path.name.encode()) <= 255
    directions = read_step_directions(step_folder)
    assert sorted(directions) == sorted(HOSTILE_TORCH_NAMES)
    for name, (shape, bits) in directions.items():
        assert bits.tolist() == by_hand[name].tolist(), name

    result = compare_dumps(tmp_path / "dump", tmp_path / "dump", tmp_path / "compared", per_param_plots=True)
    assert result.ranks[0].similarities("/etc/passwd") == [1.0]
    assert [p.name for p in tmp_path.iterdir() if p.name not in ("dump", "compared")] == []
    pictures = tmp_path / "compared/rank0/similarities_picture"
    assert all(p.parent == pictures for p in files_under(pictures))
    assert len(files_under(pictures)) == len(HOSTILE_TORCH_NAMES) + 2  # one per parameter, summary, heat map


@pytest.mark.parametrize("name", ["../../escaped", "/tmp/absolute", "..", ".", "../" * 100 + "deep",
                                  "x" * 1000, "rank0/../../up"])
def test_dotted_and_traversing_names_from_any_monitor_are_written_inside_the_step_folder(tmp_path, name):
    """MindSpore parameter names may hold dots; the one writer both monitors share is attacked directly."""
    record = StepRecord(rank=0, step=0, level="L1", bounds=(), names=[name, "ok"], shapes=[(3,), (2,)],
                        values=np.zeros((2, 3), np.float32),
                        directions=np.concatenate([np.packbits([1, 0, 1]), np.packbits([0, 1])]))
    write_step(tmp_path / "dump", record, "npy")
    step_folder = tmp_path / "dump/rank0/step0"
    assert {p.parent for p in files_under(tmp_path / "dump/rank0")} <= {tmp_path / "dump/rank0", step_folder}
    assert [p.name for p in tmp_path.iterdir()] == ["dump"]
    directions = read_step_directions(step_folder)
    assert directions[name][1].tolist() == np.packbits([1, 0, 1]).tolist()
    assert directions["ok"][1].tolist() == np.packbits([0, 1]).tolist()


# --- files of a dump folder: links and pickles ----------------------------------------------------------------
def train_dump(folder: Path, steps: int = 2) -> Path:
    torch.manual_seed(0)
    with GradientMonitor(GradProbeConfig(dump_path=str(folder), level="L1"), log_to_mlflow=False) as monitor:
        train(torch.nn.Linear(3, 2), steps, monitor=monitor, data=gaussian(4, 3), seed=None,
              loss=lambda output, _: output.square().sum())
    return folder


def plant_link(dump: Path, relative: str, outside: Path) -> Path:
    """Replaces ``dump/relative`` by a link to ``outside``, a valid file of the same kind holding the secret."""
    target = dump / relative
    if target.suffix == ".json":
        outside.write_text(json.dumps({"config": {"token": SECRET.decode()}}))
    else:
        shutil.copyfile(target, outside)
        with open(outside, "ab") as f:  # still a valid CSV / zip: trailing bytes are ignored by both readers
            f.write(b"\r\n" + SECRET if target.suffix == ".csv" else SECRET)
    target.unlink()
    target.symlink_to(outside)
    return target


@pytest.mark.parametrize("relative", ["rank0/grad_summary_1.csv", "rank0/step1/directions.npz",
                                      "msprobe_mlflow_config.json"])
def test_a_link_planted_in_a_dump_is_refused_by_upload_before_anything_is_sent(tmp_path, empty_run, relative):
    dump = train_dump(tmp_path / "dump")
    link = plant_link(dump, relative, tmp_path / f"outside{Path(relative).suffix}")
    client, run_id = empty_run
    with pytest.raises(ValueError, match=f"^{link}: is a symbolic link .*dump files must be plain files"):
        upload_dump(dump, run_id, tracking_uri=client.tracking_uri)
    assert_run_is_empty(client, run_id)


@pytest.mark.parametrize("relative", ["rank0/grad_summary_1.csv", "rank0/step1/directions.npz"])
def test_a_link_planted_in_a_dump_is_refused_by_compare_before_any_output(tmp_path, relative):
    dump = train_dump(tmp_path / "dump")
    link = plant_link(dump, relative, tmp_path / f"outside{Path(relative).suffix}")
    with pytest.raises(ValueError, match="is a symbolic link"):
        compare_dumps(dump, train_dump(tmp_path / "clean"), tmp_path / "compared")  # A's CSVs give the order
    assert not (tmp_path / "compared").exists()
    assert link.is_symlink()  # refused, not followed or replaced


class RunsCode:
    """Unpickling this creates ``marker``: proof that a loader executed code from the file."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (str(self.marker),)


def test_pickled_arrays_in_a_dump_are_refused_without_running_them(tmp_path, empty_run):
    marker = tmp_path / "code_ran"
    payload = np.array([RunsCode(marker)], dtype=object)
    packed_dump = train_dump(tmp_path / "packed")
    archive = packed_dump / "rank0/step1/directions.npz"
    np.savez(archive, format_version=np.array(1), names=payload, ndims=np.array([1]), dims=np.array([3]),
             bits=np.packbits([1, 0, 1]))
    npy_dump = train_dump(tmp_path / "npy")
    (npy_dump / "rank0/step1/directions.npz").unlink()
    np.save(npy_dump / "rank0/step1/weight.npy", payload, allow_pickle=True)
    client, run_id = empty_run
    with pytest.raises(ValueError, match=f"^{archive}: not a readable direction archive .*allow_pickle=False"):
        upload_dump(packed_dump, run_id, tracking_uri=client.tracking_uri)
    with pytest.raises(ValueError, match=r"weight\.npy: dtype object, expected bool"):
        upload_dump(npy_dump, run_id, tracking_uri=client.tracking_uri)
    for dump in (packed_dump, npy_dump):
        with pytest.raises(ValueError):
            compare_dumps(dump, dump, None)
    assert not marker.exists()
    assert_run_is_empty(client, run_id)


def test_a_file_that_is_no_archive_is_never_uploaded_as_directions(tmp_path, empty_run):
    dump = train_dump(tmp_path / "dump")
    (dump / "rank0/step1/directions.npz").write_bytes(SECRET)  # e.g. a private key copied under that name
    client, run_id = empty_run
    with pytest.raises(ValueError, match="directions.npz: not a readable direction archive"):
        upload_dump(dump, run_id, tracking_uri=client.tracking_uri)
    assert_run_is_empty(client, run_id)


# --- a downloaded run: its ID names the cache folder --------------------------------------------------------
@pytest.mark.parametrize("run_id", ["../../escaped", "/tmp/absolute-run", "..", "a/../../b", "x" * 300, "nul\x00"])
def test_a_run_id_from_a_hostile_server_cannot_leave_the_cache(tmp_path, tracking_uri, run_id):
    """A real server cannot send such an ID; a hostile or broken one could. Nothing is created or requested."""
    info = RunInfo(run_id=run_id, experiment_id="0", user_id="x", status="FINISHED", start_time=0, end_time=0,
                   lifecycle_stage="active", artifact_uri="http://tracking.example/artifacts")
    listing = RunDumpListing(Run(info, RunData()), steps={0: [0]})
    cache = tmp_path / "cache"
    with pytest.raises(RunDumpError, match="is not a plain name .*refusing to name a cache folder after it"):
        fetch_run_dump(MlflowClient(tracking_uri), listing, {0: [0]}, cache_dir=cache)
    assert list(tmp_path.iterdir()) == []


# --- data_name of the API checker's dumps ---------------------------------------------------------------------
def api_dump(folder: Path, data_name: str):
    """The call of ``data_name``; a second call's input, a plain file, makes ``npy`` the dump's tensor folder."""
    np.save(folder / "npy" / "plain.npy", np.ones(2, np.float32))
    path = folder / "api_info.json"
    path.write_text(json.dumps({"task": "tensor", "dump_data_dir": "npy", "data": {
        f"Mint.abs.{i}.forward": {"input_args": [{"type": "mindspore.Tensor", "dtype": "Float32", "shape": [2],
                                                  "data_name": name}], "output": []}
        for i, name in enumerate([data_name, "plain.npy"])}}), encoding="utf-8")
    return read_api_info(path).calls[0]


def test_a_data_name_that_is_a_link_leading_outside_is_refused(tmp_path):
    (tmp_path / "npy").mkdir()
    np.save(tmp_path / "outside.npy", np.ones(2, np.float32))
    (tmp_path / "npy/x.npy").symlink_to(tmp_path / "outside.npy")
    call = api_dump(tmp_path, "x.npy")
    assert call.forward is None
    assert f"input_args[0].data_name = 'x.npy' leads outside {tmp_path / 'npy'}" in call.forward_problem


def test_a_data_name_with_a_nul_is_refused_naming_the_field(tmp_path):
    (tmp_path / "npy").mkdir()
    call = api_dump(tmp_path, "x\x00.npy")
    assert "input_args[0].data_name = 'x\\x00.npy' contains a NUL character" in call.forward_problem


def test_an_over_long_data_name_stays_inside_and_fails_to_load_with_a_clear_error(tmp_path):
    pytest.importorskip("mindspore", reason="loading inputs for the API checker needs MindSpore")
    from msprobe_mlflow.api_check.inputs import InputError, load

    (tmp_path / "npy").mkdir()
    call = api_dump(tmp_path, "a" * 5000 + ".npy")
    [argument] = call.forward.args
    assert argument.data_path.parent == (tmp_path / "npy").resolve()
    with pytest.raises(InputError, match=r"^Mint\.abs\.0 input 0: .*: not a readable \.npy file"):
        load(argument, "Mint.abs.0 input 0")
