"""Direction files: msprobe's boolean .npy (``np.save(grad > 0)``) and our packed archive round-trip to the same
bits, which are ``np.packbits(grad > 0)`` per parameter, each padded to a whole byte."""
import json
import math
import tracemalloc
import zipfile

import numpy as np
import pytest
import torch

from msprobe_mlflow.directions import (MAX_METADATA_BYTES, NAME_MAP_FILE_NAME, PACKED_FILE_NAME, read_npy_folder,
                                       read_packed, LaidOutReader, read_step_directions, write_npy,
                                       write_packed)
from msprobe_mlflow.torch_kernels.statistics import pack_signs

NAN, INF = float("nan"), float("inf")

# Gradients chosen so every sign case appears: positive, negative, 0, -0.0, NaN, +/-inf; numels 0, 1, 5 and 7 (odd:
# padded), 8 (exactly a byte), 9 and 15 (a byte and a padded one).
GRADIENTS = {
    "fc1.weight": np.array([[0.5, -1.0, 0.0], [-0.0, NAN, 2.0]], dtype=np.float32),
    "specials": np.array([INF, -INF, 1e-30, -1e-30, NAN], dtype=np.float32),
    "fc1.bias": np.array([1.0, -2.0, 3.0, 0.0, 5.0, -0.0, 7.0], dtype=np.float32),
    "byte": np.array([1, 0, 1, 0, 1, 1, -1, 1], dtype=np.float32),
    "nine": np.arange(-4, 5, dtype=np.float32),
    "grid": np.linspace(-1, 1, 15, dtype=np.float32).reshape(3, 5),
    "scalar": np.array(0.25, dtype=np.float32),
    "negative scalar": np.array(-0.25, dtype=np.float32),
    "empty": np.zeros((0,), dtype=np.float32),
    "empty matrix": np.zeros((4, 0), dtype=np.float32),
}


def packed_by_hand(values: np.ndarray) -> np.ndarray:
    """Bits of ``values > 0``, first element in the high bit of the first byte, the last byte padded with 0."""
    flags = [bool(v > 0) for v in values.reshape(-1)]
    flags += [False] * (-len(flags) % 8)
    return np.array([sum(flag << (7 - i) for i, flag in enumerate(flags[start:start + 8]))
                     for start in range(0, len(flags), 8)], dtype=np.uint8)


def concatenated_bits(gradients: dict) -> np.ndarray:
    pieces = [packed_by_hand(g) for g in gradients.values()]
    return np.concatenate(pieces) if pieces else np.zeros(0, np.uint8)


def test_hand_packing_is_numpy_packbits_of_grad_positive():
    for values in GRADIENTS.values():
        np.testing.assert_array_equal(packed_by_hand(values), np.packbits(values.reshape(-1) > 0))


def test_pack_signs_gives_packbits_of_each_gradient_padded_to_a_byte_and_concatenated():
    grads = [torch.from_numpy(g.copy()) for g in GRADIENTS.values()]
    np.testing.assert_array_equal(pack_signs(grads).numpy(), concatenated_bits(GRADIENTS))


def test_pack_signs_of_half_precision_and_non_contiguous_gradients():
    values = np.array([[1.0, -1.0, 0.0], [2.0, -0.0, 3.0]], dtype=np.float32)
    transposed = torch.from_numpy(values).t()  # not contiguous: C order of the transposed view
    expected = np.concatenate([packed_by_hand(values.T), packed_by_hand(values), packed_by_hand(values)])
    grads = [transposed, torch.from_numpy(values).bfloat16(), torch.from_numpy(values).half()]
    np.testing.assert_array_equal(pack_signs(grads).numpy(), expected)


def test_pack_signs_of_no_gradient_is_empty():
    assert pack_signs([]).numpy().tolist() == []


def test_packed_archive_round_trip(tmp_path):
    path = tmp_path / "rank0" / "step3" / PACKED_FILE_NAME
    names, shapes = list(GRADIENTS), [g.shape for g in GRADIENTS.values()]
    write_packed(path, names, shapes, concatenated_bits(GRADIENTS))
    read = read_packed(path)
    assert list(read) == names
    for name, values in GRADIENTS.items():
        shape, bits = read[name]
        assert shape == values.shape
        np.testing.assert_array_equal(bits, np.packbits(values.reshape(-1) > 0))


