"""The noise-aware rule on real trainings: runs that differ in rounding from step 0 (float64 against float32) are
not suspicious, and a bug on top of that noise is named at the step it starts, with its parameter.

The model has the parameters that make the noise: an attention layer's fused q/k/v bias (its key third has a
gradient that is zero in exact arithmetic) and a bias right before a BatchNorm (the whole gradient is zero in exact
arithmetic). Every run is trained once per module (a few seconds) and compared with the float32 baseline.
"""
from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from msprobe_mlflow import GradProbeConfig, compare_dumps
from msprobe_mlflow.compare.noise_rule import (NORM_BEYOND_FIRST, TRANSIENT_MEANS, NoiseAwareJudge,
                                                first_steps_tolerance, significant_bits)
from msprobe_mlflow.compare.step import SideStatistics, StepComparison
from msprobe_mlflow.compare.verdict import Verdict, rule_settings
from msprobe_mlflow.directions import step_compute_format
from msprobe_mlflow.dump import findings_dir, read_summary, step_dir, summary_csv_path
from msprobe_mlflow.pytorch import GradientMonitor

STEPS = 30
BUG_FROM = 18


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attention = torch.nn.MultiheadAttention(16, 2, batch_first=True)
        self.conv = torch.nn.Conv1d(16, 16, 1)  # its bias feeds a BatchNorm: a gradient of rounding only
        self.norm = torch.nn.BatchNorm1d(16)
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x, causal=True, head_in_bf16=False):
        mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool), 1) if causal else None
        y, _ = self.attention(x, x, x, attn_mask=mask, need_weights=False)
        y = self.norm(self.conv(y.transpose(1, 2))).transpose(1, 2)
        y = torch.relu(y)
        if head_in_bf16:  # an explicit cast: autocast would leave a float64 model alone
            bf16 = torch.bfloat16
            return torch.nn.functional.linear(y.to(bf16), self.head.weight.to(bf16),
                                              self.head.bias.to(bf16)).to(x.dtype).mean(dim=1)
        return self.head(y).mean(dim=1)


