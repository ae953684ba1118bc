"""msprobe's two API-checker CSVs (UTF-8 with BOM, CRLF; FORMATS.md section 6), sharing one local-time stamp.

``accuracy_checking_details_{stamp}.csv``: one row per compared output (or per side that could not be compared).
``accuracy_checking_result_{stamp}.csv``: one row per API call, forward and backward status (empty when the dump
has no such entry) and the joined messages of what did not pass.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

from msprobe_mlflow.dump import write_csv
from msprobe_mlflow.api_check.results import ApiResult, OutputResult

DETAILS_HEADER = ["API Name", "Bench Dtype", "Tested Dtype", "Shape", "Cosine", "MaxAbsErr", "MaxRelativeErr",
                  "Status", "Message"]
RESULT_HEADER = ["API Name", "Forward Test Success", "Backward Test Success", "Message"]
DETAILS_PREFIX = "accuracy_checking_details"
RESULT_PREFIX = "accuracy_checking_result"


def details_rows(results: list[ApiResult]) -> list[list]:
    return [DETAILS_HEADER, *(_details_row(row) for result in results for row in result.output_rows())]


def _details_row(row: OutputResult) -> list:
    """Shape as a Python tuple (``(2, 3)``), metrics as Python float reprs, empty cells for what is missing."""
    metrics = ["" if value is None else float(value) for value in (row.cosine, row.max_abs_err, row.max_relative_err)]
    shape = "" if row.shape is None else tuple(row.shape)
    return [row.name, row.bench_dtype, row.tested_dtype, shape, *metrics, row.status, row.message]


def result_rows(results: list[ApiResult]) -> list[list]:
    rows = [RESULT_HEADER]
    for result in results:
        forward = result.forward.status if result.forward is not None else ""
        backward = result.backward.status if result.backward is not None else ""
        rows.append([result.name, forward, backward, result.message])
    return rows


def write_reports(results: list[ApiResult], output_dir: str | os.PathLike) -> tuple[Path, Path]:
    """Writes both CSVs into ``output_dir`` (created if missing); returns (details, result).

    Each file is written whole through a temporary file. Existing files are never replaced: if either name of
    this second's stamp is taken, ``_2``, ``_3``... is appended to the stamp of both.
    """
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d%H%M%S", time.localtime())
    suffix, attempt = stamp, 1
    while any((output_dir / f"{prefix}_{suffix}.csv").exists() for prefix in (DETAILS_PREFIX, RESULT_PREFIX)):
        attempt += 1
        suffix = f"{stamp}_{attempt}"
    details_path = output_dir / f"{DETAILS_PREFIX}_{suffix}.csv"
    result_path = output_dir / f"{RESULT_PREFIX}_{suffix}.csv"
    write_csv(details_path, details_rows(results))
    write_csv(result_path, result_rows(results))
    return details_path, result_path
