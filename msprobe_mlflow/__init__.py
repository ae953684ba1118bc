"""msprobe-mlflow: MLflow as the system of record for precision debugging of PyTorch and MindSpore training."""
from msprobe_mlflow.config import GradProbeConfig

__version__ = "0.1.0"
__all__ = ["GradProbeConfig", "__version__"]