def train(dump: Path, dtype=torch.float32, bug: str | None = None, bug_from: int = BUG_FROM, autocast: bool = False,
          **options) -> Path:
    torch.manual_seed(0)
    model = Tiny().to(dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    options = {"statistics": ["param_norm"], **options}  # the weights' norms: judged too, noise must not trip them
    options = {"log_to_mlflow": False, **options}
    monitor = GradientMonitor(GradProbeConfig(dump_path=str(dump), level="L2"), **options)
    monitor.monitor(model, optimizer)
    data = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        x, target = torch.randn(8, 6, 16, generator=data), torch.randn(8, 4, generator=data)
        buggy = bug is not None and step >= bug_from
        if bug == "weight_decay_x10" and step == bug_from:  # acts on the weights after this step's gradients
            optimizer.param_groups[0]["weight_decay"] *= 10
        if bug == "weights_corrupted" and step == bug_from:  # silent corruption: 4 elements become 10x the largest
            with torch.no_grad():
                model.conv.weight.view(-1)[:4] = 10 * model.conv.weight.abs().max()
        if buggy and bug == "new_batches":
            x = x.flip(0)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model(x.to(dtype), causal=not (buggy and bug == "no_causal_mask"),
                        head_in_bf16=buggy and bug == "head_in_bf16")
        loss = torch.nn.functional.mse_loss(out.to(dtype), target.to(dtype))
        optimizer.zero_grad()
        loss.backward()
        if buggy and bug in ("gradients_x2", "gradients_x1.05"):  # a loss scaled by a wrong world size: signs intact
            for parameter in model.parameters():
                parameter.grad.mul_(2 if bug == "gradients_x2" else 1.05)
        if buggy and bug == "head_gradient_zeroed":
            model.head.weight.grad.zero_()
        if bug == "one_element_spiked" and step == bug_from:  # once, in its smallest element: a 0.5% larger norm
            grad = model.head.weight.grad.view(-1)
            grad[grad.abs().argmin()] += 0.1 * grad.norm()
        optimizer.step()
    monitor.stop()
    return dump


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("noise-rule")
    runs = {"baseline": train(root / "baseline"), "float64": train(root / "float64", torch.float64)}
    for bug in ("new_batches", "gradients_x2", "head_gradient_zeroed", "weight_decay_x10", "one_element_spiked"):
        runs[bug] = train(root / bug, torch.float64, bug)
    runs["no_causal_mask_from_0"] = train(root / "no_causal_mask_from_0", torch.float64, "no_causal_mask", 0)
    runs["gradients_x1.05_from_0"] = train(root / "gradients_x1.05_from_0", torch.float64, "gradients_x1.05", 0)
    runs["head_in_bf16_alone"] = train(root / "head_in_bf16_alone", torch.float32, "head_in_bf16")
    runs["head_in_bf16"] = train(root / "head_in_bf16", torch.float64, "head_in_bf16")
    runs["head_in_bf16_from_0"] = train(root / "head_in_bf16_from_0", torch.float64, "head_in_bf16", 0)
    runs["weights_corrupted"] = train(root / "weights_corrupted", torch.float64, "weights_corrupted")
    runs["weights_corrupted_from_0"] = train(root / "weights_corrupted_from_0", torch.float64, "weights_corrupted", 0)
    runs["bf16_autocast"] = train(root / "bf16_autocast", autocast=True)
    runs["head_in_bf16_float32_from_0"] = train(root / "head_in_bf16_float32_from_0", torch.float32, "head_in_bf16", 0)
    runs["gradients_only"] = train(root / "gradients_only", statistics=[])
    runs["weights_corrupted_gradients_only"] = train(root / "weights_corrupted_gradients_only", torch.float64,
                                                     "weights_corrupted", statistics=[])
    runs["weight_decay_x10_gradients_only"] = train(root / "weight_decay_x10_gradients_only", torch.float64,
                                                    "weight_decay_x10", statistics=[])
    return runs


def unrecorded(dump: Path, copy: Path) -> Path:
    """A copy of ``dump`` whose direction archives do not record the format the run computed in (an earlier
    version's dump; msprobe's ``.npy`` form has no place for it): a pair with it has no recorded precision."""
    shutil.copytree(dump, copy)
    for archive in copy.glob("rank*/step*/directions.npz"):
        with np.load(archive, allow_pickle=False) as fields:
            kept = {key: fields[key] for key in fields.files if key != "compute_format"}
        assert len(kept) == 5  # the format was recorded
        np.savez(archive, **kept)
    return copy


@pytest.fixture(scope="module")
def unknown_baseline(runs, tmp_path_factory) -> Path:
    return unrecorded(runs["baseline"], tmp_path_factory.mktemp("unrecorded") / "baseline")


def verdict(runs, candidate: str, rule: str = "noise", precision: str | None = None):
    return compare_dumps(runs["baseline"], runs[candidate], None, rule=rule, precision=precision,
                         plots=False).verdict.ranks[0]


def test_a_pair_that_differs_in_rounding_from_step_0_is_not_suspicious(runs):
    noise = verdict(runs, "float64")
    assert noise.first_suspicious_step is None, noise
    # msprobe's rule, built on pairs that agree bit for bit, calls the same pair suspicious at its first step
    assert verdict(runs, "float64", "msprobe").first_suspicious_step == 0


def test_the_noise_parameters_are_recognised_and_reported(runs):
    noise = {n.name: n for n in verdict(runs, "float64").sign_noise}
    assert noise["conv.bias"].kind == "whole gradient"
    assert noise["attention.in_proj_bias"].kind == "signs"
    # the key third of the fused bias: a third of 48 elements is at rounding level, so its signs disagree
    assert noise["attention.in_proj_bias"].similarity < 0.97 and noise["attention.in_proj_bias"].norm_difference < 1e-4


def test_a_break_on_top_of_the_noise_is_named_at_its_step(runs):
    found = verdict(runs, "new_batches")
    assert found.first_suspicious_step == BUG_FROM
    assert {trip.name for trip in found.parameter_trips} & {"head.weight", "attention.in_proj_weight"}


def test_a_magnitude_bug_with_every_sign_intact_is_named_by_the_norms(runs):
    found = verdict(runs, "gradients_x2")
    assert found.first_suspicious_step == BUG_FROM
    assert {trip.reason for trip in found.parameter_trips} >= {"norm"}
    assert verdict(runs, "gradients_x2", "msprobe").first_suspicious_step == 0  # msprobe's: only the noise


def test_one_element_corrupted_once_below_the_magnitude_floor_is_named_at_its_step_by_its_spread(runs):
    """One element of the head's gradient raised by a tenth of the gradient's norm, at one step only: the norm
    moves by 0.4%, under the 1% floor, but thousands of deviations beyond the float64 pair's noise; the optimizer
    applies it, so the next step's norms part across the model. Named at its step, by that norm."""
    found = verdict(runs, "one_element_spiked")
    norms = [read_summary(summary_csv_path(runs[name], 0, BUG_FROM)).numbers("norm")
             for name in ("baseline", "one_element_spiked")]
    head = read_summary(summary_csv_path(runs["baseline"], 0, BUG_FROM)).column("param_name").index("head.weight")
    moved = (norms[1][head] - norms[0][head]) / norms[1][head]
    assert 1e-3 < moved < 1e-2  # below the floor
    assert found.first_suspicious_step == BUG_FROM
    assert (found.parameter_trips[0].name, found.parameter_trips[0].reason) == ("head.weight", "norm")
    assert f"under the 1% floor, it spread: step {BUG_FROM + 1}'s median norm difference" in \
        found.parameter_trips[0].detail


@pytest.mark.parametrize("next_step", ["spreads", "breaks alone"])
def test_a_faint_break_is_suspicious_only_where_the_next_steps_norms_part_across_the_model(next_step):
    """By hand: w's norm differs by 0.5% of its scale at step 20, beyond its noise (1e-6) but under the 1% floor.
    Where every norm then differs by 1e-3 at step 21 (the change reached the whole model), step 20 is the verdict,
    named by w; where step 21 only has v's signs jump, once (a break of its own that does not persist), nothing
    is."""
    numels, noise = [10_000, 10_000], np.random.default_rng(0)
    judge = NoiseAwareJudge(0)
    for step in range(24):
        agreeing, norm_b = [9_990, 10_000], 1 + 1e-6 * noise.standard_normal(2)
        if step == 20:
            norm_b[0] = 1.005
        if step == 21 and next_step == "spreads":
            norm_b = np.array([1.001, 1.001])
        if step == 21 and next_step == "breaks alone":
            agreeing = [9_990, 9_600]
        judge.judge_step(_step(step, agreeing, numels, [1, 1], norm_b))
    if next_step == "spreads":
        assert judge.verdict.first_suspicious_step == 20
        assert [(trip.name, trip.reason) for trip in judge.verdict.parameter_trips] == [("w", "norm")]
    else:
        assert judge.verdict is None


def test_the_parameter_a_bug_touched_ranks_first(runs):
    found = verdict(runs, "head_gradient_zeroed")
    assert found.first_suspicious_step == BUG_FROM
    assert found.parameter_trips[0].name == "head.weight"
    assert "attention.in_proj_bias" not in [trip.name for trip in found.parameter_trips]  # noise never a culprit


def test_a_corrupted_weight_ranks_first_by_its_own_norm_where_the_weights_norms_are_recorded(runs):
    found = verdict(runs, "weights_corrupted")
    assert found.first_suspicious_step == BUG_FROM
    first = found.parameter_trips[0]
    assert (first.name, first.reason) == ("conv.weight", "weight") and first.detail.startswith("parameter norm A ")
    # from the gradients alone the layer feeding the corrupted one moves most: the weight is not first
    alone = compare_dumps(runs["gradients_only"], runs["weights_corrupted_gradients_only"], None,
                          plots=False).verdict.ranks[0]
    assert alone.first_suspicious_step == BUG_FROM
    assert alone.parameter_trips[0].name != "conv.weight" and "weight" not in {t.reason for t in alone.parameter_trips}


def test_gradients_at_rounding_level_come_last_among_the_culprits_even_without_noise(runs):
    """The head computed in bfloat16 from the bug on, against a baseline equal bit for bit until then: every
    gradient below the head moves a little, and those that are zero in exact arithmetic (the conv's bias before
    the BatchNorm, the attention's output bias before that conv) move by their whole size. They break (no rounding
    between the runs: nothing is noise) but come after the others, so the head is among the first three."""
    found = verdict(runs, "head_in_bf16_alone")
    names = [trip.name for trip in found.parameter_trips]
    assert found.first_suspicious_step == BUG_FROM
    assert {"conv.bias", "attention.out_proj.bias"} <= set(names[-2:])
    assert {"head.weight", "head.bias"} & set(names[:3])


@pytest.mark.parametrize("candidate", ["head_in_bf16_alone", "head_in_bf16"])
def test_a_layer_computed_in_bfloat16_is_named_first_by_its_gradients_coarse_significands(runs, candidate):
    """The head computed in bfloat16 from the bug on (alone, and on top of float64-vs-float32 noise): its rounding
    reaches every gradient below it at the same relative size, but its own gradients now come out of a bfloat16
    matmul, so their max and min carry at most 8 significant bits, in B only and in none of B's steps before."""
    found = verdict(runs, candidate)
    assert found.first_suspicious_step == BUG_FROM
    first_two = found.parameter_trips[:2]
    assert {trip.name for trip in first_two} == {"head.weight", "head.bias"}, found
    assert {trip.reason for trip in first_two} == {"precision"}
    assert all(" in B: " in trip.detail and "significant bits from this step" in trip.detail for trip in first_two)
    assert "precision" not in {trip.reason for trip in found.parameter_trips[2:]}


def test_a_layer_cast_to_bfloat16_from_step_0_is_named_first_where_its_run_recorded_a_finer_format(runs, tmp_path):
    """The head cast to bfloat16 in B's code from step 0, on float64-vs-float32 noise: no earlier step shows its
    format change, but B's monitor recorded float64 while the head's gradients carry at most 8 significant bits (and
    A's more): a 16-bit format B did not report. Without B's recorded format that is no evidence."""
    found = verdict(runs, "head_in_bf16_from_0")
    assert found.first_suspicious_step == 0
    first_two = found.parameter_trips[:2]
    assert {trip.name for trip in first_two} == {"head.weight", "head.bias"}, found
    assert all(trip.reason == "precision" and "where B recorded float64" in trip.detail for trip in first_two)
    unknown = compare_dumps(runs["baseline"], unrecorded(runs["head_in_bf16_from_0"], tmp_path / "unrecorded"), None,
                            precision="float32", plots=False).verdict.ranks[0]
    assert unknown.first_suspicious_step == 0
    assert "precision" not in {trip.reason for trip in unknown.parameter_trips}


def test_coarse_significands_alone_are_no_break():
    """By hand: from step 20 B's gradient extremes of w carry 8 significant bits (a clip to +-0.5078125, say) while
    its norm and signs agree with A's as before: evidence of where a change entered, never a verdict by itself
    (with the gate that adds it only to suspicious steps removed, this fails)."""
    judge = NoiseAwareJudge(0)
    for step in range(24):
        comparison = _step(step, [9_990, 10_000], [10_000, 10_000], [1, 1], [1, 1])
        fine, coarse = 0.1 + 1e-7 * step, 0.5078125 if step >= 20 else 0.1 + 1e-7 * step
        comparison.statistics_a.max, comparison.statistics_a.min = np.array([fine, fine]), np.array([-fine, -fine])
        comparison.statistics_b.max, comparison.statistics_b.min = np.array([coarse, fine]), np.array([-coarse, -fine])
        assert judge.judge_step(comparison) is None
    assert significant_bits(np.array([0.5078125]))[0] == 7 and significant_bits(np.array([0.1000023]))[0] > 11


def test_significant_bits_are_those_of_the_format_a_value_was_rounded_to():
    """Against numpy's own float32 bits and torch's bfloat16 rounding: a float32 value needs 24 bits less the
    trailing zeros of its 23-bit fraction; a value rounded to bfloat16 needs at most 8."""
    values = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    fraction = values.view(np.uint32) & np.uint32((1 << 23) - 1)
    trailing = np.array([23 if f == 0 else (int(f) & -int(f)).bit_length() - 1 for f in fraction])
    assert np.array_equal(significant_bits(values.astype(np.float64)), 24 - trailing)
    bfloat16 = torch.from_numpy(values).to(torch.bfloat16).to(torch.float64).numpy()
    assert np.nanmax(significant_bits(bfloat16)) <= 8 < np.nanmax(significant_bits(values.astype(np.float64)))
    assert np.isnan(significant_bits(np.array([0.0, np.nan, np.inf, 1e-310]))).all()


def test_a_bug_below_the_magnitude_floor_that_moves_every_norm_at_once_is_named_at_its_step(runs):
    """A tenfold weight decay on top of float64-vs-float32 noise moves each norm far less than the 1% a single
    parameter's break needs, but it moves all of them at once: the median norm difference grows by orders of
    magnitude in one step, where rounding's grows smoothly. Its first different gradients are those of the step
    after it starts."""
    found = verdict(runs, "weight_decay_x10")
    assert found.first_suspicious_step == BUG_FROM + 1
    assert found.summary_trip.reason == "norm" and found.summary_trip.score > 10


def test_the_comparison_runs_first_line_says_that_the_norms_jumped(runs, tmp_experiment):
    """The UI's one line: a break of the norms leaves the sign similarity as it was, so it names what moved."""
    from mlflow.tracking import MlflowClient

    from msprobe_mlflow import compare_runs

    result = compare_runs(runs["baseline"], runs["weight_decay_x10_gradients_only"], plots=False)
    headline = MlflowClient().get_run(result.run_id).data.tags["mlflow.note.content"].splitlines()[0]
    assert headline.startswith(f"**Departure**: the runs part at step {BUG_FROM + 1} on rank 0 (beyond this "
                               f"pair's learnt noise")  # a jump across the model, but no norm beyond 10%
    assert "; summary norm: median norm difference " in headline
    assert "x the largest of the last 20 steps in one step" in headline and headline.endswith("[noise rule]")


def test_a_weight_corrupted_before_the_first_update_is_named_at_step_0_against_rounding(runs):
    """At step 0 no optimizer has moved the weights yet: the runs' norms may differ by their storage's rounding
    only, so a corrupted weight is named there (later, its noise must be learnt first)."""
    found = verdict(runs, "weights_corrupted_from_0")
    first = found.parameter_trips[0]
    assert found.first_suspicious_step == 0 and (first.name, first.reason) == ("conv.weight", "weight")
    bound = first_steps_tolerance("float32", [Tiny().conv.weight.numel()])[0]  # the pair recorded float32 (float64)
    assert found.recorded_precision == "float32"
    assert f"before the first update (the weights' rounding moves it by {bound * 100:.2g}% at most)" in first.detail


def test_a_weight_that_jumped_ranks_before_a_gradient_that_moved_more():
    """By hand: at step 20 B's weight w jumps (1.5% of its scale, the gradients agreeing before) and v's gradient
    norm doubles, far more deviations; w comes first, v after it."""
    judge = NoiseAwareJudge(0)
    a = b = 0.1
    for step in range(22):
        move_a, move_b = (0.0001, 0.0016) if step == 20 else (1e-5, 0.99e-5)
        a, b = a + move_a, b + move_b
        comparison = _weights_step(step, a, b)
        if step >= 20:
            comparison.statistics_b.norm[1] = 2.0
        judge.judge_step(comparison)
    assert [(t.name, t.reason) for t in judge.verdict.parameter_trips] == [("w", "weight"), ("v", "norm")]
    assert judge.verdict.parameter_trips[0].score < judge.verdict.parameter_trips[1].score


def test_the_comparison_runs_first_line_gives_the_first_culprit_not_the_most_deviations():
    """The UI's one line names the verdict's first culprit: a weight that moved comes before a gradient that moved
    by more deviations (the layer feeding it)."""
    from msprobe_mlflow.compare.verdict import RankVerdict, RuleSettings, Trip, Verdict
    from msprobe_mlflow.tracking.comparison_run import _headline

    trips = [Trip("conv.weight", 18, None, None, "weight", 12.0, "parameter norm A 1, B 1.2: ..."),
             Trip("attention.out_proj.weight", 18, None, None, "norm", 900.0, "norm A 1, B 2: ...")]
    headline = _headline(Verdict(RuleSettings("noise"), [RankVerdict(0, 18, None, trips)]))
    assert "(conv.weight weight: parameter norm A 1, B 1.2: ... (12x its noise), and 1 more " \
           "parameters)" in headline


def test_a_bug_present_from_step_0_is_named_at_step_0(runs):
    found = verdict(runs, "no_causal_mask_from_0")
    assert found.first_suspicious_step == 0
    assert found.parameter_trips  # named by its parameters, whose norms differ beyond rounding


def test_a_bug_from_step_0_below_bfloat16_rounding_is_named_there_once_the_pairs_precision_is_known(
        runs, unknown_baseline):
    """The head in bfloat16 from step 0 on top of float64-vs-float32 noise moves the norms by about 1e-3 at step 0:
    within what bfloat16 rounding can do (the tolerance when the pair's precision is not known), far beyond what
    float32's can. Given ``precision="float32"`` (the coarser format of the pair), or recorded by both runs'
    monitors (float64 and float32: the head's cast is in the model's code, not torch's settings), step 0 is named;
    the benign pair stays quiet at that precision."""
    unknown = compare_dumps(unknown_baseline, runs["head_in_bf16_from_0"], None, plots=False).verdict.ranks[0]
    assert unknown.first_suspicious_step != 0 and unknown.recorded_precision is None
    recorded = verdict(runs, "head_in_bf16_from_0")
    assert recorded.first_suspicious_step == 0 and recorded.recorded_precision == "float32"
    given = compare_dumps(unknown_baseline, runs["head_in_bf16_from_0"], None, precision="float32",
                          plots=False).verdict.ranks[0]
    assert given.recorded_precision is None and given.parameter_trips == recorded.parameter_trips
    assert given.first_suspicious_step == 0 and given.parameter_trips
    bound = 0.1 * 2.0 ** -16  # 26 float32 units: 0.1 for 26 bfloat16 units, times 2**-24 / 2**-8
    norm = next(trip for trip in given.parameter_trips if trip.reason == "norm")  # after the head's format
    assert norm.detail.endswith(f"(rounding moves it by {bound * 100:.2g}% at most in the first steps)")
    assert verdict(runs, "float64", precision="float32").first_suspicious_step is None
    assert verdict(runs, "float64").first_suspicious_step is None and verdict(runs, "float64").recorded_precision


def test_a_norm_off_in_the_first_steps_beyond_any_format_a_device_could_hide_is_a_break_where_formats_are_known(
        runs, unknown_baseline):
    """Every gradient 5% larger from step 0 (float64 against the float32 baseline, both formats recorded): beyond
    the 1.25% float16's rounding (a device's own TF32 or HF32 too) could move a norm before any update, so a break,
    though within the 10% of bfloat16 that judges a pair whose formats are not known (where step 0 is no alarm)."""
    found = verdict(runs, "gradients_x1.05_from_0")
    assert (found.first_suspicious_step, found.grade, found.recorded_precision) == (0, "break", "float32"), found
    assert found.evidence == NORM_BEYOND_FIRST
    norms = [trip.detail for trip in found.parameter_trips if trip.reason == "norm"]
    assert norms and all(re.search(r": \+4\.[0-9]{2}% of its scale \(rounding moves it by", d) for d in norms), norms
    unknown = compare_dumps(unknown_baseline, runs["gradients_x1.05_from_0"], None, plots=False).verdict.ranks[0]
    assert unknown.first_suspicious_step != 0 and unknown.recorded_precision is None


def test_first_steps_beyond_float32_rounding_are_said_where_the_pairs_precision_is_not_known(runs, unknown_baseline):
    """Without the pair's precision, the head in bfloat16 from step 0 (on float64-vs-float32 noise) is within what
    bfloat16 rounding can do and not named; the verdict says instead that the first steps' norms differ beyond
    float32 rounding, where and by how much, and how to judge them at float32's bound. The benign pair, whose first
    steps stay within float32 rounding, says nothing; nor does a pair judged at a given or recorded precision."""
    comparison = compare_dumps(unknown_baseline, runs["head_in_bf16_from_0"], None, plots=False)
    note = comparison.verdict.ranks[0].first_steps
    assert note is not None and note.step < 5 and note.bound == 0.1 * 2.0 ** -16
    # the named parameter's norms at that step, from the two CSVs: the scaled difference is at most the relative one
    tables = [read_summary(summary_csv_path(runs[name], 0, note.step)) for name in ("baseline", "head_in_bf16_from_0")]
    a, b = (table.numbers("norm")[table.column("param_name").index(note.name)] for table in tables)
    assert note.bound < note.difference <= abs(b - a) / max(a, b) + 1e-12
    assert (note.finest == "tf32") == (note.difference <= 0.1 * 2.0 ** -3) and note.finest in ("tf32", "bfloat16")
    printed = comparison.verdict.describe()
    assert f"{note.name}'s norm differs by {note.difference:.2%}" in printed and "--precision float32" in printed
    assert comparison.verdict.to_dict()["ranks"][0]["first_steps"]["name"] == note.name
    assert compare_dumps(unknown_baseline, runs["float64"], None, plots=False).verdict.ranks[0].first_steps is None
    assert verdict(runs, "head_in_bf16_from_0", precision="float32").first_steps is None
    assert verdict(runs, "head_in_bf16_from_0").first_steps is None


def sixteen_bit_gradients(dump: Path, steps: range) -> set[str]:
    """The parameters whose gradient max and min (from the CSVs) both fit in 11 significant bits at one of ``steps``,
    gradients at rounding level (below 2**-8 of the step's largest) aside."""
    def fits(value: float) -> bool:
        return value == 0 or (math.frexp(value)[0] * 2 ** 11).is_integer()

    found = set()
    for step in steps:
        table = read_summary(summary_csv_path(dump, 0, step))
        top, bottom = table.numbers("max"), table.numbers("min")
        largest = np.maximum(np.abs(top), np.abs(bottom))
        for name, high, low, size in zip(table.column("param_name"), top, bottom, largest):
            if size >= 2.0 ** -8 * largest.max() and fits(high) and fits(low):
                found.add(name)
    return found


def test_the_first_steps_note_says_which_run_computes_in_a_16_bit_format(runs, unknown_baseline, tmp_path):
    """IEEE 754 rounds a bfloat16 result to 8 significant bits: under autocast the matmuls' gradients show it, so the
    note says which run computes so (autocast: the pair's rounding, not a reason for --precision float32). Where
    both runs do, there is no note: the same autocast run against the float64 run carries one, against a run
    whose head is cast to bfloat16 none. (The note stands whatever the verdict: on this 16-wide model the rule
    calls the autocast pair suspicious at step 22, see docs/compare.md.) The pairs' precision is not recorded here:
    recorded, it leaves nothing to note."""
    autocast = compare_dumps(unknown_baseline, runs["bf16_autocast"], None, plots=False).verdict
    note = autocast.ranks[0].first_steps
    coarse = sixteen_bit_gradients(runs["bf16_autocast"], range(5))
    assert note is not None and note.sixteen_bit == "B"
    assert note.sixteen_bit_parameters == len(coarse) > 0 and note.sixteen_bit_example in coarse
    assert not sixteen_bit_gradients(runs["baseline"], range(5))
    assert "run B computes" in autocast.describe() and "16-bit format" in autocast.describe()
    unknown_autocast = unrecorded(runs["bf16_autocast"], tmp_path / "autocast")
    swapped = compare_dumps(unknown_autocast, runs["float64"], None, plots=False).verdict.ranks[0].first_steps
    assert swapped is not None and swapped.sixteen_bit == "A"
    cast = compare_dumps(unknown_baseline, runs["head_in_bf16_from_0"], None, plots=False).verdict.ranks[0]
    assert cast.first_steps.sixteen_bit == "B" and cast.first_steps.sixteen_bit_example.startswith("head.")
    both = compare_dumps(unknown_autocast, runs["head_in_bf16_from_0"], None, plots=False).verdict.ranks[0]
    assert sixteen_bit_gradients(runs["head_in_bf16_from_0"], range(5)) and both.first_steps is None
    assert verdict(runs, "bf16_autocast").first_steps is None


def test_the_first_steps_tolerance_covers_what_summing_a_norm_in_float32_rounds():
    """Given the pair's precision, a norm's own computation is rounding too: torch's float32 norm of a large tensor
    (the CSV's column) is off by hundreds of float32 units from float64's, more than the 26 units float32 rounding
    moved the benchmark's small layers. The tolerance covers it, so a wide float32 pair is not a bug at step 0; a
    small parameter keeps the 26 units."""
    from msprobe_mlflow.compat import foreach_norm

    sizes = np.array([16, 1 << 18, 1 << 20, 1 << 22])
    generator = torch.Generator().manual_seed(0)
    errors = []
    for size in sizes:
        values = torch.randn(int(size), generator=generator) * 0.02
        in_float32 = foreach_norm([values], dtype=torch.float32)[0].item()
        in_float64 = foreach_norm([values.double()], dtype=torch.float64)[0].item()
        errors.append(abs(in_float32 - in_float64) / in_float64)
    tolerance = first_steps_tolerance("float32", sizes)
    assert errors[2] > 26 * 2.0 ** -24  # what the 26 units alone would call a bug
    assert np.all(np.array(errors) < tolerance) and tolerance[0] == 0.1 * 2.0 ** -16
    assert np.all(first_steps_tolerance(None, sizes) == 0.1)  # not known: bfloat16's, whatever the size


def test_the_live_verdict_takes_the_pairs_precision_and_equals_compares(runs, unknown_baseline, tmp_path):
    train(tmp_path / "live", torch.float64, "head_in_bf16", 0, baseline=str(unknown_baseline), precision="float32")
    live = json.loads((findings_dir(tmp_path / "live", 0) / "verdict.json").read_text())["verdict"]
    afterwards = compare_dumps(unknown_baseline, tmp_path / "live", None, precision="float32", plots=False).verdict
    assert live == afterwards.to_dict() and afterwards.first_suspicious_step == 0 and live["precision"] == "float32"


def test_gradients_out_of_a_16_bit_format_in_both_runs_make_the_recorded_precision_bfloat16(runs):
    """Both runs cast the head to bfloat16 from step 0 (a cast in the model's code: torch reports float32 and
    float64): both runs' head gradients show a 16-bit format, so the first steps are judged at bfloat16's rounding,
    not float32's, and the pair is quiet."""
    found = compare_dumps(runs["head_in_bf16_float32_from_0"], runs["head_in_bf16_from_0"], None,
                          plots=False).verdict
    assert found.ranks[0].recorded_precision == "bfloat16" and not found.suspicious
    recorded = {step_compute_format(step_dir(runs[name], 0, 0)) for name in ("head_in_bf16_float32_from_0",
                                                                             "head_in_bf16_from_0")}
    assert recorded == {"float32", "float64"}
    assert "first steps judged at bfloat16 rounding, from what both runs recorded" in found.describe()


def test_steps_recorded_without_a_format_after_the_first_ones_leave_their_recorded_precision(runs, tmp_path):
    """The baseline's archives from step 10 on hold no format (as where a step's forward went past the monitored
    module): the first steps were judged at float32, both runs having recorded it there, and the verdict says so."""
    partly = unrecorded(runs["baseline"], tmp_path / "partly")
    for step in range(10):
        shutil.copyfile(step_dir(runs["baseline"], 0, step) / "directions.npz",
                        step_dir(partly, 0, step) / "directions.npz")
    assert step_compute_format(step_dir(partly, 0, 9)) == "float32"
    assert step_compute_format(step_dir(partly, 0, 10)) is None
    found = compare_dumps(partly, runs["float64"], None, plots=False).verdict
    assert not found.suspicious and found.ranks[0].recorded_precision == "float32"


def test_the_live_verdict_reads_the_recorded_precision_as_compare_does(runs, tmp_path):
    """Both runs' monitors recorded their formats (float32, float64): the live verdict judges the first steps at
    float32's rounding, names the head cast to bfloat16 at step 0 and equals compare's afterwards."""
    train(tmp_path / "live", torch.float64, "head_in_bf16", 0, baseline=str(runs["baseline"]))
    live = json.loads((findings_dir(tmp_path / "live", 0) / "verdict.json").read_text())["verdict"]
    afterwards = compare_dumps(runs["baseline"], tmp_path / "live", None, plots=False).verdict
    assert live == afterwards.to_dict() and afterwards.first_suspicious_step == 0
    assert live["ranks"][0]["recorded_precision"] == "float32" and "precision" not in live


def test_the_comparison_runs_second_line_gives_the_first_steps_beyond_float32_rounding(runs, unknown_baseline,
                                                                                       tmp_experiment):
    """In the UI, below the verdict's line: short, as the description's lines do not wrap beside its wide table."""
    from mlflow.tracking import MlflowClient

    from msprobe_mlflow import compare_runs

    result = compare_runs(unknown_baseline, runs["head_in_bf16_from_0"], plots=False)
    note = result.verdict.ranks[0].first_steps
    lines = MlflowClient().get_run(result.run_id).data.tags["mlflow.note.content"].splitlines()
    assert lines[0].startswith("**Consistent**") and lines[2] == (
        f"**First steps** beyond float32 rounding: `{note.name}` {note.difference:.2%} at step {note.step}, within "
        f"{note.finest}'s; run B has {note.sixteen_bit_parameters} gradient(s) in a 16-bit format "
        f"(`{note.sixteen_bit_example}`): if by a cast, not autocast, use `--precision float32`")
    quiet = compare_runs(unknown_baseline, runs["float64"], plots=False)
    description = MlflowClient().get_run(quiet.run_id).data.tags["mlflow.note.content"]
    assert "**First steps**" not in description
    seen = quiet.verdict.ranks[0].sensitivity  # what it could not see, in the first line too
    assert f"; norm moves under {seen.median * 100:.2g}% of a gradient's scale were within the pair's noise at step " \
           f"{seen.step}" in description.splitlines()[0]


def test_the_live_verdict_says_the_same_of_the_first_steps_in_its_file_and_its_runs_description(
        runs, unknown_baseline, tmp_path, tmp_experiment):
    import mlflow
    from mlflow.tracking import MlflowClient

    with mlflow.start_run() as run:
        train(tmp_path / "live", torch.float64, "head_in_bf16", 0, baseline=str(unknown_baseline), log_to_mlflow=True)
    live = json.loads((findings_dir(tmp_path / "live", 0) / "verdict.json").read_text())["verdict"]
    afterwards = compare_dumps(unknown_baseline, tmp_path / "live", None, plots=False).verdict
    note = afterwards.ranks[0].first_steps
    assert live == afterwards.to_dict() and note is not None and not afterwards.suspicious
    description = MlflowClient().get_run(run.info.run_id).data.tags["mlflow.note.content"]
    assert description.startswith("msprobe-mlflow live verdict: no suspicious step") and description.endswith(
        f"; {note.note()}")


def test_the_command_takes_the_pairs_precision_and_refuses_it_with_msprobes_rule(runs, tmp_path):
    from click.testing import CliRunner

    from msprobe_mlflow.commands.cli import main

    sources = [str(runs["baseline"]), str(runs["head_in_bf16_from_0"])]
    given = CliRunner().invoke(main, ["compare", *sources, "--no-mlflow", "--precision", "float32",
                                      "--output", str(tmp_path / "out")])
    assert given.exit_code == 0, given.output
    assert "first suspicious step 0" in given.output
    saved = json.loads((tmp_path / "out" / "verdict.json").read_text())
    assert saved["verdict"]["precision"] == "float32"
    refused = CliRunner().invoke(main, ["compare", *sources, "--no-mlflow", "--precision", "float32", "--rule",
                                        "msprobe"])
    assert refused.exit_code != 0 and "--precision applies to --rule noise only" in refused.output


def _step(step: int, agreeing, numels, norm_a, norm_b) -> StepComparison:
    ones = np.ones(len(numels))
    return StepComparison(step, ("w", "v"), ("w", "v"), np.array(agreeing), np.array(numels),
                          SideStatistics(np.array(norm_a, float), ones, -ones),
                          SideStatistics(np.array(norm_b, float), ones, -ones))


def test_a_slow_steady_drift_trips_nothing_and_a_jump_of_the_same_size_does():
    """By hand: w's signs disagree on 0.1% more of its elements each step (two trajectories parting), from 0.1% to
    4% over 40 steps, and nothing trips; a jump of 4% at step 30 that stays, after 30 quiet steps, is a break
    named by w, at step 30, once step 31 shows that it persists."""
    numels = [10_000, 10_000]
    drifting, jumping = NoiseAwareJudge(0), NoiseAwareJudge(0)
    for step in range(40):
        assert drifting.judge_step(_step(step, [9_990 - 10 * step, 10_000], numels, [1, 1], [1, 1])) is None
        found = jumping.judge_step(_step(step, [9_990 - (400 if step >= 30 else 0), 10_000], numels, [1, 1], [1, 1]))
        assert (found is None) == (step != 31)
    assert jumping.verdict.first_suspicious_step == 30 and jumping.verdict.parameter_trips[0].name == "w"


def _weights_step(step: int, weight_a: float, weight_b: float) -> StepComparison:
    """Gradients that agree (w's signs at a steady rounding rate); w's own norms ``weight_a``, ``weight_b``."""
    comparison = _step(step, [9_990, 10_000], [10_000, 10_000], [1, 1], [1, 1])
    comparison.statistics_a.parameter_norm = np.array([weight_a, 1.0])
    comparison.statistics_b.parameter_norm = np.array([weight_b, 1.0])
    return comparison


def test_a_weight_that_moves_in_one_run_only_breaks_and_one_both_runs_move_does_not():
    """By hand (a conv bias under bfloat16 autocast did this, step 217 of a benign pair): the two runs' norms of w
    drift apart slowly; at step 20 a gradient spike moves w by 0.004 in A and 0.0025 in B, the difference by 1.5%
    of its scale, more than the window ever did; both runs took the step, so it is no break. The same difference
    made by B alone (0.0016 while A moved 0.0001) is a weight that moved without the training: named, first."""
    judges = {"spike": NoiseAwareJudge(0), "corrupted": NoiseAwareJudge(0)}
    for kind, judge in judges.items():
        a = b = 0.1
        for step in range(24):
            move_a, move_b = {20: (0.004, 0.0025) if kind == "spike" else (0.0001, 0.0016)}.get(step, (1e-5, 0.99e-5))
            a, b = a + move_a, b + move_b
            judge.judge_step(_weights_step(step, a, b))
    assert judges["spike"].verdict is None
    corrupted = judges["corrupted"]
    assert corrupted.verdict.first_suspicious_step == 20
    assert (corrupted.verdict.parameter_trips[0].name, corrupted.verdict.parameter_trips[0].reason) == ("w", "weight")


def test_weights_that_all_part_a_little_at_once_are_named_there_while_their_gradients_stay_in_the_noise():
    """By hand (a tenfold weight decay under rounding noise did this on the benchmark: conv, seed 2): ten
    parameters' gradient norms differ by a random 1e-4 of their scale at every step, the noise of a pair, and the
    runs' weight norms part slowly (1e-9 of their scale per step). From step 20 B's weights lose 4e-5 of their norm
    more than A's at each step: both runs still move every weight alike (1e-3 a step), the gradients show nothing
    beyond their noise, but every weight's difference grew hundreds of times in one step: named at step 20, by the
    weights, the gradients' series quiet."""
    names, count = tuple(f"p{i}" for i in range(10)), 10
    noise = np.random.default_rng(0)
    judge = NoiseAwareJudge(0)
    weight_a = weight_b = np.ones(count)
    for step in range(24):
        weight_a = weight_a * (1 - 1e-3)
        weight_b = weight_b * (1 - 1e-3 - (4e-5 if step >= 20 else 1e-9))
        norm_b = 1 + 1e-4 * noise.standard_normal(count)
        sides = [SideStatistics(norms, np.ones(count), -np.ones(count), parameter_norm=weights.copy())
                 for norms, weights in ((np.ones(count), weight_a), (norm_b, weight_b))]
        found = judge.judge_step(StepComparison(step, names, names, np.full(count, 9_990), np.full(count, 10_000),
                                                *sides))
        assert (found is None) == (step != 21), (step, found)
    trip = judge.verdict.summary_trip
    assert judge.verdict.first_suspicious_step == 20 and trip.reason == "weight", judge.verdict
    assert trip.detail.startswith("median parameter norm difference ") and not judge.verdict.parameter_trips
    assert judge.verdict.grade == "break" and judge.verdict.evidence.startswith(
        f"the whole model's weights parted in one step, at step 20 ({trip.detail}), which rounding carried forward "
        "does not do")


@pytest.mark.parametrize("parted, grade", [(30, "departure"), (300, "break")])
def test_weights_parting_across_the_model_grade_a_jump_as_a_break_only_beyond_the_jump_rounding_never_makes(parted,
                                                                                                        grade):
    """By hand: ten gradients' norms differ by 1e-7 of their scale, the weights' by 1e-9 more per step; at step 20
    every gradient norm differs by 1e-4 (a jump across the model, below each norm's floor: a departure on its own),
    and at step 21 the update that step made parts every weight, ``parted`` times more than the weights' largest
    difference of the last 20 steps. The weights' differences grew 2.3x in one step at most over the divergence
    benchmark's 120 benign pairs: 300x is an update that differed, a break; 30x confirms the jump but is no
    evidence beyond rounding."""
    names, count = tuple(f"p{i}" for i in range(10)), 10
    noise = np.random.default_rng(0)
    judge = NoiseAwareJudge(0)
    weight_a, weight_b = np.ones(count), np.ones(count)
    for step in range(22):
        weight_a = weight_a * (1 - 1e-3)
        weight_b = weight_a * (1 - (parted * 2.0 ** -24 if step == 21 else 1e-9 * step))
        norm_b = 1 + (1e-4 if step >= 20 else 1e-7) * (1 + 0.1 * noise.random(count))
        sides = [SideStatistics(norms, np.ones(count), -np.ones(count), parameter_norm=weights.copy())
                 for norms, weights in ((np.ones(count), weight_a), (norm_b, weight_b))]
        found = judge.judge_step(StepComparison(step, names, names, np.full(count, 9_990), np.full(count, 10_000),
                                                *sides))
        assert (found is None) == (step != 21), (step, found)
    assert judge.verdict.first_suspicious_step == 20 and judge.verdict.summary_trip.reason == "norm"
    assert judge.verdict.grade == grade, judge.verdict.evidence
    parted = "the whole model's weights parted in one step, at step 21 ("
    assert (parted in judge.verdict.evidence) == (grade == "break")


def test_a_spike_that_does_not_persist_is_rounding_not_a_verdict():
    """By hand: the same 4% jump of w at step 30 only (a sum that cancelled once) is no verdict; the same jump at
    step 30 that persists is."""
    numels = [10_000, 10_000]
    spike = NoiseAwareJudge(0)
    for step in range(40):
        assert spike.judge_step(_step(step, [9_990 - (400 if step == 30 else 0), 10_000], numels, [1, 1],
                                      [1, 1])) is None
    assert spike.report().first_suspicious_step is None


def test_statistics_from_the_dump_are_what_the_rule_reads(runs):
    """The rule's norms are the CSV's: B's norm is twice A's on every parameter from the bug on."""
    step = BUG_FROM
    norms = [read_summary(summary_csv_path(runs[name], 0, step)).numbers("norm") for name in ("float64",
                                                                                             "gradients_x2")]
    assert np.allclose(np.array(norms[1]), 2 * np.array(norms[0]), rtol=1e-6)


def test_culprits_are_ranked_by_how_far_beyond_their_noise_they_moved():
    """By hand: after 20 steps at 0.1% disagreement, a.small moves to 2% (about 60 binomial deviations) and z.big
    to 20% (about 600): z.big comes first, whatever the names' order."""
    judge, numels = NoiseAwareJudge(0), [10_000, 10_000]
    step = lambda s, agreeing: StepComparison(s, ("a.small", "z.big"), ("a.small", "z.big"), np.array(agreeing),
                                              np.array(numels))
    for s in range(20):
        assert judge.judge_step(step(s, [9_990, 9_990])) is None
    assert judge.judge_step(step(20, [9_800, 8_000])) is None  # held until the next step
    found = judge.judge_step(step(21, [9_800, 8_000]))
    assert found.first_suspicious_step == 20
    assert [trip.name for trip in found.parameter_trips] == ["z.big", "a.small"]
    assert found.parameter_trips[0].score > 5 * found.parameter_trips[1].score


def test_runs_that_agreed_bit_for_bit_have_no_noise_so_an_early_sign_bug_is_named_not_excused():
    """By hand: equal signs and norms at steps 0-2 (no rounding between the runs); at step 3 w's signs differ on
    40% of its elements with its norm unchanged: in the first steps that would pass for sign noise in a pair that
    differs in rounding; here it is the first suspicious step, named by w."""
    judge, numels = NoiseAwareJudge(0), [1_000, 1_000]
    for step in range(6):
        found = judge.judge_step(_step(step, [1_000 if step < 3 else 600, 1_000], numels, [1, 1], [1, 1]))
    assert found is None and judge.verdict.first_suspicious_step == 3
    assert [trip.name for trip in judge.verdict.parameter_trips] == ["w"] and judge.verdict.sign_noise == []


def test_the_comparison_run_records_the_pairs_precision(runs, tmp_experiment):
    from mlflow.tracking import MlflowClient

    from msprobe_mlflow import compare_runs

    result = compare_runs(runs["baseline"], runs["head_in_bf16_from_0"], precision="float32", plots=False)
    params = MlflowClient().get_run(result.run_id).data.params
    assert params == {"rule": "noise", "precision": "float32"} and result.verdict.first_suspicious_step == 0


def test_the_comparison_run_records_the_precision_both_runs_recorded(runs, tmp_experiment):
    """Not given: the comparison run's params say which format the first steps were judged at, from the runs."""
    from mlflow.tracking import MlflowClient

    from msprobe_mlflow import compare_runs

    result = compare_runs(runs["baseline"], runs["head_in_bf16_from_0"], plots=False)
    params = MlflowClient().get_run(result.run_id).data.params
    assert params == {"rule": "noise", "recorded_precision": "float32"}
    assert result.verdict.first_suspicious_step == 0


def train_on_threads(dump: Path, threads: int, steps: int = 12, autocast: bool = False) -> Path:
    """An MLP wide enough for torch to split its matrix products over ``threads``: the sums' order, so their last
    bits, differ with the thread count (a new kernel, another cluster)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(128, 512), torch.nn.GELU(), torch.nn.LayerNorm(512),
                                    torch.nn.Linear(512, 512), torch.nn.GELU(), torch.nn.Linear(512, 10))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        monitor = GradientMonitor(GradProbeConfig(dump_path=str(dump), level="L1"), log_to_mlflow=False)
        monitor.monitor(model, optimizer)
        data = torch.Generator().manual_seed(1)
        for _ in range(steps):
            x, y = torch.randn(256, 128, generator=data), torch.randint(0, 10, (256,), generator=data)
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
        monitor.stop()
    finally:
        torch.set_num_threads(before)
    return dump


def test_runs_whose_signs_agree_while_their_statistics_differ_in_the_last_bits_are_not_bit_for_bit(tmp_path):
    one, two = train_on_threads(tmp_path / "one", 1), train_on_threads(tmp_path / "two", 2)
    first = compare_dumps(one, two, None, plots=False)
    assert first.ranks[0].summary[0] == 1.0  # every sign agrees at step 0...
    assert read_summary(summary_csv_path(one, 0, 0)).rows != read_summary(summary_csv_path(two, 0, 0)).rows  # bits
    assert not first.verdict.suspicious, first.verdict.describe()


def test_an_update_that_differed_parts_every_weight_at_once_a_break_where_the_weights_are_recorded(runs):
    """A tenfold weight decay on real trainings (float64 against float32): the step after it starts, every weight's
    norm difference grows hundreds of times at once, where rounding carried forward grows it smoothly."""
    decayed = verdict(runs, "weight_decay_x10")
    assert (decayed.first_suspicious_step, decayed.grade) == (BUG_FROM + 1, "break")
    assert f"the whole model's weights parted in one step, at step {BUG_FROM + 1} (median parameter norm difference " \
        in decayed.evidence


def test_a_doubled_gradient_is_a_break_and_a_jump_within_every_norms_rounding_a_departure(runs):
    """A tenfold weight decay, the weights' norms not recorded: its gradients' norms jump across the model, each
    within what amplified rounding can move it, so a departure."""
    doubled = compare_dumps(runs["baseline"], runs["gradients_x2"], None, plots=False).verdict
    assert (doubled.grade, doubled.ranks[0].grade) == ("break", "break")
    assert "a norm moved by more than 10% of its scale and 10x its largest" in doubled.ranks[0].evidence
    decayed = compare_dumps(runs["baseline"], runs["weight_decay_x10_gradients_only"], None, plots=False).verdict
    assert decayed.grade == "departure" and decayed.ranks[0].evidence.startswith("beyond this pair's learnt noise")
    assert decayed.to_dict()["grade"] == "departure"
    assert "first suspicious step 19, a departure: beyond this pair's learnt noise" in decayed.describe()
    assert (decayed.fails("break"), decayed.fails("departure"), doubled.fails("break")) == (False, True, True)


def test_runs_that_agreed_bit_for_bit_until_a_step_break_there():
    """By hand: two runs equal in every recorded byte for 6 steps, then one norm differs by 0.01%: no rounding
    lies between them, so the difference is a break, not a departure."""
    judge = NoiseAwareJudge(0)
    for step in range(8):
        norm_b = 1.0001 if step >= 6 else 1.0
        side_a = SideStatistics(np.array([1.0]), np.array([0.5]), np.array([-0.5]))
        side_b = SideStatistics(np.array([norm_b]), np.array([0.5]), np.array([-0.5]))
        judge.judge_step(StepComparison(step, ("w",), ("w",), np.array([100]), np.array([100]), side_a, side_b))
    assert (judge.verdict.first_suspicious_step, judge.verdict.grade) == (6, "break")
    assert judge.verdict.evidence == "the runs agreed bit for bit until this step"


@pytest.mark.parametrize("largest, jump, grade", [(0.0, 0.3, "break"), (0.09, 0.3, "departure"),
                                                  (0.09, 2 / 3, "break")])
def test_a_norm_move_is_a_break_only_beyond_ten_times_what_the_pair_showed_lately(largest, jump, grade):
    """By hand (resnet-bn, float64 against float32, step 119: norms 4-10% apart after moves of 0.4-2% in the
    window did this): w's norm difference wanders by 1e-4 of its scale, once by ``largest`` (step 25), then B's norm
    moves by ``jump`` of it at step 30 and stays. Named at its step either way (more than 10% moves at once); a
    *break* only beyond ten times the window's largest move, counted as ratios of norms: 30% after a quiet pair,
    B = 3x A (2/3 of its scale) after a 9% move (ten times 9% as a difference would be out of reach), but 30% after
    it is what the pair's amplified rounding reaches."""
    judge = NoiseAwareJudge(0)
    wander = 1e-4 * np.cos(np.arange(40))
    wander[25] = largest
    for step in range(40):
        norm_b = 1 / (1 - jump) if step >= 30 else 1 + wander[step]
        judge.judge_step(_step(step, [9_990, 9_990], [10_000, 10_000], [1, 1], [norm_b, 1]))
    assert (judge.verdict.first_suspicious_step, judge.verdict.grade) == (30, grade), judge.verdict
    assert judge.verdict.parameter_trips[0].name == "w"
    if grade == "break":
        assert judge.verdict.evidence == "a norm moved by more than 10% of its scale and 10x its largest move of " \
                                         "the last 20 steps"


@pytest.mark.parametrize("steps, both, grade", [((30,), True, "departure"), (range(30, 40), True, "break"),
                                                 ((30,), False, "break"), ((39,), True, "break")])
def test_a_move_of_the_whole_model_gone_at_the_next_step_is_a_departure(steps, both, grade):
    """By hand (GPT-2 with clipping, bfloat16 against float32, step 265: 19 parameters' norms 10-30% apart and the
    model's signs 3% apart for one step, back at the next, did this): B's norms are 1.5x A's at ``steps``, with 10%
    of the signs flipped in ``both`` parameters or in w's norm alone. Named at its step in every case; a *break*
    where it persists, where it stayed in one parameter (an element corrupted once), or where no step after it
    says (the last one); a departure where the whole model moved for one step only."""
    judge = NoiseAwareJudge(0)
    for step in range(40):
        moved = step in steps
        agreeing = [9_000, 9_000] if moved and both else [9_990, 9_990]
        judge.judge_step(_step(step, agreeing, [10_000, 10_000], [1, 1], [1.5 if moved else 1.0,
                                                                          1.5 if moved and both else 1.0]))
    assert (judge.report().first_suspicious_step is None) == (steps[0] == 39)  # the last step: once judging ends
    assert (judge.finish() is None) == (steps[0] != 39)
    verdict = judge.report()
    assert (verdict.first_suspicious_step, verdict.grade) == (steps[0], grade), verdict
    assert (verdict.evidence == TRANSIENT_MEANS) == (grade == "departure")


def test_a_quiet_verdict_says_the_least_norm_move_it_could_have_seen_and_that_move_is_named():
    """Issue 47's decision 1, by hand: w's and v's norm differences alternate +-0.4% of their scale. The quiet
    verdict says how far a norm had to move to be seen at the last step; a move of w 20% short of that, from step
    30 on, stays quiet, and one 20% beyond it is named at step 30."""
    def judge(move: float = 0.0) -> NoiseAwareJudge:
        judge = NoiseAwareJudge(0)
        for step in range(40):
            wander = 0.004 * (-1) ** step
            w = move if step >= 30 else wander
            judge.judge_step(_step(step, [9_990, 9_990], [10_000, 10_000], [1, 1], [1 + w, 1 + wander]))
        judge.finish()
        return judge

    quiet = judge().report()
    seen = quiet.sensitivity
    assert not quiet.suspicious and seen.step == 39 and seen.median > 0.01  # beyond the 1% floor: the pair's noise
    assert f"at step 39, a gradient norm moving by less than {seen.median * 100:.2g}% of its scale" in \
        Verdict(rule_settings(), [quiet]).describe()
    assert Verdict(rule_settings(), [quiet]).to_dict()["ranks"][0]["sensitivity"]["median"] == seen.median
    assert not judge(0.8 * seen.median).report().suspicious
    assert judge(1.2 * seen.median).report().first_suspicious_step == 30


def test_the_cli_fails_on_a_break_by_default_and_on_a_departure_when_asked(runs):
    from click.testing import CliRunner

    from msprobe_mlflow.commands.cli import main

    def exit_code(candidate, *grade):
        return CliRunner().invoke(main, ["compare", str(runs["baseline"]), str(runs[candidate]), "--no-mlflow",
                                         "--no-plots", "--fail-on-suspicious", *grade]).exit_code

    assert (exit_code("weight_decay_x10_gradients_only"), exit_code("weight_decay_x10_gradients_only", "departure")) \
        == (0, 3)
    assert (exit_code("gradients_x2"), exit_code("float64", "departure")) == (3, 0)


def test_the_first_sign_flips_after_steps_of_none_are_drift_not_a_break(tmp_path):
    """bfloat16 autocast on one thread against two: a handful of signs disagree at step 0, ten times as many at step 1
    (the elements nearest zero, as the trajectories drift apart). A few steps of next to no disagreement teach no
    rate."""
    one, two = (train_on_threads(tmp_path / name, threads, autocast=True) for name, threads in (("one", 1), ("two", 2)))
    comparison = compare_dumps(one, two, None, plots=False)
    first, second = comparison.ranks[0].summary[:2]
    assert 1 - first < 1e-4 and 1 - second > 2 * (1 - first)  # more than doubled: the old early rule's break
    assert not comparison.verdict.suspicious, comparison.verdict.describe()


def test_evidence_reads_as_ratios_and_percentages():
    """A doubled norm is 'B = 2.00x A'; a difference far below a percent keeps two significant digits; a score
    past a thousand deviations is not printed as a count nobody can read."""
    from msprobe_mlflow.compare.noise_rule import _trip
    from msprobe_mlflow.compare.verdict import trip_numbers

    doubled = _trip("norm", "w", 3, 1.0, 0.5, 0.0, 872217.0, (1.0, 2.0))
    assert doubled.detail.startswith("norm A 1, B 2: B = 2.00x A (usually +0.00%)")
    assert trip_numbers(doubled).endswith("(over 1000x its noise)")
    tiny = _trip("norm", "w", 3, 1.0, 3.1e-6, 1.2e-8, 14.0, (1.0, 1.0000031))
    assert "+0.00031% of its scale (usually +1.2e-06%)" in tiny.detail
    assert trip_numbers(tiny).endswith("(14x its noise)")


@pytest.mark.parametrize("difference, silencer, grade", [(3e-4, "tf32", "departure"), (0.03, None, "break"),
                                                         (0.2, None, "break")])
def test_a_first_steps_break_within_a_coarser_formats_rounding_names_that_format_and_its_flag(difference, silencer,
                                                                                           grade):
    """By hand: both runs recorded float32; from step 0 B's norm of w is off by 0.03% (float32 allows 0.0006% for
    100 elements, TF32 0.13%: a device running float32 matmuls in TF32 looks so: a departure), by 3% (within
    bfloat16's 10% only, which real bugs reach too: no flag is offered; beyond float16's 1.25%, the coarsest a
    device computes float32 in unknown to torch: a break) or by 20% (beyond any format's rounding)."""
    judge = NoiseAwareJudge(0)
    extremes = np.array([0.1234567, 0.7654321], dtype=np.float32).astype(np.float64)  # float32's 24 bits
    for step in range(3):
        comparison = _step(step, [100, 100], [100, 100], [1, 1], [1 + difference, 1])
        for side in (comparison.statistics_a, comparison.statistics_b):
            side.max, side.min = extremes, -extremes
        comparison.compute_formats = ("float32", "float32")
        judge.judge_step(comparison)
    verdict = judge.verdict
    assert verdict.first_suspicious_step == 0 and verdict.coarser_format == silencer
    assert verdict.grade == grade, verdict
    described = Verdict_of(verdict).describe()
    if silencer:
        assert "lies within tf32's rounding: if a run computed in tf32 without torch reporting it" in described
        assert "--precision tf32" in described and "--precision tf32" in json.dumps(Verdict_of(verdict).to_dict())
    else:
        assert "--precision" not in described


def Verdict_of(rank_verdict):
    from msprobe_mlflow.compare.verdict import RuleSettings, Verdict
    return Verdict(RuleSettings(), [rank_verdict])


def test_a_gradient_a_bug_shrinks_to_rounding_level_stays_a_culprit_not_noise():
    """By hand: v's gradient is small but above rounding level (its max 0.5% of the model's) for 10 steps; at step
    10 it dips to 0.28% in A while B zeroes it (a bug). Both sides are 'at rounding level' there, but v never was
    before: it is named, not called whole-gradient noise."""
    judge = NoiseAwareJudge(0)
    extremes = np.array([0.7654321, 0.0051234], dtype=np.float32).astype(np.float64)
    for step in range(12):
        v_max = (0.0021234 if step >= 10 else extremes[1], 0.0 if step >= 10 else extremes[1])
        sides = []
        for side, v in zip("ab", v_max):
            maxima = np.array([extremes[0], v])
            rounding = 1e-7 * (step % 3) if side == "b" else 0.0  # the runs differ in rounding from step 0
            norms = np.array([1.0 + rounding, 0.0 if v == 0 else v * 10])
            sides.append(SideStatistics(norms, maxima, -maxima))
        agreeing = [999, 500 if step >= 10 else 1000]
        judge.judge_step(StepComparison(step, ("w", "v"), ("w", "v"), np.array(agreeing), np.array([1000, 1000]),
                                        *sides))
    verdict = judge.report()
    assert verdict.first_suspicious_step == 10, verdict
    assert "v" in [trip.name for trip in verdict.parameter_trips]
    assert "v" not in [noise.name for noise in verdict.sign_noise]


def without_step_0_format(dump: Path, copy: Path) -> Path:
    """A copy of ``dump`` whose step 0 archive records no compute format, as ``autolog()`` writes it: it attaches at
    the first optimizer step, after step 0's forward, whose autocast it could not see."""
    shutil.copytree(dump, copy)
    archive = step_dir(copy, 0, 0) / "directions.npz"
    with np.load(archive, allow_pickle=False) as fields:
        kept = {key: fields[key] for key in fields.files if key != "compute_format"}
    np.savez(archive, **kept)
    assert step_compute_format(step_dir(copy, 0, 0)) is None and step_compute_format(step_dir(copy, 0, 1))
    return copy


def test_a_run_whose_step_0_recorded_no_format_is_judged_at_what_its_later_steps_recorded(runs, tmp_path):
    """autolog's runs: a bug from step 0 smaller than bfloat16 rounding, 'no suspicious step' while step 0's
    missing format made the whole pair unknown, is named by step 1 at float32's bound; the benign pair stays quiet
    and carries no first-steps note suggesting a flag."""
    buggy = without_step_0_format(runs["head_in_bf16_from_0"], tmp_path / "buggy")
    found = compare_dumps(runs["baseline"], buggy, None, plots=False).verdict.ranks[0]
    assert found.first_suspicious_step in (0, 1) and found.recorded_precision == "float32", found
    benign = compare_dumps(runs["baseline"], without_step_0_format(runs["float64"], tmp_path / "benign"), None,
                           plots=False).verdict.ranks[0]
    assert benign.first_suspicious_step is None and benign.first_steps is None and benign.recorded_precision
