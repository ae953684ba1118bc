"""API checker metrics and verdict (docs/api_check.md, "Metrics and verdict"), on arrays small enough to work out
by hand."""
import math

import numpy as np
import pytest

from msprobe_mlflow.api_check.metrics import (Thresholds, compare_arrays, cosine_similarity, max_abs_err,
                                              max_relative_err)


def test_cosine_is_epsilon_smoothed_dot_over_norms():
    # dot = 1*1 + 0*1 = 1, |bench| = 1, |tested| = sqrt(2)
    assert cosine_similarity(np.array([1.0, 0.0]), np.array([1.0, 1.0])) == pytest.approx(
        (1e-8 + 1) / (1e-8 + math.sqrt(2)), rel=1e-15)


def test_cosine_of_opposite_vectors_is_minus_one():
    assert cosine_similarity(np.array([[1.0, 2.0]]), np.array([[-1.0, -2.0]])) == pytest.approx(
        (1e-8 - 5) / (1e-8 + 5), rel=1e-15)


def test_cosine_of_two_zero_tensors_is_one():
    assert cosine_similarity(np.zeros(3), np.zeros(3)) == 1.0


def test_max_abs_err_is_largest_absolute_difference():
    assert max_abs_err(np.array([1.0, -2.0, 3.0]), np.array([1.5, -2.0, 2.0])) == 1.0


def test_max_relative_err_uses_1e_minus_8_where_bench_is_zero():
    # |0 - 1e-9| / 1e-8 = 0.1 ; |4 - 5| / 4 = 0.25
    assert max_relative_err(np.array([0.0, 4.0]), np.array([1e-9, 5.0])) == pytest.approx(0.25)
    # |0 - 1| / 1e-8 = 1e8 dominates
    assert max_relative_err(np.array([0.0, 4.0]), np.array([1.0, 4.0])) == pytest.approx(1e8)


def test_metrics_are_computed_in_float64_from_float16_inputs():
    bench = np.array([1.0, 2.0], dtype=np.float16)
    tested = np.array([1.0, 2.001953125], dtype=np.float16)  # one float16 ulp above 2
    assert max_abs_err(bench, tested) == 0.001953125


def test_empty_tensors_compare_as_equal():
    empty = np.zeros((0, 3))
    assert (cosine_similarity(empty, empty), max_abs_err(empty, empty), max_relative_err(empty, empty)) == (
        1.0, 0.0, 0.0)


def test_pass_needs_cosine_above_and_max_abs_below_their_thresholds():
    result = compare_arrays(np.array([1.0, 2.0]), np.array([1.0, 2.0005]), Thresholds())
    assert (result.status, result.message) == ("pass", "")
    assert result.max_abs_err == pytest.approx(0.0005)


def test_max_abs_err_at_the_threshold_fails_with_msprobe_message():
    result = compare_arrays(np.array([1.0, 2.0]), np.array([1.0, 2.5]), Thresholds(max_abs_err=0.5))
    assert result.status == "error"
    assert result.message == "max absolute difference is greater than threshold: 0.5"


def test_low_cosine_and_large_error_give_both_messages():
    result = compare_arrays(np.array([1.0, 0.0]), np.array([0.0, 1.0]), Thresholds())
    assert result.status == "error"
    assert result.cosine == pytest.approx(1e-8 / (1e-8 + 1))
    assert result.message == ("cosine similarity is less than threshold: 0.99 "
                              "max absolute difference is greater than threshold: 0.001")


def test_max_relative_err_does_not_decide():
    result = compare_arrays(np.array([0.0, 1.0]), np.array([1e-6, 1.0]), Thresholds())
    assert result.max_relative_err == pytest.approx(100.0)
    assert result.status == "pass"


def test_non_finite_values_at_the_same_positions_with_the_same_signs_pass_and_the_finite_ones_are_measured():
    bench = np.array([np.inf, 1.0, -np.inf, np.nan, 2.0])
    tested = np.array([np.inf, 1.0005, -np.inf, np.nan, 2.0])
    result = compare_arrays(bench, tested, Thresholds())
    # the finite elements: bench [1, 2], tested [1.0005, 2]
    cosine = (1e-8 + 1.0005 + 4) / (1e-8 + math.sqrt(5) * math.sqrt(1.0005 ** 2 + 4))
    assert (result.status, result.message) == ("pass", "")
    assert (result.cosine, result.max_abs_err, result.max_relative_err) == pytest.approx((cosine, 0.0005, 0.0005),
                                                                                         rel=1e-12)


def test_outputs_that_are_all_non_finite_and_identical_pass_as_empty_ones_do():
    result = compare_arrays(np.array([np.inf, np.nan]), np.array([np.inf, np.nan]), Thresholds())
    assert (result.cosine, result.max_abs_err, result.max_relative_err, result.status) == (1.0, 0.0, 0.0, "pass")


@pytest.mark.parametrize("tested, found", [([-np.inf, 1.0], "bench inf, tested -inf"),
                                           ([np.nan, 1.0], "bench inf, tested nan"),
                                           ([3.0, 1.0], "bench inf, tested 3.0")])
def test_a_non_finite_value_that_differs_in_position_or_sign_fails_naming_the_first(tested, found):
    result = compare_arrays(np.array([np.inf, 1.0]), np.array(tested), Thresholds())
    assert result.status == "error"
    assert result.message == f"non-finite values differ at 1 of 2 elements (the first at flat index 0: {found})"
    assert (result.cosine, result.max_abs_err) == (pytest.approx(1.0), 0.0)  # the finite element agrees


def test_nan_where_the_benchmark_is_finite_fails():
    result = compare_arrays(np.array([1.0, 2.0]), np.array([1.0, np.nan]), Thresholds())
    assert result.status == "error"
    assert result.message == "non-finite values differ at 1 of 2 elements (the first at flat index 1: bench 2.0, " \
                             "tested nan)"


@pytest.mark.parametrize("bench, tested", [(np.zeros((2, 3)), np.zeros((3, 2))), (None, np.zeros(2)),
                                           (np.zeros(2), None)])
def test_pairs_that_are_not_two_tensors_of_one_shape_have_no_metrics_and_fail(bench, tested):
    result = compare_arrays(bench, tested, Thresholds())
    assert (result.cosine, result.max_abs_err, result.max_relative_err, result.status) == (None, None, None, "error")
    assert "skip comparing" in result.message
