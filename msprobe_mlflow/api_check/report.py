"""msprobe's two API-checker CSVs (UTF-8 with BOM, CRLF; docs/api_check.md, "Outputs"), sharing one local-time
stamp: ``accuracy_checking_details_{stamp}.csv`` and ``accuracy_checking_result_{stamp}.csv``, the tables of
``results.details_rows`` and ``results.result_rows`` (an empty cell for ``None``, as Python's csv writes it).
"""
from __future__ import annotations

import os
import time
from pathlib import Path

from msprobe_mlflow.dump import write_csv
from msprobe_mlflow.api_check.results import ApiResult, details_rows, result_rows

DETAILS_PREFIX = "accuracy_checking_details"
RESULT_PREFIX = "accuracy_checking_result"


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
