"""How far run B's gradients moved among the exponents against A's: the arithmetic against numpy on raw values,
and ``compare_dumps`` on real float32 and float16 trainings (a loss scale lost at step 3) and a benign pair."""
from __future__ import annotations

import json

import numpy as np
import pytest

from msprobe_mlflow.compare.exponent_shift import ZERO_SHARE_MOVED, exponent_shift, zero_shares_and_mean_exponents
from msprobe_mlflow.statistics_table import exponent_counts


def numpy_zero_share_and_mean_exponent(values: np.ndarray) -> tuple[float, float]:
    """From the values themselves: the share of zeros, and the mean of ``floor(log2|x|)`` over the finite non-zero
    ones (``np.log2`` in float64, exact for float32's powers of two)."""
    values = values.astype(np.float64)
    kept = values[np.isfinite(values) & (values != 0)]
    return float(np.mean(values == 0)), float(np.mean(np.floor(np.log2(np.abs(kept))))) if kept.size else np.nan


def test_zero_shares_and_mean_exponents_are_numpys_from_the_values():
    rng = np.random.default_rng(0)
    arrays = [(rng.standard_normal(1000) * 10.0 ** rng.integers(-30, 5)).astype(np.float32) for _ in range(5)]
    arrays[1][:300] = 0
    arrays[2][:10] = [np.inf, -np.inf, np.nan, 0, -0.0, 1e-45, 3e-39, 1.0, 0.5, 2.0 ** 100]
    arrays.append(np.zeros(7, np.float32))
    zeros, means = zero_shares_and_mean_exponents(np.array([exponent_counts(a) for a in arrays]))
    for array, zero, mean in zip(arrays, zeros, means):
        expected_zero, expected_mean = numpy_zero_share_and_mean_exponent(array)
        assert zero == pytest.approx(expected_zero, abs=1e-15)
        assert (np.isnan(mean) and np.isnan(expected_mean)) or mean == pytest.approx(expected_mean, rel=1e-12)


def test_flushed_small_gradients_move_the_share_at_zero_and_name_the_parameters_that_lost_most():
    rng = np.random.default_rng(1)
    a = [rng.standard_normal(n).astype(np.float32) * scale for n, scale in ((10_000, 1.0), (10_000, 1e-5),
                                                                            (3_000, 1e-6), (20, 1e-5))]
    b = [np.where(np.abs(x) < 1e-6, 0, x).astype(np.float32) for x in a]  # what float16 keeps at scale 1, roughly
    shift = exponent_shift(7, ("big", "small", "tiny", "bias"), np.array([exponent_counts(x) for x in a]),
                           np.array([exponent_counts(x) for x in b]))
    flushed = [int(np.sum((x != 0) & (np.abs(x) < 1e-6))) for x in a]  # elements each lost to zero
    assert shift.zero_share == pytest.approx(sum(flushed) / sum(x.size for x in a), abs=1e-12)
    assert shift.moved and sum(flushed) > ZERO_SHARE_MOVED * sum(x.size for x in a)
    by_count = sorted(range(4), key=lambda i: -flushed[i])
    assert [name for name, _, _ in shift.parameters] == [("big", "small", "tiny", "bias")[i] for i in by_count[:3]
                                                         if flushed[i]]
    tiny = dict((name, (zero, binades)) for name, zero, binades in shift.parameters)["tiny"]
    assert tiny[0] == pytest.approx(flushed[2] / 3_000, abs=1e-12) and tiny[1] > 0  # its smallest went to zero
    assert "more of its gradient elements at zero than A (most: " in shift.describe()
    same = exponent_shift(7, ("big",), np.array([exponent_counts(a[0])]), np.array([exponent_counts(a[0])]))
    assert not same.moved and (same.zero_share, same.binades, same.parameters) == (0.0, 0.0, ())


torch = pytest.importorskip("torch")


class TinyLayer(torch.nn.Module):
    """``head(tiny(x) * 1e-4)``: the tiny layer's gradients are 1e-4 times the head's."""

    def __init__(self):
        super().__init__()
        self.tiny, self.head = torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.tiny(x) * 1e-4)


def train(dump, *, float16: bool, perturb: bool = False, steps: int = 6, **live) -> list[dict[str, np.ndarray]]:
    """6 steps of :class:`TinyLayer`, recording exponent counts into ``dump``; ``float16``: autocast with a
    GradScaler whose scale is 2**14 and drops to 1 after step 2; ``live``: ``baseline=`` and its options; returns
    each step's gradients."""
    from msprobe_mlflow import GradProbeConfig
    from msprobe_mlflow.pytorch import GradientMonitor

    torch.manual_seed(0)
    model = TinyLayer()
    if perturb:  # one ulp on every weight: rounding, not a bug
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1 + 2.0 ** -23 * torch.sign(torch.randn_like(p)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # fixed weights: every step sees the same model
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 14, growth_interval=10_000, enabled=float16)
    monitor = GradientMonitor(GradProbeConfig(level="L1", dump_path=str(dump)), log_to_mlflow=False,
                              statistics=["exponents"], **live).monitor(model, optimizer)
    inputs = torch.Generator().manual_seed(1)
    captured = []
    for step in range(steps):
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16, enabled=float16):
            loss = model(torch.randn(16, 8, generator=inputs)).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        captured.append({n: p.grad.detach().numpy().copy() for n, p in model.named_parameters()})
        scaler.update(1.0 if step == 2 else None)
    monitor.stop()
    return captured


