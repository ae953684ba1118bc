"""The API check in MLflow, read back from a real SQLite store: the check's run (summary metrics, options, both CSVs)
and one nested run per API (metrics per output, status and message tags, inputs as params), created in batches."""
import json
import math

import mlflow
import numpy as np
import pytest
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from msprobe_mlflow.api_check import check_api_accuracy
from msprobe_mlflow.dump import read_csv


@pytest.fixture(scope="module")
def tracking_uri(sqlite_store):
    return sqlite_store[0]


@pytest.fixture(scope="module")
def dump_path(tmp_path_factory):
    """A tensor-task dump whose verdicts are known by construction: add and where match torch, mul's recorded
    output is off by one in one element, Tensor.add is not a mint API."""
    folder = tmp_path_factory.mktemp("dump")
    data_dir = folder / "npy"
    data_dir.mkdir()

    def t(name, values, dtype="Float32"):
        values = np.asarray(values, dtype=np.float32 if dtype == "Float32" else None)
        np.save(data_dir / f"{name}.npy", values)
        return {"type": "mindspore.Tensor", "dtype": dtype, "shape": list(values.shape), "data_name": f"{name}.npy"}

    data = {
        "Mint.add.0.forward": {"input_args": [t("ax", [1, 2, 3]), t("ay", [10, 20, 30])],
                               "input_kwargs": {"alpha": {"type": "int", "value": 1}},
                               "output": [t("ao", [11, 22, 33])]},
        "Mint.add.0.backward": {"input": [t("as", [1, -1, 2])], "output": [t("ag0", [1, -1, 2]), t("ag1", [1, -1, 2])]},
        "Mint.mul.0.forward": {"input_args": [t("mx", [1, 2, 3]), t("my", [2, 2, 2])], "input_kwargs": {},
                               "output": [t("mo", [2, 4, 7])]},
        "Tensor.add.0.forward": {"input_args": [], "output": []},
        "Mint.where.0.forward": {"input_args": [t("wc", [True, False], "Bool"), t("wx", [1, 2]), t("wy", [3, 4])],
                                 "input_kwargs": {}, "output": [t("wo", [1, 4])]},
    }
    path = folder / "api_info.json"
    path.write_text(json.dumps({"task": "tensor", "dump_data_dir": "npy", "data": data}), encoding="utf-8")
    return path


def new_experiment(name, folder):
    """An experiment whose artifacts stay in ``folder``: MLflow's default, ./mlruns, is the working folder."""
    return MlflowClient().create_experiment(name, artifact_location=(folder / "artifacts").as_uri())


MUL_COSINE = (1e-8 + (2 * 2 + 4 * 4 + 6 * 7)) / (1e-8 + math.sqrt(4 + 16 + 36) * math.sqrt(4 + 16 + 49))


def children(client, run):
    return client.search_runs([run.info.experiment_id],
                              filter_string=f"tags.mlflow.parentRunId = '{run.info.run_id}'")


@pytest.fixture(scope="module")
def logged(tracking_uri, dump_path, tmp_path_factory):
    new_experiment("api-check", tmp_path_factory.mktemp("artifacts"))
    report = check_api_accuracy(dump_path, output_dir=tmp_path_factory.mktemp("out"), experiment="api-check")
    client = MlflowClient()
    return report, client, client.get_run(report.run_id)


def test_check_run_holds_summary_metrics(logged):
    _, _, run = logged
    assert run.data.metrics == {"apis_total": 4, "apis_checked": 3, "apis_pass": 2, "apis_error": 1,
                                "apis_skip": 1, "apis_out_of_memory": 0, "pass_rate": pytest.approx(2 / 3)}
    assert run.info.status == "FINISHED"
    assert run.data.tags["msprobe_mlflow.framework"] == "mindspore"
    assert run.data.params["task"] == "tensor" and run.data.params["cosine_threshold"] == "0.99"


