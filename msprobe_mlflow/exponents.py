"""Exponent counts on disk: ``rank{R}/exponents_{S}.npz`` beside the step's CSV (ours; msprobe's CSV stays its own
bytes), written before the CSV as the directions are.

An ``.npz`` (``np.savez``: compressing it cost 10 ms a step of 512 parameters, writing it 0.2 ms) holding the
parameters' ``names`` and their counts from exponent ``lowest`` to ``highest`` (the range that occurs at this step
in any parameter; none: ``highest < lowest``), then zeros, then non-finite elements, flattened (``counts``, in the
narrowest unsigned integer type that holds them): a few dozen columns of the
:data:`~msprobe_mlflow.statistics_table.EXPONENT_BINS` a step computes; and where known, the step's ``loss_scale``
(float64), at which the format losses are read. Read back with ``allow_pickle=False``, every field capped by what
the others allow before it is read; a damaged file raises :class:`~msprobe_mlflow.directions.DamagedFile` naming
the file and the field.
"""
from __future__ import annotations

import io
import os
import zipfile
from pathlib import Path

import numpy as np

from msprobe_mlflow.directions import MAX_METADATA_BYTES, DamagedFile, FieldError, read_field
from msprobe_mlflow.safe_paths import atomic_write_bytes, refuse_symlink
from msprobe_mlflow.statistics_table import EXPONENT_HIGH, EXPONENT_LOW, ExponentCounts

FILE_PREFIX, FILE_SUFFIX = "exponents_", ".npz"
FORMAT_VERSION = 1


def exponents_file_name(step: int) -> str:
    return f"{FILE_PREFIX}{step}{FILE_SUFFIX}"


def write_exponents(path: str | os.PathLike, names: list[str], counts: ExponentCounts,
                    loss_scale: float | None = None) -> None:
    """Writes ``counts`` (a row per name) and the ``loss_scale`` where known (see the module docstring)."""
    if len(counts.kept) != len(names):
        raise ValueError(f"{path}: {len(counts.kept)} rows of exponent counts for {len(names)} names")
    kept = counts.kept.reshape(-1)
    buffer = io.BytesIO()
    np.savez(buffer, format_version=np.array(FORMAT_VERSION), names=np.array(names, dtype=str),
             lowest=np.array(counts.lowest), highest=np.array(counts.highest),
             counts=kept.astype(np.min_scalar_type(int(kept.max(initial=0)))),
             **({} if loss_scale is None else {"loss_scale": np.array(float(loss_scale))}))
    atomic_write_bytes(Path(path), buffer.getvalue())


def read_exponents(path: str | os.PathLike) -> tuple[list[str], ExponentCounts, float | None]:
    """The names, exponent counts (a row per name) and loss scale (None: not known) of a file of
    :func:`write_exponents`. Raises :class:`DamagedFile` naming the file and the field."""
    path = Path(path)
    try:
        with zipfile.ZipFile(refuse_symlink(path)) as archive:
            names, counts, loss_scale = _read_fields(archive)
    except FieldError as e:
        raise DamagedFile(path, str(e)) from None
    except Exception as e:  # zip or npy header damage, truncation, a CRC that zipfile checks, pickled objects
        raise DamagedFile(path, f"not a readable exponent file ({e})") from e
    return names, counts, loss_scale


def _scalar(archive: zipfile.ZipFile, field: str, low: int, high: int) -> int:
    value = read_field(archive, field, 8, "a number needs 8")
    if value.shape != () or value.dtype.kind not in "iu" or not low <= int(value) <= high:
        raise FieldError(f"field {field} = {value.tolist()}, expected an integer from {low} to {high}")
    return int(value)


def _read_fields(archive: zipfile.ZipFile) -> tuple[list[str], ExponentCounts, float | None]:
    present = set(archive.namelist())
    for field in ("format_version", "names", "lowest", "highest", "counts"):
        if f"{field}.npy" not in present:
            raise FieldError(f"field {field} is missing from the exponent file")
    _scalar(archive, "format_version", FORMAT_VERSION, FORMAT_VERSION)
    names = read_field(archive, "names", MAX_METADATA_BYTES, f"more than the {MAX_METADATA_BYTES} names may hold")
    if names.dtype.kind != "U":
        raise FieldError(f"field names is {names.dtype}, expected text")
    lowest = _scalar(archive, "lowest", EXPONENT_LOW, EXPONENT_HIGH + 1)
    highest = _scalar(archive, "highest", lowest - 1, EXPONENT_HIGH)
    width = highest - lowest + 3
    needed = len(names) * width * 8
    counts = read_field(archive, "counts", needed, f"the names and exponents need {needed}")
    if counts.dtype.kind not in "iu" or counts.size != len(names) * width or (counts < 0).any():
        raise FieldError(f"field counts holds {counts.size} {counts.dtype} values, expected {len(names) * width} "
                         f"counts ({len(names)} names, exponents {lowest} to {highest}, zeros, non-finite)")
    kept = ExponentCounts(lowest, counts.astype(np.int64).reshape(len(names), width))
    loss_scale = None
    if "loss_scale.npy" in present:
        value = read_field(archive, "loss_scale", 8, "a number needs 8")
        if value.shape != () or value.dtype != np.float64 or not float(value) > 0:
            raise FieldError(f"field loss_scale = {value.tolist()}, expected a positive float64")
        loss_scale = float(value)
    return names.tolist(), kept, loss_scale
