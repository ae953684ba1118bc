"""The CPU statistics in one read of each gradient: a numba kernel, compiled once per dtype and cached on disk.

numpy needs one call, and so one pass over memory, per statistic; here one kernel walks each gradient in blocks
that fit the L1 cache: one loop over rows of 8 adds the squares in torch's own order and takes the largest and
smallest IEEE words as integers in the element's own width (the max and min follow from them, see
:func:`_extremes`), at the speed memory delivers the block; while it sits in the cache, vectorised loops count
each bound and the zeros, pack the sign bits eight at a time by one multiplication and (opt-in) count the
elements per binary exponent. It releases the GIL: :func:`statistics` spreads the gradients over this rank's cores
while the training thread waits in the optimizer's pre-hook (:func:`worker_threads`).
"""
from __future__ import annotations

import contextlib
import functools
import os
import threading
from typing import Callable

import numpy as np
import torch
from numba import carray, njit, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from msprobe_mlflow.compat import foreach_norm, numba_slp_vectorize, set_numba_cache_dir
from msprobe_mlflow.statistics_table import EXPONENT_BINS, EXPONENT_HIGH, EXPONENT_LOW, NON_FINITE_BIN, ZERO_BIN
from msprobe_mlflow.torch_kernels.openmp import on_torch_threads

BLOCK = 1 << 13  # elements per block (32 KiB of float32): every loop over a block reads it from the L1 cache
SMALL_ARRAY = 1 << 14  # elements: smaller arrays share one kernel call, so a model of many pays one call's cost
PARALLEL_MIN = 1 << 20  # elements: below this, threads cost more than they save
_GATHER_BITS = np.uint64(0x8040201008040201)  # (8 bytes of 0/1) * this >> 56: byte k's bit lands at bit 7-k
_LIMITS = {  # per dtype, in its bits' integer type: the sign bit (the smallest), the magnitude mask (the largest), +inf
    np.dtype(np.float32): np.array([-(1 << 31), 0x7FFFFFFF, 0x7F800000], np.int32),
    np.dtype(np.float64): np.array([-(1 << 63), 0x7FFFFFFFFFFFFFFF, 0x7FF0000000000000], np.int64)}
_SUBNORMAL_BIN = EXPONENT_BINS  # float32 subnormals wait in a bin of their own for :func:`_place_subnormals`
_TABLES = 8  # histogram copies, one per element of a row of 8: repeated exponents do not wait on each other
_DIRECT = 256  # elements: fewer are counted straight into the row, without the copies (which cost more to add up)
CACHE_ENV = "NUMBA_CACHE_DIR"


def _cache_folder() -> str | None:
    """Where numba keeps the compiled kernel. Beside this file when that is writable (numba's default); else
    (a read-only site-packages, a container image) a per-user folder, so that only the first process of a new
    environment compiles (seconds) instead of every process. ``NUMBA_CACHE_DIR`` set by the user wins."""
    if os.environ.get(CACHE_ENV) or os.access(os.path.dirname(os.path.abspath(__file__)), os.W_OK):
        return None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "msprobe-mlflow", "numba")


def kernel(function: Callable) -> Callable:
    """``function`` compiled at its first call for each dtype (only the dtypes a model has: seconds each), cached on
    disk (:func:`_cache_folder`) for the later processes; compiled in each process if no folder can be written."""
    folder = _cache_folder()
    if folder:
        set_numba_cache_dir(folder)
    try:
        return njit(nogil=True, cache=True)(function)
    except RuntimeError:  # no writable cache folder at all
        return njit(nogil=True)(function)


@contextlib.contextmanager
def _slp(dtype: np.dtype):
    """numba's superword vectoriser on while the kernel is first compiled for ``dtype`` (numba leaves it off by
    default; without it the 8 lanes of the row loop run as scalars, 2.5 times slower). Cached code keeps it."""
    if dtype in _vectorised:
        yield
        return
    with _compiling, numba_slp_vectorize():
        try:
            yield
        finally:
            _vectorised.add(dtype)


_vectorised: set = set()
_compiling = threading.Lock()


def _in_width_of(value, like):
    """``value`` as ``like``'s integer type: numba widens ``int32 & int32`` to 64 bits, which would halve the
    lanes of each vector (and double the work) in the kernel's row loop."""


@overload(_in_width_of)
def _in_width_of_typed(value, like):
    narrow = np.int32 if like.bitwidth == 32 else np.int64
    return lambda value, like: narrow(value)


