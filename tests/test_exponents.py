"""Exponent counts on disk (msprobe_mlflow.exponents): written compactly, read back whole, damage refused by file
and field; carried by the steps archive. The monitors' files against numpy are checked in test_pytorch_monitor.py
and test_mindspore_monitor.py, every backend's counts in test_statistic_table.py."""
from __future__ import annotations

import io
import zipfile

import numpy as np
import pytest

from msprobe_mlflow.directions import DamagedFile
from msprobe_mlflow.dump import extract_steps_archive, exponents_path, summary_csv_path, write_steps_archive
from msprobe_mlflow.exponents import read_exponents, write_exponents
from msprobe_mlflow.statistics_table import EXPONENT_BINS, EXPONENT_LOW, ExponentCounts, exponent_counts

NAMES = ["layer.weight", "layer.bias", "empty"]


def counts_of_three() -> np.ndarray:
    rng = np.random.default_rng(0)
    values = [rng.standard_normal(1000).astype(np.float32) * 1e-3,
              np.array([0.0, -0.0, np.inf, np.nan, 1e-45, 3e38], np.float32), np.zeros(0, np.float32)]
    return np.array([exponent_counts(v) for v in values])


def test_counts_come_back_whole_from_the_range_that_occurs(tmp_path):
    counts = counts_of_three()
    path = tmp_path / "exponents_3.npz"
    write_exponents(path, NAMES, ExponentCounts.of(counts), loss_scale=1024.0)
    names, found, loss_scale = read_exponents(path)
    assert (names, loss_scale) == (NAMES, 1024.0)
    np.testing.assert_array_equal(found.full(), counts)
    with np.load(path, allow_pickle=False) as stored:  # only -149 (1e-45) to 127 (3e38) kept, and the last two
        assert (int(stored["lowest"]), int(stored["highest"])) == (-149, 127)
        assert stored["counts"].size == len(NAMES) * (127 + 149 + 1 + 2)


def test_a_step_without_a_finite_nonzero_element_keeps_zeros_and_non_finite_only(tmp_path):
    counts = np.zeros((2, EXPONENT_BINS), np.int64)
    counts[:, -2:] = [[5, 0], [1, 2]]
    write_exponents(tmp_path / "e.npz", ["a", "b"], ExponentCounts.of(counts))
    np.testing.assert_array_equal(read_exponents(tmp_path / "e.npz")[1].full(), counts)


def rewritten(path, **fields):
    """The file at ``path`` with ``fields`` replaced (an uncompressed .npz, as a damaged or hostile file may be)."""
    with np.load(path, allow_pickle=False) as stored:
        kept = {key: stored[key] for key in stored.files}
    buffer = io.BytesIO()
    np.savez(buffer, **{**kept, **fields})
    path.write_bytes(buffer.getvalue())


@pytest.mark.parametrize("fields, problem", [
    ({"counts": np.zeros(7, np.int64)}, "field counts holds 7"),
    ({"lowest": np.array(-400)}, "field lowest = -400, expected an integer from -150 to 129"),
    ({"format_version": np.array(2)}, "field format_version = 2"),
    ({"names": np.array([1, 2, 3])}, "field names is int64, expected text"),
    ({"loss_scale": np.array(-1.0)}, "field loss_scale = -1.0, expected a positive float64"),
    ({"counts": np.array(["x"] * 3, dtype=object)}, "Python objects"),
])
def test_a_malformed_field_is_refused_naming_the_file_and_the_field(tmp_path, fields, problem):
    path = tmp_path / "exponents_0.npz"
    write_exponents(path, NAMES, ExponentCounts.of(counts_of_three()))
    rewritten(path, **fields)
    with pytest.raises(DamagedFile, match=problem) as raised:
        read_exponents(path)
    assert raised.value.path == path


def test_a_flipped_byte_is_refused_by_the_archives_checksum(tmp_path):
    path = tmp_path / "exponents_0.npz"
    write_exponents(path, NAMES, ExponentCounts.of(counts_of_three()))
    with zipfile.ZipFile(path) as archive:
        member = archive.getinfo("counts.npy")
    data = bytearray(path.read_bytes())
    data[member.header_offset + 30 + len(member.filename) + member.compress_size // 2] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.raises(DamagedFile, match="exponents_0.npz"):
        read_exponents(path)


def test_the_steps_archive_carries_each_steps_exponent_counts(tmp_path):
    dump, counts = tmp_path / "dump", counts_of_three()
    for step in (0, 1):
        write_exponents(exponents_path(dump, 0, step), NAMES, ExponentCounts.of(counts + step))
        summary_csv_path(dump, 0, step).write_bytes(b"param_name,max,min,norm,shape\r\n")
    archive = write_steps_archive(dump, 0, [0, 1], tmp_path, packed_directions=None)
    assert extract_steps_archive(archive, tmp_path / "copy") == [0, 1]
    for step in (0, 1):
        np.testing.assert_array_equal(read_exponents(tmp_path / "copy" / f"exponents_{step}.npz")[1].full(),
                                      counts + step)


def test_the_lowest_bin_holds_what_lies_below_float32s_least_subnormal():
    counts = exponent_counts(np.array([1e-300, 2.0 ** -150, 2.0 ** -149, 2.0 ** 128, 1e300, 2.0 ** 127]))
    assert {EXPONENT_LOW + b: int(counts[b]) for b in np.flatnonzero(counts)} == {-150: 2, -149: 1, 127: 1, 128: 2}
