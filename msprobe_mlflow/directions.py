"""Gradient directions (``grad > 0``) on disk, in both forms, each with its reader next to its writer.

- ``packed`` (ours, default): one uncompressed ``.npz`` archive per rank and step holding every parameter's sign
  bits (``np.packbits`` order, each parameter padded to a whole byte) with names and shapes: 1 bit per element plus
  a small header, and one file to upload per step. After the bits, where the monitor knew it, the format the run
  computed that step in (``compute_format``, :mod:`msprobe_mlflow.formats`): it travels wherever the directions go
  (archives, runs, the live verdict's baseline), and a reader that does not know the field ignores it.
- ``npy`` (msprobe's): one boolean ``.npy`` per parameter, 1 byte per element.

Everything loads with ``allow_pickle=False``; a malformed or damaged file raises :class:`DamagedFile` (a
``ValueError``) naming the file and field. Every read of a packed archive is checked against the CRC-32s the archive
records (the zip's own checksums), the memory-mapped bits included, so a flipped byte is refused, never compared;
msprobe's ``.npy`` form records no checksum: its header is checked against the file's size and each element must be
the 0 or 1 ``np.save(grad > 0)`` writes. A
compressed archive (``np.savez_compressed``: not ours, but accepted) is inflated no further than its shapes need,
so a zip bomb is refused before it is inflated; its bits are then held in memory.
``open_step_directions`` lists a step's parameters (names, shapes) and reads each one's bits only when asked, so a
reader such as the comparator holds one parameter in memory at a time, not the whole step.
"""
from __future__ import annotations

import functools
import io
import json
import math
import os
import struct
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from msprobe_mlflow.formats import UNIT_ROUNDOFF
from msprobe_mlflow.layout import consecutive_slices, packed_slices
from msprobe_mlflow.safe_paths import atomic_write_bytes, atomic_writer, param_file_stem, refuse_symlink

try:  # the same CRC-32 with the CPU's carry-less multiply: a step's 8.4 MB of signs in 0.16 ms, zlib's 2 to 3 ms
    from zlib_ng.zlib_ng import crc32
except ImportError:  # a platform without its wheel: the same values, slower
    from zlib import crc32

PACKED_FILE_NAME = "directions.npz"
COMPUTE_FORMAT = "compute_format"  # the packed archive's optional field after the bits
NAME_MAP_FILE_NAME = "param_names.json"
PACKED_FORMAT_VERSION = 1

# Per-parameter directions as read back: name -> (shape, packed sign bits).
Directions = dict[str, tuple[tuple[int, ...], np.ndarray]]


class DamagedFile(ValueError):
    """A dump file that cannot be read as it was written (damaged, truncated, or not what its name says): ``path``
    names it and ``problem`` says what is wrong, so that a caller can name the step and go on without it (``compare
    --skip-damaged``, the live verdict) rather than compare what the file no longer holds."""

    def __init__(self, path: str | os.PathLike, problem: str):
        super().__init__(f"{path}: {problem}")
        self.path, self.problem = Path(path), problem


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


def _layout_fields(names, shapes) -> dict[str, np.ndarray]:
    """The fields of a packed archive that say what it holds (all but ``bits``)."""
    return {"format_version": np.array(PACKED_FORMAT_VERSION), "names": np.array(names, dtype=str),
            "ndims": np.array([len(s) for s in shapes], dtype=np.int64),
            "dims": np.array([d for s in shapes for d in s], dtype=np.int64)}


def write_packed(path: Path, names: list[str], shapes: list[tuple[int, ...]], bits: np.ndarray,
                 compute_format: str | None = None) -> None:
    """The archive ``np.savez`` writes for these fields (``compute_format`` after the bits, where known), byte for
    byte, from the bytes it gives this layout (:func:`_packed_template`) and the bits' CRC-32: a few Python
    operations a step instead of ``zipfile``'s hundreds, on the writer thread that shares the interpreter lock with
    training."""
    bits = np.ascontiguousarray(bits, dtype=np.uint8).reshape(-1)
    template = _packed_template(tuple(names), tuple(tuple(shape) for shape in shapes), len(bits), compute_format)
    head, tail = bytearray(template.head), bytearray(template.tail)
    crc = crc32(bits, template.bits_header_crc)
    struct.pack_into("<I", head, template.local_crc_at, crc)
    struct.pack_into("<I", tail, template.central_crc_at, crc)
    with atomic_writer(path) as f:
        f.write(head)
        f.write(bits)
        f.write(tail)


