"""The comparator's pure core: similarity on packed sign bits and the suspicious-step rule, checked by hand."""
from __future__ import annotations

import numpy as np
import pytest

from msprobe_mlflow.compare import similarity as similarity_module
from msprobe_mlflow.compare.similarity import (agreeing_directions, agreeing_per_parameter, similarity,
                                                summary_similarity)
from msprobe_mlflow.compare.verdict import (MsprobeJudge, RankVerdict, RuleSettings, Verdict, check_thresholds,
                                            judge_rank)


def packed(signs) -> np.ndarray:
    return np.packbits(np.asarray(signs, dtype=bool).reshape(-1))


def test_odd_numel_counts_only_real_elements():
    a = np.array([1, 0, 1, 1, 0, 0, 1, 0, 1, 1, 1, 0, 1], dtype=bool)  # 13 elements: 2 bytes, 3 padding bits
    b = a.copy()
    b[[0, 7, 12]] = ~b[[0, 7, 12]]  # three flips, the last one in the padded byte
    assert agreeing_directions(packed(a), packed(b), 13) == 10
    assert similarity(10, 13) == pytest.approx(10 / 13)


def test_garbage_in_padding_bits_is_ignored():
    a = np.array([1, 0, 1, 1, 0], dtype=bool)  # 5 elements: bits 7..3 of one byte, 3 padding bits
    bits_a, bits_b = packed(a), packed(a)
    bits_b[0] |= 0b00000111  # a foreign writer left the padding set
    assert agreeing_directions(bits_a, bits_b, 5) == 5


def test_scalar_parameter():
    assert agreeing_directions(packed([True]), packed([True]), 1) == 1
    assert agreeing_directions(packed([True]), packed([False]), 1) == 0
    assert similarity(0, 1) == 0.0


def test_empty_parameter_has_similarity_zero():
    empty = np.zeros(0, dtype=np.uint8)
    assert agreeing_directions(empty, empty, 0) == 0
    assert similarity(0, 0) == 0.0


def test_matches_elementwise_equality_across_chunks(monkeypatch):
    monkeypatch.setattr(similarity_module, "CHUNK_BYTES", 3)  # many chunks, a partial last one
    rng = np.random.default_rng(0)
    a, b = rng.random(1001) > 0.5, rng.random(1001) > 0.5
    assert agreeing_directions(packed(a), packed(b), 1001) == int((a == b).sum())


def test_wrong_byte_count_is_refused():
    with pytest.raises(ValueError, match="12 elements need 2"):
        agreeing_directions(np.zeros(1, np.uint8), np.zeros(2, np.uint8), 12)


def test_summary_is_weighted_by_element_count():
    # 10 agreeing of 10, 0 of 2: weighted 10/12, where the mean of the rows would be 0.5
    assert summary_similarity([10, 0], [10, 2]) == pytest.approx(10 / 12)
    assert summary_similarity([0], [0]) == 0.0


STEPS = [0, 5, 10, 15]


def series_trips(name, steps, values):
    """The trips of msprobe's rule on one series at its first suspicious step (the verdict names that step only)."""
    return judge_rank(0, steps, [None] * len(steps), {name: values}).parameter_trips


def test_first_step_below_threshold_trips():
    trips = series_trips("w", STEPS[:2], [0.96, 0.96])
    assert [(t.step, t.reason) for t in trips] == [(0, "first")]
    assert trips[0].fall == pytest.approx(0.04)


def test_thresholds_are_strict():
    assert series_trips("w", STEPS[:2], [0.97, 0.97]) == []  # not below 0.97
    assert series_trips("w", STEPS[:2], [1.0, 0.97]) == []  # a drop of exactly 0.03 is not more than 0.03
    assert [t.step for t in series_trips("w", STEPS[:2], [1.0, 0.969])] == [5]


def test_drop_is_measured_from_the_previous_compared_value():
    trips = series_trips("w", STEPS, [1.0, 0.99, 0.90, 0.5])
    assert [(t.step, t.previous, t.similarity) for t in trips] == [(10, 0.99, 0.90)]
    trips = series_trips("w", STEPS, [1.0, 0.98, 0.96, 0.5])  # 0.02 at a time: not from 1.0, from the last value
    assert [(t.step, t.previous, t.similarity) for t in trips] == [(15, 0.96, 0.5)]


