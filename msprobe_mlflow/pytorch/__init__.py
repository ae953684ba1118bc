"""PyTorch gradient monitor."""
from msprobe_mlflow.pytorch.monitor import GradientMonitor, PrecisionDebugger

__all__ = ["GradientMonitor", "PrecisionDebugger"]
