"""The summary metrics of a step, from its grad_summary table: keys a person can read, values by hand."""
from __future__ import annotations

from pathlib import Path

import pytest

from msprobe_mlflow.dump import SummaryTable
from msprobe_mlflow.levels import csv_header
from msprobe_mlflow.metrics import step_metrics

SHARES = "share of gradient elements"


def l2_table(bounds: list, rows: list[list]) -> SummaryTable:
    """A table as read from a CSV: every cell text."""
    return SummaryTable(Path("grad_summary_0.csv"), csv_header("L2", bounds), [[str(c) for c in r] for r in rows])


def bucket_keys(metrics: dict[str, float]) -> list[str]:
    """The bucket keys in the order they were produced (the CSV's column order, which is numeric)."""
    return [key for key in metrics if key.startswith(f"grad/rank0/{SHARES}/") and not key.endswith("exactly 0")]


def test_l2_bucket_charts_are_titled_in_words_and_sort_in_numeric_order():
    """MLflow's run page: a section per key prefix (up to the last ``/``), charts titled by the rest, by name.
    Before: ``grad/rank0/fraction`` holding ``0 -inf lt g le -1``, ``1 -1 lt g le 0``..."""
    # 2 elements in (-inf, -1], 1 in (-1, 0] (a zero), 1 in (0, 1], none above 1.
    table = l2_table([-1, 0, 1], [["w", 0.5, 0.25, 0.25, 0.0, 0.25, 0.5, -2.0, 2.0, [4]]])
    metrics = step_metrics(table, 0)
    keys = bucket_keys(metrics)
    assert keys == ["grad/rank0/share of gradient elements/1 at most -1",
                    "grad/rank0/share of gradient elements/2 over -1 up to 0",
                    "grad/rank0/share of gradient elements/3 over 0 up to 1",
                    "grad/rank0/share of gradient elements/4 over 1"]
    assert sorted(keys) == keys  # what the MLflow UI shows: sorted by name
    assert [metrics[k] for k in keys] == [0.5, 0.25, 0.25, 0.0]
    assert metrics["grad/rank0/share of gradient elements/exactly 0"] == 0.25


def test_only_what_changes_from_step_to_step_is_a_metric():
    """``params`` (the number of rows) and ``nonfinite_params`` (0 on a healthy run) drew flat lines on every run."""
    table = l2_table([-1, 0, 1], [["w", 0.5, 0.25, 0.25, 0.0, 0.25, 0.5, -2.0, 2.0, [4]],
                                  ["b", 0.0, 0.0, 0.0, 1.0, 0.0, "nan", "nan", "nan", [1]]])
    metrics = step_metrics(table, 0)
    assert sorted(metrics) == sorted(["grad/rank0/total_norm", "grad/rank0/max", "grad/rank0/min",
                                      *bucket_keys(metrics), "grad/rank0/share of gradient elements/exactly 0"])


def test_more_than_ten_buckets_still_sort_in_numeric_order():
    bounds = list(range(-5, 6))  # 11 bounds, 12 buckets
    table = l2_table(bounds, [["w", *[0.0] * 11, 1.0, 0.0, 9.0, 9.0, 9.0, [1]]])
    keys = bucket_keys(step_metrics(table, 0))
    assert keys[0] == f"grad/rank0/{SHARES}/01 at most -5"
    assert keys[10] == f"grad/rank0/{SHARES}/11 over 4 up to 5"
    assert keys[11] == f"grad/rank0/{SHARES}/12 over 5"
    assert sorted(keys) == keys


def test_bucket_fractions_are_weighted_by_element_count():
    # a: 4 elements, 1 at most -1 and 3 in (-1, 0]; b: 1 element above 1. Over 5 elements: 1/5, 3/5, 0, 1/5.
    table = l2_table([-1, 0, 1], [["a", 0.25, 0.75, 0.0, 0.0, 0.5, 0.0, -3.0, 1.0, [2, 2]],
                                  ["b", 0.0, 0.0, 0.0, 1.0, 0.0, 4.0, 4.0, 4.0, [1]]])
    metrics = step_metrics(table, 0)
    assert [metrics[k] for k in bucket_keys(metrics)] == pytest.approx([1 / 5, 3 / 5, 0.0, 1 / 5])
    assert metrics[f"grad/rank0/{SHARES}/exactly 0"] == pytest.approx(2 / 5)
