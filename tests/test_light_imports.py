"""What importing costs: the API checker's numpy-only modules load no framework, no MLflow.

Each check runs in a fresh interpreter, since this test process has imported everything already.
"""
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "mindspore", "mlflow", "matplotlib")


def heavy_modules_after(code: str) -> list[str]:
    """The heavy top-level packages in ``sys.modules`` after running ``code`` in a fresh interpreter."""
    probe = f"{code}\nimport sys\nprint(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return eval(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("module", ["msprobe_mlflow.api_check", "msprobe_mlflow.api_check.parser",
                                    "msprobe_mlflow.api_check.metrics", "msprobe_mlflow.api_check.results",
                                    "msprobe_mlflow.api_check.report"])
def test_api_checker_modules_import_without_torch_mindspore_or_mlflow(module):
    assert heavy_modules_after(f"import {module}") == []


def test_the_mindspore_alias_of_the_api_checker_is_lazy():
    assert heavy_modules_after("import msprobe_mlflow.mindspore") == []
