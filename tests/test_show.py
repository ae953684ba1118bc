"""``msprobe-mlflow show``: a comparison run's verdict printed again as compare printed it, the operator once
located, and every comparison of a pair, newest first."""
import mlflow
import pytest
from click.testing import CliRunner

from msprobe_mlflow import compare_runs
from msprobe_mlflow.commands.cli import main
from msprobe_mlflow.localization import locate_hint
from tests.test_locate_runs import training_run
from tests.tiny_transformer import FaultyKernel


@pytest.fixture
def pair(tmp_experiment, tmp_path):
    return (training_run(tmp_path / "a", "gpu", [2]),
            training_run(tmp_path / "b", "npu", [2], FaultyKernel("gelu", 1, error=1e-2)))


def show(*arguments):
    return CliRunner().invoke(main, ["show", *arguments, "--tracking-uri", mlflow.get_tracking_uri()])


def test_show_prints_the_verdict_again_and_lists_the_pairs_comparisons(pair):
    first = compare_runs(*pair, plots=False)
    printed = show(first.run_id)
    assert printed.exit_code == 0, printed.output
    hint = locate_hint(*pair, first.verdict)  # the next command, as compare printed it
    assert hint.startswith(f"next, the operator: msprobe-mlflow locate {pair[0]} {pair[1]} --step 2\n")
    assert printed.output.strip() == f"{first.verdict.describe()}\n\n{hint}\n\n{first.comparison.table()}".strip()
    second = compare_runs(*pair, plots=False)
    listed = show(*pair)
    assert listed.exit_code == 0, listed.output
    lines = listed.output.strip().splitlines()
    assert [line.split()[0] for line in lines] == [second.run_id, first.run_id]  # newest first
    assert lines[0].endswith("suspicious from step 2 (break)")
    assert show(pair[1], pair[0]).output.startswith("no comparison of A = ")  # the pair is ordered


def test_show_adds_the_operator_once_located(pair):
    import msprobe_mlflow

    located = msprobe_mlflow.locate(*pair)
    printed = show(located.comparison_run_id)
    assert printed.output.strip().endswith(f"operator (locate run {located.run_id}): {located.describe()}")


def test_show_refuses_a_run_that_is_no_comparison(pair):
    refused = show(pair[0])
    assert refused.exit_code == 2
    assert f"run {pair[0]} is not a comparison run" in refused.output
