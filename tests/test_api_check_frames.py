"""The API checker's details and results as pandas DataFrames, for notebooks: the same tables as the two CSVs, with
numbers as floats, and pandas imported only when a frame is asked for."""
import math
import subprocess
import sys
from pathlib import Path

from msprobe_mlflow.api_check import ApiCheckReport, ApiResult, OutputResult, SideResult
from msprobe_mlflow.api_check.report import write_reports
from msprobe_mlflow.dump import read_csv

REPO = Path(__file__).resolve().parents[1]


def report() -> ApiCheckReport:
    """add passes forward and backward, mul is error, atan2 is skip, Tensor.add is not checked at all."""
    add = ApiResult.from_sides(
        "Mint.add.0",
        SideResult("pass", "", [OutputResult("Mint.add.0.forward.output.0", "pass", "", "Float32", "Float32", (2, 3),
                                             1.0, 0.0, 0.0)]),
        SideResult("pass", "", [OutputResult("Mint.add.0.backward.output.0", "pass", "", "Float32", "Float32", (2, 3),
                                             0.9999999999999999, 2.5e-08, 1e-07)]), {})
    mul = ApiResult.from_sides(
        "Mint.mul.0",
        SideResult("error", "max absolute difference is greater than threshold: 0.001",
                   [OutputResult("Mint.mul.0.forward.output.0", "error",
                                 "max absolute difference is greater than threshold: 0.001", "Float16", "Float16",
                                 (), 0.5, 1.0, 0.25)]), None, {})
    atan2 = ApiResult.from_sides("Mint.atan2.0", SideResult("skip", "no kernel", [
        OutputResult("Mint.atan2.0.forward", "skip", "no kernel")]), None, {})
    not_checked = ApiResult("Tensor.add.0", "skip", "Tensor APIs are not checked")
    return ApiCheckReport([add, mul, atan2, not_checked])


def test_details_frame_is_the_details_csv_with_float_metrics_and_nan_where_there_are_none(tmp_path):
    checked = report()
    frame = checked.details_frame()
    details_csv, _ = write_reports(checked.results, tmp_path)
    header, *rows = read_csv(details_csv)
    assert list(frame.columns) == header
    assert len(frame) == len(rows) == 5
    assert [str(cell) for cell in frame["API Name"]] == [row[0] for row in rows]
    for column in ("Cosine", "MaxAbsErr", "MaxRelativeErr"):
        assert frame[column].dtype == "float64"
        index = header.index(column)
        assert [None if math.isnan(value) else value for value in frame[column]] == [
            float(row[index]) if row[index] else None for row in rows]
    assert list(frame["Shape"]) == [(2, 3), (2, 3), (), None, None]
    assert list(frame["Status"]) == ["pass", "pass", "error", "skip", "skip"]


def test_results_frame_is_the_result_csv_plus_each_apis_status(tmp_path):
    checked = report()
    frame = checked.results_frame()
    _, result_csv = write_reports(checked.results, tmp_path)
    header, *rows = read_csv(result_csv)
    assert list(frame.columns) == [*header, "Status"]
    assert frame[header].fillna("").values.tolist() == rows  # a side the dump does not have: None here, "" there
    assert list(frame["Status"]) == ["pass", "error", "skip", "skip"]
    assert list(frame.loc[frame["Status"] == "error", "API Name"]) == ["Mint.mul.0"]


def test_an_empty_report_gives_frames_with_the_columns_and_no_rows():
    empty = ApiCheckReport([])
    assert (len(empty.details_frame()), len(empty.results_frame())) == (0, 0)
    assert empty.details_frame()["Cosine"].dtype == "float64"


def test_pandas_is_imported_only_when_a_frame_is_asked_for():
    probe = ("import sys\nimport msprobe_mlflow.api_check as api_check\nbefore = 'pandas' in sys.modules\n"
             "api_check.ApiCheckReport([]).results_frame()\nprint(before, 'pandas' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "True"]
