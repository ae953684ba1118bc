"""The local dump: msprobe's folder layout, its CSV text, and the one reader and one writer for it.

```
{dump_path}/rank{R}/grad_summary_{S}.csv       every level (UTF-8 with BOM, CRLF)
{dump_path}/rank{R}/step{S}/directions.npz     L1/L2, packed form (ours)
{dump_path}/rank{R}/step{S}/{param}.npy        L1/L2, msprobe's boolean form
```
"""
from __future__ import annotations

import csv
import io
import os
import re
from dataclasses import dataclass
from pathlib import Path

from msprobe_mlflow.directions import PACKED_FILE_NAME, write_npy, write_packed
from msprobe_mlflow.levels import csv_header
from msprobe_mlflow.records import StepRecord
from msprobe_mlflow.safe_paths import atomic_write_bytes, refuse_symlink


def rank_dir(dump_path: str | os.PathLike, rank: int) -> Path:
    return Path(dump_path) / f"rank{rank}"


def summary_csv_path(dump_path: str | os.PathLike, rank: int, step: int) -> Path:
    return rank_dir(dump_path, rank) / f"grad_summary_{step}.csv"


def step_dir(dump_path: str | os.PathLike, rank: int, step: int) -> Path:
    return rank_dir(dump_path, rank) / f"step{step}"


def csv_text(rows: list[list]) -> bytes:
    """msprobe's CSV bytes: Python's ``csv`` writer (CRLF line ends) encoded as UTF-8 with a BOM."""
    out = io.StringIO()
    csv.writer(out).writerows(rows)
    return out.getvalue().encode("utf-8-sig")


def write_csv(path: Path, rows: list[list]) -> None:
    atomic_write_bytes(path, csv_text(rows))


def read_csv(path: str | os.PathLike) -> list[list[str]]:
    with open(refuse_symlink(Path(path)), encoding="utf-8-sig", newline="") as f:
        return list(csv.reader(f))


def write_step(dump_path: str | os.PathLike, record: StepRecord, direction_format: str = "packed") -> list[Path]:
    """Writes one step's summary CSV (and directions at L1/L2); returns the files written, CSV first.

    Directions are written before the CSV, so a CSV on disk means its step is complete.
    """
    written = []
    if record.directions is not None:
        folder = step_dir(dump_path, record.rank, record.step)
        if direction_format == "packed":
            path = folder / PACKED_FILE_NAME
            write_packed(path, record.names, record.shapes, record.directions)
            written.append(path)
        else:
            write_npy(folder, record.names, record.shapes, record.directions)
            written.append(folder)
    csv_path = summary_csv_path(dump_path, record.rank, record.step)
    write_csv(csv_path, [csv_header(record.level, record.bounds), *record.csv_rows()])
    return [csv_path, *written]


def indexed_children(folder: str | os.PathLike, prefix: str) -> list[int]:
    """Sorted ``N`` of the sub-folders named ``{prefix}N`` (``rank0``, ``step12``)."""
    pattern = re.compile(rf"^{re.escape(prefix)}(\d+)$")
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = [int(m.group(1)) for child in folder.iterdir() if (m := pattern.match(child.name)) and child.is_dir()]
    return sorted(found)


def summary_steps(rank_folder: str | os.PathLike) -> list[int]:
    """Sorted steps that have a ``grad_summary_{S}.csv`` in a rank folder."""
    pattern = re.compile(r"^grad_summary_(\d+)\.csv$")
    return sorted(int(m.group(1)) for p in Path(rank_folder).glob("grad_summary_*.csv") if (m := pattern.match(p.name)))


@dataclass
class SummaryTable:
    """A ``grad_summary_{S}.csv`` as read back: header lower-cased (msprobe's MindSpore graph mode writes
    ``Param_name,Max,...``), cells as text, names never type-guessed."""

    path: Path
    header: list[str]
    rows: list[list[str]]

    def column(self, name: str) -> list[str]:
        try:
            index = self.header.index(name)
        except ValueError:
            raise ValueError(f"{self.path}: column {name!r} is missing (header: {','.join(self.header)})") from None
        return [row[index] for row in self.rows]


def read_summary(path: str | os.PathLike) -> SummaryTable:
    rows = read_csv(path)
    if not rows or not rows[0] or rows[0][0].lower() != "param_name":
        raise ValueError(f"{path}: first row is not a grad_summary header (expected it to start with param_name)")
    header = [cell if cell.startswith(("(", "=")) or cell == "MD5" else cell.lower() for cell in rows[0]]
    for number, row in enumerate(rows[1:], start=2):
        if len(row) != len(header):
            raise ValueError(f"{path}: row {number} has {len(row)} cells, the header has {len(header)}")
    return SummaryTable(Path(path), header, rows[1:])