def _extremes(high, low, flipped_high, sign, magnitude, infinity):
    """Order keys of the floats' max and min, and whether a NaN was among them, from the largest and smallest of
    their IEEE words read as signed integers (``high``, ``low``) and the largest with the sign bit flipped (the
    largest read unsigned): integer reductions in the words' own width, which vectorise well.

    Non-negative floats order as their words read signed, negative ones in reverse: the max is the largest signed
    word when one is non-negative, else the smallest (the negative of least magnitude); the min is the largest
    word read unsigned when one is negative (the negative of most magnitude), else the smallest. A NaN's
    magnitude bits exceed infinity's, so it is the largest word of its sign either way."""
    top = _in_width_of(flipped_high ^ sign, high)
    maximum, minimum = high if high >= 0 else low, top if low < 0 else low
    has_nan = high > infinity or (low < 0 and _in_width_of(top & magnitude, top) > infinity)
    return (maximum if maximum >= 0 else _in_width_of(maximum ^ magnitude, maximum),
            minimum if minimum >= 0 else _in_width_of(minimum ^ magnitude, minimum), has_nan)


def _fused_square_add(x, total):
    """float32 ``fma(x, x, total)``, rounded once: ``x * x`` is exact in float64, their sum is rounded to odd there
    (the last bit set when the sum was inexact), so that rounding it to float32 is the correctly rounded result."""
    product, augend = np.float64(x) * np.float64(x), np.float64(total)
    high = product + augend
    if np.isfinite(high):
        virtual = high - product
        low = (product - (high - virtual)) + (augend - virtual)  # high + low == product + augend exactly
        word = np.array([high]).view(np.int64)
        if low != 0 and word[0] & 1 == 0:
            word[0] += 1 if (low > 0) == (high > 0) else -1
        high = word.view(np.float64)[0]
    return np.float32(high)


def _count_zeros(block):
    """``np.sum(block == 0)`` (-0.0 too), in 32-bit lanes as :func:`_count_below`."""
    zeros = np.int32(0)
    for i in range(block.size):
        zeros = np.int32(zeros + (np.int32(1) if block[i] == 0 else np.int32(0)))
    return zeros


def _count_below(block, bound):
    """``np.sum(block <= bound)``, added in 32-bit lanes (numba widens ``int32 + int32`` to 64 bits: half the
    lanes per vector unless each sum is narrowed again)."""
    below = np.int32(0)
    for i in range(block.size):
        below = np.int32(below + (np.int32(1) if block[i] <= bound else np.int32(0)))
    return below


def _pack_signs(block, positive, out):
    """``np.packbits(block > 0)`` into ``out``: the 0/1 bytes of 8 elements read as one little-endian word and
    gathered into one byte by a multiplication (the last byte zero-padded)."""
    for i in range(block.size):
        positive[i] = 1 if block[i] > 0 else 0
    whole = (block.size + 7) // 8
    positive[block.size:whole * 8] = 0
    words = positive.view(np.uint64)
    for j in range(whole):
        out[j] = np.uint8((words[j] * _GATHER_BITS) >> np.uint64(56))


def _exponent_fields(like):
    """The exponent field of the float whose words have ``like``'s type, as constants the compiler folds: its
    shift, its mask, what to subtract from it for a bin (:data:`EXPONENT_LOW` included), the highest bin of an
    exponent, and where its subnormals count (float32's wait in ``_SUBNORMAL_BIN``; float64's are all below
    2**-150: the lowest bin)."""


@overload(_exponent_fields)
def _exponent_fields_typed(like):
    if like.bitwidth == 32:
        fields = tuple(map(np.int32, (23, 0xFF, 127 + EXPONENT_LOW, EXPONENT_HIGH - EXPONENT_LOW, _SUBNORMAL_BIN)))
    else:
        fields = tuple(map(np.int64, (52, 0x7FF, 1023 + EXPONENT_LOW, EXPONENT_HIGH - EXPONENT_LOW, 0)))
    return lambda like: fields


