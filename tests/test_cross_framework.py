"""A MindSpore training against its PyTorch twin (the same model, weights copied, the same batches): compare pairs
their parameters with no name map (``ln.gamma`` is ``ln.weight``, numbered ``SequentialCell`` children are named
torch modules, a wrapper's ``network.`` prefix), judges the benign pair quiet and names a bug in ``ln.gamma``."""
from __future__ import annotations

import json

import numpy as np
import pytest

ms = pytest.importorskip("mindspore", reason="MindSpore is not installed (the torch-only stage)")
torch = pytest.importorskip("torch")
from mindspore import Tensor, nn  # noqa: E402

from mindspore_training import custom_loop, squared_error_of  # noqa: E402
from msprobe_mlflow import GradProbeConfig, compare_dumps  # noqa: E402
from msprobe_mlflow.compare.pairing import pair_parameters  # noqa: E402
from msprobe_mlflow.mindspore import GradientMonitor as MindSporeMonitor  # noqa: E402
from msprobe_mlflow.pytorch import GradientMonitor as TorchMonitor  # noqa: E402
from tiny_models import normed_mlp, sgd, train  # noqa: E402

STEPS, BUG_STEP = 24, 12
rng = np.random.default_rng(3)
W1, B1 = rng.standard_normal((16, 8)).astype(np.float32) * 0.3, rng.standard_normal(16).astype(np.float32) * 0.1
W2, B2 = rng.standard_normal((2, 16)).astype(np.float32) * 0.3, rng.standard_normal(2).astype(np.float32) * 0.1
BATCHES = [rng.standard_normal((16, 8)).astype(np.float32) * 2 + 1 for _ in range(STEPS)]
TORCH_NAMES = ["ln.weight", "ln.bias", "body.fc1.weight", "body.fc1.bias", "body.fc2.weight", "body.fc2.bias"]
MINDSPORE_NAMES = ["network.ln.gamma", "network.ln.beta", "network.body.0.weight", "network.body.0.bias",
                   "network.body.2.weight", "network.body.2.bias"]


pytestmark = pytest.mark.usefixtures("pynative")  # in a temporary folder (conftest.py): MindSpore writes
# compiler reports (rank_0/om/...) into the current one


def targets(x: np.ndarray) -> np.ndarray:
    return np.stack([np.sin(x[:, 0]), np.cos(x[:, 1])], axis=1).astype(np.float32)


