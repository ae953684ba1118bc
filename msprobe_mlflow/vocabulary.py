"""The run's vocabulary: the names the MLflow runs are written and read with (monitored, comparison and API-check
runs: tags, metric keys, rank statuses, artifact and dump folders), in one place at the bottom of the package, so
that the writers (the sinks, ``upload``, the monitors, ``compare``) and the readers (``compare``, ``read_statistics``)
cannot drift apart. Plain strings and string builders: it imports nothing of the package.

Artifact layout of a monitored run: ``grad_probe/`` mirrors the local dump (``grad_probe/rank{R}/grad_summary_{S}.csv``,
``grad_probe/rank{R}/step{S}/directions.npz``) plus ``grad_probe/config.json``; of a comparison run, ``grad_compare/``
holds the comparator's output folder (``rank{R}/similarities.csv``, plots, ``verdict.json``).

``tests/test_vocabulary.py`` fails on a tag, metric key or artifact name spelled anywhere else in the package.
"""
from __future__ import annotations

import os
import re

ARTIFACT_ROOT = "grad_probe"
CONFIG_FILE_NAME = "config.json"  # ``grad_probe/config.json``: msprobe's config the run was monitored with
COMPARE_ARTIFACT_ROOT = "grad_compare"
VERDICT_FILE_NAME = "verdict.json"  # the comparator's verdict: in ``grad_compare/``, and a live verdict's findings
TAG_PREFIX = "msprobe_mlflow."
TAG_RANGES_LIMIT = 4000  # characters of a tag listing steps or ranks (``dump.step_ranges``); MLflow holds 8000
NO_RUN = "no-run"  # the dump folder of a monitor that found no run, beside the ``{run_id}`` folders

# MLflow's own tags that we write or read.
MLFLOW_TAG_PREFIX = "mlflow."
DESCRIPTION_TAG = "mlflow.note.content"  # MLflow's run description, shown on the run page
SOURCE_NAME_TAG = "mlflow.source.name"  # what created the run: ``msprobe-mlflow upload``, ``compare``, ``api-check``
AUTOLOGGING_TAG = "mlflow.autologging"  # MLflow's tag on the runs its autologging starts
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"  # an experiment's: which view MLflow 3.7's UI opens it in

# A monitored run's tags, from the rank that owns it or from ``upload``; ``compare`` reads the level back.
FRAMEWORK_TAG = f"{TAG_PREFIX}framework"
LEVEL_TAG = f"{TAG_PREFIX}level"
VERSION_TAG = f"{TAG_PREFIX}version"  # msprobe-mlflow's version, on every run it creates
WORLD_SIZE_TAG = f"{TAG_PREFIX}world_size"
DUMP_PATH_TAG = f"{TAG_PREFIX}dump_path"  # the dump folder (each rank's own: ``rank_tag(R, "dump_path")``)

# A rank's status (tag ``msprobe_mlflow.rank{R}.status``): ``running`` from the start, then what the rank says of its
# own end (finished; incomplete: steps in the local dump only; failed: its training raised; killed: SIGTERM or
# Ctrl-C), or ``missing``: rank 0 (or a later ``upload``) found that it never said.
RUNNING, FINISHED, INCOMPLETE, FAILED, KILLED, MISSING = "running", "finished", "incomplete", "failed", "killed", \
    "missing"
RANK_ENDINGS = (FINISHED, INCOMPLETE, FAILED, KILLED)
RANK_FAILURES = (FAILED, KILLED)
FAILED_RANKS_TAG = f"{TAG_PREFIX}failed_ranks"  # the ranks whose training failed or was killed; the run is FAILED
MISSING_RANKS_TAG = f"{TAG_PREFIX}missing_ranks"  # the ranks that never said how they ended
# Under rank-0 aggregation each summary metric goes up as its distribution over the ranks (``tracking/aggregate.py``):
# ``grad/ranks/{metric} min``, ``median``, ``max``, ``min rank``, ``max rank``; the run's tag says so.
RANK_SUMMARY_TAG = f"{TAG_PREFIX}rank_summary"
OVER_RANKS = "distribution over ranks"  # its value for such a run (none: every rank's own keys)
UNSENT_DISTRIBUTION_STEPS_TAG = f"{TAG_PREFIX}unsent_distribution_steps"  # steps whose distribution rank 0 kept
MLFLOW_STEP_OFFSET_TAG = f"{TAG_PREFIX}mlflow_step_offset"  # added to the dump's steps for MLflow's
RECORDED_TAG = f"{TAG_PREFIX}gradients_recorded"  # what the recorded gradients are (before or after clipping)
FAILED_STEPS_TAG = f"{TAG_PREFIX}failed_steps"  # steps whose probe failed
TRACED_STEPS_TAG = f"{TAG_PREFIX}traced_steps"  # steps whose operator trace is in the run (``locate``)
TRACE_FOLDER = "trace"  # the operator traces: ``{dump_path}/rank{R}/trace/step{S}/rank{R}/``, mirrored in the run
TRAINING_ID_TAG = f"{TAG_PREFIX}training_id"  # the training whose dump the run holds (the dump's training ID)

