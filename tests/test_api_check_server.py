"""The nested runs of a check logged through a real ``mlflow server``: several at a time, every one present with its
status, and without MLflow's two link lines per nested run (its switch set back afterwards)."""
import os

import pytest
from mlflow import MlflowClient

from mlflow_server import MlflowServer
from msprobe_mlflow.api_check import check_api_accuracy
from msprobe_mlflow.tracking.api_check_runs import NESTED_RUNS_AT_ONCE

EXAMPLE = (os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
           + "/examples/mindspore_api_dump/tensor/api_info.json")


@pytest.mark.server
def test_nested_runs_through_a_server_are_all_there_and_print_no_links(tmp_path, capsys):
    server = MlflowServer(tmp_path / "server").start()
    try:
        client = MlflowClient(server.uri)
        experiment_id = client.create_experiment("api-check-server")
        report = check_api_accuracy(EXAMPLE, output_dir=tmp_path / "out", experiment="api-check-server",
                                    tracking_uri=server.uri)
        printed = capsys.readouterr().out
        nested = client.search_runs([experiment_id], filter_string=f"tags.mlflow.parentRunId = '{report.run_id}'",
                                    max_results=1000)
        assert len(report.results) > NESTED_RUNS_AT_ONCE  # more than one batch at a time
        assert sorted((run.data.tags["api_name"], run.data.tags["status"], run.info.status) for run in nested) == \
            sorted((result.name, result.status, "FINISHED") for result in report.results)
        assert printed.count("View run") == 1  # the check's own run only
        assert "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT" not in os.environ
    finally:
        server.stop()
