"""The CPU statistics in one read of each gradient: a numba kernel, compiled once per dtype and cached on disk.

numpy needs one call, and so one pass of compute, per statistic (max, min, each bound's count, the zero count,
the sign bits); here one kernel walks each gradient in cache-sized blocks and, while a block sits in the cache,
runs a handful of simple loops over it that the compiler vectorises: max and min as integers (see
:func:`_order_key_to_values`), NaN and zero counts, one count per bound, the packed sign bits. It releases the GIL.
"""
from __future__ import annotations

import numpy as np
from numba import njit

BLOCK = 1 << 14  # elements per block (64 KiB of float32): every loop over a block reads it from the L2 cache
_MAGNITUDE = {np.dtype(np.float32): np.int32(0x7FFFFFFF), np.dtype(np.float64): np.int64(0x7FFFFFFFFFFFFFFF)}
_INFINITY_BITS = {np.dtype(np.float32): np.int32(0x7F800000), np.dtype(np.float64): np.int64(0x7FF0000000000000)}
SMALL_ARRAY = 1 << 14  # elements: smaller arrays share one kernel call, so a model of many pays one call's cost


def _segments_statistics(values, bits, ends, rows, bounds, magnitude, infinity_bits, with_counts, with_signs,
                         keys, counts, signs, sign_offsets):
    """For segment ``s = values[ends[s-1]:ends[s]]``, writes into row ``rows[s]``: ``keys`` (max and min order
    keys), ``counts`` (``x <= b`` per bound, then ``x == 0``, then NaN), and its packed signs at
    ``signs[sign_offsets[s]:]`` (``np.packbits(x > 0)``, the last byte zero-padded)."""
    start = 0
    bound_count = bounds.size
    for s in range(ends.size):
        end, row = ends[s], rows[s]
        largest, smallest = -(1 << 63), (1 << 63) - 1
        for low in range(start, end, BLOCK):
            # Loops over 0-based views, so that numba drops the negative-index check and the loops vectorise.
            block, words = values[low:min(low + BLOCK, end)], bits[low:min(low + BLOCK, end)]
            zeros = 0
            nans = 0
            for i in range(words.size):
                word = words[i]
                key = word ^ ((word >> 63) & magnitude)
                largest = max(largest, key)
                smallest = min(smallest, key)
                absolute = word & magnitude
                zeros += absolute == 0
                nans += absolute > infinity_bits
            counts[row, bound_count] += zeros
            counts[row, bound_count + 1] += nans
            if with_counts:
                for b in range(bound_count):
                    bound = bounds[b]
                    below = 0
                    for i in range(block.size):
                        below += block[i] <= bound
                    counts[row, b] += below
            if with_signs:
                out = signs[sign_offsets[s] + (low - start) // 8:]
                whole = block.size // 8
                for j in range(whole):
                    byte = 0
                    for k in range(8):
                        byte |= np.uint8(block[8 * j + k] > 0) << np.uint8(7 - k)
                    out[j] = byte
                if block.size % 8:
                    byte = 0
                    for k in range(block.size % 8):
                        byte |= np.uint8(block[8 * whole + k] > 0) << np.uint8(7 - k)
                    out[whole] = byte
        keys[row, 0], keys[row, 1] = largest, smallest
        start = end


try:  # compiled at the first call (seconds), then loaded from numba's cache folder by later processes
    _segments_statistics = njit(nogil=True, cache=True)(_segments_statistics)
except RuntimeError:  # no writable cache folder: compile in each process
    _segments_statistics = njit(nogil=True)(_segments_statistics)


def _order_key_to_values(keys: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """The inverse of the kernel's order key: an IEEE float's bits with the magnitude bits of negatives flipped
    order as the floats do (-0.0 just below +0.0), so max and min run as integer reductions."""
    magnitude = np.int64(_MAGNITUDE[dtype])
    words = keys ^ ((keys >> 63) & magnitude)
    return words.astype(np.int32).view(np.float32) if dtype == np.float32 else words.view(np.float64)


def statistics(arrays: list[np.ndarray], bounds, *, with_counts: bool, with_signs: bool, sign_offsets: list[int],
               signs: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(maxima, minima, counts)`` of 1-D float32/float64 ``arrays``, their packed signs written into ``signs``
    at ``sign_offsets`` when ``with_signs``.

    maxima, minima: float64, NaN for an empty array or one holding NaN (NaN propagates, as ``np.max``); of +0.0 and
    -0.0, max is +0.0 and min -0.0. counts: int64 ``(len(arrays), len(bounds) + 1)``, the elements ``x <= b`` for
    each bound (compared in the array's dtype; zeros when not ``with_counts``), then those ``== 0`` (-0.0 too).
    """
    count = len(arrays)
    maxima, minima = np.full(count, np.nan), np.full(count, np.nan)
    counts = np.zeros((count, len(bounds) + 2), np.int64)
    keys = np.zeros((count, 2), np.int64)
    signs = np.zeros(0, np.uint8) if signs is None else signs
    for dtype in {a.dtype for a in arrays}:
        members = [i for i, a in enumerate(arrays) if a.dtype == dtype and a.size]
        typed_bounds = np.asarray(bounds, dtype)
        for group in [[i] for i in members if arrays[i].size >= SMALL_ARRAY] + \
                     [[i for i in members if arrays[i].size < SMALL_ARRAY]]:
            if not group:
                continue
            flat = arrays[group[0]] if len(group) == 1 else np.concatenate([arrays[i] for i in group])
            _segments_statistics(flat, flat.view(_MAGNITUDE[dtype].dtype), np.cumsum([arrays[i].size for i in group]),
                                 np.array(group), typed_bounds, _MAGNITUDE[dtype], _INFINITY_BITS[dtype], with_counts,
                                 with_signs, keys, counts, signs, np.array([sign_offsets[i] for i in group]))
        if members:
            found = np.array(members)
            clean = found[counts[found, -1] == 0]
            maxima[clean] = _order_key_to_values(keys[clean, 0], dtype)
            minima[clean] = _order_key_to_values(keys[clean, 1], dtype)
    return maxima, minima, counts[:, :-1]
