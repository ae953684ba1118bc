"""What msprobe writes for a gradient, computed independently in numpy and plain Python (no package code), for
the monitor tests on the CPU and on CUDA."""
import csv
import hashlib
import math

import numpy as np
import pytest
import torch

NAN, INF = float("nan"), float("inf")


def bf16_round(values: np.ndarray) -> np.ndarray:
    """float32 -> nearest bfloat16 (ties to even), as float32: keep the top 16 bits after rounding."""
    values = np.asarray(values, dtype=np.float32)
    bits = values.view(np.uint32).astype(np.uint64)
    rounded = (bits + np.uint64(0x7FFF) + ((bits >> np.uint64(16)) & np.uint64(1))) & np.uint64(0xFFFF0000)
    return np.where(np.isnan(values), np.float32(NAN), rounded.astype(np.uint32).view(np.float32))


ROUND_TO = {torch.float32: lambda v: np.asarray(v, np.float32), torch.bfloat16: bf16_round,
            torch.float16: lambda v: np.asarray(v, np.float32).astype(np.float16).astype(np.float32)}


def bucket_of(x: float, bounds32: list) -> int:
    """Right-closed buckets: x <= b0 is bucket 0, b(i-1) < x <= b(i) is bucket i, the rest (NaN too) the last."""
    for index, bound in enumerate(bounds32):
        if x <= bound:
            return index
    return len(bounds32)


def expected_row(values, level: str, bounds=(-1, 0, 1), dtype=torch.float32) -> dict:
    """What msprobe writes for a gradient holding ``values`` (already in the gradient's dtype, as float32)."""
    values = np.asarray(values, dtype=np.float32)
    flat = values.reshape(-1)
    numel = flat.size
    row = {"shape": str(list(values.shape))}
    row["max"] = float(np.max(flat)) if numel else NAN
    row["min"] = float(np.min(flat)) if numel else NAN
    norm32 = np.float32(math.sqrt(sum(float(x) ** 2 for x in flat)))
    row["norm"] = float(ROUND_TO[dtype](norm32))
    if level == "L0":
        row["MD5"] = hashlib.md5(flat.astype("<f4").tobytes()).hexdigest()
    if level == "L2":
        bounds32 = [np.float32(b) for b in bounds]
        counts = [0] * (len(bounds) + 1)
        for x in flat:
            counts[bucket_of(x, bounds32)] += 1
        zeros = sum(1 for x in flat if x == 0)
        row["buckets"] = [c / numel if numel else 0 for c in counts] + [zeros / numel if numel else 0]
    return row


def read_rows(path) -> tuple[list[str], dict[str, list[str]]]:
    with open(path, encoding="utf-8-sig", newline="") as f:
        rows = list(csv.reader(f))
    return rows[0], {row[0]: row for row in rows[1:]}


def assert_row(cells: list[str], header: list[str], expected: dict, norm_rel: float = 1e-6) -> None:
    """Every cell equal to the expected value (norm within ``norm_rel``: float32 summation order)."""
    cell = dict(zip(header, cells))
    assert cell["shape"] == expected["shape"]
    for key in ("max", "min"):
        assert float(cell[key]) == pytest.approx(expected[key], nan_ok=True, rel=0, abs=0), key
    assert float(cell["norm"]) == pytest.approx(expected["norm"], nan_ok=True, rel=norm_rel), "norm"
    if "MD5" in expected:
        assert cell["MD5"] == expected["MD5"]
    if "buckets" in expected:
        bucket_cells = [float(c) for h, c in zip(header, cells) if h.startswith(("(", "="))]
        assert bucket_cells == expected["buckets"]


# The CSV text of one step whose gradients are set by hand, written out here (the PyTorch and MindSpore monitor
# tests both expect it): scale -3.0 (0-d), fc1.weight [[2, -1, 0], [0, 2, -4]], fc1.bias [0.1, -0.0].
# fc1.weight: max 2, min -4, norm sqrt(4+1+4+16) = 5; bounds [-1, 0, 1]: {-1, -4} <= -1, {0, 0} in (-1, 0],
# nothing in (0, 1], {2, 2} > 1, two zeros: 2/6, 2/6, 0, 2/6 and =0 2/6.
# fc1.bias: float32(0.1) = 0.10000000149011612 is max and norm; min is -0.0, which is in (-1, 0] and is a zero.
# scale: a 0-d parameter, shape [], -3.0 in (-inf, -1].
EXPECTED_L2 = (
    '\ufeffparam_name,"(-inf, -1]","(-1, 0]","(0, 1]","(1, inf)",=0,max,min,norm,shape\r\n'
    'scale,1.0,0.0,0.0,0.0,0.0,-3.0,-3.0,3.0,[]\r\n'
    'fc1.weight,0.3333333333333333,0.3333333333333333,0.0,0.3333333333333333,0.3333333333333333,'
    '2.0,-4.0,5.0,"[2, 3]"\r\n'
    'fc1.bias,0.0,0.5,0.5,0.0,0.5,0.10000000149011612,-0.0,0.10000000149011612,[2]\r\n'
).encode("utf-8")

EXPECTED_L1 = (
    '\ufeffparam_name,max,min,norm,shape\r\n'
    'scale,-3.0,-3.0,3.0,[]\r\n'
    'fc1.weight,2.0,-4.0,5.0,"[2, 3]"\r\n'
    'fc1.bias,0.10000000149011612,-0.0,0.10000000149011612,[2]\r\n'
).encode("utf-8")