@dataclass(frozen=True)
class _PackedTemplate:
    """``np.savez``'s bytes for one layout, before (``head``) and after (``tail``) the bits' data, and where the one
    thing that changes from step to step goes: the bits member's CRC-32, in its local header (``head``) and its
    central directory entry (``tail``). ``np.savez`` dates every member 1980-01-01, so no time changes."""

    head: bytes
    tail: bytes
    bits_header_crc: int  # CRC-32 of the bits member's .npy header, continued over the bits
    local_crc_at: int
    central_crc_at: int


@functools.lru_cache(maxsize=4)
def _packed_template(names: tuple[str, ...], shapes: tuple[tuple[int, ...], ...], length: int,
                     compute_format: str | None) -> _PackedTemplate:
    """What ``np.savez`` writes for this layout with ``length`` zero bytes of bits, split around them; written
    through a temporary file, so a large model's bits are never held twice. The CRC-32 sits 14 bytes into a local
    header and 16 into a central directory entry, whose size is 46 bytes and the lengths at 28 (APPNOTE.TXT 4.3.7,
    4.3.12)."""
    known = {COMPUTE_FORMAT: np.array(compute_format)} if compute_format is not None else {}
    with tempfile.TemporaryFile() as f:
        np.savez(f, **_layout_fields(names, shapes), bits=np.zeros(length, np.uint8), **known)
        with zipfile.ZipFile(f) as archive:
            members, entry = archive.infolist(), archive.start_dir
        before = [member.filename for member in members].index("bits.npy")
        bits_member = members[before]
        header_at = _member_data_offset(f, bits_member)
        bits_at = header_at + bits_member.file_size - length
        f.seek(0)
        head = f.read(bits_at)
        f.seek(bits_at + length)
        tail = f.read()
    entry -= bits_at + length  # the central directory's place in the tail
    for _ in members[:before]:
        entry += 46 + sum(struct.unpack("<HHH", tail[entry + 28:entry + 34]))
    return _PackedTemplate(head, tail, crc32(head[header_at:]), bits_member.header_offset + 14, entry + 16)


def _read_npy_header(f) -> tuple[tuple[int, ...], np.dtype]:
    """Shape and dtype from an open ``.npy`` stream (NPY 1.0 or 2.0), leaving the stream at the data."""
    version = np.lib.format.read_magic(f)
    if version not in ((1, 0), (2, 0)):
        raise ValueError(f"NPY version {version}, expected 1.0 or 2.0")
    read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
    shape, _, dtype = read_header(f)
    return tuple(shape), dtype


def checked_npy_header(path: Path) -> tuple[tuple[int, ...], np.dtype]:
    """Shape and dtype of the ``.npy`` file at ``path``, checked against the file's size before its data is read:
    ``np.load`` first allocates what the header claims, so ten bytes claiming a billion elements are refused here.
    Raises ``ValueError`` naming the file. An object array's size is not known from its header: loading it with
    ``allow_pickle=False`` refuses it."""
    try:
        with open(path, "rb") as f:
            shape, dtype = _read_npy_header(f)
            held = os.fstat(f.fileno()).st_size - f.tell()
    except Exception as e:
        raise DamagedFile(path, f"not a readable .npy file ({e})") from e
    needed = math.prod(shape) * dtype.itemsize
    if not dtype.hasobject and held != needed:
        raise DamagedFile(path, f"not a readable .npy file (it holds {held} data bytes, its header's shape "
                                f"{list(shape)} needs {needed})")
    return shape, dtype


class FieldError(ValueError):
    """A field of a packed archive that is missing, malformed or larger than the archive's shapes allow."""


