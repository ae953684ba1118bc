"""What the API check tells the user (issue 26, item 7): the skipped APIs named and grouped by why (the platform's
missing kernels apart from the model), a check's MLflow run named so that two checks are told apart, the dump's
absolute path as its param, a run that lasts as long as the check, and a folder in msprobe's layout taken for the
dump it holds. Real MindSpore and torch, a real MLflow SQLite store."""
import json
import random
import re
import shutil
from datetime import datetime
from pathlib import Path

import pytest
from click.testing import CliRunner
from mlflow import MlflowClient

from msprobe_mlflow.api_check import check_api_accuracy
from msprobe_mlflow.api_check.results import NO_KERNEL, NOT_MINT
from msprobe_mlflow.commands.cli import main
from msprobe_mlflow.tracking.runs import now_ms

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "mindspore_api_dump"
DOCS = REPO / "docs" / "api_check.md"


def stat(shape=(2, 3), low=0.5, high=2.0):
    return {"type": "mindspore.Tensor", "dtype": "Float32", "shape": list(shape), "Max": high, "Min": low}


def write_dump(folder: Path, data: dict, name="api_info.json", task="statistics") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(json.dumps({"task": task, "dump_data_dir": "." if task == "tensor" else None, "data": data}),
                    encoding="utf-8")
    return path


def tiny_dump(folder: Path, name="api_info.json", calls=1) -> Path:
    """Calls that are not mint APIs, in the tensor task: checked in this process, in a moment, none run."""
    return write_dump(folder, {f"Tensor.add.{i}.forward": {"input_args": []} for i in range(calls)}, name, "tensor")


def cli(*args):
    result = CliRunner().invoke(main, ["api-check", *map(str, args)])
    return result.exit_code, result.stdout, result.stderr


# --- skips, grouped by why ------------------------------------------------------------------------------------------

def kernelless_ops_in_the_docs() -> list[str]:
    """The mint ops docs/api_check.md says have no CPU kernel here (its line starting "No CPU kernel")."""
    line = next(line for line in DOCS.read_text(encoding="utf-8").splitlines() if line.startswith("No CPU kernel"))
    return re.findall(r"`(\w+)`", line)


KERNELLESS_INPUTS = {  # name: (family, positional inputs, keyword arguments)
    "logaddexp": ("Mint", [stat(), stat()], {}), "cumsum": ("Mint", [stat()], {"dim": 0}),
    "sort": ("Mint", [stat()], {}), "logsumexp": ("Mint", [stat()], {"dim": 0}),
    "gelu": ("MintFunctional", [stat()], {}), "frac": ("Mint", [stat()], {}),
    "addcmul": ("Mint", [stat(), stat(), stat()], {}), "std": ("Mint", [stat()], {}), "var": ("Mint", [stat()], {}),
    "norm": ("Mint", [stat()], {}), "median": ("Mint", [stat()], {}), "atan2": ("Mint", [stat(), stat()], {}),
}


def test_the_ops_the_docs_list_without_a_cpu_kernel_are_skips_of_the_platform(tmp_path):
    """Each op the docs name is run here: MindSpore's own words (the kernel is unregistered) put it in the
    platform's group, and add beside them still passes."""
    names = kernelless_ops_in_the_docs()
    assert sorted(names) == sorted(KERNELLESS_INPUTS)
    data = {f"{KERNELLESS_INPUTS[name][0]}.{name}.0.forward": {
        "input_args": KERNELLESS_INPUTS[name][1],
        "input_kwargs": {key: {"type": "int", "value": value} for key, value in KERNELLESS_INPUTS[name][2].items()}}
        for name in names}
    data["Mint.add.0.forward"] = {"input_args": [stat(), stat()], "input_kwargs": {}}
    report = check_api_accuracy(write_dump(tmp_path, data), output_dir=tmp_path / "out", log_to_mlflow=False)
    skipped = {result.name.split(".")[1]: result for result in report.with_status("skip")}
    assert sorted(skipped) == sorted(names)
    for name, result in skipped.items():
        assert re.search(r"The kernel \w+ unregistered", result.message), (name, result.message)
        assert result.skip_group == NO_KERNEL, name
    assert report.skips_by_group() == {NO_KERNEL: report.with_status("skip")}
    assert report.count("pass") == 1


def test_the_summary_names_each_skipped_api_under_why_it_was_skipped(tmp_path):
    code, out, _ = cli(EXAMPLE / "statistics" / "api_info.json", "--output", tmp_path, "--no-mlflow")
    assert code == 3  # erfinv
    lines = out.splitlines()
    kernel = lines.index(f"skip (1): {NO_KERNEL}")
    assert lines[kernel + 1].split()[0] == "Mint.atan2.0"
    assert "The kernel Atan2Ext unregistered." in lines[kernel + 1]
    not_mint = lines.index(f"skip (1): {NOT_MINT}")
    assert lines[not_mint + 1].split()[0] == "Functional.relu.0"


def test_a_long_skip_group_is_cut_and_says_where_the_rest_is(tmp_path):
    dump = tiny_dump(tmp_path, calls=12)
    code, out, _ = cli(dump, "--output", tmp_path / "out", "--no-mlflow")
    assert code == 0
    lines = out.splitlines()
    start = lines.index(f"skip (12): {NOT_MINT}")
    assert [line.split()[0] for line in lines[start + 1:start + 11]] == [f"Tensor.add.{i}" for i in range(10)]
    assert lines[start + 11] == "  ... and 2 more (the result CSV lists them all)"


# --- the check's run in MLflow --------------------------------------------------------------------------------------

@pytest.fixture
def experiment(sqlite_store, tmp_path):
    name = f"api-check-{tmp_path.name}"
    MlflowClient().create_experiment(name, artifact_location=(tmp_path / "artifacts").as_uri())
    return name


