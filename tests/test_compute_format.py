"""The format each step computed in, as the PyTorch monitor records it with the step's directions, and as the
comparator reads it back: real trainings under the settings torch reports (dtype, autocast, float32 matmul
precision), and archives holding it byte for byte as ``np.savez`` writes them."""
from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch

from msprobe_mlflow import GradProbeConfig
from msprobe_mlflow.directions import _layout_fields, read_packed, step_compute_format, write_packed
from msprobe_mlflow.dump import step_dir
from msprobe_mlflow.formats import coarsest
from msprobe_mlflow.pytorch import GradientMonitor
from tiny_models import gaussian, mlp, train


def recorded_formats(dump: Path, dtype=torch.float32, autocast: bool = False, through=None, steps: int = 2) -> list:
    """Trains a small model ``steps`` steps under the monitor; ``through(model)`` is what the forward calls.
    Returns the format recorded at each step."""
    def forward(model, x):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            return (through or (lambda m: m))(model)(x)

    monitor = GradientMonitor(GradProbeConfig(dump_path=str(dump), level="L1"), log_to_mlflow=False)
    train(mlp(8, 8, 2, activation=torch.nn.ReLU).to(dtype), steps, monitor=monitor, forward=forward,
          data=gaussian(4, 8, dtype=dtype), seed=None, loss=lambda out, _: out.float().square().mean())
    monitor.stop()
    return [step_compute_format(step_dir(dump, 0, step)) for step in range(steps)]


def test_the_monitor_records_the_format_torch_computes_in(tmp_path):
    assert recorded_formats(tmp_path / "float32") == ["float32", "float32"]
    assert recorded_formats(tmp_path / "float64", torch.float64) == ["float64", "float64"]
    assert recorded_formats(tmp_path / "autocast", autocast=True) == ["bfloat16", "bfloat16"]
    assert recorded_formats(tmp_path / "bf16", torch.bfloat16) == ["bfloat16", "bfloat16"]
    try:
        torch.set_float32_matmul_precision("high")  # float32 matmuls may use TF32
        assert recorded_formats(tmp_path / "high") == ["tf32", "tf32"]
        high_float64 = recorded_formats(tmp_path / "high_float64", torch.float64)
        assert high_float64 == ["float64", "float64"]  # no TF32 for float64
    finally:
        torch.set_float32_matmul_precision("highest")


def test_the_format_is_not_known_where_no_forward_of_the_monitored_model_ran(tmp_path):
    """The forward called past the monitored module (its layers one by one): autocast could have been on unseen."""
    def layer_by_layer(model):
        return lambda x: model[2](model[1](model[0](x)))

    assert recorded_formats(tmp_path / "past", through=layer_by_layer) == [None, None]


def test_the_archive_holds_the_format_as_np_savez_writes_it_and_refuses_another(tmp_path):
    names, shapes = ["w", "b"], [(3, 3), (5,)]
    bits = np.array([0b10110000, 0b10000000, 0b11100000], np.uint8)  # w: 9 bits in 2 bytes, b: 5 in 1
    folder = tmp_path / "step0"
    folder.mkdir()
    for compute_format in (None, "float32", "bfloat16"):
        write_packed(folder / "directions.npz", names, shapes, bits, compute_format)
        expected = io.BytesIO()
        np.savez(expected, **_layout_fields(names, shapes), bits=bits,
                 **({"compute_format": np.array(compute_format)} if compute_format else {}))
        assert (folder / "directions.npz").read_bytes() == expected.getvalue()
        assert step_compute_format(folder) == compute_format
        shape, read = read_packed(folder / "directions.npz")["b"]
        assert shape == (5,) and read.tolist() == [0b11100000]
    np.savez(folder / "directions.npz", **_layout_fields(names, shapes), bits=bits, compute_format=np.array("fp8"))
    with pytest.raises(ValueError, match=r"directions\.npz: field compute_format = 'fp8', expected one of"):
        step_compute_format(folder)
    assert step_compute_format(tmp_path / "no_such_step") is None


def test_a_pairs_format_is_the_coarser_and_unknown_when_either_is():
    assert coarsest(["float64", "float32"]) == "float32"
    assert coarsest(["float32", "bfloat16", "tf32"]) == "bfloat16"
    assert coarsest(["float32", None]) is None and coarsest([]) is None