def read_field(archive: zipfile.ZipFile, field: str, max_bytes: int, limit: str) -> np.ndarray:
    """Field ``field`` of an ``.npz``, stored or compressed, read no further than its header's shape needs.

    Refused before its data is read (or inflated) when that shape needs more than ``max_bytes`` (``limit`` says
    why that many), and after reading one byte past it when the member holds more than its shape: a compressed
    member is never inflated whole (zip bombs). Pickled objects are refused, never loaded.
    """
    with archive.open(f"{field}.npy") as f:
        shape, dtype = _read_npy_header(f)
        if dtype.hasobject:
            raise ValueError(f"field {field} holds Python objects (dtype {dtype}), which are never loaded "
                             f"(allow_pickle=False)")
        if len(shape) > 1:
            raise FieldError(f"field {field} has shape {list(shape)}, expected one dimension at most")
        size = math.prod(shape) * dtype.itemsize
        if size > max_bytes:
            raise FieldError(f"field {field} claims {size} bytes, {limit}")
        data = f.read(size)
        if len(data) != size:
            raise FieldError(f"field {field} holds {len(data)} bytes, its shape {list(shape)} needs {size}")
        if f.read(1):
            raise FieldError(f"field {field} holds more bytes than its shape {list(shape)} needs")
    return np.frombuffer(data, dtype=dtype).reshape(shape)


def _check_bits(dtype: np.dtype, shape: tuple[int, ...], needed: int) -> None:
    if dtype != np.uint8 or len(shape) != 1:
        raise FieldError(f"field bits is {dtype} with shape {list(shape)}, expected 1-D uint8")
    if shape[0] != needed:
        raise FieldError(f"field bits holds {shape[0]} bytes, the shapes need {needed}")


def _member_data_offset(f, info: zipfile.ZipInfo) -> int:
    """Where the stored member ``info`` starts in the archive file ``f``: after its local header."""
    f.seek(info.header_offset)
    local_header = f.read(30)
    if len(local_header) != 30 or local_header[:4] != b"PK\x03\x04":
        raise FieldError(f"field {info.filename.removesuffix('.npy')} has a damaged zip header")
    name_length, extra_length = struct.unpack("<HH", local_header[26:30])
    return info.header_offset + 30 + name_length + extra_length


def _check_crc(info: zipfile.ZipInfo, crc: int) -> None:
    """Refuses a member whose bytes do not give the CRC-32 the archive records for it (its central directory's,
    the one ``zipfile`` checks)."""
    if crc != info.CRC:
        raise FieldError(f"field {info.filename.removesuffix('.npy')} fails its CRC-32 check (the archive records "
                          f"{info.CRC:08x}, its bytes give {crc:08x}): the file was damaged after it was written")


def _bits(archive: zipfile.ZipFile, path: Path, needed: int) -> np.ndarray:
    """The ``bits`` field, ``needed`` bytes: memory-mapped when stored (as we write it), else read and capped;
    either way checked against its CRC-32 (``zipfile`` checks a field it reads; a mapped one is checked here, over
    the bytes mapped: a step's 8.4 MB in 0.16 ms with zlib-ng)."""
    info = archive.getinfo("bits.npy")
    if info.compress_type != zipfile.ZIP_STORED:
        bits = read_field(archive, "bits", needed, f"the shapes need {needed}")
        _check_bits(bits.dtype, bits.shape, needed)
        return bits
    with open(path, "rb") as f:
        header_at = _member_data_offset(f, info)
        f.seek(header_at)
        shape, dtype = _read_npy_header(f)
        offset = f.tell()
        f.seek(header_at)
        header = f.read(offset - header_at)
    _check_bits(dtype, shape, needed)
    if info.file_size != len(header) + needed:
        raise FieldError(f"field bits is recorded as {info.file_size} bytes, its header and shapes make "
                          f"{len(header) + needed}")
    bits = np.memmap(path, dtype=np.uint8, mode="r", offset=offset, shape=shape) if needed else np.empty(0, np.uint8)
    _check_crc(info, crc32(bits, crc32(header)))
    return bits


