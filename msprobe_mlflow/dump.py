"""The local dump: msprobe's folder layout, its CSV text, and the one reader and one writer for it.

```
{dump_path}/rank{R}/grad_summary_{S}.csv       every level (UTF-8 with BOM, CRLF)
{dump_path}/rank{R}/step{S}/directions.npz     L1/L2, packed form (ours)
{dump_path}/rank{R}/step{S}/{param}.npy        L1/L2, msprobe's boolean form
{dump_path}/rank{R}/exponents_{S}.npz          opt-in, ours: the elements at each binary exponent (exponents.py)
{dump_path}/rank{R}/findings/                  ours: what the live sinks found (live verdict, anomaly flags)
{dump_path}/rank{R}/training_id                 ours: the ID of the training that writes this rank folder
{dump_path}/rank{R}/training.lock               ours: there while a training writes this rank folder, locked by it
{dump_path}/msprobe_mlflow_config.json         ours: the framework, config and training ID that wrote the dump
{dump_path}/previous/{ID}/                     ours: an earlier training's dump, set aside by the next one
```

A dump holds one training's steps: a monitor sets aside what another training left in its ``dump_path``
(:func:`set_aside_other_training`), and ``compare`` and ``upload`` refuse a folder mixed otherwise (by hand, or by
a writer that records no training ID: :func:`check_one_training`).

In a run, ``grad_probe/rank{R}/steps_{ranges}.zip`` (``archive_every_n_steps``; ``steps_0-9_12.zip`` holds steps 0
to 9 and 12) stands for those steps' ``grad_summary_{S}.csv``, ``step{S}/directions.npz`` and
``exponents_{S}.npz``, under these names:
one request per archive instead of two per step. Readers of a run expand it into this layout.

A run's ``grad_probe/`` artifacts mirror this tree, so the names and their parsers below serve both: the
``relative_*`` functions give POSIX paths relative to the dump's root, the ``parse_*`` functions read a name back
(None when it is not one of ours).
"""
from __future__ import annotations

import csv
import functools
import io
import json
import math
import os
import re
import uuid
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

try:
    import fcntl
except ImportError:  # Windows: no lock file, so no training is ever taken for abandoned
    fcntl = None

from msprobe_mlflow.config import GradProbeConfig
from msprobe_mlflow.directions import PACKED_FILE_NAME, write_npy, write_packed
from msprobe_mlflow.exponents import exponents_file_name, write_exponents
from msprobe_mlflow.levels import LEVELS, MD5_COLUMN
from msprobe_mlflow.records import StepRecord
from msprobe_mlflow.safe_paths import atomic_write_bytes, confined_path, refuse_symlink
from msprobe_mlflow.vocabulary import TRACE_FOLDER

DUMP_CONFIG_FILE_NAME = "msprobe_mlflow_config.json"
TRAINING_ID_FILE_NAME = "training_id"
TRAINING_LOCK_FILE_NAME = "training.lock"
PREVIOUS_FOLDER = "previous"
RANK_PREFIX, STEP_PREFIX = "rank", "step"
FINDINGS_FOLDER = "findings"
SUMMARY_PREFIX, SUMMARY_SUFFIX = "grad_summary_", ".csv"
ARCHIVE_PREFIX, ARCHIVE_SUFFIX = "steps_", ".zip"
MAX_ARCHIVE_MEMBER_BYTES = 4 << 30  # a member larger than this (uncompressed) is refused, not extracted
MAX_ARCHIVE_STEPS = 100_000  # a name announcing more steps is no archive of ours


def relative_rank_dir(rank: int) -> str:
    return f"{RANK_PREFIX}{rank}"


def relative_step_dir(rank: int, step: int) -> str:
    return f"{relative_rank_dir(rank)}/{STEP_PREFIX}{step}"


def relative_summary_path(rank: int, step: int) -> str:
    return f"{relative_rank_dir(rank)}/{SUMMARY_PREFIX}{step}{SUMMARY_SUFFIX}"


def _parse_index(name: str, prefix: str, suffix: str = "") -> int | None:
    match = re.match(rf"^{re.escape(prefix)}(\d+){re.escape(suffix)}$", name)
    return int(match.group(1)) if match else None


def parse_rank_folder(name: str) -> int | None:
    """``3`` for ``rank3``; None for any other name."""
    return _parse_index(name, RANK_PREFIX)


