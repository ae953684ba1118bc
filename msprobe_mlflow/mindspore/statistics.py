"""Gradient statistics with MindSpore ops, written so that the same code runs eagerly (PyNative) and inside a
compiled graph (GRAPH_MODE, ``@mindspore.jit``, ``TrainOneStepCell``).

Every public function takes the optimizer's gradient tuple and a tuple of bools, known at compile time, saying
which gradients are monitored, and returns one flat tensor. The per-gradient work is mapped over the tuple with
``HyperMap``, as MindSpore's own optimizers do: a Python loop would unroll into a chain of list operations that
exceeds the compiler's call-depth limit (1000) at a few hundred parameters. Inside, every ``if`` tests a dtype or a
shape, which the compiler knows. The result is laid out as :class:`msprobe_mlflow.layout.StatisticsLayout` says,
as the PyTorch monitor's is, once :func:`propagate_nan` has run on the host.

MindSpore's CPU kernels reject most bfloat16 ops (max, comparisons, reductions), so each bfloat16 or float16
gradient is cast to float32 first. That changes no value: max, min, the comparisons and ``> 0`` are exact on the
float32 copy. The norm is accumulated in float32 and then rounded to the gradient's dtype, as
``torch._foreach_norm`` returns it. float64 gradients stay float64 (as the PyTorch monitor and msprobe compare
them: a value too small for float32 is still ``> 0``), their max, min and norm are then rounded to float32.
"""
from __future__ import annotations

import numpy as np
import mindspore as ms
from mindspore import mint, ops

from msprobe_mlflow.layout import EXTREMES, StatisticsLayout
from msprobe_mlflow.statistics_table import (BIT_WEIGHTS, EXPONENT_BINS, EXPONENT_HIGH, EXPONENT_LOW, EXTRA as
                                             EXTRA_STATISTICS, NON_FINITE_BIN, ZERO_BIN, Statistic, byte_padding)

_COMPARISON_MATRIX_LIMIT = 1 << 24  # booleans: a 16 MiB temporary
_NAN = ms.Tensor(np.nan, ms.float64)


def _as_float32(grad):
    return grad if grad.dtype == ms.float32 else grad.astype(ms.float32)


def _comparable(grad):
    """The gradient in the dtype its statistics are computed in: float64 stays, anything else becomes float32."""
    return grad if grad.dtype == ms.float64 else _as_float32(grad)


def _scalar64(value):
    return ops.reshape(value.astype(ms.float64), (1,))


_map = ops.HyperMap()
_extremes_and_norm = ops.MultitypeFuncGraph("msprobe_mlflow_extremes_and_norm")
_bucket_counts = ops.MultitypeFuncGraph("msprobe_mlflow_bucket_counts")
_exponent_counts = ops.MultitypeFuncGraph("msprobe_mlflow_exponent_counts")
_sign_bits = ops.MultitypeFuncGraph("msprobe_mlflow_sign_bits")
_flat_float32 = ops.MultitypeFuncGraph("msprobe_mlflow_flat_float32")
_norm = ops.MultitypeFuncGraph("msprobe_mlflow_norm")


@_extremes_and_norm.register("Bool", "Tensor")
def _extremes_and_norm_of(selected, grad):
    """``[max, min, norm]``, each a float32 value (held in float64). An empty gradient gives NaN, NaN, 0."""
    if not selected:
        return mint.zeros((0,), dtype=ms.float64)
    if grad.size == 0:
        return mint.cat((mint.zeros((2,), dtype=ms.float64) / 0.0, mint.zeros((1,), dtype=ms.float64)))
    comparable = _comparable(grad)
    norm = mint.sqrt(mint.sum(comparable * comparable))
    if grad.dtype == ms.float16 or grad.dtype == ms.bfloat16:
        norm = norm.astype(grad.dtype)
    return mint.cat((_scalar64(mint.max(comparable).astype(ms.float32)),
                     _scalar64(mint.min(comparable).astype(ms.float32)), _scalar64(norm.astype(ms.float32))))


