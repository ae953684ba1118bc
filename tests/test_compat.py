"""Every private name in ``msprobe_mlflow.compat``, run against the installed library (torch, MLflow, Lightning as
pyproject.toml allows them), and what each shim does where a newer version drops the name (the attribute deleted
stands for that version): a fallback that keeps the result right, or an error naming the library, the version and
the range checked."""
from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import tomllib
import types
from pathlib import Path

import mlflow
import numpy as np
import pytest
import torch
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from msprobe_mlflow import compat

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def test_the_ranges_checked_are_pyprojects_and_hold_the_installed_versions():
    project = tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))["project"]
    requirements = [Requirement(line) for line in project["dependencies"]] + \
        [Requirement(line) for extra in project["optional-dependencies"].values() for line in extra]
    for library, specifier in compat.CHECKED_WITH.items():
        assert {r.specifier for r in requirements if r.name == library} == {SpecifierSet(specifier)}, library
        try:
            installed = Version(importlib.metadata.version(library))
        except importlib.metadata.PackageNotFoundError:  # an extra this environment leaves out (torch-only stage)
            continue
        assert installed in SpecifierSet(specifier), (library, installed)


def test_compat_imports_no_library_at_import_time():
    code = ("import sys, msprobe_mlflow.compat\n"
            "print([m for m in ('torch', 'mlflow', 'lightning', 'numba', 'mindspore') if m in sys.modules])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


@pytest.fixture
def one_rank_group(tmp_path):
    torch.distributed.init_process_group("gloo", init_method=(tmp_path / "rendezvous").as_uri(), rank=0,
                                         world_size=1)
    yield
    torch.distributed.destroy_process_group()


def test_default_store_is_the_jobs_rendezvous_store(one_rank_group):
    store = compat.default_store()
    store.set("compat/key", b"value")
    assert store.get("compat/key") == b"value"
    assert isinstance(store, torch.distributed.Store)


def test_default_store_gone_is_an_error_naming_torch_and_the_range(one_rank_group, monkeypatch):
    from torch.distributed import distributed_c10d

    monkeypatch.delattr(distributed_c10d, "_get_default_store")
    with pytest.raises(compat.MissingPrivateApi) as raised:
        compat.default_store()
    message = str(raised.value)
    assert f"torch {importlib.metadata.version('torch')} has no " \
           "torch.distributed.distributed_c10d._get_default_store" in message
    assert "checked with torch>=2.1" in message


def test_current_experiment_id_follows_set_experiment(tmp_experiment):
    assert compat.current_experiment_id() == tmp_experiment
    other = mlflow.create_experiment("compat-other")
    mlflow.set_experiment(experiment_id=other)
    assert compat.current_experiment_id() == other != tmp_experiment


def test_current_experiment_id_gone_is_an_error_naming_mlflow(tmp_experiment, monkeypatch):
    from mlflow.tracking import fluent

    monkeypatch.delattr(fluent, "_get_experiment_id")
    with pytest.raises(compat.MissingPrivateApi, match=r"mlflow [\d.]+\S* has no mlflow\.tracking\.fluent\."
                                                       r"_get_experiment_id.*checked with mlflow>=3\.7,<4"):
        compat.current_experiment_id()


def test_lightnings_trainer_and_mlflow_loggers_uri(tmp_sqlite_uri, monkeypatch):
    lightning = pytest.importorskip("lightning")
    from lightning.pytorch.loggers import MLFlowLogger

    logger = MLFlowLogger(tracking_uri=tmp_sqlite_uri)
    trainer = lightning.Trainer(logger=logger, accelerator="cpu", devices=1, enable_progress_bar=False,
                                enable_checkpointing=False, enable_model_summary=False)
    model = lightning.LightningModule()
    model.trainer = trainer
    assert compat.lightning_trainer(model) is trainer
    assert compat.lightning_trainer(torch.nn.Linear(1, 1)) is None
    assert compat.mlflow_logger_tracking_uri(logger) == tmp_sqlite_uri
    monkeypatch.delattr(logger, "_tracking_uri")  # a newer Lightning: the caller falls back to the active URI
    assert compat.mlflow_logger_tracking_uri(logger) is None


def test_tensor_version_counts_in_place_changes_only():
    tensor = torch.zeros(4)
    before = compat.tensor_version(tensor)
    tensor + 1
    assert compat.tensor_version(tensor) == before
    tensor.add_(1)
    tensor.mul_(2)
    assert compat.tensor_version(tensor) == before + 2


def test_tensor_version_gone_never_matches_so_every_gradient_counts_as_changed():
    without = types.SimpleNamespace()  # stands for a tensor of a torch without _version
    assert compat.tensor_version(without) != compat.tensor_version(without)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_foreach_norm_is_each_tensors_norm_with_and_without_torchs(dtype, monkeypatch):
    arrays = [np.random.default_rng(seed).standard_normal(size) for seed, size in enumerate((1, 7, 1000))]
    expected = [np.sqrt(np.sum(array.astype(np.float64) ** 2)) for array in arrays]
    tensors = [torch.from_numpy(array).to(dtype) for array in arrays]
    tolerance = 1e-6 if dtype == torch.float32 else 1e-12
    np.testing.assert_allclose([norm.item() for norm in compat.foreach_norm(tensors)], expected, rtol=tolerance)
    monkeypatch.delattr(torch, "_foreach_norm")
    np.testing.assert_allclose([norm.item() for norm in compat.foreach_norm(tensors)], expected, rtol=tolerance)


def test_numba_cache_dir_is_set_and_a_numba_without_it_keeps_its_own(tmp_path, monkeypatch):
    from numba.core import config

    monkeypatch.setattr(config, "CACHE_DIR", config.CACHE_DIR)  # restored after the test
    assert compat.set_numba_cache_dir(str(tmp_path)) is True
    assert config.CACHE_DIR == str(tmp_path)
    monkeypatch.delattr(config, "CACHE_DIR")
    assert compat.set_numba_cache_dir(str(tmp_path / "other")) is False
    assert not hasattr(config, "CACHE_DIR")


def test_numba_slp_vectorize_is_on_inside_only_and_a_numba_without_it_is_left_alone(monkeypatch):
    from numba.core import config

    monkeypatch.setattr(config, "SLP_VECTORIZE", 0)
    with compat.numba_slp_vectorize():
        assert config.SLP_VECTORIZE == 1
    assert config.SLP_VECTORIZE == 0
    monkeypatch.delattr(config, "SLP_VECTORIZE")
    with compat.numba_slp_vectorize():
        assert not hasattr(config, "SLP_VECTORIZE")


def test_mindspore_amp_level_is_the_level_auto_mixed_precision_gave_and_empty_without():
    pytest.importorskip("mindspore", reason="MindSpore is not installed (the torch-only stage)")
    from mindspore import amp, nn

    assert compat.mindspore_amp_level(nn.Dense(2, 2)) == ""
    assert compat.mindspore_amp_level(amp.auto_mixed_precision(nn.Dense(2, 2), "auto")) == "auto"
    assert compat.mindspore_amp_level(types.SimpleNamespace()) == ""  # a MindSpore without _amp_level


def test_ascend_precision_settings_are_ascends_own_and_set_contexts_where_mindspore_has_no_getter(monkeypatch):
    mindspore = pytest.importorskip("mindspore", reason="MindSpore is not installed (the torch-only stage)")
    import mindspore._c_expression as expression

    assert not hasattr(expression, "AscendOpPrecisionConf")  # a CPU build: set_context's ascend_config is read
    context = {"ascend_config": {"precision_mode": "force_fp16", "conv_allow_hf32": False}}
    monkeypatch.setattr(mindspore, "get_context", context.get)
    assert compat.ascend_precision_settings() == {"precision_mode": "force_fp16", "op_precision_mode": "",
                                                  "matmul_allow_hf32": "", "conv_allow_hf32": "0"}
    ascend = types.SimpleNamespace(precision_mode=lambda: "must_keep_origin_dtype", op_precision_mode=lambda: "",
                                   matmul_allow_hf32=lambda: "1", conv_allow_hf32=lambda: "")
    monkeypatch.setattr(expression, "AscendOpPrecisionConf",  # stands for an Ascend build's
                        types.SimpleNamespace(get_instance=lambda: ascend), raising=False)
    assert compat.ascend_precision_settings() == {"precision_mode": "must_keep_origin_dtype", "op_precision_mode": "",
                                                  "matmul_allow_hf32": "1", "conv_allow_hf32": ""}
