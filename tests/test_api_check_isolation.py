"""The API checker leaves the process as it found it: called between two steps of a graph-mode MindSpore training
(tests/api_check_between_steps.py, in a process of its own), MindSpore stays in graph mode, launch blocking stays as
it was, and the second step trains as if the check had not run."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from api_check_between_steps import INPUTS, LEARNING_RATE, TARGETS, WEIGHT
from msprobe_mlflow.api_check import check_api_accuracy

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "mindspore_api_dump" / "statistics" / "api_info.json"
SCRIPT = Path(__file__).with_name("api_check_between_steps.py")


def numpy_sgd(steps: int) -> list[dict]:
    """The linear layer after each SGD step on the mean squared error, in float64."""
    weight, bias, states = WEIGHT.astype(np.float64), np.zeros(1), []
    for _ in range(steps):
        residual = INPUTS @ weight.T + bias - TARGETS
        d_prediction = 2 * residual / residual.size
        weight, bias = weight - LEARNING_RATE * d_prediction.T @ INPUTS, bias - LEARNING_RATE * d_prediction.sum(0)
        states.append({"weight": weight, "bias": bias})
    return states


@pytest.fixture(scope="module")
def statuses_in_this_process(tmp_path_factory):
    """The example's verdicts from a check run in pytest's own process (launch blocking is on here, so the calls
    run in it)."""
    report = check_api_accuracy(EXAMPLE, output_dir=tmp_path_factory.mktemp("here"), log_to_mlflow=False)
    return {result.name: result.status for result in report.results}


@pytest.mark.parametrize("preset", ["not-preset", "preset"])
def test_a_check_between_two_graph_mode_steps_changes_neither_mindspore_nor_the_training(
        tmp_path, preset, statuses_in_this_process):
    """not-preset: launch blocking is off, as in most trainings, so the calls run in a worker process; preset: it
    is on already, so they run in the training's process, in PyNative mode, and graph mode comes back after."""
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    completed = subprocess.run([sys.executable, str(SCRIPT), str(EXAMPLE), str(tmp_path / "out"), preset],
                               env=environment, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-3000:]
    found = json.loads(completed.stdout.strip().splitlines()[-1])
    expected_settings = {"mode": found["graph_mode"], "launch_blocking": preset == "preset"}
    assert found["before"] == expected_settings
    assert found["after"] == expected_settings
    assert found["statuses"] == statuses_in_this_process
    assert found["statuses"]["Mint.atan2.0"] == "skip"  # MindSpore really ran: it has no CPU kernel for atan2
    for state, expected in zip(found["steps"], numpy_sgd(2)):
        np.testing.assert_allclose(state["weight"], expected["weight"], rtol=1e-5)
        np.testing.assert_allclose(state["bias"], expected["bias"], rtol=1e-5, atol=1e-7)
