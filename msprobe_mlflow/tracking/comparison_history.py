"""A comparison run read back: its verdict as ``compare`` printed it, and every comparison of a pair, newest first
(``msprobe-mlflow show``)."""
from __future__ import annotations

import os

from mlflow.entities import Run, ViewType
from mlflow.tracking import MlflowClient

from msprobe_mlflow.tracking.comparison_run import pair_key, pair_search, resolve_source
from msprobe_mlflow.tracking.run_dump import get_run
from msprobe_mlflow.tracking.server import require_existing_store
from msprobe_mlflow.vocabulary import (DESCRIPTION_TAG, FIRST_SUSPICIOUS_STEP_TAG, GRADE_TAG, LOCATE_RUN_TAG, PAIR_TAG,
                                       VERDICT_TAG)

_FENCE = "```text\n"


def comparison_run(client: MlflowClient, run_id: str) -> Run:
    """The run, refused when it is no comparison run (it has no pair key)."""
    run = get_run(client, run_id, f"run {run_id!r}")
    if PAIR_TAG not in run.data.tags:
        raise ValueError(f"run {run_id} is not a comparison run (no tag {PAIR_TAG}); give the comparison run's ID, "
                         f"or the two compared runs to list their comparisons")
    return run


def printed_verdict(client: MlflowClient, run: Run) -> str:
    """The verdict and table as ``compare`` printed them (from the run's description), and the operator, if
    ``locate`` named one."""
    description = run.data.tags.get(DESCRIPTION_TAG, "")
    printed = description.split(_FENCE, 1)[1].rsplit("```", 1)[0].rstrip() if _FENCE in description else description
    located = run.data.tags.get(LOCATE_RUN_TAG)
    if located:
        finding = client.get_run(located).data.tags.get(DESCRIPTION_TAG, "").split("\n", 1)[0].strip("*")
        printed += f"\n\noperator (locate run {located}): {finding}"
    return printed


def comparisons_of(client: MlflowClient, a: str | os.PathLike, b: str | os.PathLike) -> list[Run]:
    """Every comparison run of the ordered pair (A, B), newest first, in every active experiment."""
    sources = [resolve_source(given, side, lambda *_: client) for given, side in ((a, "A"), (b, "B"))]
    experiments = [e.experiment_id for e in client.search_experiments(view_type=ViewType.ACTIVE_ONLY)]
    return client.search_runs(experiments, filter_string=pair_search(pair_key(sources)),
                              order_by=["attributes.start_time DESC"], max_results=1000)


def comparison_line(run: Run) -> str:
    """One line per comparison: its ID, when, its verdict, first suspicious step and grade."""
    tags = run.data.tags
    step = tags.get(FIRST_SUSPICIOUS_STEP_TAG)
    verdict = tags.get(VERDICT_TAG, "no verdict") + (f" from step {step}" if step else "") + \
        (f" ({tags[GRADE_TAG]})" if GRADE_TAG in tags else "")
    return f"{run.info.run_id}  {run.info.run_name}  {verdict}"


def show_comparison(run_id: str, tracking_uri: str | None = None) -> str:
    """What ``msprobe-mlflow show RUN`` prints."""
    require_existing_store(tracking_uri, f"run {run_id!r}")
    client = MlflowClient(tracking_uri)
    return printed_verdict(client, comparison_run(client, run_id))


def list_comparisons(a: str | os.PathLike, b: str | os.PathLike, tracking_uri: str | None = None) -> list[str]:
    """What ``msprobe-mlflow show A B`` prints: a line per comparison of the pair, newest first."""
    require_existing_store(tracking_uri, f"A = {str(a)!r}")
    return [comparison_line(run) for run in comparisons_of(MlflowClient(tracking_uri), a, b)]
