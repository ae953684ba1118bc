"""Training scripts run in an interpreter of their own: for what a test process cannot undo (a framework already
imported, or one that must look absent)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from mlflow.tracking import MlflowClient


def run_and_read_logged_steps(script: Path, tracking_uri: str) -> tuple[str, list[int]]:
    """Runs ``script`` (it prints its MLflow run ID last) and returns that run ID and the steps at which the run
    got ``grad/rank0/total_norm``."""
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    run_id = done.stdout.split()[-1]
    history = MlflowClient(tracking_uri).get_metric_history(run_id, "grad/rank0/total_norm")
    return run_id, [metric.step for metric in history]
