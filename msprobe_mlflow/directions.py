"""Gradient directions (``grad > 0``) on disk, in both forms, each with its reader next to its writer.

- ``packed`` (ours, default): one uncompressed ``.npz`` archive per rank and step holding every parameter's sign
  bits (``np.packbits`` order, each parameter padded to a whole byte) with names and shapes: 1 bit per element plus
  a small header, and one file to upload per step.
- ``npy`` (msprobe's): one boolean ``.npy`` per parameter, 1 byte per element.

Everything loads with ``allow_pickle=False``; a malformed file raises ``ValueError`` naming the file and field.
``open_step_directions`` lists a step's parameters (names, shapes) and reads each one's bits only when asked, so a
reader such as the comparator holds one parameter in memory at a time, not the whole step.
"""
from __future__ import annotations

import io
import json
import math
import os
import struct
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from msprobe_mlflow.layout import consecutive_slices, packed_slices
from msprobe_mlflow.safe_paths import atomic_write_bytes, param_file_stem, refuse_symlink

PACKED_FILE_NAME = "directions.npz"
NAME_MAP_FILE_NAME = "param_names.json"
PACKED_FORMAT_VERSION = 1

# Per-parameter directions as read back: name -> (shape, packed sign bits).
Directions = dict[str, tuple[tuple[int, ...], np.ndarray]]


@dataclass(frozen=True)
class StoredDirection:
    """One parameter's directions on disk: its shape is known, its bits are read only by ``packed_bits()``."""

    path: Path
    shape: tuple[int, ...]
    load: Callable[[], np.ndarray] = field(repr=False, compare=False)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def packed_bits(self) -> np.ndarray:
        """``np.packbits(grad > 0)`` of this parameter (``packed_length(numel)`` bytes), read from disk now."""
        return self.load()


def write_packed(path: Path, names: list[str], shapes: list[tuple[int, ...]], bits: np.ndarray) -> None:
    buffer = io.BytesIO()
    np.savez(
        buffer,
        format_version=np.array(PACKED_FORMAT_VERSION),
        names=np.array(names, dtype=str),
        ndims=np.array([len(s) for s in shapes], dtype=np.int64),
        dims=np.array([d for s in shapes for d in s], dtype=np.int64),
        bits=np.ascontiguousarray(bits, dtype=np.uint8),
    )
    atomic_write_bytes(path, buffer.getvalue())


def _read_npy_header(f) -> tuple[tuple[int, ...], np.dtype]:
    """Shape and dtype from an open ``.npy`` stream (NPY 1.0 or 2.0), leaving the stream at the data."""
    version = np.lib.format.read_magic(f)
    if version not in ((1, 0), (2, 0)):
        raise ValueError(f"NPY version {version}, expected 1.0 or 2.0")
    read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
    shape, _, dtype = read_header(f)
    return tuple(shape), dtype


def _stored_array_bits(archive: zipfile.ZipFile, member: str, path: Path) -> np.ndarray:
    """The uint8 array ``member`` of an uncompressed ``.npz``, memory-mapped (a compressed one is read whole)."""
    info = archive.getinfo(member)
    if info.compress_type != zipfile.ZIP_STORED:
        with archive.open(member) as f:
            return np.lib.format.read_array(f, allow_pickle=False)
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        local_header = f.read(30)
        if len(local_header) != 30 or local_header[:4] != b"PK\x03\x04":
            raise ValueError(f"field {member[:-4]} has a damaged zip header")
        name_length, extra_length = struct.unpack("<HH", local_header[26:30])
        f.seek(info.header_offset + 30 + name_length + extra_length)
        shape, dtype = _read_npy_header(f)
        offset = f.tell()
    if dtype != np.uint8 or len(shape) != 1:
        raise ValueError(f"field {member[:-4]} is {dtype} with shape {list(shape)}, expected 1-D uint8")
    if shape[0] == 0:
        return np.empty(0, dtype=np.uint8)
    return np.memmap(path, dtype=np.uint8, mode="r", offset=offset, shape=shape)


def open_packed(path: Path) -> dict[str, StoredDirection]:
    """The parameters of a packed archive; the ``bits`` field is memory-mapped, each parameter read when asked."""
    missing = []
    refuse_symlink(path)
    try:
        with np.load(path, allow_pickle=False) as archive:
            missing = [key for key in ("format_version", "names", "ndims", "dims", "bits") if key not in archive.files]
            if not missing:
                fields = {key: archive[key] for key in ("format_version", "names", "ndims", "dims")}
                bits = _stored_array_bits(archive.zip, "bits.npy", path)
    except Exception as e:  # zip or npy header damage, truncation
        raise ValueError(f"{path}: not a readable direction archive ({e})") from e
    if missing:
        raise ValueError(f"{path}: field {missing[0]} is missing from the direction archive")
    if int(fields["format_version"]) != PACKED_FORMAT_VERSION:
        raise ValueError(f"{path}: field format_version = {int(fields['format_version'])}, "
                         f"expected {PACKED_FORMAT_VERSION}")
    names, ndims, dims = fields["names"], fields["ndims"], fields["dims"]
    if len(ndims) != len(names) or int(ndims.sum()) != len(dims) or (dims < 0).any() or (ndims < 0).any():
        raise ValueError(f"{path}: fields names/ndims/dims disagree ({len(names)} names, {len(ndims)} ndims, "
                         f"{len(dims)} dims)")
    shapes = [tuple(dims[piece].tolist()) for piece in consecutive_slices(ndims.tolist())]
    pieces = packed_slices(math.prod(shape) for shape in shapes)
    needed = pieces[-1].stop if pieces else 0
    if needed != len(bits):
        raise ValueError(f"{path}: field bits holds {len(bits)} bytes, the shapes need {needed}")
    return {name: StoredDirection(path, shape, lambda piece=piece: np.array(bits[piece]))
            for name, shape, piece in zip(names.tolist(), shapes, pieces)}


