"""The dump's bytes are msprobe's: folder layout, CSV header, cell formatting, UTF-8 BOM and CRLF line ends.

Expected texts are written out by hand; every number in them follows from the gradients set in the test.
"""
import hashlib
import re

import numpy as np
import pytest
import torch

from gradient_expectations import EXPECTED_L1, EXPECTED_L2
from msprobe_mlflow.config import GradProbeConfig
from msprobe_mlflow.directions import PACKED_FILE_NAME, read_step_directions
from msprobe_mlflow.dump import (DUMP_CONFIG_FILE_NAME, csv_text, indexed_children, parse_rank_folder,
                                 parse_step_folder, parse_summary_name, read_dump_config, read_summary,
                                 relative_step_dir, relative_summary_path, step_dir, summary_csv_path, summary_steps,
                                 write_dump_config, write_step)
from msprobe_mlflow.pytorch import GradientMonitor
from msprobe_mlflow.levels import bucket_labels, csv_header
from msprobe_mlflow.records import StepRecord


class SmallModel(torch.nn.Module):  # its own model: a parameter of its own before its child's, in the expected rows
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(3, 2)
        self.scale = torch.nn.Parameter(torch.tensor(1.0))


def one_step_with_hand_set_gradients(dump_path, level, **config):
    """scale -3.0, fc1.weight [[2, -1, 0], [0, 2, -4]], fc1.bias [0.1, -0.0]; one SGD step; returns the CSV.

    Model order is named_parameters() order: a module's own parameters (scale) before its children's."""
    model = SmallModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    monitor = GradientMonitor(GradProbeConfig(dump_path=str(dump_path), level=level, **config),
                              log_to_mlflow=False).monitor(model, optimizer)
    model.fc1.weight.grad = torch.tensor([[2.0, -1.0, 0.0], [0.0, 2.0, -4.0]])
    model.fc1.bias.grad = torch.tensor([0.1, -0.0])
    model.scale.grad = torch.tensor(-3.0)
    optimizer.step()
    monitor.stop()
    return summary_csv_path(dump_path, 0, 0).read_bytes()


def test_exact_bytes_of_an_l2_summary(tmp_path):
    assert one_step_with_hand_set_gradients(tmp_path, "L2") == EXPECTED_L2


def test_exact_bytes_of_an_l1_summary(tmp_path):
    assert one_step_with_hand_set_gradients(tmp_path, "L1") == EXPECTED_L1


def test_exact_bytes_of_an_l0_summary_with_md5_of_float32_little_endian_bytes(tmp_path):
    def md5(values):
        return hashlib.md5(np.array(values, dtype="<f4").tobytes()).hexdigest()

    expected = (
        '\ufeffparam_name,MD5,max,min,norm,shape\r\n'
        f'scale,{md5(-3.0)},-3.0,-3.0,3.0,[]\r\n'
        f'fc1.weight,{md5([2, -1, 0, 0, 2, -4])},2.0,-4.0,5.0,"[2, 3]"\r\n'
        f'fc1.bias,{md5([0.1, -0.0])},0.10000000149011612,-0.0,0.10000000149011612,[2]\r\n'
    ).encode("utf-8")
    assert one_step_with_hand_set_gradients(tmp_path, "L0") == expected
    # L0: no directions
    assert sorted(p.name for p in (tmp_path / "rank0").iterdir()) == ["grad_summary_0.csv", "training_id"]


def test_custom_bounds_are_labelled_with_python_str(tmp_path):
    text = one_step_with_hand_set_gradients(tmp_path, "L2", bounds=(-0.5, 1e-05, 0.01, 2)).decode("utf-8-sig")
    assert text.split("\r\n")[0] == \
        'param_name,"(-inf, -0.5]","(-0.5, 1e-05]","(1e-05, 0.01]","(0.01, 2]","(2, inf)",=0,max,min,norm,shape'


def test_the_dump_tree_is_msprobes_with_our_packed_directions(tmp_path):
    one_step_with_hand_set_gradients(tmp_path, "L1")
    files = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert [f for f in files if f.startswith("rank")] == \
        ["rank0/grad_summary_0.csv", f"rank0/step0/{PACKED_FILE_NAME}", "rank0/training_id"]
    directions = read_step_directions(tmp_path / "rank0" / "step0")
    assert {name: bits.tolist() for name, (_, bits) in directions.items()} == \
        {"fc1.weight": [0b10001000], "fc1.bias": [0b10000000], "scale": [0]}


