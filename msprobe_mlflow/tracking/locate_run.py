"""``locate`` on runs: A and B may be MLflow run IDs (their traces are downloaded, or read in place), the step is
the pair's first suspicious step unless given, and the finding becomes a run nested under the pair's comparison
run (``locate step S rank R``: tags, metrics, ``locate/ops.csv``, ``locate/differences.png``), linked from the
comparison run's description."""
from __future__ import annotations

import math
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mlflow.entities import Metric, Run
from mlflow.tracking import MlflowClient

from msprobe_mlflow import __version__
from msprobe_mlflow.localization import OPERATOR, Localization, call_site, locate_traces
from msprobe_mlflow.localization.judge import rounding_reach
from msprobe_mlflow.localization.report import OPS_FILE, PLOT_FILE, plot_differences, write_ops_csv
from msprobe_mlflow.trace.files import TraceError, trace_folder, trace_root, traced_steps
from msprobe_mlflow.trace.options import TRACE_SAVE_VARIABLE, TRACE_STEPS_VARIABLE
from msprobe_mlflow.tracking.comparison_run import (LazyClient, compare_runs, pair_key, previous_comparison,
                                                   resolve_source)
from msprobe_mlflow.tracking.experiments import experiment_id_for, run_page_link
from msprobe_mlflow.tracking.run_dump import fetch_artifacts, get_run, local_artifact_dump, run_cache
from msprobe_mlflow.tracking.runs import MAX_TAG_VAL_LENGTH, clipped, created_run, log_batched, now_ms, tag
from msprobe_mlflow.vocabulary import (DESCRIPTION_TAG, LOCATE_ARTIFACT_ROOT, LOCATE_FINDING_TAG,
                                       LOCATE_RUN_TAG, PARENT_RUN_TAG, SOURCE_NAME_TAG, TRACE_FOLDER, VERSION_TAG,
                                       locate_metric, locate_tag, trace_artifact_folder)

if TYPE_CHECKING:
    from msprobe_mlflow.torch_kernels.operator_replay import SideError

_STEP_FOLDER = re.compile(r"step(\d+)$")
# The first line of a comparison run's description, once located (an operator, drift or a near tie); the label
# "**Operator**" of earlier versions is replaced too
_LOCATED_LINES = ("**Located**", "**Operator**")


@dataclass
class LocateResult:
    """What :func:`locate` returns: the finding, the step and rank it is of, and the runs it made."""
    localization: Localization
    step: int
    rank: int
    run_id: str | None = None  # the locate run (None: not logged)
    comparison_run_id: str | None = None  # the comparison run it is nested under, if any
    side: "SideError | None" = None  # each side's error against the float64 replay of the named call
    side_hint: str = ""  # how to learn which side is wrong, when the call's inputs were not saved

    def describe(self) -> str:
        found = self.localization
        if self.side is not None:
            return f"{found.describe()}; {self.side.describe(found.pair.call.name, found.module)}"
        return found.describe()


def locate(a: str | os.PathLike, b: str | os.PathLike, *, step: int | None = None, rank: int | None = None,
           tracking_uri: str | None = None, cache_dir: str | os.PathLike | None = None, log_run: bool = True,
           progress: bool | None = None) -> LocateResult:
    """Names the first operator of a traced step whose output differs beyond what its inputs and rounding explain
    (:func:`msprobe_mlflow.localization.locate_traces`). ``a`` and ``b``: MLflow run IDs, monitors' dump folders
    or trace folders. ``step`` None: the pair's first suspicious step, from a comparison of the two (logged as the
    pair's comparison run unless ``log_run=False``), or the one step both trace folders hold. ``log_run``: a run
    nested under the pair's comparison run, where there is a tracking store to log into (a run ID was given, or a
    comparison was logged). Where both traces saved the named call's inputs (``trace_save``), ``side`` holds each
    side's error against its float64 replay: which side is wrong."""
    clients = LazyClient(tracking_uri)
    runs = [_run_or_none(given, side, clients) for given, side in ((a, "A"), (b, "B"))]
    comparison_run_id = None
    if step is None and all(run is not None or _holds_gradients(given) for run, given in zip(runs, (a, b))):
        comparison = compare_runs(a, b, tracking_uri, cache_dir=cache_dir, log_run=log_run, progress=progress)
        verdict = comparison.verdict
        ranks = [r for r in verdict.ranks if r.suspicious and (rank is None or r.rank == rank)]
        if not ranks:
            raise ValueError(f"A and B agree at every compared step{'' if rank is None else f' of rank {rank}'} "
                             f"(verdict: consistent): nothing to locate; give --step S to compare a traced step "
                             f"anyway")
        first = min(ranks, key=lambda r: r.first_suspicious_step)
        step, rank = first.first_suspicious_step, first.rank
        comparison_run_id = comparison.run_id
        both = set.intersection(*(set(_traced_steps(given, run, rank, clients)) for given, run in zip((a, b), runs)))
        step = min((s for s in both if s >= step), default=step)  # trace_on_suspicious traced the step after
    folders = [_trace_root(given, side, run, step, rank, clients, cache_dir, progress)
               for given, side, run in zip((a, b), "AB", runs)]
    found = locate_traces(*folders, step=step, rank=rank)
    step, rank = _step_and_rank(found)
    result = LocateResult(found, step, rank, comparison_run_id=comparison_run_id)
    if found.kind == OPERATOR:
        result.side, result.side_hint = _which_side(found, step)
    if log_run and (clients.made or any(runs)):
        client = clients()
        if comparison_run_id is None:
            comparison_run_id = _latest_comparison(client, a, b, runs)
        result.run_id = log_locate_run(client, result, runs, comparison_run_id, (str(a), str(b)))
        result.comparison_run_id = comparison_run_id
    return result


