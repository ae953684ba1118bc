"""The judge of each rule (see ``compare/verdict.py``): the one place that knows both."""
from __future__ import annotations

from msprobe_mlflow.compare.noise_rule import NoiseAwareJudge
from msprobe_mlflow.compare.verdict import MsprobeJudge, RuleSettings


def judge_for(settings: RuleSettings, rank: int):
    """A fresh judge of ``settings.rule`` for one rank: ``judge_step(comparison)`` per compared step (ascending),
    ``verdict`` once a step is suspicious, ``finish()`` once the steps end (a verdict it held back, or None),
    ``report()`` for the rank's verdict."""
    if settings.rule == "msprobe":
        return MsprobeJudge(rank, settings.first_threshold, settings.drop_threshold)
    return NoiseAwareJudge(rank, settings.precision)
