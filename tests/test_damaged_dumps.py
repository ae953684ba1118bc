"""Damaged and incomplete dumps written by the real monitor: every direction file read is checked (a packed
archive against the CRC-32s it records, on the memory-mapped fast path too; msprobe's ``.npy`` form byte by byte),
a damaged step is named by file and step and never compared (``--skip-damaged`` compares the rest and lists it),
and a step whose summary CSV is absent is compared on its signs and said so."""
from __future__ import annotations

import json
import shutil
import struct
import zipfile
from pathlib import Path

import mlflow
import numpy as np
import pytest
import torch
from click.testing import CliRunner
from mlflow.tracking import MlflowClient

from msprobe_mlflow import GradProbeConfig, compare_dumps, compare_runs
from msprobe_mlflow import directions
from msprobe_mlflow.commands.cli import main
from msprobe_mlflow.compare.engine import CompareInputError, SkippedStep
from msprobe_mlflow.compare.step import StepLayout, compare_step
from msprobe_mlflow.directions import DamagedFile, open_step_directions
from msprobe_mlflow.dump import step_dir, summary_csv_path
from msprobe_mlflow.pytorch import GradientMonitor
from tiny_models import gaussian, mlp, sgd, train

STEPS = 4
DAMAGED_STEP = 2


def write_dump(dump: Path, direction_format: str = "packed") -> None:
    """A model whose signs (67,848 bits, 8.5 kB) are most of each step's archive, at L2; the same data every run,
    so two runs agree at every step (similarity 1.0)."""
    config = GradProbeConfig(dump_path=str(dump), level="L2", direction_format=direction_format)
    with GradientMonitor(config, log_to_mlflow=False) as monitor:
        train(mlp(256, 256, 8), STEPS, optimizer=sgd(0.05), monitor=monitor,
              data=gaussian(16, 256, target=lambda x: torch.ones(16, 8)))


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """Two identical runs in each direction form: ``a``, ``b`` (packed), ``a_npy``, ``b_npy`` (msprobe's)."""
    root = tmp_path_factory.mktemp("trained")
    for name in ("a", "b"):
        write_dump(root / name)
        write_dump(root / f"{name}_npy", "npy")
    return root


@pytest.fixture
def dumps(trained, tmp_path) -> tuple[Path, Path]:
    """Fresh copies of the packed pair, for a test to damage."""
    return (Path(shutil.copytree(trained / "a", tmp_path / "a")), Path(shutil.copytree(trained / "b", tmp_path / "b")))


def bits_span(archive: Path) -> tuple[int, int]:
    """Where the sign bits lie in the archive file (after the bits member's local header and .npy header)."""
    with zipfile.ZipFile(archive) as opened:
        info = opened.getinfo("bits.npy")
    raw = archive.read_bytes()
    name_length, extra_length = struct.unpack("<HH", raw[info.header_offset + 26:info.header_offset + 30])
    member_at = info.header_offset + 30 + name_length + extra_length
    header_length = struct.unpack("<H", raw[member_at + 8:member_at + 10])[0]  # NPY 1.0
    return member_at + 10 + header_length, member_at + info.file_size


