"""Everything that talks to MLflow: the per-step sink, autolog, uploads of dumps, comparison and API-check runs.

Artifact layout of a monitored run: ``grad_probe/`` mirrors the local dump (``grad_probe/rank{R}/grad_summary_{S}.csv``,
``grad_probe/rank{R}/step{S}/directions.npz``) plus ``grad_probe/config.json``.
"""
ARTIFACT_ROOT = "grad_probe"
TAG_PREFIX = "msprobe_mlflow."
TAG_RANGES_LIMIT = 4000  # characters of a tag listing steps or ranks (``dump.step_ranges``); MLflow holds 8000

# A rank's status (tag ``msprobe_mlflow.rank{R}.status``): ``running`` from the start, then what the rank says of its
# own end (finished; incomplete: steps in the local dump only; failed: its training raised; killed: SIGTERM or
# Ctrl-C), or ``missing``: rank 0 (or a later ``upload``) found that it never said.
RANK_ENDINGS = ("finished", "incomplete", "failed", "killed")
RANK_FAILURES = ("failed", "killed")
FAILED_RANKS_TAG = f"{TAG_PREFIX}failed_ranks"  # the ranks whose training failed or was killed; the run is FAILED
MISSING_RANKS_TAG = f"{TAG_PREFIX}missing_ranks"  # the ranks that never said how they ended

# What the live sinks find, by kind: the tag of the parameters it names (``first_{kind}_step`` holds the step).
FINDING_KINDS = {"suspicious": "suspicious_parameters", "nonfinite": "nonfinite_parameters",
                 "spike": "spike_parameters"}


def finding_tags(kind: str, rank: int, step: int, parameters: str, several_ranks: bool) -> dict[str, str]:
    """A rank's first finding of ``kind``: the run-level tags and, with ``several_ranks``, the same under
    ``rank{R}.``, so that the run end can set the run-level ones to the earliest rank's (:func:`earliest_findings`)."""
    tags = {}
    for prefix in (TAG_PREFIX, f"{TAG_PREFIX}rank{rank}.")[:2 if several_ranks else 1]:
        tags[f"{prefix}first_{kind}_step"] = str(step)
        tags[f"{prefix}{FINDING_KINDS[kind]}"] = parameters
    return tags


def earliest_findings(run_tags: dict[str, str], ranks: list[int]) -> dict[str, str]:
    """The run-level finding tags as the earliest step over ``ranks`` (the lowest rank on a tie), from their
    ``rank{R}.`` tags; kinds no rank found are left out."""
    tags = {}
    for kind, parameters_tag in FINDING_KINDS.items():
        found = [(int(run_tags[f"{TAG_PREFIX}rank{r}.first_{kind}_step"]), r) for r in ranks
                 if f"{TAG_PREFIX}rank{r}.first_{kind}_step" in run_tags]
        if found:
            step, rank = min(found)
            tags[f"{TAG_PREFIX}first_{kind}_step"] = str(step)
            tags[f"{TAG_PREFIX}{parameters_tag}"] = run_tags.get(f"{TAG_PREFIX}rank{rank}.{parameters_tag}", "")
    return tags