def parse_step_folder(name: str) -> int | None:
    """``12`` for ``step12``; None for any other name."""
    return _parse_index(name, STEP_PREFIX)


def parse_summary_name(name: str) -> int | None:
    """``12`` for ``grad_summary_12.csv``; None for any other name."""
    return _parse_index(name, SUMMARY_PREFIX, SUMMARY_SUFFIX)


def step_ranges(steps, separator: str = ",", limit: int | None = None) -> str:
    """``0-3,7,9-10`` for steps 0, 1, 2, 3, 7, 9, 10: short, even for thousands of steps; cut after a whole range
    and ended with ``...`` to stay within ``limit`` characters (an MLflow tag value holds 8000)."""
    ranges: list[list[int]] = []
    for step in sorted(steps):
        if ranges and step == ranges[-1][1] + 1:
            ranges[-1][1] = step
        else:
            ranges.append([step, step])
    text = separator.join(f"{a}" if a == b else f"{a}-{b}" for a, b in ranges)
    if limit is None or len(text) <= limit:
        return text
    end = f"{separator}..."
    return text[:limit - len(end) + 1].rsplit(separator, 1)[0] + end


def relative_archive_path(rank: int, steps: list[int]) -> str:
    """``rank3/steps_0-9_12.zip`` for steps 0..9 and 12 of rank 3."""
    return f"{relative_rank_dir(rank)}/{ARCHIVE_PREFIX}{step_ranges(steps, '_')}{ARCHIVE_SUFFIX}"


def parse_archive_name(name: str) -> list[int] | None:
    """``[0, 1, 2, 12]`` for ``steps_0-2_12.zip``; None for any other name (and for ranges of more than
    ``MAX_ARCHIVE_STEPS`` steps)."""
    match = re.match(rf"^{ARCHIVE_PREFIX}(\d+(?:-\d+)?(?:_\d+(?:-\d+)?)*){re.escape(ARCHIVE_SUFFIX)}$", name)
    if not match:
        return None
    steps: list[int] = []
    for part in match.group(1).split("_"):
        first, _, last = part.partition("-")
        announced = range(int(first), int(last or first) + 1)
        if len(steps) + len(announced) > MAX_ARCHIVE_STEPS:
            return None
        steps += announced
    return steps


def rank_dir(dump_path: str | os.PathLike, rank: int) -> Path:
    return Path(dump_path) / relative_rank_dir(rank)


def findings_dir(dump_path: str | os.PathLike, rank: int) -> Path:
    """Where the live sinks keep what they found for a rank; no ``step{S}`` name, so dump readers pass it by."""
    return rank_dir(dump_path, rank) / FINDINGS_FOLDER


def summary_csv_path(dump_path: str | os.PathLike, rank: int, step: int) -> Path:
    return Path(dump_path) / relative_summary_path(rank, step)


def exponents_path(dump_path: str | os.PathLike, rank: int, step: int) -> Path:
    return rank_dir(dump_path, rank) / exponents_file_name(step)


def step_dir(dump_path: str | os.PathLike, rank: int, step: int) -> Path:
    return Path(dump_path) / relative_step_dir(rank, step)


def csv_text(rows: list[list]) -> bytes:
    """msprobe's CSV bytes: Python's ``csv`` writer (CRLF line ends) encoded as UTF-8 with a BOM."""
    out = io.StringIO()
    csv.writer(out).writerows(rows)
    return out.getvalue().encode("utf-8-sig")


def csv_cells(values: list[str]) -> list[str]:
    """Each value as one cell of a row that Python's ``csv`` writer writes (quoted where it must be), so that rows
    of known cells can be joined without the writer, byte for byte as it would write them."""
    out, cells = io.StringIO(), []
    writer = csv.writer(out)
    for value in values:
        out.seek(0)
        out.truncate()
        writer.writerow([value, ""])
        cells.append(out.getvalue()[:-len(",\r\n")])
    return cells


def summary_csv_bytes(record: StepRecord) -> bytes:
    """``csv_text([record.csv_header(), *record.csv_rows()])``, built at once for the writer thread (which shares
    the interpreter lock with training): Python's ``repr`` formats the numbers (what the ``csv`` writer writes),
    each distinct value once (shares repeat), into the layout's text (:func:`_summary_template`). Made once per record:
    the local dump writes them, the metrics read them back."""
    if record.summary_csv is None:
        record.summary_csv = _summary_csv(record)
    return record.summary_csv


