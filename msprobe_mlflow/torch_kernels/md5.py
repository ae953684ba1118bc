"""msprobe's L0 column (the MD5 of each gradient's float32 bytes) for many gradients at once: 16 MD5s side by side.

One MD5 is a chain of dependent 32-bit operations: about 700 MB/s on one core (``hashlib``), however fast memory
is. :func:`_md5_blocks` is the MD5 compression (RFC 1321) written once on vectors of 16 32-bit lanes as LLVM IR
(compiled in about a second, where numba's vectoriser took minutes on the same rounds written per lane), and
:func:`_hash_streams` feeds each lane the next 64 bytes of its own gradient, read where the gradient lies, and
the next gradient when one is done. Measured here (AVX-512; 16 x 16 MB; ``benchmarks/monitor_benchmark.py
--kernel``): 5.3-5.9 GB/s on one core with every lane busy, 0.4 GB/s in a lane alone; so a gradient much longer
than the others goes to ``hashlib`` (:func:`_plan`).
"""
from __future__ import annotations

import math
import sys

import numpy as np
import torch
from llvmlite import ir
from numba import carray, types
from numba.extending import intrinsic

from msprobe_mlflow.torch_kernels.fused import PARALLEL_MIN, Located, in_parallel, kernel, pointer, worker_threads
from msprobe_mlflow.statistics_table import md5_hex

LANES = 16
LANE_SLOWDOWN = 1.8  # hashlib's speed on one array over a lane's alone (measured here: 710 / 395 MB/s)
_INITIAL = np.array([0x67452301, 0xEFCDAB89, 0x98BADCFE, 0x10325476], np.uint32)  # RFC 1321, 3.3
_SHIFTS = [7, 12, 17, 22] * 4 + [5, 9, 14, 20] * 4 + [4, 11, 16, 23] * 4 + [6, 10, 15, 21] * 4
_SINES = [int(abs(math.sin(i + 1)) * 2 ** 32) & 0xFFFFFFFF for i in range(64)]
_WORD_ORDER = [i if i < 16 else (5 * i + 1) % 16 if i < 32 else (3 * i + 5) % 16 if i < 48 else 7 * i % 16
               for i in range(64)]


def _transposed(builder, rows: list) -> list:
    """The 16 x 16 matrix of ``rows`` (``<16 x i32>`` each) transposed, in four rounds of two-row shuffles: round
    ``s`` swaps the ``s`` x ``s`` blocks off the diagonal of each ``2s`` x ``2s`` block."""
    rows, size, step = list(rows), len(rows), 1
    while step < size:
        for i in (i for i in range(size) if not i & step):
            upper = [j if not j & step else size + j - step for j in range(size)]
            lower = [j + step if not j & step else size + j for j in range(size)]
            rows[i], rows[i + step] = (builder.shuffle_vector(rows[i], rows[i + step], ir.Constant(
                ir.VectorType(ir.IntType(32), size), mask)) for mask in (upper, lower))
        step *= 2
    return rows


@intrinsic
def _md5_blocks(typing_context, state, sources):
    """One MD5 compression per lane: ``state`` (uint32 ``[4, LANES]``: a, b, c, d, lane ``k`` in column ``k``)
    takes in the 64 bytes at address ``sources[k]``, RFC 1321 section 3.4. Each lane's block is one vector load;
    :func:`_transposed` turns the 16 loads into word ``w`` of every lane per vector."""
    def generate(context, builder, signature, arguments):
        vector = ir.VectorType(ir.IntType(32), LANES)
        splat = lambda value: ir.Constant(vector, [value] * LANES)
        at = lambda base, k: builder.gep(base, [ir.Constant(ir.IntType(64), k)])
        state_at = builder.bitcast(context.make_array(signature.args[0])(context, builder, arguments[0]).data,
                                   vector.as_pointer())
        addresses = context.make_array(signature.args[1])(context, builder, arguments[1]).data
        blocks = [builder.load(builder.inttoptr(builder.load(at(addresses, k)), vector.as_pointer()), align=4)
                  for k in range(LANES)]
        words = _transposed(builder, blocks)
        start = [builder.load(at(state_at, k), align=4) for k in range(4)]
        a, b, c, d = start
        ones = splat(0xFFFFFFFF)
        for i in range(64):
            if i < 16:
                f = builder.or_(builder.and_(b, c), builder.and_(builder.xor(b, ones), d))
            elif i < 32:
                f = builder.or_(builder.and_(d, b), builder.and_(builder.xor(d, ones), c))
            elif i < 48:
                f = builder.xor(builder.xor(b, c), d)
            else:
                f = builder.xor(c, builder.or_(b, builder.xor(d, ones)))
            x = builder.add(builder.add(builder.add(f, a), splat(_SINES[i])), words[_WORD_ORDER[i]])
            rotated = builder.or_(builder.shl(x, splat(_SHIFTS[i])), builder.lshr(x, splat(32 - _SHIFTS[i])))
            a, b, c, d = d, builder.add(b, rotated), b, c
        for k, value in enumerate((a, b, c, d)):
            builder.store(builder.add(start[k], value), at(state_at, k), align=4)
        return context.get_dummy_value()
    return types.void(state, sources), generate