def test_check_run_holds_both_csvs_as_artifacts(logged, tmp_path):
    report, client, run = logged
    names = sorted(a.path for a in client.list_artifacts(run.info.run_id, "api_check"))
    assert names == sorted(f"api_check/{p.name}" for p in (report.details_csv, report.result_csv))
    downloaded = client.download_artifacts(run.info.run_id, f"api_check/{report.result_csv.name}", str(tmp_path))
    assert [row[0] for row in read_csv(downloaded)[1:]] == ["Mint.add.0", "Mint.mul.0", "Tensor.add.0",
                                                             "Mint.where.0"]


def test_one_nested_run_per_api_named_after_it_with_its_status_unless_pass(logged):
    """Every run of the list shows a green Finished: the name says which APIs did not pass."""
    _, client, run = logged
    runs = children(client, run)
    assert sorted(r.info.run_name for r in runs) == ["Mint.add.0", "Mint.where.0", "[error] Mint.mul.0",
                                                     "[skip] Tensor.add.0"]
    assert {r.info.experiment_id for r in runs} == {run.info.experiment_id}
    assert {r.info.status for r in runs} == {"FINISHED"}


def test_nested_run_has_metrics_per_output_status_message_and_inputs(logged):
    _, client, run = logged
    by_name = {r.data.tags["api_name"]: r for r in children(client, run)}
    mul = by_name["Mint.mul.0"]
    assert mul.data.metrics == pytest.approx({"forward/output/0/cosine": MUL_COSINE,
                                              "forward/output/0/max_abs_err": 1.0,
                                              "forward/output/0/max_relative_err": 1 / 6}, rel=1e-12)
    assert mul.data.tags["status"] == "error" and mul.data.tags["forward_status"] == "error"
    assert mul.data.tags["message"] == "max absolute difference is greater than threshold: 0.001"
    assert mul.data.params == {"input_args.0": "Tensor Float32 [3] from mx.npy",
                               "input_args.1": "Tensor Float32 [3] from my.npy"}
    add = by_name["Mint.add.0"]
    assert set(add.data.metrics) == {f"{side}/output/{i}/{metric}" for side, i in
                                     (("forward", 0), ("backward", 0), ("backward", 1))
                                     for metric in ("cosine", "max_abs_err", "max_relative_err")}
    assert (add.data.tags["status"], add.data.tags["backward_status"]) == ("pass", "pass")
    assert add.data.params["input_kwargs.alpha"] == "int 1"
    skipped = by_name["Tensor.add.0"]
    assert skipped.data.metrics == {} and skipped.data.tags["status"] == "skip"


def test_search_runs_by_status_tag_lists_the_failures(logged):
    _, _, run = logged
    failures = mlflow.search_runs([run.info.experiment_id], filter_string="tags.status = 'error'")
    assert list(failures["tags.api_name"]) == ["Mint.mul.0"]


def test_the_check_run_lists_the_apis_with_status_error_in_a_tag(logged):
    _, _, run = logged
    assert run.data.tags["error_apis"] == "Mint.mul.0"


def test_nested_runs_are_logged_in_one_batch_each(tracking_uri, dump_path, tmp_path, monkeypatch):
    """Spies on the real client: no per-value calls; one log_batch per API's run, two for the check's (its options
    as it starts, its results as it ends)."""
    calls = []
    for method in ("log_batch", "log_metric", "log_param", "set_tag"):
        real = getattr(MlflowClient, method)
        monkeypatch.setattr(MlflowClient, method,
                            lambda self, *a, _real=real, _name=method, **k: calls.append(_name) or _real(self, *a, **k))
    new_experiment("api-check-batches", tmp_path)  # before the spying starts
    check_api_accuracy(dump_path, output_dir=tmp_path, experiment="api-check-batches")
    assert calls == ["log_batch"] * (2 + 3)  # the check's run, then add, mul, where (Tensor.add has no values)