def _which_side(found: Localization, step: int) -> tuple["SideError | None", str]:
    """Each side's error against the float64 replay of the named call, where both traces saved its inputs."""
    if found.pair.call.is_module:
        return None, ("which side is wrong: a module's backward across frameworks is not replayed; trace the step "
                      "on one framework on both devices to name the operator inside it and its side")
    names = dict.fromkeys((found.pair.a.name, found.pair.b.name))
    hint = (f"which side is wrong: rerun both trainings with {TRACE_STEPS_VARIABLE}={step} "
            f"{TRACE_SAVE_VARIABLE}={','.join(names)}")
    try:
        from msprobe_mlflow.torch_kernels.operator_replay import side_error
    except ModuleNotFoundError as e:  # a MindSpore-only install reading traces
        return None, f"which side is wrong needs torch to replay the call ({e})"
    side = side_error(Path(found.folders[0]), found.pair.a.name, Path(found.folders[1]), found.pair.b.name,
                      found.judgement.tolerance, *rounding_reach(found.pair.a, found.pair.b))
    return side, "" if side is not None else hint


def _run_or_none(given, side: str, clients: LazyClient) -> Run | None:
    if Path(given).exists():
        return None
    resolve_source(given, side, clients)  # refuses a mistyped folder, checks the store, names the side
    return get_run(clients(), str(given), f"{side} = {str(given)!r}")


def _holds_gradients(folder) -> bool:
    """A monitor's (or msprobe's grad_probe) dump: gradient steps to compare, not only traces."""
    return any(Path(folder).glob("rank*/grad_summary_*.csv"))


def _trace_root(given, side: str, run: Run | None, step: int | None, rank: int | None, clients: LazyClient,
                cache_dir, progress) -> Path:
    """The local folder holding ``step``'s trace of ``given`` (its ``step{S}/rank{R}/`` inside)."""
    if run is None:
        return trace_folder(given, step, rank)
    rank = 0 if rank is None else rank
    client, run_id = clients(), run.info.run_id
    relative = trace_artifact_folder(rank)
    steps = _traced_steps(given, run, rank, clients)
    if step is None and len(steps) == 1:
        step = steps[0]
    if step is None:
        raise TraceError(f"{side}: run {run_id} holds traces of steps {steps or 'none'} of rank {rank}: name one "
                         f"(--step)")
    if step not in steps:
        raise TraceError(f"{side}: run {run_id} has no trace of step {step} of rank {rank} (its traced steps: "
                         f"{steps or 'none'}); rerun that training with {TRACE_STEPS_VARIABLE}={step}")
    in_place = local_artifact_dump(run)
    if in_place is not None:
        return in_place / f"rank{rank}" / TRACE_FOLDER
    wanted_files = _files_below(client, run_id, f"{relative}/step{step}/rank{rank}")
    return fetch_artifacts(client, run_id, run_cache(client, run_id, cache_dir), wanted_files, progress) / \
        f"rank{rank}" / TRACE_FOLDER


def _files_below(client: MlflowClient, run_id: str, folder: str) -> list[tuple[str, int | None]]:
    files = []
    for entry in client.list_artifacts(run_id, folder):
        files += _files_below(client, run_id, entry.path) if entry.is_dir else [(entry.path, entry.file_size)]
    return files


def _traced_steps(given, run: Run | None, rank: int, clients: LazyClient) -> list[int]:
    if run is None:
        return traced_steps(trace_root(given, rank))
    return sorted(int(m.group(1)) for e in clients().list_artifacts(run.info.run_id, trace_artifact_folder(rank))
                  if e.is_dir and (m := _STEP_FOLDER.search(e.path)))


