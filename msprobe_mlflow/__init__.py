"""msprobe-mlflow: MLflow as the system of record for precision debugging of PyTorch and MindSpore training."""
import importlib

from msprobe_mlflow.config import GradProbeConfig

__version__ = "0.1.0"

# Imported on first use, so that ``import msprobe_mlflow`` stays light (no torch, mlflow, matplotlib or pandas).
_LAZY_EXPORTS = {
    "autolog": "msprobe_mlflow.integrations.autolog",
    "upload_dump": "msprobe_mlflow.tracking.upload",
    "compare_dumps": "msprobe_mlflow.compare.engine",
    "compare_runs": "msprobe_mlflow.tracking.comparison_run",
    "locate": "msprobe_mlflow.tracking.locate_run",
    "read_statistics": "msprobe_mlflow.tracking.run_dump",
    "MonitorOptions": "msprobe_mlflow.monitoring.options",
}
__all__ = ["GradProbeConfig", "__version__", *_LAZY_EXPORTS]


def __dir__():
    """What a notebook's completion should offer: the public names, the lazy ones included (``dir()`` would show
    only those imported so far, and the internals)."""
    return sorted([*__all__, "mindspore"])


def __getattr__(name):
    if name in _LAZY_EXPORTS:
        return getattr(importlib.import_module(_LAZY_EXPORTS[name]), name)
    if name == "mindspore":  # MLflow's spelling after a plain import: msprobe_mlflow.mindspore.autolog() (light)
        return importlib.import_module("msprobe_mlflow.mindspore")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