def test_missing_values_are_skipped():
    trips = series_trips("w", STEPS[:3], [1.0, None, 0.9])
    assert [(t.step, t.previous) for t in trips] == [(10, 1.0)]
    assert series_trips("w", STEPS[:2], [None, 0.5]) == []  # the first-step rule needs a value at step 0


def test_rank_verdict_names_first_step_and_orders_parameters_by_fall():
    parameters = {"small.fall": [1.0, 0.99, 0.95, 0.95], "big.fall": [1.0, 0.99, 0.90, 0.5],
                  "later": [1.0, 1.0, 1.0, 0.5], "steady": [1.0, 1.0, 1.0, 1.0]}
    verdict = judge_rank(0, STEPS, [1.0, 0.995, 0.93, 0.7], parameters)
    assert verdict.first_suspicious_step == 10
    assert [t.name for t in verdict.parameter_trips] == ["big.fall", "small.fall"]  # fell 0.09, then 0.04
    assert verdict.summary_trip.fall == pytest.approx(0.065)


def test_thresholds_are_options():
    parameters = {"w": [1.0, 0.99, 0.95, 0.95]}
    assert judge_rank(0, STEPS, [1.0] * 4, parameters, drop_threshold=0.05).first_suspicious_step is None
    assert judge_rank(0, STEPS, [1.0] * 4, parameters, first_threshold=1.0, drop_threshold=0.05) \
        .first_suspicious_step is None
    assert judge_rank(0, STEPS, [0.99] * 4, parameters, first_threshold=0.995).first_suspicious_step == 0


def test_verdict_over_ranks():
    quiet = judge_rank(0, STEPS, [1.0] * 4, {})
    loud = judge_rank(1, STEPS, [1.0, 1.0, 0.8, 0.8], {})
    verdict = Verdict(RuleSettings("msprobe"), [quiet, loud])
    assert verdict.suspicious and verdict.first_suspicious_step == 10
    as_dict = verdict.to_dict()
    assert as_dict["ranks"][1]["summary_trip"]["fall"] == pytest.approx(0.2)
    assert "rank 1: first suspicious step 10" in verdict.describe()
    assert not Verdict(RuleSettings("msprobe"), [quiet]).suspicious


@pytest.mark.parametrize("value", [1.5, -0.1, True, "0.9", float("nan")])
def test_bad_threshold_is_refused(value):
    with pytest.raises(ValueError, match=r"drop_threshold = .* expected a number between 0 and 1"):
        check_thresholds(0.97, value)


def _judged_step_by_step(rank, steps, summary, parameters, omit_gaps=False, **thresholds):
    """Feeds the series to the live judge one step at a time, as a training run does; ``omit_gaps``: a parameter
    not compared at a step is left out of that step rather than given as None (steps laid out differently)."""
    judge = MsprobeJudge(rank, **thresholds)
    verdicts = [judge.judge(step, summary[j], {name: values[j] for name, values in parameters.items()
                                               if not (omit_gaps and values[j] is None)})
                for j, step in enumerate(steps)]
    fired = [v for v in verdicts if v is not None]
    assert len(fired) <= 1  # the verdict is given once
    return judge.verdict


def test_the_step_by_step_judge_gives_the_hand_checked_verdict():
    parameters = {"small.fall": [1.0, 0.99, 0.95, 0.95], "big.fall": [1.0, 0.99, 0.90, 0.5]}
    verdict = _judged_step_by_step(0, STEPS, [1.0, 0.995, 0.93, 0.7], parameters)
    assert verdict.first_suspicious_step == 10
    assert [t.name for t in verdict.parameter_trips] == ["big.fall", "small.fall"]
    assert _judged_step_by_step(0, STEPS, [1.0] * 4, {"w": [1.0] * 4}) is None


def _random_series(rng, length: int) -> list:
    """Similarities that mostly stay put, sometimes fall or recover, with gaps (None) and ties."""
    values, value = [], 1.0 if rng.random() < 0.8 else 0.96
    for _ in range(length):
        values.append(None if rng.random() < 0.15 else round(value, 3))
        value = float(np.clip(value + rng.choice([0.0, 0.0, 0.0, -0.01, -0.02, -0.031, -0.05, 0.04]), 0.0, 1.0))
    return values