def test_the_npy_direction_form_writes_one_msprobe_file_per_parameter(tmp_path):
    one_step_with_hand_set_gradients(tmp_path, "L2", direction_format="npy")
    step_dir = tmp_path / "rank0" / "step0"
    assert sorted(p.name for p in step_dir.iterdir()) == ["fc1.bias.npy", "fc1.weight.npy", "scale.npy"]
    weight = np.load(step_dir / "fc1.weight.npy", allow_pickle=False)
    assert weight.dtype == np.bool_ and weight.tolist() == [[True, False, False], [False, True, False]]
    assert np.load(step_dir / "scale.npy").shape == ()


def hand_record(level, bounds=(-1, 0, 1)):
    """Two parameters: 'w' (3 elements, one of them 0) and an empty one."""
    return StepRecord(
        rank=2, step=7, level=level, bounds=bounds, names=["w", "empty"], shapes=[(3,), (0,)],
        values=np.array([[1.5, -0.5, 2.0], [np.nan, np.nan, 0.0]], dtype=np.float32),
        bucket_counts=np.array([[0, 2, 0, 1], [0, 0, 0, 0]]), zero_counts=np.array([1, 0]),
        md5=["0" * 32, hashlib.md5(b"").hexdigest()],
        directions=np.array([0b10100000], dtype=np.uint8))


def test_an_empty_parameter_has_nan_max_and_min_norm_zero_and_fractions_zero(tmp_path):
    # Decided: numel 0 gives max/min nan, norm 0.0 (the norm of nothing) and fractions written 0, like msprobe's
    # `x / element_num if element_num != 0 else 0`.
    write_step(tmp_path, hand_record("L2"))
    assert summary_csv_path(tmp_path, 2, 7).read_bytes() == (
        '\ufeffparam_name,"(-inf, -1]","(-1, 0]","(0, 1]","(1, inf)",=0,max,min,norm,shape\r\n'
        'w,0.0,0.6666666666666666,0.0,0.3333333333333333,0.3333333333333333,1.5,-0.5,2.0,[3]\r\n'
        'empty,0,0,0,0,0,nan,nan,0.0,[0]\r\n').encode("utf-8")


def test_write_step_returns_the_csv_first_then_the_directions(tmp_path):
    written = write_step(tmp_path, hand_record("L1"))
    assert written == [tmp_path / "rank2" / "grad_summary_7.csv", tmp_path / "rank2" / "step7" / PACKED_FILE_NAME]
    assert read_step_directions(tmp_path / "rank2" / "step7")["w"] == ((3,), [0b10100000])


def test_headers_per_level():
    assert csv_header("L0", (-1, 0, 1)) == ["param_name", "MD5", "max", "min", "norm", "shape"]
    assert csv_header("L1", (-1, 0, 1)) == ["param_name", "max", "min", "norm", "shape"]
    assert csv_header("L2", (0.5,)) == ["param_name", "(-inf, 0.5]", "(0.5, inf)", "=0", "max", "min", "norm",
                                        "shape"]
    assert bucket_labels((-1, 0, 1)) == ["(-inf, -1]", "(-1, 0]", "(0, 1]", "(1, inf)", "=0"]


def test_csv_text_quotes_names_with_commas_and_quotes():
    assert csv_text([['a,b "c"', 1.0]]) == '\ufeff"a,b ""c""",1.0\r\n'.encode("utf-8")


def test_read_summary_round_trips_what_write_step_wrote(tmp_path):
    write_step(tmp_path, hand_record("L0"))
    table = read_summary(summary_csv_path(tmp_path, 2, 7))
    assert table.header == ["param_name", "MD5", "max", "min", "norm", "shape"]
    assert table.column("param_name") == ["w", "empty"]
    assert table.column("norm") == ["2.0", "0.0"]
    assert table.column("MD5")[1] == "d41d8cd98f00b204e9800998ecf8427e"