def test_a_lost_loss_scale_is_told_at_its_step_and_a_benign_pair_stays_where_it_was(tmp_path):
    from msprobe_mlflow.compare.engine import compare_dumps

    grads_a = train(tmp_path / "a", float16=False)
    grads_b = train(tmp_path / "b", float16=True)
    expected = None  # the first step whose model-level move passes a limit, from the raw gradients
    for step, (a, b) in enumerate(zip(grads_a, grads_b)):
        zero_a, zero_b = (numpy_zero_share_and_mean_exponent(np.concatenate([g.ravel() for g in grads.values()]))[0]
                          for grads in (a, b))
        if abs(zero_b - zero_a) > ZERO_SHARE_MOVED:
            expected = step
            break
    assert expected == 3  # the step after the scale was lost
    comparison = compare_dumps(tmp_path / "a", tmp_path / "b", tmp_path / "out", plots=False)
    (rank,) = comparison.ranks
    move = rank.first_exponent_move
    assert move is not None and move.step == 3 and move.zero_share > ZERO_SHARE_MOVED
    assert move.parameters[0][0] == "tiny.weight"
    verdict = comparison.verdict.ranks[0]  # the noise rule reads it: its norms moved within float16's rounding
    assert (verdict.first_suspicious_step, verdict.grade) == (3, "departure")
    assert verdict.summary_trip.reason == "zeros" and verdict.parameter_trips[0].name == "tiny.weight"
    assert [s.step for s in rank.exponent_shifts] == list(range(6))
    written = json.loads((tmp_path / "out" / "verdict.json").read_text())["ranks"][0]["exponent_shifts"]
    assert written["first_move"]["step"] == 3 and written["zero_share"] == [s.zero_share for s in rank.exponent_shifts]
    assert "exponents: from step 3, B holds" in comparison.table()

    train(tmp_path / "rounding", float16=False, perturb=True)
    benign = compare_dumps(tmp_path / "a", tmp_path / "rounding", None)
    assert benign.ranks[0].exponent_shifts and benign.ranks[0].first_exponent_move is None
    assert not benign.verdict.suspicious
    assert "exponents: B's share of gradient elements at zero stayed within 1% of A's" in benign.table()


def test_the_live_verdict_names_the_lost_loss_scale_at_its_step_as_compare_does(tmp_path):
    from msprobe_mlflow.compare.engine import compare_dumps

    train(tmp_path / "a", float16=False)
    calls = []
    with pytest.warns(UserWarning, match="rank 0: step 3 is suspicious against baseline"):
        train(tmp_path / "b", float16=True, baseline=str(tmp_path / "a"), on_suspicious=calls.append)
    [live] = calls
    afterwards = compare_dumps(tmp_path / "a", tmp_path / "b", None).verdict.ranks[0]
    assert (live.first_suspicious_step, live.summary_trip.reason) == (3, "zeros")
    assert live == afterwards


@pytest.mark.server
def test_a_comparison_of_runs_on_a_server_downloads_the_counts_and_logs_the_move(tmp_path):
    from mlflow.tracking import MlflowClient

    from mlflow_server import MlflowServer
    from msprobe_mlflow.tracking.comparison_run import compare_runs
    from msprobe_mlflow.tracking.upload import upload_dump

    train(tmp_path / "a", float16=False)
    train(tmp_path / "b", float16=True)
    server = MlflowServer(tmp_path / "server").start()
    try:
        client = MlflowClient(server.uri)
        experiment = client.create_experiment("exponent shift")
        runs = [upload_dump(tmp_path / side, tracking_uri=server.uri, experiment="exponent shift").run_id
                for side in "ab"]
        result = compare_runs(*runs, tracking_uri=server.uri, cache_dir=tmp_path / "cache", plots=False)
        assert list((tmp_path / "cache" / runs[1] / "grad_probe" / "rank0").glob("exponents_*.npz"))  # downloaded
        assert result.comparison.ranks[0].first_exponent_move.step == 3
        history = client.get_metric_history(result.run_id, "exponent_shift/rank0/zero share")
        assert [m.step for m in history] == list(range(6))
        assert [m.value for m in history] == [s.zero_share for s in result.comparison.ranks[0].exponent_shifts]
        tags = client.get_run(result.run_id).data.tags
        assert tags["msprobe_mlflow.compare.rank0.exponents_moved"].startswith("step 3: B holds")
        assert experiment == client.get_run(result.run_id).info.experiment_id
    finally:
        server.stop()