# The most the names, ndims or dims field may hold: a million parameters named in 64 characters (UTF-32).
MAX_METADATA_BYTES = 256 * 2**20
_METADATA_LIMIT = f"more than the {MAX_METADATA_BYTES} a field of names, ndims or dims may hold"


def _read_packed_fields(archive: zipfile.ZipFile, path: Path) -> tuple[list[str], list[tuple[int, ...]], np.ndarray]:
    """Names, shapes and bits of a packed archive, each field checked before the next is read."""
    present = set(archive.namelist())
    for key in ("format_version", "names", "ndims", "dims", "bits"):
        if f"{key}.npy" not in present:
            raise FieldError(f"field {key} is missing from the direction archive")
    version = read_field(archive, "format_version", 8, "a version number needs 8")
    if version.shape != () or version.dtype.kind not in "iu" or int(version) != PACKED_FORMAT_VERSION:
        raise FieldError(f"field format_version = {version.tolist()}, expected {PACKED_FORMAT_VERSION}")
    names, ndims, dims = (read_field(archive, key, MAX_METADATA_BYTES, _METADATA_LIMIT)
                          for key in ("names", "ndims", "dims"))
    if names.dtype.kind != "U" or ndims.dtype.kind not in "iu" or dims.dtype.kind not in "iu":
        raise FieldError(f"fields names/ndims/dims are {names.dtype}/{ndims.dtype}/{dims.dtype}, expected text "
                          f"and integers")
    if len(ndims) != len(names) or sum(ndims.tolist()) != len(dims) or (dims < 0).any() or (ndims < 0).any():
        raise FieldError(f"fields names/ndims/dims disagree ({len(names)} names, {len(ndims)} ndims, "
                          f"{len(dims)} dims)")
    shapes = [tuple(dims[piece].tolist()) for piece in consecutive_slices(ndims.tolist())]
    pieces = packed_slices(math.prod(shape) for shape in shapes)
    return names.tolist(), shapes, _bits(archive, path, pieces[-1].stop if pieces else 0)


def open_packed(path: Path) -> dict[str, StoredDirection]:
    """The parameters of a packed archive; each parameter's bits are read when asked (memory-mapped as we write
    them; a compressed archive from elsewhere is read once, capped by its shapes)."""
    refuse_symlink(path)
    try:
        with zipfile.ZipFile(path) as archive:
            names, shapes, bits = _read_packed_fields(archive, path)
    except FieldError as e:
        raise DamagedFile(path, str(e)) from None
    except Exception as e:  # zip or npy header damage, truncation, a CRC that zipfile checks, pickled objects
        raise DamagedFile(path, f"not a readable direction archive ({e})") from e
    pieces = packed_slices(math.prod(shape) for shape in shapes)
    return {name: StoredDirection(path, shape, lambda piece=piece: np.array(bits[piece]))
            for name, shape, piece in zip(names, shapes, pieces)}


@functools.lru_cache(maxsize=4)
def _layout_bytes(names: tuple[str, ...], shapes: tuple[tuple[int, ...], ...]) -> dict[str, bytes]:
    """The bytes ``write_packed`` gives each layout field of an archive holding ``names`` with ``shapes``."""
    encoded = {}
    for key, value in _layout_fields(names, shapes).items():
        buffer = io.BytesIO()
        np.lib.format.write_array(buffer, value, allow_pickle=False)
        encoded[key] = buffer.getvalue()
    return encoded