def _hash_streams(addresses, lengths, digests, initial):
    """The MD5 of each stream ``s`` (``lengths[s]`` bytes at ``addresses[s]``, a multiple of 4) into
    ``digests[s]`` (its four words), ``LANES`` streams at a time: each lane takes the next stream when its own is
    done. A lane reads its stream's whole blocks in place, then its last bytes and the padding (``0x80``, zeros,
    the length in bits) from its own 128 bytes of ``tails``: two runs of consecutive blocks, so the lanes go on
    together, each address a block further, until one of them reaches the end of a run. An idle lane hashes its
    stale tail, which nobody reads."""
    state = np.zeros((4, LANES), np.uint32)
    sources = np.zeros(LANES, np.int64)  # each lane's next block
    strides = np.zeros(LANES, np.int64)  # 64 bytes, 0 when idle
    tails = np.zeros((LANES, 32), np.uint32)
    stream = np.full(LANES, -1, np.int64)
    done = np.zeros(LANES, np.int64)  # blocks hashed
    whole = np.zeros(LANES, np.int64)  # blocks read in place
    total = np.zeros(LANES, np.int64)  # blocks with the padding
    following = 0
    while True:
        run = 0
        for k in range(LANES):
            if stream[k] < 0 and following < addresses.size:
                s, following = following, following + 1
                stream[k], done[k], whole[k] = s, 0, lengths[s] // 64
                rest = lengths[s] % 64 // 4  # words after the last whole block
                total[k] = whole[k] + (1 if rest < 14 else 2)
                last = carray(pointer(addresses[s] + 64 * whole[k]), (rest,), np.uint32)
                for w in range(32):
                    tails[k, w] = last[w] if w < rest else 0x80 if w == rest else 0
                bits = np.uint64(8 * lengths[s])
                tails[k, 16 * (total[k] - whole[k]) - 2] = np.uint32(bits & np.uint64(0xFFFFFFFF))
                tails[k, 16 * (total[k] - whole[k]) - 1] = np.uint32(bits >> np.uint64(32))
                for w in range(4):
                    state[w, k] = initial[w]
            sources[k], strides[k] = tails.ctypes.data + 128 * k, 0
            if stream[k] >= 0:
                in_place = done[k] < whole[k]
                sources[k] = addresses[stream[k]] + 64 * done[k] if in_place else \
                    tails.ctypes.data + 128 * k + 64 * (done[k] - whole[k])
                strides[k] = 64
                left = (whole[k] if in_place else total[k]) - done[k]
                run = left if run == 0 else min(run, left)
        if run == 0:
            return
        for _ in range(run):
            _md5_blocks(state, sources)
            for k in range(LANES):
                sources[k] += strides[k]
        for k in range(LANES):
            if stream[k] >= 0:
                done[k] += run
                if done[k] == total[k]:
                    for w in range(4):
                        digests[stream[k], w] = state[w, k]
                    stream[k] = -1


_hash_streams = kernel(_hash_streams)


def _plan(sizes: list[int], threads: int) -> tuple[list[int], list[list[int]]]:
    """Which of the arrays of ``sizes`` (bytes) ``hashlib`` hashes alone, and the rest split into groups for the
    lanes, at most ``threads``. The lanes hash a group in the time of its longest array or of its bytes over
    ``LANES``, whichever is longer; ``hashlib`` takes an array in ``1 / LANE_SLOWDOWN`` of a lane's time. So the
    longest arrays go to ``hashlib`` while that shortens the whole (an embedding far larger than every layer), and
    the lanes' arrays are split only while every group keeps its lanes busy."""
    order = sorted(range(len(sizes)), key=lambda i: -sizes[i])
    remaining = sum(sizes)
    alone = 0

    def lanes_time(first: int, remaining: int) -> float:
        return max(sizes[order[first]] if first < len(order) else 0, remaining / LANES)

    while alone < len(order):
        longest = sizes[order[alone]]
        if longest / LANE_SLOWDOWN + lanes_time(alone + 1, remaining - longest) >= lanes_time(alone, remaining):
            break
        alone, remaining = alone + 1, remaining - longest
    laned = order[alone:]
    count = min(threads, math.ceil(remaining / (LANES * sizes[laned[0]]))) if laned and remaining else 1
    groups: list[list[int]] = [[] for _ in range(max(1, count))]
    loads = [0] * len(groups)
    for i in laned:  # the longest first, each to the group with the fewest bytes
        lightest = loads.index(min(loads))
        groups[lightest].append(i)
        loads[lightest] += sizes[i]
    return order[:alone], [group for group in groups if group]


def md5_digests(grads: list[torch.Tensor]) -> list[str]:
    """Hex MD5 of each CPU gradient's float32 little-endian C-order bytes (msprobe's L0 column): contiguous float32
    gradients read where they lie, through the lanes; the others (another dtype or layout, converted one at a
    time, or any on a big-endian machine) through ``hashlib``; spread over :func:`worker_threads` threads (both
    release the GIL). The caller keeps the gradients unchanged until it returns."""
    laned = [k for k, g in enumerate(grads) if g.dtype is torch.float32 and g.is_contiguous() and g.numel()] \
        if sys.byteorder == "little" else []
    located = Located.of_tensors([grads[k] for k in laned], float64=False)
    threads = worker_threads() if sum(g.numel() for g in grads) >= PARALLEL_MIN else 1
    alone, groups = _plan((4 * located.sizes).tolist(), threads)
    by_hashlib = sorted({*range(len(grads))} - {*laned} | {laned[i] for i in alone}, key=lambda k: -grads[k].numel())
    digests = [""] * len(grads)

    def digest(work) -> None:
        if isinstance(work, int):
            digests[work] = md5_hex(grads[work].detach().float().contiguous().numpy())
            return
        words = np.zeros((len(work), 4), "<u4")
        _hash_streams(located.addresses[work], 4 * located.sizes[work], words, _INITIAL)
        text = words.tobytes().hex()
        for j, i in enumerate(work):
            digests[laned[i]] = text[32 * j:32 * j + 32]

    in_parallel(digest, [*groups, *by_hashlib], threads)
    return digests