def read_packed_laid_out(path: Path, names: list[str], shapes: list[tuple[int, ...]]) -> np.ndarray | None:
    """The whole ``bits`` field of a packed archive that holds exactly ``names`` with ``shapes``, in that order, read
    at once; None for any other archive (``open_packed`` then says what it holds). A reader that knows the layout
    compares a whole step in one go instead of listing thousands of small parameters one by one."""
    try:
        with np.load(refuse_symlink(path), allow_pickle=False) as archive:
            if (int(archive["format_version"]) != PACKED_FORMAT_VERSION or archive["names"].tolist() != list(names)
                    or archive["ndims"].tolist() != [len(shape) for shape in shapes]
                    or archive["dims"].tolist() != [d for shape in shapes for d in shape]):
                return None
            bits = archive["bits"]
    except Exception:  # damaged, or not ours: open_packed names the problem
        return None
    needed = sum((math.prod(shape) + 7) // 8 for shape in shapes)
    return bits if bits.dtype == np.uint8 and bits.shape == (needed,) else None


def read_packed(path: Path) -> Directions:
    return {name: (stored.shape, stored.packed_bits()) for name, stored in open_packed(path).items()}


def write_npy(step_dir: Path, names: list[str], shapes: list[tuple[int, ...]], bits: np.ndarray) -> None:
    """msprobe's form: ``{step_dir}/{name}.npy`` booleans; unsafe names get a sanitised stem, mapped in a JSON."""
    step_dir.mkdir(parents=True, exist_ok=True)
    renamed = {}
    for name, shape, piece in zip(names, shapes, packed_slices(math.prod(shape) for shape in shapes)):
        signs = np.unpackbits(bits[piece], count=math.prod(shape)).astype(bool).reshape(shape)
        stem = param_file_stem(name)
        if stem != name:
            renamed[stem] = name
        buffer = io.BytesIO()
        np.save(buffer, signs)
        atomic_write_bytes(step_dir / f"{stem}.npy", buffer.getvalue())
    if renamed:
        atomic_write_bytes(step_dir / NAME_MAP_FILE_NAME, json.dumps(renamed, indent=1).encode())


def _load_npy_bits(path: Path, shape: tuple[int, ...]) -> np.ndarray:
    try:
        signs = np.load(path, allow_pickle=False)
    except Exception as e:
        raise ValueError(f"{path}: not a readable .npy file ({e})") from e
    if signs.dtype != np.bool_ or signs.shape != shape:
        raise ValueError(f"{path}: holds {signs.dtype} {list(signs.shape)}, its header said bool {list(shape)}")
    return np.packbits(signs.reshape(-1))


def open_npy_folder(step_dir: Path) -> dict[str, StoredDirection]:
    """msprobe's boolean ``.npy`` files of a step folder: headers are checked now, data read when asked."""
    renamed = {}
    map_path = step_dir / NAME_MAP_FILE_NAME
    if map_path.exists():
        try:
            renamed = json.loads(map_path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ValueError(f"{map_path}: not valid JSON ({e})") from e
        if not isinstance(renamed, dict) or not all(isinstance(v, str) for v in renamed.values()):
            raise ValueError(f"{map_path}: expected an object mapping file stems to parameter names, found "
                             f"{json.dumps(renamed)[:200]}")
    result: dict[str, StoredDirection] = {}
    for path in sorted(step_dir.glob("*.npy")):
        refuse_symlink(path)
        try:
            with open(path, "rb") as f:
                shape, dtype = _read_npy_header(f)
        except Exception as e:
            raise ValueError(f"{path}: not a readable .npy file ({e})") from e
        if dtype != np.bool_:
            raise ValueError(f"{path}: dtype {dtype}, expected bool (np.save(grad > 0))")
        result[renamed.get(path.stem, path.stem)] = StoredDirection(
            path, shape, lambda path=path, shape=shape: _load_npy_bits(path, shape))
    return result


def read_npy_folder(step_dir: Path) -> Directions:
    return {name: (stored.shape, stored.packed_bits()) for name, stored in open_npy_folder(step_dir).items()}


def open_step_directions(step_dir: str | os.PathLike) -> dict[str, StoredDirection]:
    """Directions of one rank and step, whichever form the folder holds (packed archive first), read lazily."""
    step_dir = Path(step_dir)
    packed = step_dir / PACKED_FILE_NAME
    if packed.exists():
        return open_packed(packed)
    return open_npy_folder(step_dir)


def read_step_directions(step_dir: str | os.PathLike) -> Directions:
    """Directions of one rank and step, whichever form the folder holds (packed archive first)."""
    return {name: (stored.shape, stored.packed_bits()) for name, stored in open_step_directions(step_dir).items()}
