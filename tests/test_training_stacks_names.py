"""Names do not depend on wrappers: a wrapper's component is dropped, a user's own submodule called ``module``
keeps its name, and the comparator matches the names of dumps written before names were unwrapped, saying so."""
from __future__ import annotations

import torch

from msprobe_mlflow import GradProbeConfig
from msprobe_mlflow.compare.engine import compare_dumps
from msprobe_mlflow.dump import read_summary
from msprobe_mlflow.parameter_names import eager_named_parameters
from msprobe_mlflow.pytorch import GradientMonitor
from tiny_models import gaussian, mlp, train


class Holder(torch.nn.Module):  # its own model: the attribute it holds the layers under is what the tests vary
    """Not a wrapper, though its attribute names are those wrappers use: old dumps had such names."""

    def __init__(self, inner: torch.nn.Module, attribute: str):
        super().__init__()
        setattr(self, attribute, inner)
        self.attribute = attribute

    def forward(self, x):
        return getattr(self, self.attribute)(x)


def test_wrapper_components_are_dropped_and_a_users_module_attribute_is_kept():
    inner = mlp(4, 3, 2)
    compiled = torch.compile(torch.nn.DataParallel(Holder(inner, "module")), backend="eager")
    names = [name for name, _ in eager_named_parameters(compiled)]
    assert [name for name, _ in compiled.named_parameters()][0] == "_orig_mod.module.module.0.weight"
    assert names == ["module.0.weight", "module.0.bias", "module.2.weight", "module.2.bias"]


def dump_two_steps(model: torch.nn.Module, dump) -> None:
    with GradientMonitor(GradProbeConfig(dump_path=str(dump), level="L1"), log_to_mlflow=False) as monitor:
        train(model, 2, monitor=monitor, data=gaussian(6, 4), seed=5)


def test_compare_matches_old_prefixed_names_and_says_so(tmp_path):
    dump_two_steps(Holder(mlp(4, 3, 2), "_orig_mod"), tmp_path / "old_compiled")
    dump_two_steps(mlp(4, 3, 2), tmp_path / "eager")
    assert read_summary(tmp_path / "old_compiled/rank0/grad_summary_0.csv").column("param_name")[0] == \
        "_orig_mod.0.weight"
    comparison = compare_dumps(tmp_path / "old_compiled", tmp_path / "eager", tmp_path / "out", plots=False,
                               progress=False)
    (rank,) = comparison.ranks
    assert rank.parameters == ["_orig_mod.0.weight", "_orig_mod.0.bias", "_orig_mod.2.weight", "_orig_mod.2.bias"]
    assert rank.summary == [1.0, 1.0] and not rank.only_in_a and not rank.only_in_b
    assert rank.renamed_matches[0] == ("_orig_mod.0.weight", "0.weight", "wrapper")
    assert "4 parameters paired once wrapper prefixes were removed" in comparison.table()
    assert comparison.to_dict()["ranks"][0]["renamed_matches"][0] == ["_orig_mod.0.weight", "0.weight", "wrapper"]
