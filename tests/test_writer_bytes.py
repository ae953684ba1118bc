"""The writer thread's fast paths write the bytes the plain ones do: the summary CSV built from a per-layout template
is what Python's ``csv`` writes for msprobe's cells, and the direction archive is what ``np.savez`` writes."""
from __future__ import annotations

import csv
import io
import math
import re
import zlib

import numpy as np
import pytest

from msprobe_mlflow import directions
from msprobe_mlflow.directions import _layout_fields, read_packed, write_packed
from msprobe_mlflow.dump import read_summary, summary_csv_bytes, write_step
from msprobe_mlflow.metrics import record_metrics, step_metrics
from msprobe_mlflow.records import StepRecord

# Names that csv quotes (comma, quote, newline), braces (str.format's), non-ASCII; a scalar and an empty parameter.
NAMES = ["layer.weight", 'odd,"name"', "brace{0}}", "line\nbreak", "écart", "scalar", "empty"]
SHAPES = [(2, 3), (4,), (1, 1), (5,), (2, 2), (), (0, 3)]
BOUNDS = (-1, 0, 1e-05)
SPECIAL = [math.nan, math.inf, -math.inf, -0.0, 0.0, 1e-05, 1e16, 0.1, 3.4028234663852886e38, 1.4e-45]


def msprobe_csv_rows(rows: list[list]) -> bytes:
    """Python's ``csv.writer`` text, UTF-8 with a BOM: what msprobe writes."""
    out = io.StringIO()
    csv.writer(out).writerows(rows)
    return out.getvalue().encode("utf-8-sig")


def msprobe_csv(record: StepRecord) -> bytes:
    """msprobe 1.0.3's way, written out here: ``count / numel`` (``0`` for an empty parameter), the float32 values
    as Python floats, the shape as a list, through ``csv.writer``, UTF-8 with a BOM."""
    rows = [record.csv_header()]
    for i, (name, shape) in enumerate(zip(record.names, record.shapes)):
        numel = math.prod(shape)
        row = [name]
        if record.md5 is not None:
            row.append(record.md5[i])
        if record.bucket_counts is not None:
            counts = [*(int(c) for c in record.bucket_counts[i]), int(record.zero_counts[i])]
            row += [count / numel if numel else 0 for count in counts]
        row += [float(v) for v in record.values[i]]
        row += [float(values[i]) for values in (record.extra or {}).values()]
        rows.append([*row, list(shape)])
    return msprobe_csv_rows(rows)


def make_record(level: str, seed: int) -> StepRecord:
    rng = np.random.default_rng(seed)
    n = len(NAMES)
    values = rng.standard_normal((n, 3)).astype(np.float32)
    values.flat[:len(SPECIAL)] = SPECIAL  # float32-rounded, as a monitor records them
    record = StepRecord(rank=0, step=seed, level=level, bounds=BOUNDS, names=list(NAMES), shapes=list(SHAPES),
                        values=values, extra={"spread": rng.standard_normal(n).astype(np.float32)})
    numels = [math.prod(shape) for shape in SHAPES]
    if level == "L2":
        record.bucket_counts = np.array([rng.multinomial(numel, [0.25] * 4) for numel in numels])
        record.zero_counts = np.array([rng.integers(0, numel + 1) for numel in numels])
    if level == "L0":
        record.md5 = [f"{rng.integers(2**63):032x}" for _ in range(n - 1)] + ["mix64:0123456789abcdef"]
    return record


@pytest.mark.parametrize("level", ["L0", "L1", "L2"])
def test_summary_csv_is_what_csv_writes_for_msprobe_cells(level):
    for seed in range(3):  # the second and third step reuse the layout's template
        record = make_record(level, seed)
        assert summary_csv_bytes(record) == msprobe_csv(record)


def test_summary_csv_of_a_record_without_parameters():
    record = StepRecord(rank=0, step=0, level="L2", bounds=BOUNDS, names=[], shapes=[],
                        values=np.zeros((0, 3), np.float32), bucket_counts=np.zeros((0, 4), np.int64),
                        zero_counts=np.zeros(0, np.int64))
    assert summary_csv_bytes(record) == msprobe_csv(record)