def _summary_csv(record: StepRecord) -> bytes:
    numbers = record.numbers()
    distinct, where = np.unique(numbers.view(np.int64), return_inverse=True)  # by bits: -0.0 apart from 0.0
    texts = np.array(list(map(float.__repr__, distinct.view(np.float64).tolist())), dtype=object)
    cells = texts[where.reshape(numbers.shape)]
    empty = [i for i, numel in enumerate(record.numels) if not numel]
    if empty and record.share_columns:
        cells[empty, :record.share_columns] = "0"
    if LEVELS[record.level].has_md5:  # hex digits (``mix64:`` too): cells that are never quoted
        cells = np.column_stack([np.array(record.md5, dtype=str).reshape(-1), cells])
    template = _summary_template(tuple(record.csv_header()), tuple(record.names),
                                 tuple(tuple(shape) for shape in record.shapes), cells.shape[1])
    return template.format(*cells.ravel().tolist()).encode("utf-8-sig")


@functools.lru_cache(maxsize=8)
def _summary_template(header: tuple[str, ...], names: tuple[str, ...], shapes: tuple[tuple[int, ...], ...],
                      changing: int) -> str:
    """A layout's CSV text with ``{}`` for each of a row's ``changing`` cells (MD5, numbers): header, names and
    shapes quoted as Python's ``csv`` quotes them, braces doubled for ``str.format``."""
    def fixed(cells: list[str]) -> list[str]:
        return [cell.replace("{", "{{").replace("}", "}}") for cell in cells]

    lines = [",".join(fixed(csv_cells(list(header))))]
    row_middle = ",{}" * changing
    lines += [f"{name}{row_middle},{shape}" for name, shape in
              zip(fixed(csv_cells(list(names))), fixed(csv_cells([str(list(shape)) for shape in shapes])))]
    return "\r\n".join(lines) + "\r\n"


def write_csv(path: Path, rows: list[list]) -> None:
    atomic_write_bytes(path, csv_text(rows))


def read_csv(path: str | os.PathLike) -> list[list[str]]:
    with open(refuse_symlink(Path(path)), encoding="utf-8-sig", newline="") as f:
        return list(csv.reader(f))


def write_step(dump_path: str | os.PathLike, record: StepRecord, direction_format: str = "packed") -> list[Path]:
    """Writes one step's summary CSV (and directions at L1/L2, exponent counts where asked); returns the files written,
    CSV first.

    Directions and exponents are written before the CSV, so a CSV on disk means its step is complete.
    """
    written = []
    if record.exponent_counts is not None:
        path = exponents_path(dump_path, record.rank, record.step)
        write_exponents(path, record.names, record.exponent_counts, record.loss_scale)
        written.append(path)
    if record.directions is not None:
        folder = step_dir(dump_path, record.rank, record.step)
        if direction_format == "packed":
            path = folder / PACKED_FILE_NAME
            write_packed(path, record.names, record.shapes, record.directions, record.compute_format)
            written.append(path)
        else:
            write_npy(folder, record.names, record.shapes, record.directions)
            written.append(folder)
    csv_path = summary_csv_path(dump_path, record.rank, record.step)
    atomic_write_bytes(csv_path, summary_csv_bytes(record))
    return [csv_path, *written]


def write_steps_archive(dump_path: str | os.PathLike, rank: int, steps: list[int], folder: Path,
                        packed_directions) -> Path:
    """Writes ``folder/steps_{ranges}.zip`` holding each step's CSV, packed directions and exponent counts under
    their dump names (``grad_summary_{S}.csv``, ``step{S}/directions.npz``, ``exponents_{S}.npz``; the last two
    where the step has them). ``packed_directions(step_folder, scratch)`` gives the
    step's packed file (an msprobe ``.npy`` folder is packed on the way). The CSVs are deflated; the directions are
    stored as they are: sign bits do not compress (deflate kept 100.0% of them at 26 ms per MB of CPU)."""
    path = folder / relative_archive_path(rank, steps).rsplit("/", 1)[-1]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        for step in steps:
            directions = step_dir(dump_path, rank, step)
            if directions.is_dir():
                archive.write(packed_directions(directions, folder), f"{STEP_PREFIX}{step}/{PACKED_FILE_NAME}",
                              zipfile.ZIP_STORED)
            exponents = exponents_path(dump_path, rank, step)
            if exponents.exists():
                archive.write(refuse_symlink(exponents), exponents.name)
            archive.write(refuse_symlink(summary_csv_path(dump_path, rank, step)),
                          f"{SUMMARY_PREFIX}{step}{SUMMARY_SUFFIX}")
    return path