@_bucket_counts.register("Tuple", "Bool", "Tensor")
def _bucket_counts_of(bounds32, selected, grad):
    """``[#(x <= b) for each bound b, #(x == 0)]`` (NaN is never ``<= b``: it lands in the last bucket).

    Up to ``_COMPARISON_MATRIX_LIMIT`` booleans, one comparison of the gradient against all bounds (fewer ops:
    half the compile time); beyond, one comparison per bound, so the temporary stays the size of the gradient."""
    if not selected:
        return mint.zeros((0,), dtype=ms.int64)
    if grad.size == 0:  # MindSpore's CPU sum of an empty tensor is not 0
        return mint.zeros((len(bounds32) + 1,), dtype=ms.int64)
    comparable = _comparable(grad)
    zeros = ops.reshape(mint.sum(comparable == 0, dtype=ms.int64), (1,))
    if grad.size * len(bounds32) <= _COMPARISON_MATRIX_LIMIT:
        bounds = ms.Tensor(bounds32, comparable.dtype)
        return mint.cat((mint.sum(ops.reshape(comparable, (-1, 1)) <= bounds, dim=0, dtype=ms.int64), zeros))
    counts = []
    for bound in bounds32:
        counts.append(ops.reshape(mint.sum(comparable <= bound, dtype=ms.int64), (1,)))
    counts.append(zeros)
    return mint.cat(counts)


_LN2 = float(np.log(2.0))


@_exponent_counts.register("Bool", "Tensor")
def _exponent_counts_of(selected, grad):
    """The elements at each binary exponent, then zeros, then non-finite ones
    (:func:`msprobe_mlflow.statistics_table.exponent_counts`), float64. MindSpore has no bit view of a float in a
    graph and no CPU ``log2``: ``floor(ln|x| / ln 2)`` in float64, moved by one where ``2**e`` says it missed (a
    float64 next to a power of two), then one ``unsorted_segment_sum`` of ones (its CPU kernel has no
    ``scatter_add``)."""
    if not selected:
        return mint.zeros((0,), dtype=ms.float64)
    if grad.size == 0:
        return mint.zeros((EXPONENT_BINS,), dtype=ms.float64)
    magnitude = mint.abs(ops.reshape(_comparable(grad), (-1,)).astype(ms.float64))
    finite, nonzero = mint.isfinite(magnitude), magnitude > 0
    safe = mint.where(finite & nonzero, magnitude, 1.0)
    exponent = mint.floor(mint.log(safe) / _LN2)
    exponent = exponent - (safe < mint.pow(2.0, exponent)).astype(ms.float64)
    exponent = exponent + (safe >= mint.pow(2.0, exponent + 1)).astype(ms.float64)
    bins = mint.where(nonzero, mint.clamp(exponent, EXPONENT_LOW, EXPONENT_HIGH) - EXPONENT_LOW, float(ZERO_BIN))
    bins = mint.where(finite, bins, float(NON_FINITE_BIN)).astype(ms.int32)
    return ops.unsorted_segment_sum(mint.ones(bins.shape, dtype=ms.int32), bins, EXPONENT_BINS).astype(ms.float64)


@_sign_bits.register("Bool", "Tensor")
def _sign_bits_of(selected, grad):
    """``grad > 0`` flattened and padded with 0 to a whole byte."""
    if not selected or grad.size == 0:
        return mint.zeros((0,), dtype=ms.uint8)
    bits = ops.reshape(_comparable(grad) > 0, (-1,)).astype(ms.uint8)
    padding = byte_padding(grad.size)
    if padding:
        bits = mint.cat((bits, mint.zeros((padding,), dtype=ms.uint8)))
    return bits


@_flat_float32.register("Bool", "Tensor")
def _flat_float32_of(selected, grad):
    if not selected or grad.size == 0:
        return mint.zeros((0,), dtype=ms.float32)
    return ops.reshape(_as_float32(grad), (-1,))


@_norm.register("Bool", "Tensor")
def _norm_of(selected, value):
    """The L2 norm accumulated in float32 (float64 for float64), not rounded to a bf16/fp16 dtype."""
    if not selected:
        return mint.zeros((0,), dtype=ms.float64)
    if value.size == 0:  # MindSpore's CPU sum of an empty tensor is not 0
        return mint.zeros((1,), dtype=ms.float64)
    comparable = _comparable(value)
    return _scalar64(mint.sqrt(mint.sum(comparable * comparable)))


def parameter_norms(parameters: tuple, selected: tuple) -> ms.Tensor:
    """Each selected parameter's own norm (``statistics=["param_norm"]``), float64, before the optimizer's update."""
    return mint.cat(_map(_norm, selected, parameters))


