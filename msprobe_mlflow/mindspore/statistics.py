"""Gradient statistics with MindSpore ops, written so that the same code runs eagerly (PyNative) and inside a
compiled graph (GRAPH_MODE, ``@mindspore.jit``, ``TrainOneStepCell``).

Every function here takes a tuple of gradients and returns one flat tensor; loops over the tuple unroll at
compile time and every ``if`` tests a dtype or a shape, which the compiler knows. The layout is the one
:func:`msprobe_mlflow.records.record_from_statistics` decodes, which the PyTorch monitor also produces.

MindSpore's CPU kernels reject most bfloat16 ops (max, comparisons, reductions), so each bfloat16 or float16
gradient is cast to float32 first. That changes no value: max, min, the comparisons and ``> 0`` are exact on the
float32 copy. The norm is accumulated in float32 and then rounded to the gradient's dtype, as
``torch._foreach_norm`` returns it. float64 gradients stay float64 (as the PyTorch monitor and msprobe compare
them: a value too small for float32 is still ``> 0``), their max, min and norm are then rounded to float32.
"""
from __future__ import annotations

import numpy as np
import mindspore as ms
from mindspore import mint

_BIT_WEIGHTS = (128, 64, 32, 16, 8, 4, 2, 1)  # np.packbits order: first element in the high bit


def float32_bounds(bounds) -> tuple[float, ...]:
    """The bucket bounds as the float32 values every comparison uses (``0.1`` is ``0.10000000149011612``)."""
    return tuple(float(np.float32(b)) for b in bounds)


def _as_float32(grad):
    return grad if grad.dtype == ms.float32 else grad.astype(ms.float32)


def _comparable(grad):
    """The gradient in the dtype its statistics are computed in: float64 stays, anything else becomes float32."""
    return grad if grad.dtype == ms.float64 else _as_float32(grad)


def _scalar(value):
    return mint.reshape(value, (1,))


def gradient_statistics(grads: tuple, level: str, bounds32: tuple) -> ms.Tensor:
    """One float64 vector: ``max, min, norm`` of each gradient (float32 values), then at L2, per gradient, the
    number of elements ``x <= b`` for each float32 bound ``b`` and the number equal to zero (``-0.0`` included).

    NaN anywhere makes max and min NaN, as ``torch.aminmax`` does (MindSpore's max skips NaN); NaN compares false
    so it is never counted ``<= b``, which puts it in the last bucket. An empty gradient has NaN max and min, norm 0.
    """
    values, counts = [], []
    for grad in grads:
        comparable = _comparable(grad)
        if grad.size == 0:
            nan = mint.zeros((2,), dtype=ms.float32) / 0.0
            values += [nan, mint.zeros((1,), dtype=ms.float32)]
        else:
            sum_of_squares = mint.sum(comparable * comparable)
            norm = mint.sqrt(sum_of_squares)
            if grad.dtype == ms.float16 or grad.dtype == ms.bfloat16:
                norm = norm.astype(grad.dtype)
            has_nan = mint.isnan(sum_of_squares)  # a sum of squares is NaN exactly when an element is NaN
            maximum = mint.where(has_nan, sum_of_squares, mint.max(comparable))
            minimum = mint.where(has_nan, sum_of_squares, mint.min(comparable))
            values += [_scalar(maximum.astype(ms.float32)), _scalar(minimum.astype(ms.float32)),
                       _scalar(norm.astype(ms.float32))]
        if level == "L2":
            for bound in bounds32:
                counts.append(_scalar(mint.sum((comparable <= bound).astype(ms.int32), dtype=ms.int64)))
            counts.append(_scalar(mint.sum((comparable == 0).astype(ms.int32), dtype=ms.int64)))
    statistics = mint.cat(values).astype(ms.float64)
    if level == "L2":
        statistics = mint.cat((statistics, mint.cat(counts).astype(ms.float64)))
    return statistics


def pack_signs(grads: tuple) -> ms.Tensor:
    """``grad > 0`` of each gradient bit-packed like ``np.packbits``, each padded to a whole byte, concatenated.

    Zero, -0.0 and NaN give 0 bits, as msprobe's ``np.save(grad > 0)``.
    """
    pieces = []
    for grad in grads:
        if grad.size:
            pieces.append(mint.reshape(_comparable(grad) > 0, (-1,)).astype(ms.int32))
            padding = -grad.size % 8
            if padding:
                pieces.append(mint.zeros((padding,), dtype=ms.int32))
    bits = mint.reshape(mint.cat(pieces), (-1, 8))
    weights = ms.Tensor(_BIT_WEIGHTS, ms.int32)
    return mint.sum(bits * weights, dim=1).astype(ms.uint8)


def float32_values(grads: tuple) -> ms.Tensor:
    """Every gradient cast to float32 and flattened, concatenated: the bytes msprobe's L0 ``MD5`` hashes."""
    pieces = []
    for grad in grads:
        if grad.size:
            pieces.append(mint.reshape(_as_float32(grad), (-1,)))
    return mint.cat(pieces)