def torch_batches(step: int, generator=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of ``step`` and its targets, as torch tensors (a ``data`` of tests/tiny_models.py's loop)."""
    return torch.from_numpy(BATCHES[step]), torch.from_numpy(targets(BATCHES[step]))


class MindSporeNet(nn.Cell):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm((8,), epsilon=1e-5)
        self.body = nn.SequentialCell([nn.Dense(8, 16, weight_init=Tensor(W1), bias_init=Tensor(B1)), nn.Tanh(),
                                       nn.Dense(16, 2, weight_init=Tensor(W2), bias_init=Tensor(B2))])

    def construct(self, x):
        return self.body(self.ln(x))


class Wrapped(nn.Cell):
    """A user's wrapper: MindSpore prefixes its parameters' names with ``network.``."""

    def __init__(self, net):
        super().__init__()
        self.network = net

    def construct(self, x):
        return self.network(x)


def train_mindspore(dump, gamma_bug: bool = False, level: str = "L1", network=MindSporeNet) -> list[str]:
    """Trains ``Wrapped(network())``; ``gamma_bug``: from :data:`BUG_STEP` on, ``ln.gamma``'s gradient is doubled (a
    wrong backward)."""
    def doubled_gamma(step, grads):
        return (grads[0] * 2, *grads[1:]) if gamma_bug and step >= BUG_STEP else grads

    net = Wrapped(network())
    optimizer = nn.SGD(net.trainable_params(), learning_rate=0.05)
    monitor = MindSporeMonitor(GradProbeConfig(dump_path=str(dump), level=level), log_to_mlflow=False)
    monitor.monitor(optimizer)
    custom_loop(squared_error_of(net), optimizer, [(x, targets(x)) for x in BATCHES], change_gradients=doubled_gamma)
    monitor.stop()
    return [p.name for p in net.trainable_params()]


def torch_twin() -> torch.nn.Module:
    """:class:`MindSporeNet` in PyTorch, its weights copied."""
    net = normed_mlp(8, 16, 2, eps=1e-5)
    with torch.no_grad():
        for layer, (weight, bias) in zip((net.body.fc1, net.body.fc2), ((W1, B1), (W2, B2))):
            layer.weight.copy_(torch.from_numpy(weight))
            layer.bias.copy_(torch.from_numpy(bias))
    return net


def train_torch(dump, level: str = "L1", param_list: tuple[str, ...] = ()) -> list[str]:
    net = torch_twin()
    monitor = TorchMonitor(GradProbeConfig(dump_path=str(dump), level=level, param_list=param_list),
                           log_to_mlflow=False)
    # past the twin's forward, as before it had one: these dumps record no compute format
    train(net, len(BATCHES), optimizer=sgd(0.05), monitor=monitor, data=torch_batches,
          forward=lambda net, x: net.body(net.ln(x)))
    monitor.stop()
    return [name for name, _ in net.named_parameters()]


@pytest.fixture(scope="module")
def twins(tmp_path_factory):
    folder = tmp_path_factory.mktemp("twins")
    previous = ms.get_context("mode")
    ms.set_context(mode=ms.PYNATIVE_MODE)
    try:
        names = train_torch(folder / "torch"), train_mindspore(folder / "mindspore"), \
            train_mindspore(folder / "mindspore_bug", gamma_bug=True)
        train_torch(folder / "torch_without_last_bias", param_list=tuple(TORCH_NAMES[:-1]))
        train_torch(folder / "torch_l2", level="L2")
        train_mindspore(folder / "mindspore_l2", level="L2")
    finally:
        ms.set_context(mode=previous)
    return folder, names


def test_the_twins_name_their_parameters_each_in_their_frameworks_words(twins):
    _, (torch_names, mindspore_names, _) = twins
    assert (torch_names, mindspore_names) == (TORCH_NAMES, MINDSPORE_NAMES)


def test_mindspore_is_paired_with_pytorch_without_a_name_map_and_the_benign_pair_is_quiet(twins):
    folder, _ = twins
    comparison = compare_dumps(folder / "torch", folder / "mindspore", None, progress=False)
    (rank,) = comparison.ranks
    assert rank.parameters == TORCH_NAMES and not rank.only_in_a and not rank.only_in_b
    assert [(a, b) for a, b, _ in rank.renamed_matches] == list(zip(TORCH_NAMES, MINDSPORE_NAMES))
    assert {how for *_, how in rank.renamed_matches} == {"framework", "order"}
    assert comparison.verdict.partial is None
    assert not comparison.verdict.suspicious, comparison.verdict.describe()
    assert "parameters paired by the frameworks' layer names" in comparison.table()


def test_a_bug_in_a_mindspore_layer_norm_gamma_is_named_at_its_step(twins):
    folder, _ = twins
    verdict = compare_dumps(folder / "torch", folder / "mindspore_bug", None, progress=False).verdict
    assert verdict.first_suspicious_step == BUG_STEP, verdict.describe()
    assert verdict.ranks[0].parameter_trips[0].name == "ln.weight"  # A's name; B's is network.ln.gamma


def test_a_verdict_on_part_of_the_models_says_partial(twins):
    folder, _ = twins
    comparison = compare_dumps(folder / "torch_without_last_bias", folder / "mindspore", None, progress=False)
    assert comparison.ranks[0].only_in_b == ["network.body.2.bias"]
    assert comparison.verdict.partial == "partial: the models differ (1 of 6 parameters of B unpaired)"
    assert comparison.verdict.describe().startswith("partial: the models differ (1 of 6 parameters of B unpaired)")
    assert comparison.verdict.to_dict()["partial"] == comparison.verdict.partial


def test_a_name_map_pairs_what_nothing_else_can_and_a_useless_entry_is_refused(tmp_path):
    a = {"encoder.norm.weight": (8,), "head.weight": (2, 8)}
    b = {"final_ln_scale": (8,), "classifier": (2, 8)}
    assert pair_parameters(a, b) == []  # no name, kind or prefix in common: only a map pairs them
    pairs = pair_parameters(a, b, {"encoder.norm.weight": "final_ln_scale", "head.weight": "classifier"})
    assert [(p.a, p.b, p.how) for p in pairs] == [("encoder.norm.weight", "final_ln_scale", "map"),
                                                  ("head.weight", "classifier", "map")]


def test_the_cli_takes_a_name_map_file_and_names_a_bad_one(twins, tmp_path):
    from click.testing import CliRunner

    from msprobe_mlflow.commands.cli import main

    folder, _ = twins
    good = tmp_path / "names.json"
    good.write_text(json.dumps({"body.fc1.weight": "network.body.0.weight"}))
    result = CliRunner().invoke(main, ["compare", str(folder / "torch"), str(folder / "mindspore"), "--no-mlflow",
                                      "--no-plots", "--name-map", str(good)])
    assert result.exit_code == 0, result.output
    assert "1 parameters paired by the name map (e.g. A 'body.fc1.weight' = B 'network.body.0.weight')" in \
        result.output
    typo = tmp_path / "typo.json"
    typo.write_text(json.dumps({"body.fc1.weigth": "network.body.0.weight"}))
    result = CliRunner().invoke(main, ["compare", str(folder / "torch"), str(folder / "mindspore"), "--no-mlflow",
                                      "--no-plots", "--name-map", str(typo)])
    assert result.exit_code == 2
    assert "name map entry 'body.fc1.weigth': 'network.body.0.weight' paired nothing: A has no parameter " \
           "'body.fc1.weigth'" in result.output
    broken = tmp_path / "broken.json"
    broken.write_text('["body.fc1.weight"]')
    result = CliRunner().invoke(main, ["compare", str(folder / "torch"), str(folder / "mindspore"), "--no-mlflow",
                                      "--name-map", str(broken)])
    assert result.exit_code == 2
    assert f"name map {broken}: list is not accepted; expected an object" in result.output


def test_l2_distributions_over_other_bounds_are_not_compared_and_the_comparison_says_so(twins):
    folder, _ = twins  # each framework's default bounds: torch's [-1, 0, 1], MindSpore's eleven
    comparison = compare_dumps(folder / "torch_l2", folder / "mindspore_l2", None, progress=False)
    (rank,) = comparison.ranks
    a, b = rank.bounds_differ
    assert (a[0], len(a), b[0], len(b)) == ("(-inf, -1]", 4, "(-inf, -10]", 12)
    assert "L2 distributions not compared: the runs counted them over other bounds (A (-inf, -1]," in \
        comparison.table()
    assert comparison.to_dict()["ranks"][0]["bounds_differ"] == {"a": list(a), "b": list(b)}
    assert not comparison.verdict.suspicious, comparison.verdict.describe()