def test_check_run_nests_under_the_active_run_and_leaves_it_active(tracking_uri, dump_path, tmp_path):
    experiment_id = new_experiment("api-check-active", tmp_path)
    with mlflow.start_run(experiment_id=experiment_id) as training:
        report = check_api_accuracy(dump_path, output_dir=tmp_path, nested=False)
        assert mlflow.active_run().info.run_id == training.info.run_id
    check = MlflowClient().get_run(report.run_id)
    assert check.data.tags["mlflow.parentRunId"] == training.info.run_id
    assert check.info.experiment_id == experiment_id


def test_no_nested_logs_only_the_check_run(tracking_uri, dump_path, tmp_path):
    new_experiment("api-check-flat", tmp_path)
    report = check_api_accuracy(dump_path, output_dir=tmp_path, experiment="api-check-flat", nested=False)
    client = MlflowClient()
    run = client.get_run(report.run_id)
    assert children(client, run) == []
    assert run.data.metrics["apis_total"] == 4 and run.data.params["nested"] == "False"


def test_parent_run_id_nests_the_check_run_under_that_run(tracking_uri, dump_path, tmp_path):
    client = MlflowClient()
    experiment_id = new_experiment("api-check-parent", tmp_path)
    parent = client.create_run(experiment_id)
    client.set_terminated(parent.info.run_id)
    report = check_api_accuracy(dump_path, output_dir=tmp_path, parent_run_id=parent.info.run_id, nested=False)
    check = client.get_run(report.run_id)
    assert (check.data.tags["mlflow.parentRunId"], check.info.experiment_id) == (parent.info.run_id, experiment_id)


def test_experiment_other_than_the_parents_is_refused_before_anything_is_run(tracking_uri, dump_path, tmp_path):
    client = MlflowClient()
    parent = client.create_run(new_experiment("api-check-refused", tmp_path))
    with pytest.raises(ValueError, match="experiment = 'other' is not the experiment of the parent run"):
        check_api_accuracy(dump_path, output_dir=tmp_path / "out", parent_run_id=parent.info.run_id,
                           experiment="other")
    assert not list((tmp_path / "out").glob("*.csv"))
    assert client.get_experiment_by_name("other") is None


def test_a_parent_run_mlflow_does_not_know_is_refused_before_the_output_folder_is_made(tracking_uri, dump_path,
                                                                                        tmp_path):
    with pytest.raises(MlflowException, match=f"Run with id={'0' * 32} not found"):
        check_api_accuracy(dump_path, output_dir=tmp_path / "out", parent_run_id="0" * 32)
    assert not (tmp_path / "out").exists()


def test_an_output_folder_that_cannot_be_made_creates_no_experiment(tracking_uri, dump_path, tmp_path):
    (tmp_path / "a_file").write_text("", encoding="utf-8")
    with pytest.raises(ValueError, match="output_dir = .* cannot be created"):
        check_api_accuracy(dump_path, output_dir=tmp_path / "a_file" / "out", experiment="api-check-never-made")
    assert MlflowClient().get_experiment_by_name("api-check-never-made") is None


def test_untrusted_kwarg_names_become_valid_param_keys(tracking_uri, tmp_path):
    np.save(tmp_path / "x.npy", np.ones(2, np.float32))
    x = {"type": "mindspore.Tensor", "dtype": "Float32", "shape": [2], "data_name": "x.npy"}
    path = tmp_path / "api_info.json"
    path.write_text(json.dumps({"task": "tensor", "dump_data_dir": ".", "data": {"Mint.abs.0.forward": {
        "input_args": [x], "input_kwargs": {"we!rd=name": None}, "output": [x]}}}), encoding="utf-8")
    new_experiment("api-check-keys", tmp_path)
    report = check_api_accuracy(path, output_dir=tmp_path / "out", experiment="api-check-keys")
    client = MlflowClient()
    (api_run,) = children(client, client.get_run(report.run_id))
    assert api_run.data.params == {"input_args.0": "Tensor Float32 [2] from x.npy", "input_kwargs.we_rd_name": "None"}
    assert api_run.data.tags["status"] == "skip"  # torch.abs takes no such keyword
