"""A MindSpore config without ``bounds`` uses msprobe's MindSpore default (11 bounds, 13 distribution columns), as
msprobe 1.0.3 does (``msprobe/mindspore/grad_probe/global_context.py``); PyTorch keeps ``[-1, 0, 1]``."""
from __future__ import annotations

import json

import numpy as np
import pytest

ms = pytest.importorskip("mindspore", reason="MindSpore is not installed (the torch-only stage)")
from mindspore import Parameter, Tensor, nn  # noqa: E402

from msprobe_mlflow.config import GradProbeConfig
from msprobe_mlflow.dump import read_dump_config, summary_csv_path
from msprobe_mlflow.mindspore import GradientMonitor, PrecisionDebugger

MSPROBE_MINDSPORE_BOUNDS = [-10, -1, -0.1, -0.01, -0.001, 0, 0.001, 0.01, 0.1, 1, 10]
# One element in each bucket but (0, 0.001], two zeros; every square is a multiple of 2**-14 below 2**9, so the
# float32 sum of squares is exact in any order and the norm is the correctly rounded float32 square root.
GRADIENT = np.array([[-12, -2, -0.5, -0.0625], [-0.0078125, -0.0, 0, 0.0078125], [0.0625, 0.5, 2, 12]],
                    dtype=np.float32)


def msprobe_l2_csv(name: str, grad: np.ndarray) -> bytes:
    """msprobe's L2 CSV for one gradient with its MindSpore default bounds, written out with numpy."""
    header = ['"(-inf, -10]"', '"(-10, -1]"', '"(-1, -0.1]"', '"(-0.1, -0.01]"', '"(-0.01, -0.001]"',
              '"(-0.001, 0]"', '"(0, 0.001]"', '"(0.001, 0.01]"', '"(0.01, 0.1]"', '"(0.1, 1]"', '"(1, 10]"',
              '"(10, inf)"', "=0"]
    at_most = [int((grad <= b).sum()) for b in np.float32(MSPROBE_MINDSPORE_BOUNDS)]
    fractions = [c / grad.size for c in np.diff([0, *at_most, grad.size])] + [int((grad == 0).sum()) / grad.size]
    norm = np.sqrt(np.float32(np.sum(grad.astype(np.float64) ** 2)))
    cells = [repr(float(f)) for f in fractions] + [repr(float(grad.max())), repr(float(grad.min())),
                                                   repr(float(norm)), f'"{list(grad.shape)}"']
    return ("\ufeff" + ",".join(["param_name", *header, "max", "min", "norm", "shape"]) + "\r\n"
            + ",".join([name, *cells]) + "\r\n").encode("utf-8")


def test_the_expected_row_puts_one_element_in_each_bucket_but_one():
    """The hand-made gradient really exercises the 13 columns (a check on the test's own data)."""
    assert msprobe_l2_csv("g", GRADIENT).decode("utf-8-sig").splitlines()[1].split(",")[1:14] == \
        ["0.08333333333333333"] * 5 + ["0.16666666666666666", "0.0"] + ["0.08333333333333333"] * 5 + \
        ["0.16666666666666666"]


def test_a_config_json_without_bounds_writes_msprobes_mindspore_csv(tmp_path):
    config_path = tmp_path / "config.json"
    config_path.write_text(json.dumps({"task": "grad_probe", "dump_path": str(tmp_path / "dump"), "rank": [],
                                       "step": [], "grad_probe": {"grad_level": "L2", "param_list": []}}))
    weight = Parameter(Tensor(np.zeros(GRADIENT.shape, np.float32)), name="weight")
    optimizer = nn.SGD([weight], learning_rate=0.0)
    debugger = PrecisionDebugger(str(config_path))
    debugger.monitor(optimizer)
    optimizer((Tensor(GRADIENT),))
    debugger.stop()
    assert debugger.config.bounds == tuple(MSPROBE_MINDSPORE_BOUNDS)
    assert summary_csv_path(tmp_path / "dump", 0, 0).read_bytes() == msprobe_l2_csv("weight", GRADIENT)
    assert read_dump_config(tmp_path / "dump")["config"]["grad_probe"]["bounds"] == MSPROBE_MINDSPORE_BOUNDS


def test_bounds_given_are_kept_and_pytorch_keeps_its_own_default(tmp_path):
    given = GradientMonitor(GradProbeConfig(dump_path=str(tmp_path), bounds=(-1, 0, 1)), log_to_mlflow=False)
    assert given.config.bounds == (-1, 0, 1)
    unset = GradProbeConfig(dump_path=str(tmp_path))
    assert unset.for_framework("pytorch").bounds == (-1, 0, 1)
    assert unset.replace(level="L2").for_framework("mindspore").bounds == tuple(MSPROBE_MINDSPORE_BOUNDS)
