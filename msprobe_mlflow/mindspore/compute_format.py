"""The format a MindSpore run computes each step in, recorded with the step's directions (``compute_format``) so that
the comparator knows a pair's rounding without being told (``compare --precision``; :mod:`msprobe_mlflow.formats`):
the MindSpore side of :mod:`msprobe_mlflow.pytorch.compute_format`.

The coarsest of: the optimizer's parameters' dtypes; the network's mixed precision, where the monitor is given the
network (``Model.train``'s callback and autolog give it the train network; ``monitor(optimizer, network=net)``):
cells that ``amp_level`` O2 or O3, ``Cell.to_float`` or ``custom_mixed_precision`` cast carry their dtype
(``Cell.mixed_precision_type``), level ``auto`` keeps its strategy's, and O1, which rewrites the network's code,
keeps none (not known); and, for float32 parameters, the device's: on CPU float32 operators compute in float32
(unless oneDNN's ``ONEDNN_DEFAULT_FPMATH_MODE`` lets them drop), on Ascend the precision mode and the HF32 switches
decide (:func:`ascend_format`), on GPU not known (convolutions default to TF32; what MindSpore reports of its TF32
switches is not established).

A 16-bit format the monitor cannot see (MindSpore's mixed precision on a network it was not given: a custom loop; a
cast in the network's code) shows in the gradients: a step whose format found is finer than 16 bits while a
gradient's max and min carry no more bits than float16's significand records none (:func:`step_format`), the rule
the comparator reads the significands by (``noise_rule.significant_bits``). A record finer than what the run
computed in makes a benign pair alarm (the comparator reads a float32 record with 16-bit gradients as a cast).
"""
from __future__ import annotations

import os
from typing import Iterable

import mindspore as ms
import numpy as np
from mindspore import nn

from msprobe_mlflow import compat
from msprobe_mlflow.compare.noise_rule import COARSE_BITS, FINER_THAN_16_BIT, significant_bits
from msprobe_mlflow.formats import coarsest
from msprobe_mlflow.records import StepRecord, with_compute_format

FORMAT_OF_DTYPE = {ms.float64: "float64", ms.float32: "float32", ms.bfloat16: "bfloat16", ms.float16: "float16"}
AMP_LEVELS = ("O1", "O2", "O3", "auto")  # auto_mixed_precision's levels that compute in a 16-bit format
MIXED_PRECISION = {"FP16": "float16", "BF16": "bfloat16"}  # Cell.mixed_precision_type's names that reduce
# Ascend's precision modes (mindspore.device_context.ascend.op_precision.precision_mode) -> the coarsest format a
# float32 operator may compute in. force_fp32 is CANN's cube_fp16in_fp32out: matrix operators take float16 inputs
# where they can; allow_mix_precision lowers operators "to float16 or bfloat16".
ASCEND_PRECISION_MODES = {"must_keep_origin_dtype": "float32", "force_fp32": "float16", "force_fp16": "float16",
                          "allow_fp32_to_fp16": "float16", "allow_mix_precision_fp16": "float16",
                          "allow_mix_precision": "bfloat16", "allow_fp32_to_bf16": "bfloat16",
                          "allow_mix_precision_bf16": "bfloat16"}
# oneDNN's default math mode for float32 operators (MindSpore's CPU kernels) -> the coarsest format it allows.
ONEDNN_FPMATH_MODES = {"STRICT": "float32", "TF32": "tf32", "F16": "float16", "BF16": "bfloat16", "ANY": "bfloat16"}


def compute_format(dtypes: Iterable, network: nn.Cell | None = None) -> str | None:
    """The coarsest format a step computes in whose parameters have ``dtypes``, computed by ``network`` (None: not
    seen; its gradients then tell, :func:`step_format`) on the current device (see the module docstring)."""
    dtypes = list(dtypes)
    formats = [FORMAT_OF_DTYPE.get(dtype) for dtype in dtypes]
    if network is not None:
        formats += mixed_precision_formats(network)
    if ms.float32 in dtypes:
        formats.append(float32_format(device_target()))
    return coarsest(formats)


def mixed_precision_formats(network: nn.Cell) -> list[str | None]:
    """The formats MindSpore's mixed precision makes ``network``'s cells compute in (none: as their parameters),
    with None for a cell given a level whose format nothing in it keeps (O1, or O2/O3 by rewrite)."""
    found = []
    for _, cell in network.cells_and_names():
        found += _marks(cell)
        if compat.mindspore_amp_level(cell) in AMP_LEVELS and \
                not any(_marks(inner) for _, inner in cell.cells_and_names()):
            found.append(None)
    return found


def _marks(cell: nn.Cell) -> list[str | None]:
    """The reduced formats ``cell`` itself carries: its ``to_float`` dtype, its ``auto`` strategy's dtype."""
    kind = getattr(getattr(cell, "mixed_precision_type", None), "name", "")  # None, NOTSET, FP32: no reduction
    marks = [MIXED_PRECISION[kind]] if kind in MIXED_PRECISION else []
    strategy = getattr(cell, "amp_strategy", None)
    if strategy is not None:
        marks.append(FORMAT_OF_DTYPE.get(strategy.get_amp_dtype()))
    return marks


def device_target() -> str:
    """``"CPU"``, ``"GPU"`` or ``"Ascend"``: where MindSpore runs (``get_current_device`` from MindSpore 2.5)."""
    current = getattr(ms, "get_current_device", None)
    return current().device_target if current is not None else ms.get_context("device_target")


def float32_format(device: str) -> str | None:
    """The coarsest format ``device`` may compute float32 operators in; None where MindSpore does not say."""
    if device == "CPU":
        mode = os.environ.get("ONEDNN_DEFAULT_FPMATH_MODE") or os.environ.get("DNNL_DEFAULT_FPMATH_MODE") or "STRICT"
        return ONEDNN_FPMATH_MODES.get(mode.upper())
    if device == "Ascend":
        return ascend_format(compat.ascend_precision_settings())
    return None


def ascend_format(settings: dict[str, str]) -> str | None:
    """The coarsest format Ascend may compute a float32 operator in under ``settings``
    (:func:`msprobe_mlflow.compat.ascend_precision_settings`: ``""`` where not set). None where the precision mode
    is not set (the chip decides: Atlas training products default to allow_fp32_to_fp16, A2 and later to
    must_keep_origin_dtype) or unknown, or where an operator precision file (``op_precision_mode``) may set anything.
    HF32 (11 significand bits, finer than TF32) counts as ``tf32`` unless both switches are off: CANN computes float32
    convolutions in HF32 unless ``conv_allow_hf32`` is False."""
    found = ASCEND_PRECISION_MODES.get(settings.get("precision_mode", ""))
    if found is None or settings.get("op_precision_mode"):
        return None
    hf32 = settings.get("matmul_allow_hf32") == "1" or settings.get("conv_allow_hf32") != "0"
    return coarsest([found, "tf32" if hf32 else "float32"])


def step_format(record: StepRecord, found: str | None) -> StepRecord:
    """``record`` with ``found`` as its step's format, or with none where ``found`` is finer than 16 bits and a
    gradient's max and min (those not zero) carry at most ``COARSE_BITS`` significant bits: the step computed in a
    16-bit format the monitor did not see. A float32 gradient is that coarse by chance once in 2**26."""
    if found in FINER_THAN_16_BIT:
        extremes = np.asarray(record.values, np.float64).reshape(-1, 3)
        bits = np.fmax(significant_bits(extremes[:, 0]), significant_bits(extremes[:, 1]))
        if np.any(bits <= COARSE_BITS):
            found = None
    return with_compute_format(record, found)