def extract_steps_archive(path: Path, rank_folder: Path) -> list[int]:
    """Expands an archive of :func:`write_steps_archive` into ``rank_folder``; returns its steps. Only the names
    its file name announces are accepted (``grad_summary_{S}.csv``, ``step{S}/directions.npz``,
    ``exponents_{S}.npz``), each at most
    ``MAX_ARCHIVE_MEMBER_BYTES``; anything else is refused with the member named, before a file is written."""
    steps = parse_archive_name(path.name)
    if steps is None:
        raise ValueError(f"{path}: not a steps archive name (expected steps_<ranges>.zip, e.g. steps_0-9_12.zip)")
    allowed = {f"{SUMMARY_PREFIX}{s}{SUMMARY_SUFFIX}" for s in steps} | {
        f"{STEP_PREFIX}{s}/{PACKED_FILE_NAME}" for s in steps} | {exponents_file_name(s) for s in steps}
    try:
        with zipfile.ZipFile(refuse_symlink(path)) as archive:
            members = archive.infolist()
            for member in members:
                if member.filename not in allowed:
                    raise ValueError(f"{path}: member {member.filename!r} is not one of the step files its name "
                                     f"announces (grad_summary_<S>.csv, step<S>/{PACKED_FILE_NAME}, "
                                     f"{exponents_file_name('<S>')})")
                if member.file_size > MAX_ARCHIVE_MEMBER_BYTES:
                    raise ValueError(f"{path}: member {member.filename!r} is {member.file_size} bytes uncompressed; "
                                     f"at most {MAX_ARCHIVE_MEMBER_BYTES} are accepted")
            for member in members:
                with archive.open(member) as source:
                    data = source.read(MAX_ARCHIVE_MEMBER_BYTES + 1)
                if len(data) > MAX_ARCHIVE_MEMBER_BYTES:  # the listed size lied
                    raise ValueError(f"{path}: member {member.filename!r} holds more than the "
                                     f"{MAX_ARCHIVE_MEMBER_BYTES} bytes accepted")
                atomic_write_bytes(confined_path(rank_folder, member.filename, f"{path}: member"), data)
    except zipfile.BadZipFile as e:
        raise ValueError(f"{path}: not a readable zip archive ({e})") from None
    return steps