def test_step_files_and_metrics_read_the_same_text(tmp_path):
    record = make_record("L2", 7)
    record.directions = np.arange(sum((math.prod(s) + 7) // 8 for s in SHAPES), dtype=np.uint8)
    csv_path = write_step(tmp_path, record)[0]
    assert csv_path.read_bytes() == msprobe_csv(record)
    norms = [float(v) for v in record.values[:, 2]]
    assert record_metrics(record)["grad/rank0/total_norm"] == pytest.approx(math.sqrt(math.fsum(v * v for v in norms)),
                                                                           nan_ok=True)


LAYOUTS = [(["a", "b.weight", "ü,x"], [(3, 4), (5,), ()]), ([], []), (["z"], [(0,)]),
           ([f"{i}.weight" for i in range(300)], [(64, 64)] * 300)]


@pytest.mark.parametrize("crc32", ["zlib-ng", "zlib"])  # zlib: where zlib-ng has no wheel
@pytest.mark.parametrize("names, shapes", LAYOUTS)
def test_packed_archive_is_what_numpy_savez_writes(tmp_path, monkeypatch, names, shapes, crc32):
    if crc32 == "zlib":
        monkeypatch.setattr(directions, "crc32", zlib.crc32)
        directions._packed_template.cache_clear()  # its CRC of the header too
    else:
        assert directions.crc32.__module__.startswith("zlib_ng")  # the dependency is the one used
    length = sum((math.prod(shape) + 7) // 8 for shape in shapes)
    for seed in range(3):  # the layout's template, reused with other bits
        bits = np.random.default_rng(seed).integers(0, 256, length, dtype=np.uint8)
        write_packed(tmp_path / "directions.npz", names, shapes, bits)
        expected = io.BytesIO()
        np.savez(expected, **_layout_fields(names, shapes), bits=bits)
        assert (tmp_path / "directions.npz").read_bytes() == expected.getvalue()
        read = read_packed(tmp_path / "directions.npz")
        assert list(read) == names
        assert np.array_equal(np.concatenate([b for _, b in read.values()] or [np.zeros(0, np.uint8)]), bits)


def test_packed_archive_keeps_bits_of_any_length(tmp_path):
    """Bits that do not fit the shapes are written as ``np.savez`` writes them (readers refuse them)."""
    bits = np.arange(5, dtype=np.uint8)
    write_packed(tmp_path / "directions.npz", ["w"], [(3,)], bits)
    expected = io.BytesIO()
    np.savez(expected, **_layout_fields(["w"], [(3,)]), bits=bits)
    assert (tmp_path / "directions.npz").read_bytes() == expected.getvalue()
    with pytest.raises(ValueError, match="field bits holds 5 bytes, the shapes need 1"):
        read_packed(tmp_path / "directions.npz")


def test_share_metrics_are_the_counts_over_all_elements():
    record = make_record("L2", 3)
    metrics = record_metrics(record)
    counts = np.column_stack([record.bucket_counts, record.zero_counts])
    total = sum(math.prod(shape) for shape in SHAPES)
    shares = [value for key, value in metrics.items() if "share of gradient elements" in key]
    assert shares == [int(column.sum()) / total for column in counts.T]


@pytest.mark.parametrize("column, cell, message", [
    ("max", "abc", "row 3, column max: 'abc' is not a number"),
    ("shape", "[2, -1]", "row 3, column shape: '[2, -1]' is not a list of sizes like [20, 8]")])
def test_a_bad_cell_is_named_by_row_and_column(tmp_path, column, cell, message):
    header = ["param_name", "max", "min", "norm", "shape"]
    rows = [["a", "1.0", "0.5", "2.0", "[2]"], ["b", "1.0", "0.5", "2.0", "[2]"]]
    rows[1][header.index(column)] = cell
    path = tmp_path / "grad_summary_0.csv"
    path.write_bytes(msprobe_csv_rows([header, *rows]))
    table = read_summary(path)
    with pytest.raises(ValueError, match=re.escape(f"{path}: {message}")):
        table.shapes() if column == "shape" else table.numbers(column)


@pytest.mark.parametrize("level", ["L0", "L1", "L2"])
def test_live_metrics_equal_those_read_back_from_the_written_csv(tmp_path, level):
    """The sinks read a live record's numbers, ``upload`` the CSV: both give the same floats, NaN and -0.0 alike."""
    for seed in range(3):
        record = make_record(level, seed)
        record.extra = {"param_norm": np.abs(record.values[:, 2]), "abs_mean": record.values[:, 0]}
        path = write_step(tmp_path, record)[-1]
        patterns = ("layer.*", "sc*")
        live, read_back = record_metrics(record, patterns), step_metrics(read_summary(path), 0, patterns)
        assert list(live) == list(read_back)
        assert [np.float64(v).tobytes() for v in live.values()] == [np.float64(v).tobytes() for v in read_back.values()]
