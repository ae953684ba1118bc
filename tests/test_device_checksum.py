"""The ``mix64`` device checksum of L0 (config ``checksum``): the same number as an independent numpy computation
of its definition, on every path; equal gradients give equal values, a changed or moved element a different one."""
import hashlib

import numpy as np
import pytest
import torch

from gradient_expectations import read_rows
from msprobe_mlflow import GradProbeConfig
from msprobe_mlflow.pytorch import GradientMonitor
from msprobe_mlflow.torch_kernels.statistics import ROW, launch_step_statistics

GOLDEN, MIX1, MIX2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def mix64(values: np.ndarray) -> str:
    """The definition, in numpy's wrapping uint64 arithmetic: sum of splitmix64(float32 bits + (i + 1) * GOLDEN)."""
    words = np.ascontiguousarray(values, np.float32).reshape(-1).view(np.uint32).astype(np.uint64)
    with np.errstate(over="ignore"):
        z = words + np.arange(1, words.size + 1, dtype=np.uint64) * GOLDEN
        z = (z ^ (z >> np.uint64(30))) * MIX1
        z = (z ^ (z >> np.uint64(27))) * MIX2
        z = z ^ (z >> np.uint64(31))
        return f"mix64:{int(z.sum(dtype=np.uint64)):016x}"


def gradients() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return {"rows": torch.randn(3 * ROW + 7, generator=generator),
            "special": torch.tensor([0.0, -0.0, float("nan"), float("inf"), -1.5]),
            "empty": torch.zeros(0, 3),
            "scalar": torch.tensor(2.5),
            "half": torch.randn(9, 5, generator=generator).to(torch.bfloat16),
            "double": torch.randn(4, 3, generator=generator, dtype=torch.float64),
            "transposed": torch.randn(6, 4, generator=generator).t()}


def checksums(grads: dict[str, torch.Tensor], checksum: str = "mix64") -> dict[str, str]:
    record = launch_step_statistics(list(grads), list(grads.values()), rank=0, step=0, level="L0", bounds=(0,),
                                    checksum=checksum)()
    return dict(zip(record.names, record.md5))


def test_the_checksum_column_matches_its_definition_computed_with_numpy():
    grads = gradients()
    expected = {name: mix64(grad.float().numpy()) for name, grad in grads.items()}
    assert checksums(grads) == expected


def test_equal_gradients_give_equal_checksums_and_a_changed_or_moved_element_does_not():
    grad = torch.randn(2 * ROW + 3, generator=torch.Generator().manual_seed(4))
    nudged, swapped = grad.clone(), grad.clone()
    nudged[ROW + 1] = torch.nextafter(nudged[ROW + 1], torch.tensor(np.inf))  # one ulp
    swapped[[0, 5]] = grad[[5, 0]]
    found = checksums({"same": grad, "again": grad.clone(), "nudged": nudged, "swapped": swapped})
    assert found["same"] == found["again"]
    assert len({found["same"], found["nudged"], found["swapped"]}) == 3


def test_md5_stays_the_default_and_an_unknown_checksum_is_refused():
    grad = torch.arange(6, dtype=torch.float32)
    assert checksums({"w": grad}, "md5") == {"w": hashlib.md5(grad.numpy().tobytes()).hexdigest()}
    with pytest.raises(ValueError, match="checksum = 'sha1' is not accepted; expected one of md5, mix64"):
        checksums({"w": grad}, "sha1")
    with pytest.raises(ValueError, match="checksum = 'crc'"):
        GradProbeConfig(dump_path="out", level="L0", checksum="crc")


def test_a_monitor_with_the_device_checksum_writes_it_in_the_md5_column(tmp_path):
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    config = GradProbeConfig.from_dict({"task": "grad_probe", "dump_path": str(tmp_path), "checksum": "mix64",
                                        "grad_probe": {"grad_level": "L0"}})
    monitor = GradientMonitor(config).monitor(model, optimizer)
    model(torch.ones(2, 4)).sum().backward()
    expected = {name: mix64(p.grad.numpy()) for name, p in model.named_parameters()}
    optimizer.step()
    monitor.stop()
    header, rows = read_rows(tmp_path / "rank0" / "grad_summary_0.csv")
    assert header[:2] == ["param_name", "MD5"]
    assert {name: row[1] for name, row in rows.items()} == expected


def test_the_mindspore_monitor_refuses_the_device_checksum_it_does_not_compute(tmp_path):
    pytest.importorskip("mindspore")
    from msprobe_mlflow.mindspore import GradientMonitor as MindSporeGradientMonitor

    config = GradProbeConfig(dump_path=str(tmp_path), level="L0", checksum="mix64")
    with pytest.raises(ValueError, match="checksum = 'mix64' is not accepted by the MindSpore monitor; expected md5"):
        MindSporeGradientMonitor(config, log_to_mlflow=False)
