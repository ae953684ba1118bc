"""Gradient directions (``grad > 0``) on disk, in both forms, each with its reader next to its writer.

- ``packed`` (ours, default): one uncompressed ``.npz`` archive per rank and step holding every parameter's sign
  bits (``np.packbits`` order, each parameter padded to a whole byte) with names and shapes: 1 bit per element plus
  a small header, and one file to upload per step.
- ``npy`` (msprobe's): one boolean ``.npy`` per parameter, 1 byte per element.

Everything loads with ``allow_pickle=False``; a malformed file raises ``ValueError`` naming the file and field.
"""
from __future__ import annotations

import io
import json
import math
import os
from pathlib import Path

import numpy as np

from msprobe_mlflow.records import packed_length
from msprobe_mlflow.safe_paths import atomic_write_bytes, param_file_stem

PACKED_FILE_NAME = "directions.npz"
NAME_MAP_FILE_NAME = "param_names.json"
PACKED_FORMAT_VERSION = 1

# Per-parameter directions as read back: name -> (shape, packed sign bits).
Directions = dict[str, tuple[tuple[int, ...], np.ndarray]]


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


def read_packed(path: Path) -> Directions:
    try:
        with np.load(path, allow_pickle=False) as archive:
            fields = {key: archive[key] for key in ("format_version", "names", "ndims", "dims", "bits")}
    except KeyError as e:
        raise ValueError(f"{path}: field {e} is missing from the direction archive") from e
    except Exception as e:  # zip or npy header damage
        raise ValueError(f"{path}: not a readable direction archive ({e})") from e
    if int(fields["format_version"]) != PACKED_FORMAT_VERSION:
        raise ValueError(f"{path}: field format_version = {int(fields['format_version'])}, "
                         f"expected {PACKED_FORMAT_VERSION}")
    names, ndims, dims, bits = fields["names"], fields["ndims"], fields["dims"], fields["bits"]
    if len(ndims) != len(names) or int(ndims.sum()) != len(dims) or (dims < 0).any():
        raise ValueError(f"{path}: fields names/ndims/dims disagree ({len(names)} names, {len(ndims)} ndims, "
                         f"{len(dims)} dims)")
    result: Directions = {}
    start_dim = start_byte = 0
    for name, ndim in zip(names.tolist(), ndims.tolist()):
        shape = tuple(dims[start_dim:start_dim + ndim].tolist())
        start_dim += ndim
        end_byte = start_byte + packed_length(math.prod(shape))
        result[name] = (shape, bits[start_byte:end_byte])
        start_byte = end_byte
    if start_byte != len(bits):
        raise ValueError(f"{path}: field bits holds {len(bits)} bytes, the shapes need {start_byte}")
    return result


def write_npy(step_dir: Path, names: list[str], shapes: list[tuple[int, ...]], bits: np.ndarray) -> None:
    """msprobe's form: ``{step_dir}/{name}.npy`` booleans; unsafe names get a sanitised stem, mapped in a JSON."""
    step_dir.mkdir(parents=True, exist_ok=True)
    renamed = {}
    start = 0
    for name, shape in zip(names, shapes):
        numel = math.prod(shape)
        end = start + packed_length(numel)
        signs = np.unpackbits(bits[start:end], count=numel).astype(bool).reshape(shape)
        start = end
        stem = param_file_stem(name)
        if stem != name:
            renamed[stem] = name
        buffer = io.BytesIO()
        np.save(buffer, signs)
        atomic_write_bytes(step_dir / f"{stem}.npy", buffer.getvalue())
    if renamed:
        atomic_write_bytes(step_dir / NAME_MAP_FILE_NAME, json.dumps(renamed, indent=1).encode())


def read_npy_folder(step_dir: Path) -> Directions:
    renamed = {}
    map_path = step_dir / NAME_MAP_FILE_NAME
    if map_path.exists():
        try:
            renamed = json.loads(map_path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ValueError(f"{map_path}: not valid JSON ({e})") from e
    result: Directions = {}
    for path in sorted(step_dir.glob("*.npy")):
        if path.is_symlink():
            raise ValueError(f"{path}: is a symbolic link; direction files must be plain files")
        try:
            signs = np.load(path, allow_pickle=False)
        except Exception as e:
            raise ValueError(f"{path}: not a readable .npy file ({e})") from e
        if signs.dtype != np.bool_:
            raise ValueError(f"{path}: dtype {signs.dtype}, expected bool (np.save(grad > 0))")
        result[renamed.get(path.stem, path.stem)] = (signs.shape, np.packbits(signs.reshape(-1)))
    return result


def read_step_directions(step_dir: str | os.PathLike) -> Directions:
    """Directions of one rank and step, whichever form the folder holds (packed archive first)."""
    step_dir = Path(step_dir)
    packed = step_dir / PACKED_FILE_NAME
    if packed.exists():
        return read_packed(packed)
    return read_npy_folder(step_dir)