def test_packed_archive_takes_one_bit_per_element(tmp_path):
    path = tmp_path / PACKED_FILE_NAME
    shape = (1000, 1000)
    write_packed(path, ["big"], [shape], np.zeros(math.prod(shape) // 8, np.uint8))
    assert math.prod(shape) // 8 < path.stat().st_size < math.prod(shape) // 8 + 2048


def test_packed_archive_keeps_names_that_are_not_file_names(tmp_path):
    names = ["a/b.weight", "..", "layer:0 weight", "编码器.权重", "x" * 300]
    shapes = [(3,), (2,), (1,), (9,), ()]
    gradients = {name: np.linspace(-1, 1, math.prod(shape), dtype=np.float32).reshape(shape)
                 for name, shape in zip(names, shapes)}
    write_packed(tmp_path / PACKED_FILE_NAME, names, shapes, concatenated_bits(gradients))
    read = read_packed(tmp_path / PACKED_FILE_NAME)
    assert list(read) == names
    assert [p.name for p in tmp_path.iterdir()] == [PACKED_FILE_NAME]


def test_npy_form_is_exactly_np_save_of_grad_positive(tmp_path):
    write_npy(tmp_path, list(GRADIENTS), [g.shape for g in GRADIENTS.values()], concatenated_bits(GRADIENTS))
    for name, values in GRADIENTS.items():
        path = tmp_path / f"{name}.npy"
        with open(path, "rb") as f:
            assert np.lib.format.read_magic(f) == (1, 0)
        signs = np.load(path, allow_pickle=False)
        assert signs.dtype == np.dtype("|b1") and signs.shape == values.shape
        np.testing.assert_array_equal(signs, values > 0)
        expected = tmp_path / "expected.npy"
        np.save(expected, values > 0)
        assert path.read_bytes() == expected.read_bytes()
    assert not (tmp_path / NAME_MAP_FILE_NAME).exists()  # every name here is a file name as it is


def test_npy_form_round_trip(tmp_path):
    write_npy(tmp_path, list(GRADIENTS), [g.shape for g in GRADIENTS.values()], concatenated_bits(GRADIENTS))
    read = read_npy_folder(tmp_path)
    assert sorted(read) == sorted(GRADIENTS)
    for name, values in GRADIENTS.items():
        assert read[name][0] == values.shape
        np.testing.assert_array_equal(read[name][1], np.packbits(values.reshape(-1) > 0))


def test_npy_folder_written_by_msprobe_reads_back(tmp_path):
    # msprobe's GradientMonitor.save_grad_direction: np.save(f"{param_name}.npy", grad > 0)
    for name, values in GRADIENTS.items():
        np.save(tmp_path / f"{name}.npy", values > 0)
    read = read_step_directions(tmp_path)
    for name, values in GRADIENTS.items():
        np.testing.assert_array_equal(read[name][1], np.packbits(values.reshape(-1) > 0))


def test_npy_names_msprobe_rejects_stay_in_the_step_folder_and_read_back_under_their_names(tmp_path):
    step_dir = tmp_path / "rank0" / "step0"
    names = ["a/b.weight", "../../escape.weight", "..", "layer:0.weight", "embed tokens.weight", "编码器.权重",
             "x" * 300, "y" * 300]
    gradients = {name: np.array([i - 2.0, 1.0, -1.0][: 1 + i % 3], dtype=np.float32) for i, name in enumerate(names)}
    write_npy(step_dir, names, [g.shape for g in gradients.values()], concatenated_bits(gradients))
    assert {p.parent for p in tmp_path.rglob("*") if p.is_file()} == {step_dir}
    assert all(len(p.name.encode()) <= 255 for p in step_dir.iterdir())
    for kept in ["layer:0.weight", "embed tokens.weight", "编码器.权重"]:
        assert (step_dir / f"{kept}.npy").is_file()  # as msprobe would have named them
    read = read_step_directions(step_dir)
    assert sorted(read) == sorted(names)
    for name, values in gradients.items():
        np.testing.assert_array_equal(read[name][1], np.packbits(values > 0))
    assert set(json.loads((step_dir / NAME_MAP_FILE_NAME).read_text()).values()) == \
        {"a/b.weight", "../../escape.weight", "..", "x" * 300, "y" * 300}


def test_the_packed_archive_wins_when_a_step_folder_holds_both_forms(tmp_path):
    ones, zeros = np.ones(3, np.float32), -np.ones(3, np.float32)
    write_npy(tmp_path, ["w"], [(3,)], packed_by_hand(zeros))
    write_packed(tmp_path / PACKED_FILE_NAME, ["w"], [(3,)], packed_by_hand(ones))
    assert read_step_directions(tmp_path)["w"][1].tolist() == [0b11100000]


def write_archive(path, compression=zipfile.ZIP_STORED, **arrays):
    with zipfile.ZipFile(path, "w", compression) as archive:
        for key, array in arrays.items():
            with archive.open(f"{key}.npy", "w") as f:
                np.lib.format.write_array(f, np.asarray(array), allow_pickle=True)


GOOD_FIELDS = dict(format_version=np.array(1), names=np.array(["w"]), ndims=np.array([1]), dims=np.array([9]),
                   bits=np.array([255, 128], np.uint8))


@pytest.mark.parametrize("change, message", [
    (dict(bits=None), "field bits is missing"),
    (dict(names=None), "field names is missing"),
    (dict(format_version=np.array(2)), "field format_version = 2, expected 1"),
    (dict(bits=np.array([255], np.uint8)), "field bits holds 1 bytes, the shapes need 2"),
    (dict(dims=np.array([9, 1])), "fields names/ndims/dims disagree"),
    (dict(dims=np.array([-9])), "fields names/ndims/dims disagree"),
    (dict(ndims=np.array([-1]), dims=np.array([], np.int64)), "fields names/ndims/dims disagree"),
    (dict(names=np.array(["w", "v"]), ndims=np.array([2, -1]), bits=np.array([255, 128, 0], np.uint8)),
     "fields names/ndims/dims disagree"),
    (dict(bits=np.array([1.0, 2.0])), "bits"),
    (dict(names=np.array([{"a": 1}], dtype=object)), "not a readable direction archive"),
])
def test_a_malformed_packed_archive_is_refused_naming_the_file_and_field(tmp_path, change, message):
    fields = {**GOOD_FIELDS, **change}
    path = tmp_path / PACKED_FILE_NAME
    write_archive(path, **{key: value for key, value in fields.items() if value is not None})
    with pytest.raises(ValueError) as error:
        read_packed(path)
    assert str(error.value).startswith(f"{path}: ") and message in str(error.value)


def test_a_well_formed_hand_written_archive_reads(tmp_path):
    path = tmp_path / PACKED_FILE_NAME
    write_archive(path, **GOOD_FIELDS)
    shape, bits = read_packed(path)["w"]
    assert shape == (9,) and bits.tolist() == [255, 128]


@pytest.mark.parametrize("content", [b"", b"PK\x03\x04 truncated", b"not a zip at all"])
def test_a_damaged_packed_archive_is_refused(tmp_path, content):
    path = tmp_path / PACKED_FILE_NAME
    path.write_bytes(content)
    with pytest.raises(ValueError, match="not a readable direction archive"):
        read_packed(path)


def test_npy_with_pickled_objects_is_refused_not_unpickled(tmp_path):
    np.save(tmp_path / "w.npy", np.array([{"evil": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError, match=r"w\.npy: dtype object, expected bool"):
        read_npy_folder(tmp_path)


def test_npy_of_another_dtype_is_refused(tmp_path):
    np.save(tmp_path / "w.npy", np.array([0.5, -1.0]))
    with pytest.raises(ValueError, match=r"w\.npy: dtype float64, expected bool"):
        read_step_directions(tmp_path)


def test_a_truncated_npy_is_refused_naming_it(tmp_path):
    np.save(tmp_path / "w.npy", np.ones(64, bool))
    (tmp_path / "w.npy").write_bytes((tmp_path / "w.npy").read_bytes()[:-10])
    with pytest.raises(ValueError, match=r"w\.npy"):
        read_step_directions(tmp_path)


def test_a_symlinked_npy_is_refused(tmp_path):
    outside = tmp_path / "outside.npy"
    np.save(outside, np.ones(3, bool))
    step_dir = tmp_path / "step0"
    step_dir.mkdir()
    (step_dir / "w.npy").symlink_to(outside)
    with pytest.raises(ValueError, match="is a symbolic link"):
        read_npy_folder(step_dir)


def test_a_broken_name_map_is_refused_naming_it(tmp_path):
    np.save(tmp_path / "w.npy", np.ones(3, bool))
    (tmp_path / NAME_MAP_FILE_NAME).write_text("{not json")
    with pytest.raises(ValueError, match=f"{NAME_MAP_FILE_NAME}: not valid JSON"):
        read_npy_folder(tmp_path)


# --- compressed archives: each member read only as far as the shapes allow (zip bombs) -----------------------
BOMB_BYTES = 64 * 2**20  # zeros deflate about 1000:1, so this is a 64 KiB file


def write_compressed_archive(path, bits_claimed: int, bits_held: int) -> None:
    """GOOD_FIELDS deflated, but ``bits`` with a header claiming ``bits_claimed`` bytes followed by ``bits_held``
    zero bytes, written a MiB at a time (never whole in memory)."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        for key, array in GOOD_FIELDS.items():
            if key != "bits":
                with archive.open(f"{key}.npy", "w") as f:
                    np.lib.format.write_array(f, array)
        with archive.open("bits.npy", "w", force_zip64=True) as f:
            np.lib.format.write_array_header_1_0(f, {"descr": "|u1", "fortran_order": False, "shape": (bits_claimed,)})
            for start in range(0, bits_held, 2**20):
                f.write(bytes(min(2**20, bits_held - start)))


def refusal_and_peak_memory(path, read=read_packed) -> tuple[str, int]:
    """The message ``read(path)`` is refused with, and the most memory Python and numpy held meanwhile (numpy
    reports its buffers to tracemalloc)."""
    tracemalloc.start()
    try:
        with pytest.raises(ValueError) as error:
            read(path)
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return str(error.value), peak


def test_a_compressed_archive_reads_like_the_stored_one(tmp_path):
    path = tmp_path / PACKED_FILE_NAME
    write_archive(path, zipfile.ZIP_DEFLATED, **GOOD_FIELDS)
    shape, bits = read_packed(path)["w"]
    assert shape == (9,) and bits.tolist() == [255, 128]


@pytest.mark.parametrize("claimed, held, message", [
    (BOMB_BYTES, BOMB_BYTES, f"field bits claims {BOMB_BYTES} bytes, the shapes need 2"),
    (2, 2 + BOMB_BYTES, "field bits holds more bytes than its shape [2] needs"),
])
def test_a_compressed_bits_field_larger_than_the_shapes_need_is_refused_without_inflating_it(
        tmp_path, claimed, held, message):
    path = tmp_path / PACKED_FILE_NAME
    write_compressed_archive(path, claimed, held)
    assert path.stat().st_size < BOMB_BYTES / 100
    refusal, peak = refusal_and_peak_memory(path)
    assert refusal == f"{path}: {message}"
    assert peak < 4 * 2**20


def test_a_compressed_names_field_claiming_more_than_metadata_may_hold_is_refused_before_reading(tmp_path):
    path = tmp_path / PACKED_FILE_NAME
    claimed_names = MAX_METADATA_BYTES // 4 + 1  # '<U1': 4 bytes a name
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        for key, array in GOOD_FIELDS.items():
            with archive.open(f"{key}.npy", "w") as f:
                if key == "names":
                    np.lib.format.write_array_header_1_0(
                        f, {"descr": "<U1", "fortran_order": False, "shape": (claimed_names,)})
                else:
                    np.lib.format.write_array(f, array)
    refusal, peak = refusal_and_peak_memory(path)
    assert refusal == (f"{path}: field names claims {claimed_names * 4} bytes, more than the {MAX_METADATA_BYTES} "
                       f"a field of names, ndims or dims may hold")
    assert peak < 4 * 2**20


def test_an_npy_whose_header_claims_more_than_the_file_holds_is_refused_before_anything_is_allocated(tmp_path):
    path = tmp_path / "w.npy"
    with open(path, "wb") as f:  # a header claiming a billion elements, ten bytes of data: numpy would allocate 1 GB
        np.lib.format.write_array_header_1_0(f, {"descr": "|b1", "fortran_order": False, "shape": (10**9,)})
        f.write(bytes(10))
    refusal, peak = refusal_and_peak_memory(tmp_path, read_npy_folder)
    assert refusal == (f"{path}: not a readable .npy file (it holds 10 data bytes, its header's shape [1000000000] "
                       f"needs 1000000000)")
    assert peak < 4 * 2**20


def test_an_archive_read_as_a_known_layout_gives_all_its_bits_or_nothing(tmp_path):
    """LaidOutReader: the whole bits field when names and shapes are exactly the caller's, else None (the
    caller then lists the archive with open_packed), compressed and damaged archives included."""
    path = tmp_path / PACKED_FILE_NAME
    names, shapes = list(GRADIENTS), [g.shape for g in GRADIENTS.values()]
    write_packed(path, names, shapes, concatenated_bits(GRADIENTS))
    reader = LaidOutReader(names, shapes)
    whole = reader.read(path)
    np.testing.assert_array_equal(whole, concatenated_bits(GRADIENTS))
    assert LaidOutReader(names[::-1], shapes[::-1]).read(path) is None  # another order
    assert LaidOutReader(names, [(7,)] + shapes[1:]).read(path) is None  # another shape
    assert LaidOutReader(names[:-1], shapes[:-1]).read(path) is None  # fewer parameters
    compressed = tmp_path / "compressed.npz"
    write_archive(compressed, zipfile.ZIP_DEFLATED, **GOOD_FIELDS)
    assert LaidOutReader(["w"], [(9,)]).read(compressed).tolist() == [255, 128]
    wider_names = tmp_path / "wider_names.npz"  # another writer: the same layout, encoded otherwise
    write_archive(wider_names, **{**GOOD_FIELDS, "names": np.array(["w"], dtype="<U8")})
    assert LaidOutReader(["w"], [(9,)]).read(wider_names) is None and read_packed(wider_names)["w"][0] == (9,)
    # The next step's archive of the same layout is read at the places learnt from the first; one whose layout
    # differs in a byte (a renamed parameter, same file size) or that is cut short is still refused.
    later = {name: -g for name, g in GRADIENTS.items()}
    write_packed(path, names, shapes, concatenated_bits(later))
    np.testing.assert_array_equal(reader.read(path), concatenated_bits(later))
    renamed = [names[0][:-1] + chr(ord(names[0][-1]) + 1), *names[1:]]
    write_packed(path, renamed, shapes, concatenated_bits(later))
    assert reader.read(path) is None
    write_packed(path, names, shapes, concatenated_bits(later))
    path.write_bytes(path.read_bytes()[:-3])  # truncated
    assert reader.read(path) is None


def test_large_known_layout_bits_are_mapped_not_copied_and_equal_the_written_ones(tmp_path, monkeypatch):
    """Above ``_READ_WHOLE_UP_TO`` the reader maps the bits (no per-step copy of a large model's bits)."""
    import msprobe_mlflow.directions as directions_module

    monkeypatch.setattr(directions_module, "_READ_WHOLE_UP_TO", 0)
    path = tmp_path / PACKED_FILE_NAME
    names, shapes = list(GRADIENTS), [g.shape for g in GRADIENTS.values()]
    write_packed(path, names, shapes, concatenated_bits(GRADIENTS))
    reader = LaidOutReader(names, shapes)
    reader.read(path)  # learns the places
    later = {name: -g for name, g in GRADIENTS.items()}
    write_packed(path, names, shapes, concatenated_bits(later))
    bits = reader.read(path)
    assert isinstance(bits, np.memmap)
    np.testing.assert_array_equal(bits, concatenated_bits(later))
