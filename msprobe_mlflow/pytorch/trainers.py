"""What autolog and the callbacks find of a trainer from the model it trains, without importing the trainer (nor
torch): Lightning's ``MLFlowLogger`` run, which no active run shows."""
from __future__ import annotations

from typing import TYPE_CHECKING

from msprobe_mlflow.compat import lightning_trainer, mlflow_logger_tracking_uri
from msprobe_mlflow.parameter_names import wrapper_chain

if TYPE_CHECKING:
    import torch


def mlflow_logger_run(model: "torch.nn.Module") -> tuple[str | None, str | None] | None:
    """``(run_id, tracking_uri)`` of the ``MLFlowLogger`` of the Lightning trainer ``model`` (or the module its
    wrappers wrap) is attached to; None without one. Ranks other than 0 get ``(None, uri)``: Lightning logs on rank 0
    only."""
    trainer = next((t for m in wrapper_chain(model) if (t := lightning_trainer(m)) is not None), None)
    for logger in getattr(trainer, "loggers", None) or []:
        if type(logger).__name__ == "MLFlowLogger":
            return logger.run_id, mlflow_logger_tracking_uri(logger)
    return None