def indexed_children(folder: str | os.PathLike, prefix: str) -> list[int]:
    """Sorted ``N`` of the sub-folders named ``{prefix}N`` (``RANK_PREFIX``: ``rank0``; ``STEP_PREFIX``:
    ``step12``)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = [index for child in folder.iterdir()
             if (index := _parse_index(child.name, prefix)) is not None and child.is_dir()]
    return sorted(found)


DUMP_FOLDER_EXPECTED = "expected a grad_probe dump folder (holding rank0/grad_summary_0.csv, rank0/step0/...)"


def dump_folder(path: str | os.PathLike, label: str) -> Path:
    """``path`` as a dump folder, or a ``ValueError`` saying what is there instead (nothing, a file, a folder
    without ``rank<N>/``, the steps of several trainings: :func:`check_one_training`) and what is expected;
    ``label`` names the argument (``dump_a``, ``B``)."""
    folder = Path(path)
    if not folder.exists():
        found = ": no such folder"
    elif not folder.is_dir():
        found = " is a file, not a folder"
    elif not indexed_children(folder, RANK_PREFIX):
        found = " holds no rank<N> folders"
    else:
        check_one_training(folder, f"{label} = {str(path)!r}")
        return folder
    raise ValueError(f"{label} = {str(path)!r}{found}; {DUMP_FOLDER_EXPECTED}")


def summary_steps(rank_folder: str | os.PathLike) -> list[int]:
    """Sorted steps that have a ``grad_summary_{S}.csv`` in a rank folder."""
    return sorted(step for path in Path(rank_folder).glob(f"{SUMMARY_PREFIX}*{SUMMARY_SUFFIX}")
                  if (step := parse_summary_name(path.name)) is not None)


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

    def numbers(self, name: str) -> list[float]:
        """Column ``name`` as floats (``nan`` and ``inf`` included), naming the row and cell that is no number."""
        cells = self.column(name)
        try:
            return list(map(float, cells))
        except ValueError:
            number, cell = next((number, cell) for number, cell in enumerate(cells, start=2) if not _is_float(cell))
            raise ValueError(f"{self.path}: row {number}, column {name}: {cell!r} is not a number") from None

    def shapes(self) -> list[tuple[int, ...]]:
        """The ``shape`` column (``[20, 8]``) as tuples of sizes."""
        parsed: dict[str, tuple[int, ...]] = {}  # each distinct cell once: layers repeat their shapes
        for number, cell in enumerate(self.column("shape"), start=2):
            if cell in parsed:
                continue
            try:
                shape = json.loads(cell)
                if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
                    raise ValueError
            except ValueError:
                raise ValueError(f"{self.path}: row {number}, column shape: {cell!r} is not a list of sizes "
                                 f"like [20, 8]") from None
            parsed[cell] = tuple(shape)
        return [parsed[cell] for cell in self.column("shape")]


def _is_float(cell: str) -> bool:
    try:
        float(cell)
        return True
    except ValueError:
        return False


def read_summary(path: str | os.PathLike) -> SummaryTable:
    rows = read_csv(path)
    if not rows or not rows[0] or rows[0][0].lower() != "param_name":
        raise ValueError(f"{path}: first row is not a grad_summary header (expected it to start with param_name)")
    header = [cell if cell.startswith(("(", "=")) or cell == "MD5" else cell.lower() for cell in rows[0]]
    for number, row in enumerate(rows[1:], start=2):
        if len(row) != len(header):
            raise ValueError(f"{path}: row {number} has {len(row)} cells, the header has {len(header)}")
    return SummaryTable(Path(path), header, rows[1:])


def read_statistics_table(dump_path: str | os.PathLike):
    """Every ``grad_summary_{S}.csv`` of a dump as one ``pandas.DataFrame``, for a notebook: a row per rank, step
    and parameter (model order), columns ``rank``, ``step``, ``parameter``, then the CSV's own (``MD5`` as text;
    ``max``, ``min``, ``norm`` and, at L2, the bucket fractions such as ``(-1, 0]`` and ``=0`` as floats; ``shape``
    as a tuple) and ``numel``. Raises ``ValueError`` for a folder without summaries or a malformed CSV."""
    import pandas  # only here: the dump's writer and reader need no pandas

    frames = []
    for rank in indexed_children(dump_path, RANK_PREFIX):
        for step in summary_steps(rank_dir(dump_path, rank)):
            table = read_summary(summary_csv_path(dump_path, rank, step))
            columns = {"rank": rank, "step": step, "parameter": table.column("param_name")}
            for name in table.header[1:]:
                if name != "shape":
                    columns[name] = table.column(name) if name == MD5_COLUMN else table.numbers(name)
            columns["shape"] = table.shapes()
            columns["numel"] = [math.prod(shape) for shape in columns["shape"]]
            frames.append(pandas.DataFrame(columns))
    if not frames:
        raise ValueError(f"{dump_path}: holds no rank<N>/grad_summary_<S>.csv; expected a grad_probe dump folder")
    return pandas.concat(frames, ignore_index=True)


def write_dump_config(dump_path: str | os.PathLike, framework: str, config: GradProbeConfig,
                      training_id: str | None = None) -> Path:
    """Records which framework and config wrote the dump, so an upload can give the run its params and tags, and
    which training (``training_id``, written when given)."""
    path = Path(dump_path) / DUMP_CONFIG_FILE_NAME
    saved = {"framework": framework, **({"training_id": training_id} if training_id else {}),
             "config": config.to_msprobe_dict()}
    atomic_write_bytes(path, json.dumps(saved, indent=2).encode())
    return path


def read_dump_config(dump_path: str | os.PathLike) -> dict | None:
    """The ``{"framework": ..., "config": {...}}`` that :func:`write_dump_config` wrote; None when the dump has
    none (msprobe's own dumps)."""
    config_file = Path(dump_path) / DUMP_CONFIG_FILE_NAME
    if not config_file.exists():
        return None
    try:
        saved = json.loads(refuse_symlink(config_file).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{config_file}: not a readable JSON file ({e})") from None
    if not isinstance(saved, dict) or not isinstance(saved.get("config"), dict):
        raise ValueError(f"{config_file}: field config is missing or not an object; expected the "
                         f'{{"framework": ..., "config": {{...}}}} the monitor writes')
    if "training_id" in saved:
        _check_training_id(saved["training_id"], f"{config_file}: field training_id")
    return saved


# Training IDs: which training wrote a dump, so that two trainings' steps are never taken for one.

_TRAINING_ID_PATTERN = re.compile(r"[0-9a-f]{32}")


def new_training_id() -> str:
    """A fresh training ID: a random UUID's 32 hex digits (also a safe folder name under ``previous/``)."""
    return uuid.uuid4().hex


def _check_training_id(value, where: str) -> str:
    if not isinstance(value, str) or not _TRAINING_ID_PATTERN.fullmatch(value):
        raise ValueError(f"{where} = {str(value)[:80]!r} is not a training ID; expected the 32 lower-case hex "
                         f"digits a monitor writes")
    return value


def write_training_id(dump_path: str | os.PathLike, rank: int, training_id: str) -> Path:
    """``rank{R}/training_id``, written before the rank's first step: a rank folder says on its own which training
    wrote it (ranks of one job share one ID: rank 0's)."""
    path = rank_dir(dump_path, rank) / TRAINING_ID_FILE_NAME
    atomic_write_bytes(path, _check_training_id(training_id, "training_id").encode())
    return path


def read_training_id(rank_folder: str | os.PathLike) -> str | None:
    """The ID in ``rank_folder/training_id``; None when there is none (msprobe 1.0.3, or msprobe-mlflow before
    training IDs)."""
    path = Path(rank_folder) / TRAINING_ID_FILE_NAME
    if not path.exists():
        return None
    try:
        text = refuse_symlink(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not a readable text file ({e})") from None
    return _check_training_id(text, str(path))


class TrainingLock:
    """``rank{R}/training.lock``: held (``flock``) by the process that trains into the rank folder, from before its
    first step until it closes. The operating system drops the lock when the process dies, however it dies, so a
    lock file that no process holds is a training that died without closing (SIGKILL): :meth:`abandoned`. Where
    the platform or the file system takes no locks, no file is written and no training is taken for abandoned."""

    def __init__(self, dump_path: str | os.PathLike, rank: int):
        self.path = rank_dir(dump_path, rank) / TRAINING_LOCK_FILE_NAME
        self._handle = None

    def hold(self) -> None:
        """Creates the file locked (under a temporary name, then renamed): it is never seen unlocked while the
        training lives."""
        if fcntl is None:
            return
        temporary = self.path.with_name(f".{TRAINING_LOCK_FILE_NAME}.{os.getpid()}")
        handle = open(temporary, "wb")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.replace(temporary, self.path)
        except OSError:
            handle.close()
            temporary.unlink(missing_ok=True)
            return
        self._handle = handle

    def release(self) -> None:
        """The training closed: the file goes, then the lock."""
        if self._handle is not None:
            self.path.unlink(missing_ok=True)
            self._handle.close()
            self._handle = None

    @staticmethod
    def abandoned(dump_path: str | os.PathLike, rank: int) -> bool:
        """The rank's training died without closing: its lock file is there and no process holds it."""
        path = rank_dir(dump_path, rank) / TRAINING_LOCK_FILE_NAME
        if fcntl is None or path.is_symlink() or not path.is_file():
            return False
        try:
            with open(path, "rb") as handle:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: the training lives (or a file system that takes no locks)
            return False
        return True


def _holds_steps(rank_folder: Path) -> bool:
    """Steps recorded or traced (``trace/step{S}/``): a training's that the next one must not write among."""
    return bool(summary_steps(rank_folder) or indexed_children(rank_folder, STEP_PREFIX)
                or indexed_children(rank_folder / TRACE_FOLDER, STEP_PREFIX))


def dump_trainings(folder: str | os.PathLike) -> dict[str | None, list[str]]:
    """Which training wrote which part of a dump: training ID (None: not recorded) -> ``msprobe_mlflow_config.json``
    and the rank folders holding steps (``rank0``, ...), in that order. A dump written by msprobe 1.0.3 or by
    msprobe-mlflow before training IDs has one key, None."""
    owners: dict[str | None, list[str]] = {}
    saved = read_dump_config(folder)
    if saved is not None:
        owners.setdefault(saved.get("training_id"), []).append(DUMP_CONFIG_FILE_NAME)
    for rank in indexed_children(folder, RANK_PREFIX):
        if _holds_steps(rank_dir(folder, rank)):
            owners.setdefault(read_training_id(rank_dir(folder, rank)), []).append(relative_rank_dir(rank))
    return owners


def check_one_training(folder: str | os.PathLike, label: str) -> None:
    """Refuses (``ValueError``) a dump whose parts record different trainings, naming each training and its parts:
    its steps would be compared or uploaded as one training's. A part that records no ID among parts that do
    counts as another training (written by msprobe 1.0.3, or an earlier msprobe-mlflow, into a newer dump).
    Steps that overwrote others without a rank ID of their own cannot be told apart: monitors prevent it by
    setting an earlier training aside (:func:`set_aside_other_training`)."""
    owners = dump_trainings(folder)
    if len(owners) < 2:
        return
    parts = "; ".join(f"{training_id or 'no training ID'}: {short_list(names)}"
                      for training_id, names in owners.items())
    raise ValueError(f"{label} holds the steps of {len(owners)} trainings ({parts}); compare and upload take one "
                     f"training's dump: move each training's rank folders (and its {DUMP_CONFIG_FILE_NAME}) into a "
                     f"folder of their own and give that folder")


def short_list(items: list, shown: int = 8) -> str:
    """``a, b, c`` or, past ``shown`` items, ``a, ..., h and 992 more``: a message stays short at 1000 ranks."""
    return ", ".join(map(str, items[:shown])) + (f" and {len(items) - shown} more" if len(items) > shown else "")


def set_aside_other_training(dump_path: str | os.PathLike, training_id: str,
                             ranks: list[int] | None = None) -> list[Path]:
    """Moves what another training left in ``dump_path`` to ``{dump_path}/previous/{its ID}/``, so that the
    training ``training_id`` never writes among its steps and nothing of them is lost; returns the new places.

    Moved, whole: the rank folders of ``ranks`` (None: all) that hold steps (a ``grad_summary_{S}.csv`` or a
    ``step{S}/``) and do not record ``training_id``, each under the ID it records (``before-{training_id}`` when
    it records none: msprobe 1.0.3, or msprobe-mlflow before training IDs); with them goes a copy of the other
    training's ``msprobe_mlflow_config.json``, so that each ``previous/{ID}/`` is a dump that ``compare`` and
    ``upload`` take (a copy: ranks that share a file system may each set aside their own folder; the writer then
    replaces the original). A rank folder without steps is kept (its ID, if any, replaced): it holds no step to
    mix with. A place already taken is refused before anything moves. Moves stay within ``dump_path``: one rename
    each, whatever the size, on any mount.
    """
    dump_path = Path(dump_path)
    previous = dump_path / PREVIOUS_FOLDER
    unrecorded = f"before-{training_id}"
    moves = []
    for rank in indexed_children(dump_path, RANK_PREFIX) if ranks is None else ranks:
        folder = rank_dir(dump_path, rank)
        if not folder.is_dir():
            continue
        recorded = read_training_id(folder)
        if recorded != training_id and _holds_steps(folder):
            moves.append((folder, previous / (recorded or unrecorded) / folder.name))
    taken = [str(target) for _, target in moves if os.path.lexists(target)]
    if taken:
        raise ValueError(f"{dump_path} holds another training's steps, which would be moved to {taken[0]}, but "
                         f"that is taken; move or delete it, or give this training another dump_path")
    moved = []
    saved = read_dump_config(dump_path) if moves else None
    if saved is not None and saved.get("training_id") != training_id:
        target = previous / (saved.get("training_id") or unrecorded) / DUMP_CONFIG_FILE_NAME
        atomic_write_bytes(target, (dump_path / DUMP_CONFIG_FILE_NAME).read_bytes())
        moved.append(target)
    for source, target in moves:
        target.parent.mkdir(parents=True, exist_ok=True)
        source.rename(target)
        moved.append(target)
    return moved