def _extra_graph(statistic: Statistic) -> ops.MultitypeFuncGraph:
    """An opt-in statistic of one gradient (:mod:`msprobe_mlflow.statistics_table`): its element map on the
    compared values, then its reduction, as one float64 number (a max or min of an empty gradient: NaN)."""
    graph = ops.MultitypeFuncGraph(f"msprobe_mlflow_{statistic.name}")
    element, reduction = statistic.element, statistic.reduction

    @graph.register("Bool", "Tensor")
    def _of(selected, grad):
        if not selected:
            return mint.zeros((0,), dtype=ms.float64)
        if grad.size == 0:  # MindSpore's CPU sum of an empty tensor is not 0
            return mint.zeros((1,), dtype=ms.float64) / (1.0 if reduction == "sum" else 0.0)
        mapped = element(_comparable(grad)).astype(ms.float64)
        if reduction == "sum":
            return _scalar64(mint.sum(mapped))
        reduced = mint.max(mapped) if reduction == "max" else mint.min(mapped)  # these skip NaN: NaN propagates
        return _scalar64(mint.where(mint.any(mint.isnan(mapped)), _NAN, reduced))
    return graph


_extra_graphs: dict[str, ops.MultitypeFuncGraph] = {}  # read by name in the compiled graph


def prepare_extra(names) -> tuple[str, ...]:
    """Makes the graphs of the ``extra`` statistics (names) that :func:`gradient_statistics` will look up: call it
    on the host before compiling."""
    for name in names:
        if name not in _extra_graphs:
            _extra_graphs[name] = _extra_graph(EXTRA_STATISTICS[name])
    return tuple(names)


def gradient_statistics(grads: tuple, selected: tuple, has_buckets: bool, bounds32: tuple,
                        extra: tuple = (), has_exponents: bool = False) -> ms.Tensor:
    """One float64 vector: ``max, min, norm`` of each selected gradient (float32 values), then with buckets
    (``Level.has_buckets``, L2), per selected gradient, the number of elements ``x <= b`` for each float32 bound
    ``b`` and the number equal to zero (``-0.0`` included), then with exponents (``Level.has_exponents``) each
    one's exponent counts, then the reductions of the ``extra`` statistics (their names), per gradient.
    MindSpore's max and min skip NaN: :func:`propagate_nan` makes them NaN on the host."""
    statistics = mint.cat(_map(_extremes_and_norm, selected, grads))
    if has_buckets:
        counts = mint.cat(_map(ops.partial(_bucket_counts, bounds32), selected, grads)).astype(ms.float64)
        statistics = mint.cat((statistics, counts))
    if has_exponents:
        statistics = mint.cat((statistics, mint.cat(_map(_exponent_counts, selected, grads))))
    if extra:
        columns = [ops.reshape(mint.cat(_map(_extra_graphs[name], selected, grads)), (-1, 1)) for name in extra]
        statistics = mint.cat((statistics, ops.reshape(mint.cat(columns, dim=1), (-1,))))  # per gradient
    return statistics


def pack_signs(grads: tuple, selected: tuple) -> ms.Tensor:
    """``grad > 0`` of each selected gradient bit-packed like ``np.packbits``, each padded to a whole byte,
    concatenated. Zero, -0.0 and NaN give 0 bits, as msprobe's ``np.save(grad > 0)``."""
    bits = ops.reshape(mint.cat(_map(_sign_bits, selected, grads)), (-1, 8))
    return mint.sum(bits * ms.Tensor(BIT_WEIGHTS, ms.uint8), dim=1, dtype=ms.uint8)


def float32_values(grads: tuple, selected: tuple) -> ms.Tensor:
    """Each selected gradient cast to float32 and flattened, concatenated: the bytes msprobe's L0 ``MD5`` hashes."""
    return mint.cat(_map(_flat_float32, selected, grads))


def propagate_nan(statistics: np.ndarray, layout: StatisticsLayout) -> np.ndarray:
    """Host side of :func:`gradient_statistics`: max and min become NaN where the norm is NaN (a NaN element), as
    ``torch.aminmax`` gives them. ``statistics`` is modified and returned."""
    extremes = layout.split(statistics)[EXTREMES]  # a view: max, min, norm per parameter
    extremes[np.isnan(extremes[:, 2]), :2] = np.nan
    return statistics
