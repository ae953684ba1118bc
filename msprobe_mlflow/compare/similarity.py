"""Direction similarity on packed sign bits: pure functions on numpy arrays, no I/O.

A parameter's directions are ``np.packbits(grad > 0)`` (zero, -0.0 and NaN are ``False``), padded to a whole byte.
Two elements agree when their bits are equal, so ``agreeing = numel - popcount(a XOR b)``. Padding bits are masked
off, so a writer that left garbage in them cannot change the result.
"""
from __future__ import annotations

import numpy as np

from msprobe_mlflow.layout import packed_length

# Number of set bits of every byte value (numpy 1.26 has no bitwise_count).
POPCOUNT = np.array([bin(value).count("1") for value in range(256)], dtype=np.uint8)
# Work on at most this many bytes at once, so temporaries stay small for huge parameters.
CHUNK_BYTES = 1 << 22


def agreeing_directions(bits_a: np.ndarray, bits_b: np.ndarray, numel: int) -> int:
    """How many of ``numel`` elements have the same direction in both packed arrays."""
    expected = packed_length(numel)
    if len(bits_a) != expected or len(bits_b) != expected:
        raise ValueError(f"packed directions hold {len(bits_a)} and {len(bits_b)} bytes; {numel} elements need "
                         f"{expected}")
    if numel == 0:
        return 0
    differing = 0
    for start in range(0, expected, CHUNK_BYTES):
        stop = min(start + CHUNK_BYTES, expected)
        xor = np.bitwise_xor(bits_a[start:stop], bits_b[start:stop])
        if stop == expected and numel % 8:
            xor[-1] &= (0xFF << (8 - numel % 8)) & 0xFF  # keep the real bits, the high ones in packbits order
        differing += int(POPCOUNT[xor].sum(dtype=np.int64))
    return numel - differing


def similarity(agreeing: int, numel: int) -> float:
    """msprobe's similarity: the fraction of elements whose direction agrees; 0.0 for an empty parameter."""
    return agreeing / numel if numel else 0.0


def judged_similarity(counts: tuple[int, int] | None) -> float | None:
    """The value the verdict rule sees of ``(agreeing, numel)``: None where nothing was compared (the parameter is
    absent from one side, or has no elements)."""
    return None if counts is None or counts[1] == 0 else similarity(*counts)


def summary_similarity(agreeing: list[int], numels: list[int]) -> float:
    """All parameters of a step together, weighted by element count (not the mean of the per-parameter values)."""
    total = sum(numels)
    return sum(agreeing) / total if total else 0.0