def _exponent_bins(words, magnitude, bins):
    """Each word's exponent bin (:func:`msprobe_mlflow.statistics_table.exponent_counts`) into ``bins`` (uint16),
    from the IEEE fields alone: selects in the words' own width, which vectorise."""
    shift, mask, offset, highest, subnormal = _exponent_fields(magnitude)
    zero, zero_bin, non_finite_bin = mask - mask, _in_width_of(ZERO_BIN, mask), _in_width_of(NON_FINITE_BIN, mask)
    for i in range(words.size):
        word = words[i]
        biased = _in_width_of(_in_width_of(word >> shift, word) & mask, word)
        b = _in_width_of(min(max(_in_width_of(biased - offset, word), zero), highest), word)
        b = non_finite_bin if biased == mask else b
        b = subnormal if biased == zero else b
        bins[i] = np.uint16(zero_bin if _in_width_of(word & magnitude, word) == zero else b)


def _count_exponents(words, magnitude, bins, tables, out):
    """Adds the exponent counts of ``words`` to ``out`` (a row of ``EXPONENT_BINS``). float32 blocks: one increment
    per element of its biased exponent byte, which is its bin (:func:`_count_exponent_bytes`); float64 and short
    arrays: each word's bin first (:func:`_exponent_bins`), then one increment per element, element ``i`` into
    histogram copy ``i % _TABLES`` of ``tables`` (int32, zeroed here after use); only the bins that occur are added
    up and zeroed."""
    width, n = EXPONENT_BINS + 1, words.size
    if n > _DIRECT and words.itemsize == 4:
        _count_exponent_bytes(words, magnitude, tables, out)
        return
    _exponent_bins(words, magnitude, bins)
    if n <= _DIRECT:
        waiting = False
        for i in range(n):
            if bins[i] == _SUBNORMAL_BIN:
                waiting = True
            else:
                out[bins[i]] += 1
        if waiting:
            _place_subnormals(words, magnitude, out)
        return
    low, high = bins[:n].min(), bins[:n].max()
    whole = n - n % _TABLES
    for i in range(0, whole, _TABLES):  # written out: a loop over the copies here runs twice as slow
        tables[bins[i]] += 1
        tables[width + bins[i + 1]] += 1
        tables[2 * width + bins[i + 2]] += 1
        tables[3 * width + bins[i + 3]] += 1
        tables[4 * width + bins[i + 4]] += 1
        tables[5 * width + bins[i + 5]] += 1
        tables[6 * width + bins[i + 6]] += 1
        tables[7 * width + bins[i + 7]] += 1
    for i in range(whole, n):
        tables[bins[i]] += 1
    for t in range(_TABLES):
        for b in range(low, high + 1):
            out[b] += tables[t * width + b]
        tables[t * width + low:t * width + high + 1] = 0


def _count_exponent_bytes(words, magnitude, tables, out):
    """float32 ``words``: copy ``i % 8`` of a table of the 256 biased exponents counts element ``i`` (1.7x as fast
    as a bin computed first); then 1..254 are the normal exponents' bins, 255 the non-finite, and 0 holds the
    zeros and the subnormals, told apart in the block while it is in the cache."""
    n = words.size
    whole = n - n % _TABLES
    for i in range(0, whole, _TABLES):
        tables[(words[i] >> 23) & 0xFF] += 1
        tables[256 + ((words[i + 1] >> 23) & 0xFF)] += 1
        tables[512 + ((words[i + 2] >> 23) & 0xFF)] += 1
        tables[768 + ((words[i + 3] >> 23) & 0xFF)] += 1
        tables[1024 + ((words[i + 4] >> 23) & 0xFF)] += 1
        tables[1280 + ((words[i + 5] >> 23) & 0xFF)] += 1
        tables[1536 + ((words[i + 6] >> 23) & 0xFF)] += 1
        tables[1792 + ((words[i + 7] >> 23) & 0xFF)] += 1
    for i in range(whole, n):
        tables[(words[i] >> 23) & 0xFF] += 1
    for t in range(1, _TABLES):
        for b in range(256):
            tables[b] += tables[t * 256 + b]
        tables[t * 256:(t + 1) * 256] = 0
    for b in range(1, 255):
        out[b - 127 - EXPONENT_LOW] += tables[b]
    out[NON_FINITE_BIN] += tables[255]
    if tables[0]:
        zeros = np.int32(0)
        for i in range(n):
            zeros = np.int32(zeros + (np.int32(1) if words[i] & magnitude == 0 else np.int32(0)))
        out[ZERO_BIN] += zeros
        if tables[0] > zeros:
            _place_subnormals(words, magnitude, out)
    tables[:256] = 0