@dataclass(frozen=True)
class _KnownPlaces:
    """Where an uncompressed archive of one layout holds its fields: learnt from the first archive of that layout
    read through ``zipfile``. ``write_packed`` puts a layout's fields at the same places every step, in a file of
    the same size, so the next archives are checked and read with one read and a few byte comparisons rather than
    by parsing the zip in Python at every step (the live verdict runs beside the training, sharing its
    interpreter)."""

    size: int
    expected: tuple[tuple[int, bytes], ...]  # (offset, bytes): each layout field whole, the bits field's header
    bits_offset: int
    bits_length: int
    crc_at: int  # the bits member's CRC-32 in the central directory
    header_crc: int  # CRC-32 of the bits member's .npy header (among ``expected``), continued over the bits

    def read(self, path: Path) -> np.ndarray | None:
        """The bits of the archive at ``path`` when it holds the expected bytes at their places and the bits give
        the CRC-32 it records, else None."""
        checked = max([self.bits_offset] + [at + len(field) for at, field in self.expected])
        with open(refuse_symlink(path), "rb") as f:
            if os.fstat(f.fileno()).st_size != self.size:
                return None
            head = f.read(checked)
            if any(head[at:at + len(field)] != field for at, field in self.expected):
                return None
            if self.bits_length > _READ_WHOLE_UP_TO:  # a large model's bits: mapped, compared chunk by chunk
                bits = np.memmap(path, dtype=np.uint8, mode="r", offset=self.bits_offset, shape=(self.bits_length,))
            else:
                bits = np.empty(self.bits_length, dtype=np.uint8)
                f.seek(self.bits_offset)
                if f.readinto(bits) != self.bits_length:
                    return None
            f.seek(self.crc_at)
            recorded = int.from_bytes(f.read(4), "little")
        return bits if crc32(bits, self.header_crc) == recorded else None


# Bits up to this size are read in the same open as the header check (cheaper per step than a memory map for a
# model of many small tensors); larger ones are memory-mapped, so no step allocates a copy of a large model's bits.
_READ_WHOLE_UP_TO = 1 << 22


def _learn_places(archive: zipfile.ZipFile, path: Path, layout: dict[str, bytes],
                  bits: np.ndarray) -> _KnownPlaces | None:
    """The places of an archive just read in full (None when a field is compressed: it is read the slow way)."""
    if not isinstance(bits, np.memmap):
        return None
    expected = []
    with open(path, "rb") as f:
        for key, encoded in layout.items():
            info = archive.getinfo(f"{key}.npy")
            if info.compress_type != zipfile.ZIP_STORED:
                return None
            expected.append((_member_data_offset(f, info), encoded))
        header_at = _member_data_offset(f, archive.getinfo("bits.npy"))
        f.seek(header_at)
        bits_header = f.read(bits.offset - header_at)
        expected.append((header_at, bits_header))
        size = os.fstat(f.fileno()).st_size
        crc_at = _central_crc_at(f, archive, "bits.npy")
    return _KnownPlaces(size, tuple(expected), bits.offset, len(bits), crc_at, crc32(bits_header))


def _central_crc_at(f, archive: zipfile.ZipFile, member: str) -> int:
    """Where the CRC-32 of ``member`` sits in the archive file ``f``: 16 bytes into its central directory entry,
    whose size is 46 bytes and the lengths of what follows it at 28 (APPNOTE.TXT 4.3.12); entries are in
    ``infolist()`` order."""
    at = archive.start_dir
    for info in archive.infolist():
        if info.filename == member:
            return at + 16
        f.seek(at + 28)
        at += 46 + sum(struct.unpack("<HHH", f.read(6)))
    raise FieldError(f"field {member.removesuffix('.npy')} is missing from the direction archive")