def test_read_summary_accepts_msprobe_mindspore_graph_mode_spelling(tmp_path):
    path = tmp_path / "grad_summary_0.csv"
    path.write_bytes("\ufeffParam_name,Max,Min,Norm,Shape\r\nNA,1.0,-1.0,2.0,[2]\r\n".encode("utf-8"))
    table = read_summary(path)
    assert table.header == ["param_name", "max", "min", "norm", "shape"]
    assert table.column("param_name") == ["NA"]  # a name, never guessed to be NaN


def test_read_summary_refuses_a_row_longer_than_the_header(tmp_path):
    # What msprobe writes with bounds: [] (the header lacks the bucket column the rows have).
    path = tmp_path / "grad_summary_0.csv"
    path.write_bytes("\ufeffparam_name,=0,max,min,norm,shape\r\nw,0.0,0.0,1.0,-1.0,2.0,[2]\r\n".encode("utf-8"))
    with pytest.raises(ValueError, match=r"grad_summary_0\.csv: row 2 has 7 cells, the header has 6"):
        read_summary(path)


def test_read_summary_refuses_a_file_that_is_not_a_summary(tmp_path):
    path = tmp_path / "other.csv"
    path.write_text("a,b\r\n1,2\r\n")
    with pytest.raises(ValueError, match=r"other\.csv: first row is not a grad_summary header"):
        read_summary(path)


def test_a_missing_column_is_named(tmp_path):
    write_step(tmp_path, hand_record("L1"))
    with pytest.raises(ValueError, match=r"column 'MD5' is missing \(header: param_name,max,min,norm,shape\)"):
        read_summary(summary_csv_path(tmp_path, 2, 7)).column("MD5")


def test_indexed_children_and_summary_steps_ignore_lookalikes(tmp_path):
    for name in ["rank0", "rank10", "rank2", "rankX", "rank-1", "rank3.bak"]:
        (tmp_path / name).mkdir()
    (tmp_path / "rank7").write_text("a file, not a folder")
    assert indexed_children(tmp_path, "rank") == [0, 2, 10]
    assert indexed_children(tmp_path / "missing", "rank") == []
    for name in ["grad_summary_0.csv", "grad_summary_12.csv", "grad_summary_3.csv", "grad_summary_x.csv",
                 "grad_summary_4.csv.tmp"]:
        (tmp_path / "rank0" / name).write_text("")
    assert summary_steps(tmp_path / "rank0") == [0, 3, 12]


def test_relative_paths_are_posix_and_match_the_local_ones(tmp_path):
    assert relative_summary_path(0, 3) == "rank0/grad_summary_3.csv"
    assert relative_step_dir(2, 12) == "rank2/step12"
    assert summary_csv_path(tmp_path, 0, 3) == tmp_path / "rank0" / "grad_summary_3.csv"
    assert step_dir(tmp_path, 2, 12) == tmp_path / "rank2" / "step12"


def test_names_parse_back_and_lookalikes_do_not():
    assert (parse_rank_folder("rank3"), parse_step_folder("step12"), parse_summary_name("grad_summary_12.csv")) == \
        (3, 12, 12)
    for lookalike in ["rankX", "rank-1", "rank3.bak", "step", "grad_summary_x.csv", "grad_summary_4.csv.tmp"]:
        assert parse_rank_folder(lookalike) is None
        assert parse_step_folder(lookalike) is None
        assert parse_summary_name(lookalike) is None


def test_the_dump_config_reads_back_what_was_written(tmp_path):
    config = GradProbeConfig(dump_path=str(tmp_path), level="L2", bounds=(-0.5, 0.5))
    assert read_dump_config(tmp_path) is None  # msprobe's own dumps have none
    assert write_dump_config(tmp_path, "pytorch", config) == tmp_path / DUMP_CONFIG_FILE_NAME
    assert read_dump_config(tmp_path) == {"framework": "pytorch", "config": config.to_msprobe_dict()}


@pytest.mark.parametrize("text, problem", [("{", "not a readable JSON file"),
                                           ('{"framework": "pytorch"}', "field config is missing or not an object")])
def test_a_damaged_dump_config_is_refused_naming_the_file(tmp_path, text, problem):
    (tmp_path / DUMP_CONFIG_FILE_NAME).write_text(text)
    with pytest.raises(ValueError, match=f"^{re.escape(str(tmp_path / DUMP_CONFIG_FILE_NAME))}: {problem}"):
        read_dump_config(tmp_path)
