"""What importing costs: the API checker's numpy-only modules and the CLI's help load no framework, no MLflow; the
PyTorch kernels load no monitor.

Each check runs in a fresh interpreter, since this test process has imported everything already.
"""
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "mindspore", "mlflow", "matplotlib")


def heavy_modules_after(code: str, watched: tuple[str, ...] = HEAVY) -> list[str]:
    """The ``watched`` modules (the heavy top-level packages unless told) in ``sys.modules`` after running ``code``
    in a fresh interpreter."""
    probe = f"{code}\nimport sys\nprint(sorted(m for m in {watched!r} if m in sys.modules))"
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


def test_the_documented_mindspore_autolog_is_the_function_and_importing_it_is_light():
    """``msprobe_mlflow.mindspore.autolog`` was a submodule: the documented call raised AttributeError or
    ``TypeError: 'module' object is not callable``."""
    code = ("import inspect, msprobe_mlflow\n"
            "assert inspect.isfunction(msprobe_mlflow.mindspore.autolog), msprobe_mlflow.mindspore.autolog\n"
            "from msprobe_mlflow.mindspore import autolog\n"
            "assert autolog is msprobe_mlflow.mindspore.autolog\n"
            "import msprobe_mlflow.integrations.autolog  # what msprobe_mlflow.autolog() imports\n"
            "assert msprobe_mlflow.mindspore.autolog is autolog")
    assert heavy_modules_after(code) == ["mlflow"]


def test_the_torch_kernels_import_without_the_monitor():
    """Every module of ``torch_kernels/`` loads torch and numba but no monitor, session, sink or MLflow: what is
    built on the kernels without the monitor (an operator trace, a benchmark) pays for the kernels only."""
    kernels = sorted(path.stem for path in (REPO / "msprobe_mlflow" / "torch_kernels").glob("*.py"))
    assert "statistics" in kernels and "fused" in kernels  # the glob found them
    monitor = ("mlflow", "msprobe_mlflow.pytorch", "msprobe_mlflow.monitoring", "msprobe_mlflow.session",
               "msprobe_mlflow.sinks", "msprobe_mlflow.tracking")
    code = "\n".join(f"import msprobe_mlflow.torch_kernels.{name}" for name in kernels if name != "__init__")
    assert heavy_modules_after(code, watched=monitor) == []


def test_command_line_help_imports_nothing_heavy():
    code = ("from click.testing import CliRunner\nfrom msprobe_mlflow.commands.cli import main\n"
            "for command in ([], ['upload'], ['compare'], ['api-check']):\n"
            "    assert CliRunner().invoke(main, [*command, '--help']).exit_code == 0")
    assert heavy_modules_after(code) == []


def test_bad_api_check_input_is_refused_before_any_framework_loads(tmp_path):
    broken = tmp_path / "api_info.json"
    broken.write_text('{"task": "statistics"}', encoding="utf-8")  # no data
    code = ("from click.testing import CliRunner\nfrom msprobe_mlflow.commands.cli import main\n"
            f"result = CliRunner().invoke(main, ['api-check', {str(broken)!r}, '--output', {str(tmp_path)!r}])\n"
            "assert result.exit_code == 2 and 'data = None is not accepted' in result.stderr, result.stderr")
    assert heavy_modules_after(code) == []


def test_dir_of_the_package_shows_the_public_names_lazy_ones_included_and_no_internals():
    import msprobe_mlflow

    shown = dir(msprobe_mlflow)
    assert {"autolog", "compare_runs", "compare_dumps", "read_statistics", "upload_dump", "MonitorOptions",
            "GradProbeConfig", "mindspore"} <= set(shown)
    assert not {"importlib", "config", "_LAZY_EXPORTS"} & set(shown)