def _place_subnormals(words, magnitude, out):
    """The float32 subnormals of ``words`` into their exponents' bins: ``m * 2**-149`` sits at exponent
    ``-149 + floor(log2 m)``. Rare: looked for only in a block that has one."""
    for i in range(words.size):
        m = words[i] & magnitude
        if 0 < m < (1 << 23):
            exponent = -150
            while m:
                m >>= 1
                exponent += 1
            out[exponent - EXPONENT_LOW] += 1


def _block_passes(block, words, row, bounds, counts, with_counts, positive, packed, with_signs, magnitude, bins,
                  tables, exponents, with_exponents):
    """The loops over a block of a segment while it sits in the L1 cache: its counts into ``counts[row]``, its
    packed signs into ``packed`` (``positive``: a scratch block of bytes), its exponent counts into
    ``exponents[row]``."""
    if with_counts:
        for k in range(bounds.size):
            counts[row, k] += _count_below(block, bounds[k])
        counts[row, bounds.size] += _count_zeros(block)
    if with_signs:
        _pack_signs(block, positive, packed)
    if with_exponents:
        _count_exponents(words, magnitude, bins, tables, exponents[row])


def _segments_statistics(values, words, ends, rows, bounds, limits, with_counts, with_signs, with_squares,
                         keys, counts, squares, signs, sign_offsets, positive, with_exponents, exponents, bins,
                         tables):
    """For segment ``s = values[ends[s-1]:ends[s]]``, writes into row ``rows[s]``: ``keys`` (max and min order
    keys), ``counts`` (``x <= b`` per bound and ``x == 0`` when ``with_counts``, then 1 if it holds NaN), ``squares``
    (the sum of ``x * x`` in torch's order), its packed signs at ``signs[sign_offsets[s]:]`` and, when
    ``with_exponents``, its exponent counts into ``exponents`` (``bins``, ``tables``: :func:`_count_exponents`'
    scratch).

    One loop over rows of 8 elements, element ``i`` of a segment in lane ``i % 8``, keeps 8 named lane states that
    the compiler holds in vector registers (SLP, see :func:`_slp`): 8 float32 sums of squares added in the
    segment's order, as torch's CPU norm does (equal bit for bit, checked once by :func:`_squares_match_torch`),
    and the words' extremes for :func:`_extremes`. Only what vectorises cleanly belongs in that loop: a count or
    a conditional there, or the lanes' variables reused for the tail, made the compiler shuffle lanes and the loop
    four times slower: the rest are :func:`_block_passes`."""
    zero, sign, magnitude, infinity = values.dtype.type(0), limits[0], limits[1], limits[2]
    start = 0
    for s in range(ends.size):
        end, row = ends[s], rows[s]
        h0 = h1 = h2 = h3 = h4 = h5 = h6 = h7 = f0 = f1 = f2 = f3 = f4 = f5 = f6 = f7 = sign
        l0 = l1 = l2 = l3 = l4 = l5 = l6 = l7 = magnitude
        q0 = q1 = q2 = q3 = q4 = q5 = q6 = q7 = zero
        tail = end - (end - start) % 8
        for first in range(start, end, BLOCK):
            block = values[first:min(first + BLOCK, end)]
            w = words[first:min(first + BLOCK, end)]
            for r in range((min(first + BLOCK, tail) - first) // 8):
                b = 8 * r
                q0, q1, q2, q3 = q0 + block[b] * block[b], q1 + block[b + 1] * block[b + 1], \
                    q2 + block[b + 2] * block[b + 2], q3 + block[b + 3] * block[b + 3]
                q4, q5, q6, q7 = q4 + block[b + 4] * block[b + 4], q5 + block[b + 5] * block[b + 5], \
                    q6 + block[b + 6] * block[b + 6], q7 + block[b + 7] * block[b + 7]
                h0, h1, h2, h3 = max(h0, w[b]), max(h1, w[b + 1]), max(h2, w[b + 2]), max(h3, w[b + 3])
                h4, h5, h6, h7 = max(h4, w[b + 4]), max(h5, w[b + 5]), max(h6, w[b + 6]), max(h7, w[b + 7])
                l0, l1, l2, l3 = min(l0, w[b]), min(l1, w[b + 1]), min(l2, w[b + 2]), min(l3, w[b + 3])
                l4, l5, l6, l7 = min(l4, w[b + 4]), min(l5, w[b + 5]), min(l6, w[b + 6]), min(l7, w[b + 7])
                f0, f1 = max(f0, _in_width_of(w[b] ^ sign, sign)), max(f1, _in_width_of(w[b + 1] ^ sign, sign))
                f2, f3 = max(f2, _in_width_of(w[b + 2] ^ sign, sign)), max(f3, _in_width_of(w[b + 3] ^ sign, sign))
                f4, f5 = max(f4, _in_width_of(w[b + 4] ^ sign, sign)), max(f5, _in_width_of(w[b + 5] ^ sign, sign))
                f6, f7 = max(f6, _in_width_of(w[b + 6] ^ sign, sign)), max(f7, _in_width_of(w[b + 7] ^ sign, sign))
            _block_passes(block, w, row, bounds, counts, with_counts, positive,
                          signs[sign_offsets[s] + (first - start) // 8:], with_signs, magnitude, bins, tables,
                          exponents, with_exponents)
        total = q0 + q1 + q2 + q3 + q4 + q5 + q6 + q7  # in lane order, then torch's compiled tail: 4 products
        for i in range(tail, end):  # added in order, then fused adds
            total = total + values[i] * values[i] if end - tail >= 4 and i < tail + 4 else \
                _fused_square_add(values[i], total)
        high, low, flipped_high = max(h0, h1, h2, h3, h4, h5, h6, h7), min(l0, l1, l2, l3, l4, l5, l6, l7), \
            max(f0, f1, f2, f3, f4, f5, f6, f7)
        for i in range(tail, end):
            high, low = max(high, words[i]), min(low, words[i])
            flipped_high = max(flipped_high, _in_width_of(words[i] ^ sign, sign))
        keys[row, 0], keys[row, 1], has_nan = _extremes(high, low, flipped_high, sign, magnitude, infinity)
        counts[row, bounds.size + 1] = 1 if has_nan else 0
        if with_squares:
            squares[row] = total
        start = end


@intrinsic
def pointer(typing_context, address):
    """An integer address as a ``void *``, which ``carray`` reads as an array."""
    def generate(context, builder, signature, arguments):
        return builder.inttoptr(arguments[0], cgutils.voidptr_t)
    return types.voidptr(address), generate


def _addressed_statistics(addresses, sizes, rows, like, word_like, bounds, limits, with_counts, with_signs,
                          with_squares, keys, counts, squares, signs, sign_offsets, with_exponents, exponents):
    """:func:`_segments_statistics` of each array ``s``, read where it lies: ``sizes[s]`` elements of ``like``'s
    dtype at ``addresses[s]`` (a tensor's ``data_ptr()``, kept alive by the caller), into row ``rows[s]``. No
    copy and no Python object per array: a model of many small gradients costs what their bytes cost."""
    ends = np.empty(1, np.int64)
    positive = np.zeros(BLOCK, np.uint8)
    bins = np.empty(BLOCK if with_exponents else 0, np.uint16)
    tables = np.zeros((EXPONENT_BINS + 1) * _TABLES if with_exponents else 0, np.int32)
    for s in range(addresses.size):
        ends[0] = sizes[s]
        values = carray(pointer(addresses[s]), (sizes[s],), like.dtype)
        words = carray(pointer(addresses[s]), (sizes[s],), word_like.dtype)
        _segments_statistics(values, words, ends, rows[s:s + 1], bounds, limits, with_counts, with_signs,
                             with_squares, keys, counts, squares, signs, sign_offsets[s:s + 1], positive,
                             with_exponents, exponents, bins, tables)


(_fused_square_add, _extremes, _count_zeros, _count_below, _pack_signs, _exponent_bins, _count_exponents,
 _count_exponent_bytes, _place_subnormals, _block_passes, _segments_statistics, _addressed_statistics) = map(kernel, (
    _fused_square_add, _extremes, _count_zeros, _count_below, _pack_signs, _exponent_bins, _count_exponents,
    _count_exponent_bytes, _place_subnormals, _block_passes, _segments_statistics, _addressed_statistics))


def _order_key_to_values(keys: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """The inverse of the kernel's order key: an IEEE float's bits with the magnitude bits of negatives flipped
    order as the floats do (-0.0 just below +0.0), so max and min run as integer reductions."""
    magnitude = np.int64(_LIMITS[dtype][1])
    words = keys ^ ((keys >> 63) & magnitude)
    return words.astype(np.int32).view(np.float32) if dtype == np.float32 else words.view(np.float64)


@functools.cache
def _squares_match_torch() -> bool:
    """Whether the kernel's float32 sums of squares give ``torch.linalg.vector_norm`` bit for bit here (the
    lane count of torch's CPU kernel is fixed by its build; checked once on sizes that end in a partial row)."""
    rng = np.random.default_rng(0)
    arrays = [(rng.standard_normal(size) * rng.uniform(0.01, 100)).astype(np.float32)
              for size in [*range(1, 24), 3 * BLOCK + 13] * 8]
    _, _, squares, _ = _run(Located.of_arrays(arrays), np.dtype(np.float32), np.zeros(0, np.float32), False, False,
                            True, np.zeros(len(arrays), np.int64), None, 1)
    return np.array_equal(np.sqrt(squares), torch.stack(foreach_norm(list(map(torch.from_numpy, arrays)))))


class Located:
    """Arrays as the kernel reads them: each one's address and element count, and whether it is float64 (else
    float32). The caller keeps the arrays alive while the kernel runs."""

    def __init__(self, addresses: np.ndarray, sizes: np.ndarray, is_float64: np.ndarray):
        self.addresses, self.sizes, self.is_float64 = addresses, sizes, is_float64

    @classmethod
    def of_arrays(cls, arrays: list[np.ndarray]) -> "Located":
        """Contiguous 1-D float32/float64 numpy arrays."""
        return cls(np.array([a.__array_interface__["data"][0] for a in arrays], np.int64),
                   np.array([a.size for a in arrays], np.int64), np.array([a.dtype == np.float64 for a in arrays]))

    @classmethod
    def of_tensors(cls, tensors: list[torch.Tensor], float64: bool = True) -> "Located":
        """Contiguous float32/float64 CPU tensors (``float64=False``: none is float64), with a few calls made in C
        per tensor."""
        count = len(tensors)
        is_float64 = np.fromiter((t.dtype is torch.float64 for t in tensors), bool, count) if float64 else \
            np.zeros(count, bool)
        return cls(np.fromiter(map(torch.Tensor.data_ptr, tensors), np.int64, count),
                   np.fromiter(map(torch.Tensor.numel, tensors), np.int64, count), is_float64)


def _run(located: Located, dtype: np.dtype, bounds, with_counts, with_signs, with_squares, sign_offsets, signs,
         threads, members: np.ndarray | None = None, with_exponents: bool = False):
    """The kernel over the located arrays ``members`` (all of them when None; all of ``dtype``), each of
    ``SMALL_ARRAY`` elements or more in a call of its own, the rest in one call, the calls spread over ``threads``
    threads (the largest first). Returns ``keys, counts, squares, exponents``, a row per member."""
    members = np.arange(located.sizes.size) if members is None else members
    sizes = located.sizes[members]
    count = members.size
    keys = np.zeros((count, 2), np.int64)
    counts = np.zeros((count, len(bounds) + 2), np.int64)
    squares = np.zeros(count, dtype)
    exponents = np.zeros((count if with_exponents else 0, EXPONENT_BINS), np.int64)
    signs = np.zeros(0, np.uint8) if signs is None else signs
    present = np.flatnonzero(sizes)
    large = present[sizes[present] >= SMALL_ARRAY]
    groups = [large[k:k + 1] for k in np.argsort(-sizes[large], kind="stable")]
    groups += [present[sizes[present] < SMALL_ARRAY]]
    limits = _LIMITS[dtype]
    typed_bounds = np.asarray(bounds, dtype)
    like, word_like = np.empty(0, dtype), np.empty(0, limits.dtype)

    def call(rows: np.ndarray) -> None:
        _addressed_statistics(located.addresses[members[rows]], sizes[rows], rows, like, word_like, typed_bounds,
                              limits, with_counts, with_signs, with_squares, keys, counts, squares, signs,
                              sign_offsets[rows], with_exponents, exponents)

    in_parallel(call, [g for g in groups if g.size], threads if sizes.sum() >= PARALLEL_MIN else 1)
    return keys, counts, squares, exponents


def in_parallel(work: Callable, items: list, threads: int) -> None:
    """``work(item)`` for every item, on this thread and up to ``threads - 1`` more, each taking the next item
    when done with its last (``work`` must release the GIL: numba's nogil kernels, hashlib on large buffers).
    The others are torch's idle OpenMP threads where it has them (:mod:`~msprobe_mlflow.torch_kernels.openmp`), else
    threads started for this call."""
    pending = iter(items)
    failures = []

    def worker() -> None:
        try:
            for item in pending:
                work(item)
        except BaseException as e:  # raised again on the calling thread
            failures.append(e)

    threads = min(threads, len(items))
    if threads < 2 or not on_torch_threads(worker, threads):
        helpers = [threading.Thread(target=worker, name="msprobe-mlflow-statistics", daemon=True)
                   for _ in range(threads - 1)]
        for helper in helpers:
            helper.start()
        worker()
        for helper in helpers:
            helper.join()
    if failures:
        raise failures[0]


def worker_threads() -> int:
    """Threads the statistics may use: this rank's cores (:func:`rank_cores`), or torch's intra-op thread count
    where that is more, since the training thread, and torch's threads with it, wait for them in the optimizer's
    pre-hook."""
    return max(torch.get_num_threads(), rank_cores())


def rank_cores() -> int:
    """This process's cores: its CPU affinity shared among the ranks torchrun started on this machine."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


def statistics(arrays: list[np.ndarray], bounds, *, with_counts: bool, with_signs: bool, sign_offsets: list[int],
               signs: np.ndarray | None, with_norms: bool = False, with_exponents: bool = False) -> tuple:
    """:func:`located_statistics` of contiguous 1-D float32/float64 numpy ``arrays``."""
    return located_statistics(Located.of_arrays(arrays), bounds, with_counts=with_counts, with_signs=with_signs,
                              sign_offsets=sign_offsets, signs=signs, with_norms=with_norms,
                              with_exponents=with_exponents)


def located_statistics(located: Located, bounds, *, with_counts: bool, with_signs: bool, sign_offsets,
                       signs: np.ndarray | None, with_norms: bool = False, with_exponents: bool = False) -> tuple:
    """``(maxima, minima, counts, norms, exponents)`` of the ``located`` arrays, their packed signs written into
    ``signs`` at ``sign_offsets`` when ``with_signs``.

    maxima, minima: float64, NaN for an empty array or one holding NaN (NaN propagates, as ``np.max``); of +0.0 and
    -0.0, max is +0.0 and min -0.0. counts: int64 ``(len(arrays), len(bounds) + 1)``, the elements ``x <= b`` for
    each bound (compared in the array's dtype), then those ``== 0`` (-0.0 too); zeros when not ``with_counts``.
    norms (``with_norms``): float32, ``torch.linalg.vector_norm`` of each float32 array bit for bit, NaN where it
    could not be computed so (another dtype, or a torch whose kernel sums in another order): the caller asks torch.
    exponents (``with_exponents``, else None): int64 ``(len(arrays), EXPONENT_BINS)``, the exponent counts of
    :func:`msprobe_mlflow.statistics_table.exponent_counts`.
    """
    count = located.sizes.size
    maxima, minima, norms = np.full(count, np.nan), np.full(count, np.nan), np.full(count, np.nan, np.float32)
    counts = np.zeros((count, len(bounds) + 1), np.int64)
    exponents = np.zeros((count, EXPONENT_BINS), np.int64) if with_exponents else None
    threads, sign_offsets = worker_threads(), np.asarray(sign_offsets, np.int64)
    for is_float64 in np.unique(located.is_float64):
        dtype = np.dtype(np.float64 if is_float64 else np.float32)
        found = np.flatnonzero(located.is_float64 == is_float64)
        with _slp(dtype):
            with_squares = with_norms and dtype == np.float32 and _squares_match_torch()
            keys, all_counts, squares, found_exponents = _run(located, dtype, bounds, with_counts, with_signs,
                                                              with_squares, sign_offsets[found], signs, threads,
                                                              found, with_exponents)
        counts[found] = all_counts[:, :-1]
        if with_exponents and found.size == count:  # one dtype: its rows are all of them, in order
            exponents = found_exponents
        elif with_exponents:
            exponents[found] = found_exponents
        clean = (all_counts[:, -1] == 0) & (located.sizes[found] > 0)
        maxima[found[clean]] = _order_key_to_values(keys[clean, 0], dtype)
        minima[found[clean]] = _order_key_to_values(keys[clean, 1], dtype)
        if with_squares:
            norms[found] = np.sqrt(squares)
    return maxima, minima, counts, norms, exponents
