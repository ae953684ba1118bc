"""The summary metrics of a step, from its grad_summary table: keys a person can read, values by hand."""
from __future__ import annotations

from pathlib import Path

import pytest

from msprobe_mlflow.dump import SummaryTable
from msprobe_mlflow.levels import csv_header
from msprobe_mlflow.metrics import step_metrics


def l2_table(bounds: list, rows: list[list]) -> SummaryTable:
    """A table as read from a CSV: every cell text."""
    return SummaryTable(Path("grad_summary_0.csv"), csv_header("L2", bounds), [[str(c) for c in r] for r in rows])


def bucket_keys(metrics: dict[str, float]) -> list[str]:
    """The bucket keys in the order they were produced (the CSV's column order, which is numeric)."""
    return [key for key in metrics if key.startswith("grad/rank0/fraction/")]


def test_l2_bucket_keys_sort_in_numeric_order_and_say_which_end_is_closed():
    # 2 elements in (-inf, -1], 1 in (-1, 0] (a zero), 1 in (0, 1], none above 1.
    table = l2_table([-1, 0, 1], [["w", 0.5, 0.25, 0.25, 0.0, 0.25, 0.5, -2.0, 2.0, [4]]])
    metrics = step_metrics(table, 0)
    keys = bucket_keys(metrics)
    assert keys == ["grad/rank0/fraction/0 -inf lt g le -1", "grad/rank0/fraction/1 -1 lt g le 0",
                    "grad/rank0/fraction/2 0 lt g le 1", "grad/rank0/fraction/3 1 lt g lt inf"]
    assert sorted(keys) == keys  # what the MLflow UI shows: sorted by name
    assert [metrics[k] for k in keys] == [0.5, 0.25, 0.25, 0.0]
    assert metrics["grad/rank0/zero_fraction"] == 0.25


def test_more_than_ten_buckets_still_sort_in_numeric_order():
    bounds = list(range(-5, 6))  # 11 bounds, 12 buckets
    table = l2_table(bounds, [["w", *[0.0] * 11, 1.0, 0.0, 9.0, 9.0, 9.0, [1]]])
    keys = bucket_keys(step_metrics(table, 0))
    assert keys[0] == "grad/rank0/fraction/00 -inf lt g le -5"
    assert keys[10] == "grad/rank0/fraction/10 4 lt g le 5"
    assert keys[11] == "grad/rank0/fraction/11 5 lt g lt inf"
    assert sorted(keys) == keys


def test_bucket_fractions_are_weighted_by_element_count():
    # a: 4 elements, 1 at most -1 and 3 in (-1, 0]; b: 1 element above 1. Over 5 elements: 1/5, 3/5, 0, 1/5.
    table = l2_table([-1, 0, 1], [["a", 0.25, 0.75, 0.0, 0.0, 0.5, 0.0, -3.0, 1.0, [2, 2]],
                                  ["b", 0.0, 0.0, 0.0, 1.0, 0.0, 4.0, 4.0, 4.0, [1]]])
    metrics = step_metrics(table, 0)
    assert [metrics[k] for k in bucket_keys(metrics)] == pytest.approx([1 / 5, 3 / 5, 0.0, 1 / 5])
    assert metrics["grad/rank0/zero_fraction"] == pytest.approx(2 / 5)