@pytest.mark.parametrize("seed", range(40))
def test_the_step_by_step_judge_equals_judge_rank_on_the_same_series(seed):
    rng = np.random.default_rng(seed)
    steps = sorted(rng.choice(200, size=12, replace=False).tolist())
    parameters = {f"p{i}": _random_series(rng, len(steps)) for i in range(int(rng.integers(1, 6)))}
    summary = _random_series(rng, len(steps))
    thresholds = {"first_threshold": float(rng.choice([0.97, 0.95])),
                  "drop_threshold": float(rng.choice([0.03, 0.02, 0.05]))}
    batch = judge_rank(3, steps, summary, parameters, **thresholds)
    for omit_gaps in (False, True):
        live = _judged_step_by_step(3, steps, summary, parameters, omit_gaps, **thresholds)
        assert (live or RankVerdict(3)) == batch


@pytest.mark.parametrize("chunk_bytes", [3, 1 << 22])
def test_a_whole_step_compares_like_each_parameter_alone(monkeypatch, chunk_bytes):
    """Parameters of odd sizes (padding in their last byte, garbage there on one side), empty ones, a scalar."""
    monkeypatch.setattr(similarity_module, "CHUNK_BYTES", chunk_bytes)
    rng = np.random.default_rng(1)
    numels = [0, 13, 1, 0, 64, 5, 300, 0]
    a = [rng.random(n) > 0.5 for n in numels]
    b = [rng.random(n) > 0.5 for n in numels]
    bits_a = np.concatenate([packed(x) for x in a])
    bits_b = np.concatenate([packed(x) for x in b])
    bits_b[1] |= 0b00000111  # 13 elements: the second byte holds 3 padding bits
    assert agreeing_per_parameter(bits_a, bits_b, numels).tolist() == [int((x == y).sum()) for x, y in zip(a, b)]


@pytest.mark.parametrize("chunk_bytes", [3, 1 << 22])
def test_one_layout_compares_step_after_step_like_each_parameter_alone(monkeypatch, chunk_bytes):
    """The live verdict keeps one ``PackedLayout`` while the parameters stay the same: its cuts, owners and padding
    masks must serve every step, whatever the bits."""
    monkeypatch.setattr(similarity_module, "CHUNK_BYTES", chunk_bytes)
    rng = np.random.default_rng(2)
    numels = [7, 0, 16, 1, 33, 0, 9]
    layout = similarity_module.PackedLayout(numels)
    for _ in range(4):
        a = [rng.random(n) > 0.5 for n in numels]
        b = [rng.random(n) > 0.5 for n in numels]
        bits_a, bits_b = (np.concatenate([packed(x) for x in side]) for side in (a, b))
        bits_a[0] |= 0b00000001  # garbage in the first parameter's one padding bit
        assert layout.agreeing(bits_a, bits_b).tolist() == [int((x == y).sum()) for x, y in zip(a, b)]


@pytest.mark.parametrize("chunk_bytes", [3, 8, 24, 1 << 22])
@pytest.mark.parametrize("seed", range(4))
def test_counting_a_word_at_a_time_equals_each_element_for_any_cuts(monkeypatch, chunk_bytes, seed):
    """Bits are counted per 64-bit word: parameters that start and end anywhere in a word (several in one word,
    one across many words and chunks), with garbage in every padding bit, must count as element by element."""
    monkeypatch.setattr(similarity_module, "CHUNK_BYTES", chunk_bytes)
    rng = np.random.default_rng(seed)
    numels = rng.choice([0, 1, 3, 8, 9, 17, 63, 64, 65, 200, 1000], size=40).tolist()
    a = [rng.random(n) > 0.5 for n in numels]
    b = [rng.random(n) > 0.5 for n in numels]
    bits_a, bits_b = (np.concatenate([packed(x) for x in side] + [np.zeros(0, np.uint8)]) for side in (a, b))
    end = 0
    for n in numels:  # set every padding bit on one side
        end += -(-n // 8)
        if n % 8:
            bits_b[end - 1] |= 0xFF >> (n % 8)
    assert similarity_module.PackedLayout(numels).agreeing(bits_a, bits_b).tolist() == [
        int((x == y).sum()) for x, y in zip(a, b)]