def stamp_of(run_name: str) -> datetime:
    return datetime.strptime(run_name.rsplit(" ", 1)[1], "%Y%m%d-%H%M%S.%f")


def test_checks_of_two_dumps_named_alike_get_names_from_their_folders_and_start_times(experiment, tmp_path):
    """Both files are dump.json: the names come from msprobe's dump_path/step/rank folders and the start time,
    not from MLflow's generator, which draws from Python's random (seeded by the user's mindspore.set_seed)."""
    first = tiny_dump(tmp_path / "baseline" / "step0" / "rank0", "dump.json")
    second = tiny_dump(tmp_path / "candidate" / "step0" / "rank0", "dump.json")
    random.seed(0)
    state = random.getstate()
    names = []
    for dump in (first, second):
        now = datetime.now()
        before = now.replace(microsecond=now.microsecond // 1000 * 1000)  # the name has milliseconds
        report = check_api_accuracy(dump, output_dir=tmp_path / "out", experiment=experiment, nested=False)
        after = datetime.now()
        names.append(MlflowClient().get_run(report.run_id).info.run_name)
        assert before <= stamp_of(names[-1]) <= after
    assert random.getstate() == state
    assert [name.rsplit(" ", 1)[0] for name in names] == ["api-check baseline/step0/rank0",
                                                          "api-check candidate/step0/rank0"]


def test_the_api_info_param_is_the_absolute_path_of_the_dump_file(experiment, tmp_path, monkeypatch):
    tiny_dump(tmp_path / "dump")
    monkeypatch.chdir(tmp_path)
    report = check_api_accuracy("dump/api_info.json", output_dir="out", experiment=experiment, nested=False)
    run = MlflowClient().get_run(report.run_id)
    assert run.data.params["api_info"] == str((tmp_path / "dump" / "api_info.json").resolve())
    assert run.info.run_name.startswith("api-check dump ")


def test_the_check_run_starts_before_the_first_api_and_ends_after_the_last(experiment, tmp_path):
    """While the APIs run, the check's run is already there and RUNNING; its start and end enclose them."""
    dump = tiny_dump(tmp_path, calls=2)
    client = MlflowClient()
    experiment_id = client.get_experiment_by_name(experiment).experiment_id
    seen = []

    def on_progress(done, total, name):
        seen.append((now_ms(), [(run.info.run_id, run.info.status) for run in client.search_runs([experiment_id])]))

    report = check_api_accuracy(dump, output_dir=tmp_path / "out", experiment=experiment, nested=False,
                                on_progress=on_progress)
    run = client.get_run(report.run_id)
    assert [runs for _, runs in seen] == [[(report.run_id, "RUNNING")]] * 2
    assert run.info.start_time <= seen[0][0] and run.info.end_time >= seen[-1][0]
    assert run.info.status == "FINISHED"


def test_a_check_that_fails_midway_ends_its_run_failed(experiment, tmp_path):
    dump = tiny_dump(tmp_path)

    def on_progress(done, total, name):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        check_api_accuracy(dump, output_dir=tmp_path / "out", experiment=experiment, on_progress=on_progress)
    client = MlflowClient()
    (run,) = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    assert run.info.status == "FAILED" and run.info.run_name.startswith(f"api-check {tmp_path.name} ")


# --- a folder for the dump --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("given", ["dump_path", "dump_path/step0", "dump_path/step0/rank0"])
def test_a_folder_in_msprobes_layout_is_checked_as_the_dump_it_holds(tmp_path, given):
    dump = tiny_dump(tmp_path / "dump_path" / "step0" / "rank0", "dump.json")
    (tmp_path / "dump_path" / "step0" / "rank0" / "dump_tensor_data").mkdir()  # what else msprobe puts there
    report = check_api_accuracy(tmp_path / given, output_dir=tmp_path / "out", log_to_mlflow=False)
    assert report.api_info == dump
    assert [result.name for result in report.results] == ["Tensor.add.0"]


def test_the_example_folder_is_checked_like_its_file_from_the_command_line(tmp_path):
    folder = tmp_path / "tensor"
    shutil.copytree(EXAMPLE / "tensor", folder)
    code, out, err = cli(folder, "--output", tmp_path / "out", "--no-mlflow")
    assert code == 3, err
    assert f"dump:    {folder / 'api_info.json'}" in out
    assert "1 error, 1 skip" in out


def test_a_folder_with_several_dumps_is_refused_naming_them_and_how_to_choose(tmp_path):
    for step in ("step0", "step1"):
        tiny_dump(tmp_path / "dump_path" / step / "rank0", "dump.json")
    code, out, err = cli(tmp_path / "dump_path", "--output", tmp_path / "out", "--no-mlflow")
    assert code == 2 and out == ""
    assert err == (f"msprobe-mlflow api-check: error: {tmp_path / 'dump_path'}: holds 2 dumps "
                   "(step0/rank0/dump.json, step1/rank0/dump.json); pass the one to check, e.g. "
                   f"{tmp_path / 'dump_path' / 'step0' / 'rank0' / 'dump.json'}\n")
    assert not (tmp_path / "out").exists()


def test_a_folder_without_a_dump_is_refused_saying_where_it_was_looked_for(tmp_path):
    (tmp_path / "empty" / "step0" / "rank0").mkdir(parents=True)
    with pytest.raises(ValueError, match=re.escape(
            f"{tmp_path / 'empty'}: is a folder with no api_info.json or dump.json in it nor below it in msprobe's "
            "layout (rank*/dump.json, step*/rank*/dump.json); pass the dump file")):
        check_api_accuracy(tmp_path / "empty", output_dir=tmp_path / "out", log_to_mlflow=False)