# An API's status in an API check: msprobe's words, used as they are in the CSVs, the tags, the metrics and the CLI;
# and ours, ``out_of_memory``: not checked, this machine lacks the memory the call needs (never counted as an error).
PASS, ERROR, SKIP, OUT_OF_MEMORY = "pass", "error", "skip", "out_of_memory"
API_CHECK_STATUSES = (PASS, ERROR, SKIP, OUT_OF_MEMORY)

# The exponent pictures (``tracking/exponent_images.py``): MLflow's step-slider images, keyed
# ``gradient exponents/rank{R}/{panel}``, in MLflow's own ``images/`` folder; the summary figure in ``grad_probe/rank{R}/``.
EXPONENT_IMAGES_KEY = "gradient exponents"
MLFLOW_IMAGES_FOLDER = "images"
EXPONENT_SUMMARY_FILE_NAME = "gradient_exponents.png"

# An API check's run: its tags and the folder of its CSVs.
API_CHECK_TASK_TAG = f"{TAG_PREFIX}api_check.task"
ERROR_APIS_TAG = "error_apis"
API_CHECK_ARTIFACT_ROOT = "api_check"

# What the live sinks find, by kind: the tag of the parameters it names (``first_{kind}_step`` holds the step).
FINDING_KINDS = {"suspicious": "suspicious_parameters", "nonfinite": "nonfinite_parameters",
                 "spike": "spike_parameters", "lossy": "lossy_parameters"}

# The live verdict's tags (``sinks/baseline.py``), beside its finding tags of kind ``suspicious``.
BASELINE_TAG = f"{TAG_PREFIX}baseline"  # the baseline run ID or folder
LIVE_VERDICT_TAG = f"{TAG_PREFIX}live_verdict"  # suspicious, consistent or incomplete
LIVE_VERDICT_RULE_TAG = f"{TAG_PREFIX}live_verdict_rule"
LIVE_VERDICT_PRECISION_TAG = f"{TAG_PREFIX}live_verdict_precision"

# A comparison run's tags (``compare_runs``).
COMPARE_TAG_PREFIX = f"{TAG_PREFIX}compare."
VERDICT_TAG = f"{COMPARE_TAG_PREFIX}verdict"  # suspicious or consistent
RULE_TAG = f"{COMPARE_TAG_PREFIX}rule"  # which rule judged
GRADE_TAG = f"{COMPARE_TAG_PREFIX}grade"  # the noise rule's break or departure
PARTIAL_TAG = f"{COMPARE_TAG_PREFIX}partial"  # what was not compared
FIRST_SUSPICIOUS_STEP_TAG = f"{COMPARE_TAG_PREFIX}first_suspicious_step"
PAIR_TAG = f"{COMPARE_TAG_PREFIX}pair"  # the ordered pair's key: every comparison of the same A and B has it
PREVIOUS_TAG = f"{COMPARE_TAG_PREFIX}previous_run"  # the latest earlier comparison of the pair
SKIPPED_TAG = f"{COMPARE_TAG_PREFIX}skipped_damaged"
STATISTICS_MISSING_TAG = f"{COMPARE_TAG_PREFIX}statistics_missing"
LOCATE_RUN_TAG = f"{COMPARE_TAG_PREFIX}locate_run"  # on a comparison run: its latest locate run

# A locate run (nested under the pair's comparison run): the operator named, or "drift"/"identical".
PARENT_RUN_TAG = "mlflow.parentRunId"  # MLflow's: nests a run under another in the UI
LOCATE_ARTIFACT_ROOT = "locate"  # ``locate/ops.csv``, ``locate/differences.png``
LOCATE_TAG_PREFIX = f"{TAG_PREFIX}locate."
LOCATE_FINDING_TAG = f"{LOCATE_TAG_PREFIX}finding"  # operator, sequence, argument, drift or identical


def trace_artifact_folder(rank: int) -> str:
    """``grad_probe/rank{R}/trace``: a rank's operator traces in its run (``step{S}/rank{R}/`` below)."""
    return f"{ARTIFACT_ROOT}/rank{rank}/{TRACE_FOLDER}"


