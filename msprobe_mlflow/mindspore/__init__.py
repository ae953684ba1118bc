"""MindSpore gradient monitor, its Model.train callback, its autolog and the API accuracy checker (imported lazily:
MindSpore is an optional extra)."""
import importlib

_EXPORTS = {
    "GradientMonitor": "msprobe_mlflow.mindspore.monitor",
    "GradProbeCallback": "msprobe_mlflow.mindspore.callback",
    "autolog": "msprobe_mlflow.mindspore.autologging",
    "PrecisionDebugger": "msprobe_mlflow.mindspore.monitor",
    "check_api_accuracy": "msprobe_mlflow.api_check",
}
__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
