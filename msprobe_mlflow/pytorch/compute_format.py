"""The format a run computes each step in, as torch reports it, recorded with the step's directions so that the
comparator knows a pair's rounding without being told (``compare --precision``; :mod:`msprobe_mlflow.formats`).

The coarsest of: the monitored parameters' dtypes; autocast's dtype where a forward of the model ran under it
(seen by a forward pre-hook); and, for float32 parameters, the precision torch lets float32 matmuls and
convolutions drop to (TF32 or bfloat16: ``torch.set_float32_matmul_precision``, the ``allow_tf32`` flags, the
``fp32_precision`` settings of CUDA, cuDNN and the CPU's oneDNN). Not known (None) where a parameter lives on
another device (an accelerator's own modes, such as HF32, are not reported here) or no forward of the model ran
since the last probed step (a compiled or wrapped model called past the monitored module). A cast in the model's
code is not reported either: it shows in the gradients' significands instead (the comparator's first-steps note).
"""
from __future__ import annotations

import torch

from msprobe_mlflow.formats import coarsest

FORMAT_OF_DTYPE = {torch.float64: "float64", torch.float32: "float32", torch.bfloat16: "bfloat16",
                   torch.float16: "float16"}
REPORTED_DEVICES = ("cpu", "cuda")  # whose float32 modes torch reports
REDUCED = {"tf32": "tf32", "bf16": "bfloat16", "high": "tf32", "medium": "bfloat16"}  # torch's names -> formats


class ComputeFormatWatch:
    """Watches ``model``'s forwards for autocast; ``take()`` gives the format of the step since the last call."""

    def __init__(self, model: torch.nn.Module, parameters: list[torch.Tensor]):
        self._dtypes = {parameter.dtype for parameter in parameters}
        self._devices = {parameter.device.type for parameter in parameters}
        self._autocast: set[torch.dtype] | None = None  # None: no forward since the last take()
        self._taken = False
        self._hook = model.register_forward_pre_hook(self._on_forward)

    def missed_first_forward(self) -> bool:
        """No forward seen before the first :meth:`take`: the watch came after that step's forward (``autolog()``
        attaches at the first optimizer step), or the model is called past the monitored module."""
        return not self._taken and self._autocast is None

    def _on_forward(self, module, args) -> None:
        seen = self._autocast if self._autocast is not None else set()
        seen.update(torch.get_autocast_dtype(device) for device in self._devices if torch.is_autocast_enabled(device))
        self._autocast = seen

    def take(self) -> str | None:
        """The coarsest format of the step whose forward ran since the last call (see the module docstring)."""
        seen, self._autocast, self._taken = self._autocast, None, True
        if seen is None or not self._devices or not self._devices <= set(REPORTED_DEVICES):
            return None
        formats = [FORMAT_OF_DTYPE.get(dtype) for dtype in self._dtypes | seen]
        if torch.float32 in self._dtypes:
            formats += [_reduced_float32(device) for device in self._devices]
        return coarsest(formats)

    def close(self) -> None:
        self._hook.remove()


def _reduced_float32(device: str) -> str:
    """The coarsest format torch may compute float32 matmuls and convolutions in on ``device``."""
    settings = [torch.get_float32_matmul_precision()]
    backends = torch.backends
    if device == "cuda":
        settings += ["tf32" if getattr(backends.cuda.matmul, "allow_tf32", False) else "",
                     "tf32" if getattr(backends.cudnn, "allow_tf32", False) else "",
                     getattr(backends.cuda.matmul, "fp32_precision", ""),
                     getattr(getattr(backends.cudnn, "conv", None), "fp32_precision", ""),
                     getattr(getattr(backends.cudnn, "rnn", None), "fp32_precision", "")]
    else:
        mkldnn = backends.mkldnn
        settings += [getattr(getattr(mkldnn, kind, None), "fp32_precision", "") for kind in ("matmul", "conv", "rnn")]
    return coarsest(["float32"] + [REDUCED[setting] for setting in settings if setting in REDUCED])