def locate_tag(field: str) -> str:
    """``msprobe_mlflow.locate.{field}``: step, rank, operator, module, phase, call_site."""
    return f"{LOCATE_TAG_PREFIX}{field}"


def locate_metric(field: str) -> str:
    """``locate/{field}``: input_difference, output_difference, tolerance (of the named call)."""
    return f"{LOCATE_ARTIFACT_ROOT}/{field}"


def source_run_tag(side: str) -> str:
    """``msprobe_mlflow.compare.run_a`` (side ``a`` or ``b``): a comparison's source run."""
    return f"{COMPARE_TAG_PREFIX}run_{side}"


def source_dump_path_tag(side: str) -> str:
    """``msprobe_mlflow.compare.dump_path_a``: a comparison's source folder, where it is not a run."""
    return f"{COMPARE_TAG_PREFIX}dump_path_{side}"


def compare_rank_tag(rank: int, name: str) -> str:
    """``msprobe_mlflow.compare.rank{R}.{name}``: what a comparison found on one rank."""
    return f"{COMPARE_TAG_PREFIX}rank{rank}.{name}"


def rank_tag(rank: int, name: str) -> str:
    """``msprobe_mlflow.rank{R}.{name}``: a tag one rank of a run owns."""
    return f"{TAG_PREFIX}rank{rank}.{name}"


def rank_status_tag(rank: int) -> str:
    """The tag holding how ``rank`` ended (``running`` until it says)."""
    return rank_tag(rank, "status")


def rank_failure_tag(rank: int) -> str:
    """The exception a failed rank's training raised, or the signal that ended a killed one."""
    return rank_tag(rank, "failure")


def unsent_steps_tag(rank: int) -> str:
    """The steps of an ``incomplete`` rank that are in the local dump only (``0-9,12``)."""
    return rank_tag(rank, "unsent_steps")


_RANK_STATUS_KEY = re.compile(re.escape(TAG_PREFIX) + r"rank(\d+)\.status")


def rank_statuses(tags: dict[str, str]) -> dict[int, str]:
    """Every rank's status in a run's tags, ``{rank: status}``."""
    return {int(match[1]): value for key, value in tags.items() if (match := _RANK_STATUS_KEY.fullmatch(key))}


def grad_key(rank: int, *parts: str) -> str:
    """``grad/rank{R}/...``: a gradient metric of one rank (``grad_key(0, "total_norm")``); no part: the prefix."""
    return "/".join((f"grad/rank{rank}", *parts)) if parts else f"grad/rank{rank}/"


RANK_DISTRIBUTION = ("min", "median", "max", "min rank", "max rank")


def distribution_key(suffix: str, statistic: str) -> str:
    """``grad/ranks/{suffix} {statistic}``: a summary metric's ``statistic`` (:data:`RANK_DISTRIBUTION`) over the
    ranks at a step (``distribution_key("total_norm", "max rank")``: the rank whose total norm is largest)."""
    return f"grad/ranks/{suffix} {statistic}"


def anomaly_key(rank: int, name: str) -> str:
    """``anomalies/rank{R}/{name}``: an anomaly-flag metric of one rank."""
    return f"anomalies/rank{rank}/{name}"


def summary_similarity_key(rank: int) -> str:
    """``summary_similarity/rank{R}``: a rank's summary similarity at each step, of a comparison run and of a live
    verdict alike."""
    return f"summary_similarity/rank{rank}"


def exponent_shift_key(rank: int, name: str) -> str:
    """``exponent_shift/rank{R}/{name}``: of a comparison run, how far B's gradients moved among the exponents at
    each step (``zero share`` and ``binades``, B's minus A's)."""
    return f"exponent_shift/rank{rank}/{name}"


def verdict_key(name: str, rank: int | None = None) -> str:
    """``verdict/{name}``, or one rank's ``verdict/rank{R}/{name}``: a comparison run's verdict as a metric."""
    return f"verdict/{name}" if rank is None else f"verdict/rank{rank}/{name}"


def run_dump_folder(dump_path: str, run_id: str | None) -> str:
    """A run's own dump folder under ``dump_path`` (autolog, callbacks): ``{dump_path}/{run_id}``, or ``no-run``."""
    return os.path.join(dump_path, run_id or NO_RUN)


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
        found = [(int(run_tags[rank_tag(r, f"first_{kind}_step")]), r) for r in ranks
                 if rank_tag(r, f"first_{kind}_step") in run_tags]
        if found:
            step, rank = min(found)
            tags[f"{TAG_PREFIX}first_{kind}_step"] = str(step)
            tags[f"{TAG_PREFIX}{parameters_tag}"] = run_tags.get(rank_tag(rank, parameters_tag), "")
    return tags