def _step_and_rank(found: Localization) -> tuple[int, int]:
    """From the folder compared: ``.../step{S}/rank{R}`` (msprobe's ``rank`` without a number: 0)."""
    folder = Path(found.folders[0])
    step = _STEP_FOLDER.search(folder.parent.name)
    rank = folder.name.removeprefix("rank")
    return (int(step.group(1)) if step else -1), (int(rank) if rank.isdigit() else 0)


def _latest_comparison(client: MlflowClient, a, b, runs: list[Run | None]) -> str | None:
    """The pair's latest comparison run in A's experiment (runs only: folders have no experiment)."""
    if not all(runs):
        return None
    sources = [resolve_source(given, side, lambda *_: client) for given, side in ((a, "A"), (b, "B"))]
    previous = previous_comparison(client, runs[0].info.experiment_id, pair_key(sources))
    return previous.info.run_id if previous else None


def log_locate_run(client: MlflowClient, result: LocateResult, runs: list[Run | None], parent: str | None,
                   given: tuple[str, str]) -> str:
    """The locate run, nested under ``parent`` (the comparison run) when there is one, and the link to it from
    the parent's description."""
    found = result.localization
    if parent is not None:
        experiment_id = client.get_run(parent).info.experiment_id
    elif any(runs):
        experiment_id = next(run for run in runs if run).info.experiment_id
    else:
        experiment_id = experiment_id_for(client, None)
    tags = {SOURCE_NAME_TAG: "msprobe-mlflow locate", VERSION_TAG: __version__, LOCATE_FINDING_TAG: found.kind,
            locate_tag("step"): str(result.step), locate_tag("rank"): str(result.rank),
            DESCRIPTION_TAG: clipped(_description(result, given), MAX_TAG_VAL_LENGTH)}
    if parent is not None:
        tags[PARENT_RUN_TAG] = parent
    if found.pair is not None:
        call = found.pair.call
        tags.update({locate_tag("operator"): call.name, locate_tag("module"): found.module or "(none)",
                     locate_tag("phase"): call.phase})
        if call_site(call):
            tags[locate_tag("call_site")] = call_site(call)
    metrics = []
    values = {}
    if found.judgement is not None:
        values = {"input_difference": found.judgement.input_difference,
                  "output_difference": found.judgement.output_difference, "tolerance": found.judgement.tolerance}
    if result.side is not None:
        values.update({f"error_{side}": error for side, error in (("a", result.side.error_a),
                                                                  ("b", result.side.error_b)) if error is not None})
        tags[locate_tag("side")] = result.side.wrong or "neither"
    now = now_ms()
    metrics = [Metric(locate_metric(name), value, now, result.step) for name, value in values.items()
               if math.isfinite(value)]
    with created_run(client, experiment_id, run_name=f"locate step {result.step} rank {result.rank}") as run_id:
        log_batched(client, run_id, metrics=metrics, tags=[tag(k, v) for k, v in tags.items()])
        with tempfile.TemporaryDirectory(prefix="msprobe-locate-") as scratch:
            folder = Path(scratch) / LOCATE_ARTIFACT_ROOT
            write_ops_csv(found, folder / OPS_FILE)
            plot_differences(found, folder / PLOT_FILE)
            client.log_artifacts(run_id, str(folder), LOCATE_ARTIFACT_ROOT)
    if parent is not None:
        _link_from(client, parent, experiment_id, run_id, result)
    return run_id


def _description(result: LocateResult, given: tuple[str, str]) -> str:
    hint = f"\n- {result.side_hint}" if result.side_hint else ""
    return (f"**{result.describe()}**\n\n- step {result.step}, rank {result.rank}{hint}\n- A: `{given[0]}`\n"
            f"- B: `{given[1]}`\n- every aligned call: `{LOCATE_ARTIFACT_ROOT}/{OPS_FILE}`; the differences along "
            f"the execution order: `{LOCATE_ARTIFACT_ROOT}/{PLOT_FILE}`")


def _link_from(client: MlflowClient, parent: str, experiment_id: str, run_id: str, result: LocateResult) -> None:
    """The comparison run's description gains a first line with the finding, linked to the locate run."""
    description = client.get_run(parent).data.tags.get(DESCRIPTION_TAG, "")
    if description.startswith(_LOCATED_LINES):  # an earlier locate's line: replaced
        description = description.split("\n\n", 1)[-1]
    link = run_page_link(experiment_id, run_id)
    line = f"{_LOCATED_LINES[0]} ([locate step {result.step} rank {result.rank}]({link})): {result.describe()}\n\n"
    client.set_tag(parent, DESCRIPTION_TAG, clipped(line + description, MAX_TAG_VAL_LENGTH))
    client.set_tag(parent, LOCATE_RUN_TAG, run_id)