class LaidOutReader:
    """Reads the whole ``bits`` field of packed archives that hold exactly ``names`` with ``shapes``, in that order:
    the layout fields are compared byte for byte with what ``write_packed`` writes for that layout, reading no
    further than their length, and from the second archive on, at the places learnt from the first
    (``_KnownPlaces``): a reader that knows the layout compares a step of thousands of small parameters at once,
    without decoding the layout at every step."""

    def __init__(self, names: list[str], shapes: list[tuple[int, ...]]):
        self.key = (tuple(names), tuple(tuple(shape) for shape in shapes))
        self._places: _KnownPlaces | None = None

    def read(self, path: Path) -> np.ndarray | None:
        """The bits (memory-mapped as ``open_packed`` maps them, or read at the known places), checked against
        their CRC-32; None for an archive of any other layout, or a damaged one (``open_packed`` then says what is
        wrong)."""
        try:
            bits = self._places.read(path) if self._places is not None else None
            if bits is not None:
                return bits
            layout = _layout_bytes(*self.key)
            with zipfile.ZipFile(refuse_symlink(path)) as archive:
                for field_name, expected in layout.items():
                    with archive.open(f"{field_name}.npy") as f:
                        if f.read(len(expected) + 1) != expected:
                            return None
                bits = _bits(archive, path, sum((math.prod(shape) + 7) // 8 for shape in self.key[1]))
                self._places = _learn_places(archive, path, layout, bits) or self._places
            return bits
        except Exception:
            return None


def step_compute_format(step_dir: str | os.PathLike) -> str | None:
    """The format the run computed this step in, as its packed archive records it (``compute_format``); None where
    it does not (not known to the monitor, an earlier version's archive, msprobe's ``.npy`` form). Raises
    ``ValueError`` naming the file and the field when the field is not one of :data:`~msprobe_mlflow.formats.
    UNIT_ROUNDOFF`'s formats."""
    path = Path(step_dir) / PACKED_FILE_NAME
    if not path.exists():
        return None
    try:
        with zipfile.ZipFile(refuse_symlink(path)) as archive:
            if f"{COMPUTE_FORMAT}.npy" not in archive.namelist():
                return None
            value = read_field(archive, COMPUTE_FORMAT, 64, "more than a format's name needs")
    except FieldError as e:
        raise DamagedFile(path, str(e)) from None
    except Exception as e:  # zip or npy header damage, truncation, a CRC that zipfile checks, pickled objects
        raise DamagedFile(path, f"not a readable direction archive ({e})") from e
    if value.shape != () or value.dtype.kind != "U" or str(value) not in UNIT_ROUNDOFF:
        raise DamagedFile(path, f"field {COMPUTE_FORMAT} = {value.tolist()!r}, expected one of "
                                f"{', '.join(map(repr, UNIT_ROUNDOFF))}")
    return str(value)


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
        with atomic_writer(step_dir / f"{stem}.npy") as f:
            np.save(f, signs)
    if renamed:
        atomic_write_bytes(step_dir / NAME_MAP_FILE_NAME, json.dumps(renamed, indent=1).encode())


def _load_npy_bits(path: Path, shape: tuple[int, ...]) -> np.ndarray:
    """The packed signs of msprobe's boolean ``.npy``; refused when a byte is neither 0 nor 1, which
    ``np.save(grad > 0)`` never writes (the one damage this form, which records no checksum, shows: numpy would
    read any other byte as True)."""
    try:
        signs = np.load(path, allow_pickle=False)
    except Exception as e:
        raise DamagedFile(path, f"not a readable .npy file ({e})") from e
    if signs.dtype != np.bool_ or signs.shape != shape:
        raise DamagedFile(path, f"holds {signs.dtype} {list(signs.shape)}, its header said bool {list(shape)}")
    raw = signs.reshape(-1).view(np.uint8)
    if raw.size and raw.max() > 1:
        at = int(np.argmax(raw > 1))
        raise DamagedFile(path, f"element {at} is stored as byte {raw[at]}, a boolean .npy holds 0 or 1 only: the "
                                f"file was damaged after it was written")
    return np.packbits(raw)


def open_npy_folder(step_dir: Path) -> dict[str, StoredDirection]:
    """msprobe's boolean ``.npy`` files of a step folder: headers are checked now (against the file's size too),
    data read when asked."""
    renamed = {}
    map_path = step_dir / NAME_MAP_FILE_NAME
    if map_path.exists():
        try:
            renamed = json.loads(map_path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise DamagedFile(map_path, f"not valid JSON ({e})") from e
        if not isinstance(renamed, dict) or not all(isinstance(v, str) for v in renamed.values()):
            raise DamagedFile(map_path, f"expected an object mapping file stems to parameter names, found "
                                        f"{json.dumps(renamed)[:200]}")
    result: dict[str, StoredDirection] = {}
    for path in sorted(step_dir.glob("*.npy")):
        refuse_symlink(path)
        shape, dtype = checked_npy_header(path)
        if dtype != np.bool_:
            raise DamagedFile(path, f"dtype {dtype}, expected bool (np.save(grad > 0))")
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
