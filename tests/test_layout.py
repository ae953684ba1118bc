"""The level table and the statistics layout, on data small enough to lay out by hand.

Three parameters of 3, 0 and 10 elements unless said otherwise: packed, they take 1, 0 and 2 bytes.
"""
import numpy as np
import pytest

from msprobe_mlflow.layout import StatisticsLayout, consecutive_slices, packed_length, packed_slices
from msprobe_mlflow.levels import LEVELS, csv_header, level_of_header, recorded_level
from msprobe_mlflow.records import record_from_statistics
from msprobe_mlflow.statistics_table import EXPONENT_BINS, EXPONENT_LOW

NUMELS = (3, 0, 10)
L2_WITH_EXPONENTS = recorded_level("L2", exponents=True)


def test_each_level_records_what_msprobe_writes():
    assert {name: (level.has_md5, level.has_directions, level.has_buckets, level.has_exponents)
            for name, level in LEVELS.items()} == {
        "L0": (True, False, False, False), "L1": (False, True, False, False), "L2": (False, True, True, False)}
    assert all(level.name == name for name, level in LEVELS.items())


@pytest.mark.parametrize("bounds", [(-1, 0, 1), (0.5,), (-0.5, 1e-05, 0.01, 2)])
@pytest.mark.parametrize("level", ["L0", "L1", "L2"])
def test_the_level_of_a_header_is_the_level_that_wrote_it(level, bounds):
    assert level_of_header(csv_header(level, bounds)).name == level


def test_msprobes_mindspore_graph_mode_header_read_back_is_l1():
    assert level_of_header(["param_name", "max", "min", "norm", "shape"]).name == "L1"  # read_summary lower-cases


def test_packed_lengths_pad_each_parameter_to_a_whole_byte():
    assert [packed_length(n) for n in (0, 1, 7, 8, 9, 16, 17)] == [0, 1, 1, 1, 2, 2, 3]
    assert packed_slices([3, 0, 10, 8]) == [slice(0, 1), slice(1, 1), slice(1, 3), slice(3, 4)]
    assert consecutive_slices([3, 0, 10]) == [slice(0, 3), slice(3, 3), slice(3, 13)]


@pytest.mark.parametrize("level, statistics, signs, values", [
    ("L0", 3 * 3, 0, 3 + 0 + 10),
    ("L1", 3 * 3, 1 + 0 + 2, 0),
    ("L2", 3 * 3 + 3 * (3 + 1), 1 + 0 + 2, 0),  # 3 bounds: 3 cumulative counts and the zero count
    (recorded_level("L1", exponents=True), 3 * 3 + 3 * EXPONENT_BINS, 1 + 0 + 2, 0),  # the opt-in exponents
])
def test_buffer_lengths_per_level(level, statistics, signs, values):
    layout = StatisticsLayout(level, (-1, 0, 1), NUMELS)
    assert (layout.statistics_length, layout.signs_length, layout.values_length) == (statistics, signs, values)


def test_split_gives_each_section_per_parameter_as_views_of_the_vector():
    layout = StatisticsLayout(L2_WITH_EXPONENTS, (0,), NUMELS)  # extremes: 3 per parameter, counts: x <= 0, x == 0
    vector = np.arange(15.0 + 3 * EXPONENT_BINS)
    sections = layout.split(vector)
    assert sections["extremes"].tolist() == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert sections["cumulative_counts"].tolist() == [[9, 10], [11, 12], [13, 14]]
    assert sections["exponent_counts"].tolist() == vector[15:].reshape(3, EXPONENT_BINS).tolist()
    sections["extremes"][1, 0] = -1.0
    assert vector[3] == -1.0
    assert np.concatenate(layout.in_order(sections)).tolist() == vector.tolist()


def test_a_level_without_buckets_has_only_extremes():
    sections = StatisticsLayout("L1", (0,), NUMELS).split(np.arange(9.0))
    assert list(sections) == ["extremes"]


def test_results_of_two_groups_merge_back_into_parameter_order():
    layout = StatisticsLayout(L2_WITH_EXPONENTS, (0,), NUMELS)
    # group A holds parameters 2 then 0; group B parameter 1; each laid out as a vector of its own
    exponents = {p: np.full(EXPONENT_BINS, 100.0 * p) for p in range(3)}  # parameter p's: 100 p each
    group_a = ([2, 0], (np.array([20, 21, 22, 0, 1, 2, 23, 24, 3, 4.0, *exponents[2], *exponents[0]]),
                        np.array([0xAA, 0xBB, 0xCC], np.uint8), None))
    group_b = ([1], (np.array([10, 11, 12, 13, 14.0, *exponents[1]]), np.zeros(0, np.uint8), None))
    statistics, signs, values = layout.merge([group_a, group_b])
    assert statistics.tolist() == [0, 1, 2, 10, 11, 12, 20, 21, 22, 3, 4, 13, 14, 23, 24,
                                   *exponents[0], *exponents[1], *exponents[2]]
    assert signs.tolist() == [0xCC, 0xAA, 0xBB]  # parameter 0's byte, then parameter 2's two
    assert values is None


def test_float32_values_merge_back_at_a_level_with_md5():
    layout = StatisticsLayout("L0", (0,), (2, 1))
    statistics, signs, values = layout.merge([([1], (np.arange(3.0), None, np.array([9], np.float32))),
                                              ([0], (np.arange(3.0, 6.0), None, np.array([7, 8], np.float32)))])
    assert statistics.tolist() == [3, 4, 5, 0, 1, 2]
    assert signs is None and values.tolist() == [7, 8, 9]


def test_cumulative_counts_decode_into_buckets_and_the_zero_count():
    # one parameter [-2, 0, 0, 5] with bounds (-1, 1): 1 element <= -1, 3 <= 1, 2 equal to 0; exponents 1 and 2
    exponents = np.zeros(EXPONENT_BINS)
    exponents[[1 - EXPONENT_LOW, 2 - EXPONENT_LOW, -2]] = 1, 1, 2
    record = record_from_statistics(rank=0, step=0, level=L2_WITH_EXPONENTS, bounds=(-1, 1), names=["w"],
                                    shapes=[(4,)], statistics=np.array([5.0, -2.0, np.sqrt(29), 1, 3, 2, *exponents]),
                                    signs=np.array([0x10]))
    assert (record.exponent_counts.lowest, record.exponent_counts.kept.tolist()) == (1, [[1, 1, 2, 0]])
    assert record.exponent_counts.full().tolist() == [exponents.tolist()]
    assert record.bucket_counts.tolist() == [[1, 2, 1]]  # (-inf, -1], (-1, 1], (1, inf)
    assert record.zero_counts.tolist() == [2]
    assert record.values.tolist() == [[5.0, -2.0, np.float32(np.sqrt(29))]]
    assert record.csv_rows() == [["w", 0.25, 0.5, 0.25, 0.5, 5.0, -2.0, float(np.float32(np.sqrt(29))), [4]]]
