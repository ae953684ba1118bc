"""Turning untrusted names (parameter names, dump file names, ``data_name`` fields) into paths safely."""
from __future__ import annotations

import contextlib
import hashlib
import os
import re
import secrets
from pathlib import Path
from typing import BinaryIO, Iterator

MAX_FILE_NAME_BYTES = 255
_UNSAFE_CHARACTERS = re.compile(r"[\x00-\x1f\x7f/\\]")


def _short_hash(text: str) -> str:
    return hashlib.md5(text.encode("utf-8", "surrogatepass")).hexdigest()[:8]


def param_file_stem(name: str, suffix: str = ".npy") -> str:
    """A file stem for ``name`` that stays inside its folder and fits ``MAX_FILE_NAME_BYTES`` with ``suffix``.

    Safe names (``fc1.weight``, also with ``:``, spaces or non-ASCII) are kept as they are, as msprobe writes
    them. Separators and control characters become ``_``, and a leading dot gets a ``_`` before it (no ``..``
    or hidden files); any changed or shortened name ends in ``-`` plus 8 hex digits of the original's MD5, so two
    names never share a stem.
    """
    stem = _UNSAFE_CHARACTERS.sub("_", name)
    if not stem or stem.startswith("."):
        stem = "_" + stem
    budget = MAX_FILE_NAME_BYTES - len(suffix.encode())
    if stem == name and len(stem.encode()) <= budget:
        return stem
    tag = "-" + _short_hash(name)
    encoded = stem.encode("utf-8", "surrogatepass")[: budget - len(tag)]
    return encoded.decode("utf-8", "ignore") + tag


def confined_path(root: str | os.PathLike, relative: str, what: str) -> Path:
    """``root/relative``, refusing absolute paths, ``..`` and symlinks that lead outside ``root``."""
    if "\x00" in relative:
        raise ValueError(f"{what} = {relative!r} contains a NUL character; expected a path inside {root}")
    if os.path.isabs(relative) or re.match(r"^[A-Za-z]:", relative):
        raise ValueError(f"{what} = {relative!r} is an absolute path; expected a path inside {root}")
    root_real = Path(root).resolve()
    candidate = (Path(root) / relative).resolve()
    if candidate != root_real and root_real not in candidate.parents:
        raise ValueError(f"{what} = {relative!r} leads outside {root}")
    return candidate


def refuse_symlink(path: Path) -> Path:
    """``path`` itself, unless it is a symbolic link: files read from a dump (and so possibly sent to MLflow) must
    be plain files, as msprobe requires, so that a link planted in a dump cannot make us read or upload a file
    from elsewhere. Folders may be links (a dump assembled from several disks)."""
    if path.is_symlink():
        raise ValueError(f"{path}: is a symbolic link (to {os.readlink(path)}); dump files must be plain files")
    return path


@contextlib.contextmanager
def atomic_writer(path: Path) -> Iterator["_PiecewiseWriter"]:
    """A file to write ``path`` through: a temporary file renamed to ``path`` when the block ends without an
    error, so a crash never leaves a half-written file under ``path``; a failed write removes the temporary file.

    The file gets the permissions ``open()`` would give (0666 less the umask), not a temporary file's 0600, so a
    dump stays readable by whoever could read one written by msprobe.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.parent / f".partial-{secrets.token_hex(8)}"
    descriptor = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(descriptor, "wb") as f:
            yield _PiecewiseWriter(f)
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


class _PiecewiseWriter:
    """A file whose ``write`` hands the kernel at most ``PIECE`` bytes a call: on Linux 6.18 (ext4, a Firecracker
    VM, this project's machines) one ``write`` of 2 MiB or more into a new file cost 10 to 20 times the CPU of the
    same bytes in 1 MiB calls (a step's 8.4 MB of directions: 22-70 ms against 2.3-3.5 ms; ``monitor_benchmark.py
    --kernel``), in the writer (thread, or the local dump's process) that shares the cores with training.
    Elsewhere the extra calls cost microseconds."""

    PIECE = 1 << 20

    def __init__(self, file: BinaryIO):
        self._file = file

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        for start in range(0, len(view), self.PIECE):
            self._file.write(view[start:start + self.PIECE])
        return len(view)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """``data`` written to ``path`` through :func:`atomic_writer`."""
    with atomic_writer(path) as f:
        f.write(data)