def flip_a_byte(archive: Path) -> Path:
    """One bit of one byte in the middle of the signs flipped: the zip structure stays whole."""
    start, end = bits_span(archive)
    raw = bytearray(archive.read_bytes())
    raw[(start + end) // 2] ^= 0x10
    archive.write_bytes(bytes(raw))
    return archive


def zero_40_percent(archive: Path) -> Path:
    """The middle 40% of the file zeroed, all of it within the signs (checked): only the CRC can tell."""
    raw = bytearray(archive.read_bytes())
    count = len(raw) * 4 // 10
    at = (len(raw) - count) // 2
    start, end = bits_span(archive)
    assert start <= at and at + count <= end
    raw[at:at + count] = bytes(count)
    archive.write_bytes(bytes(raw))
    return archive


def archive_of(dump: Path, step: int = DAMAGED_STEP) -> Path:
    return step_dir(dump, 0, step) / directions.PACKED_FILE_NAME


def test_a_flipped_byte_in_a_direction_archive_stops_compare_naming_the_file_and_the_step(dumps, tmp_path):
    damaged = flip_a_byte(archive_of(dumps[1]))
    with pytest.raises(CompareInputError) as raised:
        compare_dumps(*dumps, tmp_path / "out")
    assert str(raised.value).startswith(f"rank0 step{DAMAGED_STEP}: {damaged}: field bits fails its CRC-32 check")
    assert "--skip-damaged" in str(raised.value)
    assert not (tmp_path / "out").exists()


def test_an_archive_with_40_percent_zeroed_is_refused_by_its_crc(dumps):
    damaged = zero_40_percent(archive_of(dumps[0]))
    with pytest.raises(DamagedFile) as raised:
        open_step_directions(damaged.parent)
    assert raised.value.path == damaged and raised.value.problem.startswith("field bits fails its CRC-32 check")


@pytest.mark.parametrize("memory_mapped", [False, True])
def test_the_live_verdicts_fast_path_checks_the_crc_of_what_it_reads(dumps, monkeypatch, memory_mapped):
    """``compare_step`` with a layout, as the live verdict calls it: the first step teaches the reader where the
    bits lie; the damaged step is then read at those places, and refused by its CRC, not compared."""
    if memory_mapped:  # this model's 8.5 kB of bits take the large models' memory map
        monkeypatch.setattr(directions, "_READ_WHOLE_UP_TO", 0)
    stored = open_step_directions(step_dir(dumps[1], 0, 0))
    layout = StepLayout(list(stored), [s.shape for s in stored.values()])
    whole = compare_step(0, step_dir(dumps[0], 0, 0), step_dir(dumps[1], 0, 0), layout=layout)
    assert whole.summary_counts == (sum(s.numel for s in stored.values()),) * 2
    assert isinstance(layout.reader_a._places.read(archive_of(dumps[0])), np.memmap) is memory_mapped
    damaged = flip_a_byte(archive_of(dumps[0]))
    assert layout.reader_a.read(damaged) is None
    with pytest.raises(DamagedFile, match="field bits fails its CRC-32 check") as raised:
        compare_step(DAMAGED_STEP, damaged.parent, step_dir(dumps[1], 0, DAMAGED_STEP), layout=layout)
    assert raised.value.path == damaged


def test_a_flipped_byte_in_msprobes_npy_form_is_refused(trained, tmp_path):
    """msprobe's boolean .npy records no checksum; a byte other than 0 or 1 is what a flip leaves."""
    a, b = (Path(shutil.copytree(trained / name, tmp_path / name)) for name in ("a_npy", "b_npy"))
    damaged = step_dir(b, 0, DAMAGED_STEP) / "0.weight.npy"
    raw = bytearray(damaged.read_bytes())
    raw[-1000] ^= 0x10
    damaged.write_bytes(bytes(raw))
    with pytest.raises(CompareInputError, match=rf"rank0 step{DAMAGED_STEP}: {damaged}: element \d+ is stored as "
                                                rf"byte (16|17), a boolean .npy holds 0 or 1 only"):
        compare_dumps(a, b, None)


def truncate_a_row(csv_path: Path) -> Path:
    """The summary CSV cut after the third cell of its third row (the file stops mid-row)."""
    text = csv_path.read_bytes()
    third_row = text.index(b"\r\n", text.index(b"\r\n") + 2) + 2
    cut = third_row
    for _ in range(3):
        cut = text.index(b",", cut) + 1
    csv_path.write_bytes(text[:cut - 1])
    return csv_path


DAMAGES = {
    "flipped byte": lambda dumps: flip_a_byte(archive_of(dumps[1])),
    "40% zeroed": lambda dumps: zero_40_percent(archive_of(dumps[0])),
    "truncated csv": lambda dumps: truncate_a_row(summary_csv_path(dumps[1], 0, DAMAGED_STEP)),
}
PROBLEMS = {"flipped byte": "field bits fails its CRC-32 check", "40% zeroed": "field bits fails its CRC-32 check",
            "truncated csv": "row 3 has 3 cells, the header has"}


@pytest.mark.parametrize("damage", DAMAGES)
def test_skip_damaged_compares_the_other_steps_and_lists_the_skipped_one(dumps, tmp_path, damage):
    damaged = DAMAGES[damage](dumps)
    with pytest.raises(CompareInputError, match=f"rank0 step{DAMAGED_STEP}: "):
        compare_dumps(*dumps, None)
    comparison = compare_dumps(*dumps, tmp_path / "out", plots=False, skip_damaged=True)
    rank = comparison.ranks[0]
    assert rank.steps == [step for step in range(STEPS) if step != DAMAGED_STEP]
    assert rank.summary == [1.0] * (STEPS - 1)  # two identical runs
    [skipped] = rank.skipped_steps
    assert (skipped.step, skipped.file) == (DAMAGED_STEP, str(damaged))
    assert skipped.problem.startswith(PROBLEMS[damage])
    assert comparison.verdict.partial == "partial: 1 damaged step skipped"
    assert f"  step {DAMAGED_STEP} damaged, skipped (not compared): {damaged}: {PROBLEMS[damage]}" \
        in comparison.table()
    assert comparison.verdict.describe().startswith("partial: 1 damaged step skipped: a verdict on the readable "
                                                    "steps only")
    saved = json.loads((tmp_path / "out" / "verdict.json").read_text())
    assert saved["verdict"]["partial"] == "partial: 1 damaged step skipped"
    assert saved["ranks"][0]["skipped_steps"] == [{"step": DAMAGED_STEP, "file": str(damaged),
                                                   "problem": skipped.problem}]


def test_a_step_without_its_summary_csv_is_compared_on_its_signs_and_said_so(dumps, tmp_path):
    missing = summary_csv_path(dumps[1], 0, DAMAGED_STEP)
    missing.unlink()
    step = compare_step(DAMAGED_STEP, step_dir(dumps[0], 0, DAMAGED_STEP), step_dir(dumps[1], 0, DAMAGED_STEP))
    assert step.statistics_a is not None and step.statistics_b is None
    assert step.statistics_missing == (f"{missing} (absent)",)
    comparison = compare_dumps(*dumps, tmp_path / "out", plots=False)
    rank = comparison.ranks[0]
    assert rank.steps == list(range(STEPS)) and rank.summary == [1.0] * STEPS  # compared, on signs
    assert rank.statistics_missing == {DAMAGED_STEP: (f"{missing} (absent)",)}
    assert f"  step {DAMAGED_STEP} compared on signs only, no statistics (norms not judged): {missing} (absent)" \
        in comparison.table()
    saved = json.loads((tmp_path / "out" / "verdict.json").read_text())
    assert saved["ranks"][0]["statistics_missing"] == [{"step": DAMAGED_STEP, "files": [f"{missing} (absent)"]}]
    assert comparison.verdict.partial is None  # every step and parameter was compared


def test_the_command_exits_2_naming_the_damaged_step_and_skip_damaged_lists_it(dumps):
    damaged = flip_a_byte(archive_of(dumps[1]))
    refused = CliRunner().invoke(main, ["compare", *map(str, dumps), "--no-mlflow"])
    assert refused.exit_code == 2
    assert f"error: rank0 step{DAMAGED_STEP}: {damaged}: field bits fails its CRC-32 check" in refused.output
    skipped = CliRunner().invoke(main, ["compare", *map(str, dumps), "--no-mlflow", "--skip-damaged"])
    assert skipped.exit_code == 0, skipped.output
    assert f"step {DAMAGED_STEP} damaged, skipped (not compared): {damaged}: field bits fails" in skipped.stdout
    assert "partial: 1 damaged step skipped" in skipped.stdout


def test_the_comparison_run_lists_the_skipped_step_and_the_missing_statistics(sqlite_store, dumps):
    damaged = flip_a_byte(archive_of(dumps[1]))
    missing = summary_csv_path(dumps[0], 0, 3)
    missing.unlink()
    result = compare_runs(*dumps, experiment="damaged-dumps", skip_damaged=True, plots=False)
    tags = MlflowClient().get_run(result.run_id).data.tags
    assert tags["msprobe_mlflow.compare.skipped_damaged"] == f"rank0 step{DAMAGED_STEP}: {damaged}"
    assert tags["msprobe_mlflow.compare.statistics_missing"] == f"rank0 step3: {missing} (absent)"
    assert tags["msprobe_mlflow.compare.partial"] == "partial: 1 damaged step skipped"
    assert f"step {DAMAGED_STEP} damaged, skipped (not compared): {damaged}" in tags["mlflow.note.content"]
    saved = mlflow.artifacts.load_dict(f"runs:/{result.run_id}/grad_compare/verdict.json")
    assert [SkippedStep(**s) for s in saved["ranks"][0]["skipped_steps"]] == result.comparison.ranks[0].skipped_steps
