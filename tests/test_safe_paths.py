"""Untrusted names become paths only through safe_paths: they stay inside their folder, fit a file name, never
collide, and files appear whole or not at all."""
import hashlib
import io
import os
import stat

import numpy as np
import pytest

from msprobe_mlflow.safe_paths import _PiecewiseWriter, atomic_write_bytes, atomic_writer, confined_path, \
    param_file_stem


@pytest.mark.parametrize("name", ["fc1.weight", "layers.0.attn:q_proj.weight", "embed tokens.weight",
                                  "编码器.weight", "Ünïcode.bias", "a" * 251])
def test_names_msprobe_would_write_keep_their_own_stem(name):
    assert param_file_stem(name) == name


def md5_tag(name):
    return "-" + hashlib.md5(name.encode()).hexdigest()[:8]


@pytest.mark.parametrize("name, expected", [
    ("a/b.weight", "a_b.weight"),
    ("../../etc/passwd", "_.._.._etc_passwd"),
    ("..", "_.."),
    (".hidden", "_.hidden"),
    ("back\\slash", "back_slash"),
    ("tab\there\nnewline", "tab_here_newline"),
    ("", "_"),
])
def test_unsafe_names_are_sanitised_and_tagged_with_the_md5_of_the_original(name, expected):
    assert param_file_stem(name) == expected + md5_tag(name)


def test_two_names_that_sanitise_alike_get_different_stems():
    assert param_file_stem("a/b") != param_file_stem("a\\b")
    assert param_file_stem("a/b") != param_file_stem("a_b")


@pytest.mark.parametrize("name", ["x" * 300, "层" * 200, "a/" * 200])
def test_long_names_are_shortened_deterministically_to_fit_255_bytes_with_the_suffix(name):
    stem = param_file_stem(name)
    assert len((stem + ".npy").encode("utf-8")) <= 255
    assert stem.endswith(md5_tag(name))
    assert stem == param_file_stem(name)
    stem.encode("utf-8")  # no half character left by the cut


def test_a_name_of_exactly_the_budget_is_kept_and_one_byte_more_is_shortened():
    assert param_file_stem("a" * 251) == "a" * 251  # 251 + len(".npy") = 255
    assert param_file_stem("a" * 252) == "a" * (251 - 9) + md5_tag("a" * 252)


def test_every_sanitised_stem_is_a_single_plain_file_name(tmp_path):
    for name in ["a/b", "..", "../x", "/abs/path", "x" * 300, ".", "a\x00b"]:
        stem = param_file_stem(name)
        assert "/" not in stem and "\\" not in stem and "\x00" not in stem and not stem.startswith(".")
        path = tmp_path / f"{stem}.npy"
        path.write_bytes(b"")
        assert path.parent == tmp_path


def test_confined_path_accepts_paths_inside_the_root(tmp_path):
    (tmp_path / "sub").mkdir()
    assert confined_path(tmp_path, "sub/x.npy", "data_name") == (tmp_path / "sub" / "x.npy").resolve()
    assert confined_path(tmp_path, "sub/../y.npy", "data_name") == (tmp_path / "y.npy").resolve()


@pytest.mark.parametrize("relative, reason", [
    ("../outside.npy", "leads outside"),
    ("sub/../../outside.npy", "leads outside"),
    ("/etc/passwd", "is an absolute path"),
    ("C:\\data\\x.npy", "is an absolute path"),
])
def test_confined_path_refuses_escapes_naming_the_field_and_value(tmp_path, relative, reason):
    with pytest.raises(ValueError) as error:
        confined_path(tmp_path, relative, "data_name")
    assert str(error.value).startswith(f"data_name = {relative!r} {reason}")


def test_confined_path_refuses_a_symlink_that_leads_outside(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (root / "link").symlink_to(outside)
    with pytest.raises(ValueError, match="'link/x.npy' leads outside"):
        confined_path(root, "link/x.npy", "data_name")


def test_atomic_write_creates_folders_replaces_whole_and_leaves_no_partial_file(tmp_path):
    target = tmp_path / "a" / "b" / "file.bin"
    atomic_write_bytes(target, b"first")
    atomic_write_bytes(target, b"second")
    assert target.read_bytes() == b"second"
    assert sorted(p.name for p in target.parent.iterdir()) == ["file.bin"]


def test_writes_larger_than_a_piece_arrive_whole_in_pieces_the_kernel_handles_cheaply(tmp_path):
    data = np.random.default_rng(0).integers(0, 256, 2 * _PiecewiseWriter.PIECE + 3, dtype=np.uint8)
    atomic_write_bytes(tmp_path / "bytes.bin", data.tobytes())
    assert (tmp_path / "bytes.bin").read_bytes() == data.tobytes()
    floats = np.random.default_rng(1).standard_normal((700, 500)).astype(np.float32)  # 1.4 MB, one np.save
    with atomic_writer(tmp_path / "floats.npy") as f:
        np.save(f, floats)
    assert np.array_equal(np.load(tmp_path / "floats.npy", allow_pickle=False), floats)

    class Recorded(io.BytesIO):
        sizes = []

        def write(self, piece):
            self.sizes.append(len(piece))
            return super().write(piece)

    into = Recorded()
    assert _PiecewiseWriter(into).write(data) == data.size
    assert into.getvalue() == data.tobytes()
    assert Recorded.sizes == [_PiecewiseWriter.PIECE, _PiecewiseWriter.PIECE, 3]


def test_atomic_write_gives_the_permissions_of_an_ordinary_new_file(tmp_path):
    # A temporary file is created 0600; a dump shared with a group (or read by an MLflow server running as
    # another user) must get what open() would give under the process umask.
    ordinary = tmp_path / "ordinary"
    ordinary.write_bytes(b"x")
    atomic = tmp_path / "atomic"
    atomic_write_bytes(atomic, b"x")
    assert stat.S_IMODE(atomic.stat().st_mode) == stat.S_IMODE(ordinary.stat().st_mode)


def test_atomic_write_under_a_restrictive_umask_follows_it(tmp_path):
    old = os.umask(0o077)
    try:
        atomic_write_bytes(tmp_path / "private", b"x")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "private").stat().st_mode) == 0o600


def test_a_failed_atomic_write_keeps_the_old_file_and_leaves_no_partial_file(tmp_path):
    target = tmp_path / "file.bin"
    atomic_write_bytes(target, b"kept")
    with pytest.raises(TypeError):
        atomic_write_bytes(target, "not bytes")
    assert target.read_bytes() == b"kept"
    assert [p.name for p in tmp_path.iterdir()] == ["file.bin"]
