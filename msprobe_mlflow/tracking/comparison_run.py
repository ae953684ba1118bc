"""``compare_runs``: compare two monitored runs (or dump folders) and log the result as a new MLflow run.

The comparison run (default experiment: the first source run's) is named by its sources, ``<a> vs <b>`` (each
the source run's name, or the folder's), so that it reads as a comparison among training runs; its verdict is a tag
the runs table can show as a column, sort and search. It holds:

- tags ``msprobe_mlflow.compare.run_a`` / ``run_b`` (source run IDs) and ``dump_path_a`` / ``dump_path_b`` (source
  folders), ``msprobe_mlflow.compare.pair`` (a stable key of the ordered pair: every comparison of the same A and B
  carries the same one) and, when the experiment holds an earlier comparison of that pair,
  ``msprobe_mlflow.compare.previous_run`` (the latest one's ID, also linked from the description: repeated
  comparisons are new runs, linked, never overwritten), ``msprobe_mlflow.compare.verdict`` (``suspicious`` or
  ``consistent``), ``...grade`` (the noise rule's ``break`` or ``departure``), ``...partial`` (where part of
  either model, or a damaged step, was not compared), ``...skipped_damaged`` (``rank{R} step{S}: file`` of each
  damaged step left out by ``skip_damaged``), ``...statistics_missing`` (``rank{R} step{S}: file`` of each step
  compared on its signs only, its summary CSV absent), ``...rule`` (which rule judged),
  ``msprobe_mlflow.compare.first_suspicious_step`` and per rank ``...rank{R}.first_suspicious_step``,
  ``...rank{R}.suspicious_parameters`` and ``...rank{R}.sign_noise``; as the run's description (Markdown), the
  verdict in one line, links to both sources, and the printed verdict and table in a fenced block;
- params ``rule`` (and msprobe's rule's ``first_threshold``, ``drop_threshold``; the noise rule's ``precision``
  when given, else ``recorded_precision`` where it judged the first steps at what both runs recorded);
- metrics ``summary_similarity/rank{R}`` whose MLflow step is the training step (the UI draws the curve), and
  ``verdict/suspicious``, ``verdict/first_suspicious_step``, ``verdict/rank{R}/first_suspicious_step``,
  ``verdict/rank{R}/suspicious_parameters`` (a count);
- artifacts ``grad_compare/``: ``rank{R}/similarities.csv``, ``rank{R}/similarities_picture/*.png``,
  ``verdict.json``.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from mlflow.entities import Metric, Run, RunTag
from mlflow.tracking import MlflowClient

from msprobe_mlflow import __version__
from msprobe_mlflow.compare.engine import CompareInputError, DumpComparison, compare_dumps, direction_steps
from msprobe_mlflow.compare.pairing import name_map_from
from msprobe_mlflow.compare.verdict import (BREAK, DEFAULT_RULE, DEPARTURE, RuleSettings, Verdict, culprit_text,
                                            rule_settings, summary_numbers, trip_numbers)
from msprobe_mlflow.dump import dump_folder, indexed_children
from msprobe_mlflow.localization import locate_hint
from msprobe_mlflow.vocabulary import (COMPARE_ARTIFACT_ROOT, DESCRIPTION_TAG, FIRST_SUSPICIOUS_STEP_TAG, GRADE_TAG,
                                       PAIR_TAG, PARTIAL_TAG, PREVIOUS_TAG, RULE_TAG, SKIPPED_TAG, SOURCE_NAME_TAG,
                                       STATISTICS_MISSING_TAG, VERDICT_TAG, VERSION_TAG, compare_rank_tag,
                                       exponent_shift_key, source_dump_path_tag, source_run_tag,
                                       summary_similarity_key, verdict_key)
from msprobe_mlflow.tracking.experiments import MODEL_TRAINING_VIEW, experiment_id_for, run_page_link, run_page_url
from msprobe_mlflow.tracking.run_dump import RunDumpListing, fetch_run_dump, get_run, list_run_dump
from msprobe_mlflow.tracking.runs import MAX_TAG_VAL_LENGTH, clipped, created_run, log_batched, now_ms, param, tag
from msprobe_mlflow.tracking.server import require_existing_store
from msprobe_mlflow.tracking.upload import close_abandoned_run


@dataclass
class RunComparison:
    """What ``compare_runs`` returns: the comparison run (None with ``log_run=False``), the verdict, the full
    result (series per rank and parameter) and where the run lives."""

    run_id: str | None
    verdict: Verdict
    comparison: DumpComparison
    experiment_id: str | None = None
    tracking_uri: str | None = None
    pair: str | None = None  # the PAIR_TAG value: every comparison of the same A and B has it
    previous_run_id: str | None = None  # the latest earlier comparison of the pair in the experiment, if any

    def to_dataframe(self):
        """:meth:`DumpComparison.to_dataframe`: the similarities per rank, step and parameter."""
        return self.comparison.to_dataframe()

    def trips_dataframe(self):
        """:meth:`DumpComparison.trips_dataframe`: the verdict's trips (reason, score, similarity, grade)."""
        return self.comparison.trips_dataframe()

    def run_url(self) -> str | None:
        """The run's page when the store is a server, else None (open it with ``mlflow ui``)."""
        if self.run_id and self.tracking_uri and self.tracking_uri.startswith(("http://", "https://")):
            return run_page_url(self.tracking_uri, self.experiment_id, self.run_id)
        return None



@dataclass
class ComparisonSource:
    """One side of a comparison: a local dump folder, or a run logged by the monitor."""

    given: str
    folder: Path | None = None
    listing: RunDumpListing | None = None

    @property
    def run_id(self) -> str | None:
        return self.listing.run_id if self.listing else None

    @property
    def identity(self) -> str:
        """What stays the same however the source is given: the run ID, or the folder's absolute path."""
        return f"run:{self.run_id}" if self.listing else f"folder:{self.folder.resolve()}"

    @property
    def label(self) -> str:
        """A short name for the run name: the run's name, else the folder's."""
        if self.listing:
            return self.listing.run.info.run_name or self.listing.run_id[:8]
        return self.folder.resolve().name

    def steps(self, side: str) -> dict[int, list[int]]:
        """Rank -> steps holding directions."""
        if self.listing:
            return self.listing.steps
        return {rank: direction_steps(self.folder, rank, side) for rank in indexed_children(self.folder, "rank")}


def _looks_like_a_path(given: str) -> bool:
    """Run IDs are plain tokens; anything with a separator, a leading dot or tilde, is a mistyped folder."""
    return any(mark in given for mark in ("/", "\\", os.sep)) or given.startswith((".", "~")) or not given


class LazyClient:
    """The one MLflow client of a command, made when first needed: ``client(reading)`` with ``reading`` naming a
    run to read requires the local store to exist (opening a missing one would make an empty store)."""

    def __init__(self, tracking_uri: str | None):
        self.tracking_uri, self._client = tracking_uri, None

    def __call__(self, reading: str | None = None) -> MlflowClient:
        if self._client is None:
            if reading is not None:
                require_existing_store(self.tracking_uri, reading)
            self._client = MlflowClient(self.tracking_uri)
        return self._client

    @property
    def made(self) -> bool:
        return self._client is not None


def resolve_source(given: str | os.PathLike, side: str, client_factory) -> ComparisonSource:
    """A dump folder if something exists at ``given`` (a file is refused as such), else an MLflow run ID
    (``client_factory(label)`` is only called then)."""
    if Path(given).exists():
        return ComparisonSource(str(given), folder=dump_folder(given, side))
    if _looks_like_a_path(str(given)):
        raise CompareInputError(f"{side} = {str(given)!r}: no such folder; expected a grad_probe dump folder or "
                                f"an MLflow run ID")
    client = client_factory(f"{side} = {str(given)!r}")
    run = get_run(client, str(given), f"{side} = {str(given)!r}")
    closed = close_abandoned_run(client, run.info.run_id, run)  # a job that lost ranks left it RUNNING: end it
    if closed:
        warnings.warn(f"{side}: {closed}", stacklevel=2)
        run = client.get_run(run.info.run_id)  # as it is now: its ranks' new statuses
    return ComparisonSource(str(given), listing=list_run_dump(client, run))


def common_steps(source_a: ComparisonSource, source_b: ComparisonSource) -> dict[int, list[int]]:
    """Rank -> the steps both sides hold, refusing when a rank or its steps have nothing in common."""
    steps_a, steps_b = source_a.steps("A"), source_b.steps("B")
    ranks = sorted(set(steps_a) & set(steps_b))
    if not ranks:
        raise CompareInputError(f"no rank in both sources: A ({source_a.given}) has ranks {sorted(steps_a)}, "
                                f"B ({source_b.given}) has {sorted(steps_b)}")
    common = {}
    for rank in ranks:
        common[rank] = sorted(set(steps_a[rank]) & set(steps_b[rank]))
        if not common[rank]:
            raise CompareInputError(f"rank{rank}: no step in both sources (A has steps {steps_a[rank]}, B has "
                                    f"{steps_b[rank]})")
    return common


def local_dumps(source_a: ComparisonSource, source_b: ComparisonSource, client_factory,
                cache_dir: str | os.PathLike | None = None, progress: bool | None = None) -> tuple[Path, Path]:
    """Both sides as local folders: runs are read in place or downloaded (the common ranks and steps only)."""
    steps = common_steps(source_a, source_b)
    folders = []
    for source in (source_a, source_b):
        if source.folder is not None:
            folders.append(source.folder)
        else:
            folders.append(fetch_run_dump(client_factory(), source.listing, steps, cache_dir, progress))
    return folders[0], folders[1]


def _experiment_id(client: MlflowClient, experiment: str | None, sources: list[ComparisonSource]) -> str:
    if not experiment:
        for source in sources:
            if source.listing:
                return source.listing.run.info.experiment_id
    return experiment_id_for(client, experiment)


def pair_key(sources: list[ComparisonSource]) -> str:
    """The ordered pair's key (``PAIR_TAG``): 16 hex digits of the SHA-256 of both sources' identities, short
    enough to read in a table and to paste into a search."""
    return hashlib.sha256("\n".join(source.identity for source in sources).encode()).hexdigest()[:16]


def pair_search(pair: str) -> str:
    """The search (the runs table's search box, ``search_runs``' filter) for every comparison of ``pair``."""
    return f"tags.{PAIR_TAG} = '{pair}'"


def previous_comparison(client: MlflowClient, experiment_id: str, pair: str) -> Run | None:
    """The latest comparison run of ``pair`` in the experiment, if any."""
    runs = client.search_runs([experiment_id], filter_string=pair_search(pair), max_results=1,
                              order_by=["attributes.start_time DESC"])
    return runs[0] if runs else None


def experiment_search_link(experiment_id: str, search: str) -> str:
    """The experiment's runs table with ``search`` in its search box, relative to any page of the same MLflow UI."""
    return f"#/experiments/{experiment_id}/runs?searchFilter={quote(search)}&{MODEL_TRAINING_VIEW}"


def _headline(verdict: Verdict) -> str:
    """The verdict in one Markdown line: where the runs part and on what evidence, or that they do not."""
    if not verdict.suspicious:
        ranks_word = "ranks" if len(verdict.ranks) > 1 else "rank"
        noise = sorted({n.name for rank in verdict.ranks for n in rank.sign_noise})
        noise_text = f"; sign is noise in {len(noise)} parameter(s): {', '.join(noise[:3])}" if noise else ""
        blind = max((rank.sensitivity for rank in verdict.ranks if rank.sensitivity), default=None,
                    key=lambda seen: seen.median)  # the rank that could see least
        blind_text = f"; {blind.headline()}" if blind else ""
        verdict_word = f"**Consistent where compared** ({verdict.partial})" if verdict.partial else "**Consistent**"
        return (f"{verdict_word}: no suspicious step on {len(verdict.ranks)} {ranks_word} "
                f"({verdict.settings.describe()}){blind_text}{noise_text}")
    step = verdict.first_suspicious_step
    ranks = [rank for rank in verdict.ranks if rank.first_suspicious_step == step]
    where = ", ".join(str(rank.rank) for rank in ranks)
    summary = ranks[0].summary_trip
    details = [f"summary {summary_numbers(summary)}"] if summary else []
    trips = [trip for rank in ranks for trip in rank.parameter_trips]  # each rank's, most evidence first
    if trips:
        more = f", and {len(trips) - 1} more parameters" if len(trips) > 1 else ""
        details.append(f"{trips[0].name} {trip_numbers(trips[0])}{more}")
    ranks_word = "ranks" if len(ranks) > 1 else "rank"
    partial = f" ({verdict.partial})" if verdict.partial else ""
    graded = {BREAK: "**Break**", DEPARTURE: "**Departure**"}.get(verdict.grade, "**Suspicious**")
    if verdict.grade:
        details.insert(0, ranks[0].evidence)
    return (f"{graded}{partial}: the runs part at step {step} on {ranks_word} {where} ({'; '.join(details)}) "
            f"[{verdict.rule} rule]")


def _first_steps_line(verdict: Verdict) -> str | None:
    """The largest first-steps difference beyond float32 rounding over the ranks (see ``FirstSteps``), short enough
    to be read beside the headline without scrolling."""
    first = max((rank.first_steps for rank in verdict.ranks if rank.first_steps), default=None,
                key=lambda found: found.difference)
    if first is None:
        return None
    found = (f"**First steps** beyond float32 rounding: `{first.name}` {first.difference:.2%} at step {first.step}, "
             f"within {first.finest}'s; ")
    if first.sixteen_bit is None:
        return found + "if both runs compute in float32, use `--precision float32`"
    return found + (f"run {first.sixteen_bit} has {first.sixteen_bit_parameters} gradient(s) in a 16-bit format "
                    f"(`{first.sixteen_bit_example}`): if by a cast, not autocast, use `--precision float32`")


def _description(comparison: DumpComparison, sources: list[ComparisonSource], previous: Run | None = None) -> str:
    """The run's description in the UI (Markdown): the verdict in one line (and what the first steps allow, where
    the pair's precision was neither given nor recorded), links to both sources (and to the previous comparison of
    the pair), then the printed verdict and table in a fenced block, which keeps its columns aligned (cut to fit
    MLflow's limit)."""
    first_steps = _first_steps_line(comparison.verdict)
    lines = [_headline(comparison.verdict), "", *([first_steps, ""] if first_steps else [])]
    for side, source in zip("AB", sources):
        if source.run_id:
            link = run_page_link(source.listing.run.info.experiment_id, source.run_id)
            lines.append(f"- {side}: [{source.label}]({link}) `{source.run_id}`")
        else:
            lines.append(f"- {side}: `{source.folder.resolve()}`")
    if previous is not None:
        experiment_id, pair = previous.info.experiment_id, previous.data.tags[PAIR_TAG]
        lines.append(f"- previous comparison of this pair: [{previous.info.run_name}]"
                     f"({run_page_link(experiment_id, previous.info.run_id)}) "
                     f"({previous.data.tags.get(VERDICT_TAG, 'no verdict')}); "
                     f"[all of them]({experiment_search_link(experiment_id, pair_search(pair))})")
    head = "\n".join([*lines, "", "```text", ""])
    hint = locate_hint(*(source.run_id or str(source.folder.resolve()) for source in sources), comparison.verdict)
    printed = "\n\n".join(filter(None, (comparison.verdict.describe(), hint, comparison.table())))
    return f"{head}{clipped(printed, MAX_TAG_VAL_LENGTH - len(head) - 4)}\n```"


def _tags(comparison: DumpComparison, sources: list[ComparisonSource], pair: str,
          previous: Run | None) -> list[RunTag]:
    verdict = comparison.verdict
    tags = {SOURCE_NAME_TAG: "msprobe-mlflow compare", VERSION_TAG: __version__,
            DESCRIPTION_TAG: _description(comparison, sources, previous),
            VERDICT_TAG: "suspicious" if verdict.suspicious else "consistent",
            RULE_TAG: verdict.rule, PAIR_TAG: pair}
    if previous is not None:
        tags[PREVIOUS_TAG] = previous.info.run_id
    if verdict.partial:
        tags[PARTIAL_TAG] = verdict.partial
    skipped = [f"rank{r.rank} step{s.step}: {s.file}" for r in comparison.ranks for s in r.skipped_steps]
    if skipped:
        tags[SKIPPED_TAG] = clipped("; ".join(skipped), MAX_TAG_VAL_LENGTH)
    missing = [f"rank{r.rank} step{step}: {', '.join(files)}" for r in comparison.ranks
               for step, files in r.statistics_missing.items()]
    if missing:
        tags[STATISTICS_MISSING_TAG] = clipped("; ".join(missing), MAX_TAG_VAL_LENGTH)
    for side, source in zip("ab", sources):
        if source.run_id:
            tags[source_run_tag(side)] = source.run_id
        else:
            tags[source_dump_path_tag(side)] = str(source.folder.resolve())
    if verdict.suspicious:
        tags[FIRST_SUSPICIOUS_STEP_TAG] = str(verdict.first_suspicious_step)
    if verdict.grade:
        tags[GRADE_TAG] = verdict.grade
    for rank in verdict.ranks:
        if rank.suspicious:
            tags[compare_rank_tag(rank.rank, "first_suspicious_step")] = str(rank.first_suspicious_step)
            names = ", ".join(culprit_text(t) for t in rank.parameter_trips)
            tags[compare_rank_tag(rank.rank, "suspicious_parameters")] = names
        if rank.sign_noise:
            tags[compare_rank_tag(rank.rank, "sign_noise")] = ", ".join(n.name for n in rank.sign_noise)
    for rank in comparison.ranks:
        if (move := rank.first_exponent_move) is not None:
            tags[compare_rank_tag(rank.rank, "exponents_moved")] = clipped(f"step {move.step}: {move.describe()}",
                                                                            MAX_TAG_VAL_LENGTH)
    return [tag(key, value) for key, value in tags.items()]


def _metrics(comparison: DumpComparison) -> list[Metric]:
    now = now_ms()
    verdict = comparison.verdict
    metrics = [Metric(summary_similarity_key(r.rank), value, now, step)
               for r in comparison.ranks for step, value in zip(r.steps, r.summary)]
    metrics += [Metric(exponent_shift_key(r.rank, name), value, now, shift.step) for r in comparison.ranks
                for shift in r.exponent_shifts
                for name, value in (("zero share", shift.zero_share), ("binades", shift.binades))]
    metrics.append(Metric(verdict_key("suspicious"), float(verdict.suspicious), now, 0))
    if verdict.suspicious:
        metrics.append(Metric(verdict_key("first_suspicious_step"), float(verdict.first_suspicious_step), now, 0))
    for rank in verdict.ranks:
        if rank.suspicious:
            metrics.append(Metric(verdict_key("first_suspicious_step", rank.rank),
                                  float(rank.first_suspicious_step), now, 0))
        metrics.append(Metric(verdict_key("suspicious_parameters", rank.rank),
                              float(len(rank.parameter_trips)), now, 0))
    return metrics


def _verdict_first(verdict: Verdict) -> str:
    """What differs between comparisons of one pair, first in the run's name (the runs table cuts names short):
    ``break at step 120``, ``departure at step 40``, ``suspicious at step 3`` (msprobe's rule), ``consistent``."""
    if not verdict.suspicious:
        return "consistent"
    return f"{verdict.grade or 'suspicious'} at step {verdict.first_suspicious_step}"


def log_comparison_run(client: MlflowClient, comparison: DumpComparison, sources: list[ComparisonSource],
                       experiment: str | None = None, run_name: str | None = None) -> tuple[str, str, Run | None]:
    """Creates the comparison run, linked to the latest earlier comparison of the same pair in its experiment, and
    logs tags, params, metrics and the output folder; returns its run and experiment IDs and that earlier run."""
    experiment_id = _experiment_id(client, experiment, sources)
    pair = pair_key(sources)
    previous = previous_comparison(client, experiment_id, pair)
    run_name = run_name or f"{_verdict_first(comparison.verdict)}: {sources[0].label} vs {sources[1].label}"
    with created_run(client, experiment_id, run_name=run_name) as run_id:
        verdict = comparison.verdict
        recorded = sorted({rank.recorded_precision for rank in verdict.ranks} - {None})
        params = {**verdict.settings.to_dict(), **({"recorded_precision": ", ".join(recorded)} if recorded else {})}
        log_batched(client, run_id, metrics=_metrics(comparison), tags=_tags(comparison, sources, pair, previous),
                    params=[param(key, value) for key, value in params.items()])
        if comparison.output_dir is not None:
            client.log_artifacts(run_id, str(comparison.output_dir), COMPARE_ARTIFACT_ROOT)
    return run_id, experiment_id, previous


def compare_runs(run_a: str | os.PathLike, run_b: str | os.PathLike, tracking_uri: str | None = None,
                 experiment: str | None = None, run_name: str | None = None,
                 first_threshold: float | None = None, drop_threshold: float | None = None,
                 output_dir: str | os.PathLike | None = None, *, rule: str | RuleSettings = DEFAULT_RULE,
                 precision: str | None = None, plots: bool = True, per_param_plots: bool = False,
                 cache_dir: str | os.PathLike | None = None, log_run: bool = True,
                 progress: bool | None = None,
                 name_map: dict[str, str] | str | os.PathLike | None = None,
                 skip_damaged: bool = False) -> RunComparison:
    """Compares two sources (each an MLflow run ID or a dump folder) and logs a comparison run.

    ``tracking_uri`` None: the active one (``mlflow.set_tracking_uri`` / ``MLFLOW_TRACKING_URI``). Runs on a
    tracking server are downloaded only for the ranks and steps both sides hold, cached under ``cache_dir``
    (default ``~/.cache/msprobe-mlflow/runs``). ``output_dir`` None: the local outputs go to a temporary folder,
    removed once logged. ``log_run=False`` writes the local outputs only (``run_id`` is then None). ``rule``:
    ``"noise"`` (the default, with ``precision`` as :func:`~msprobe_mlflow.compare.engine.compare_dumps` takes it)
    or ``"msprobe"`` (with ``first_threshold`` and ``drop_threshold``), see ``compare/verdict.py``; or the rule with
    its settings as one :class:`~msprobe_mlflow.compare.verdict.RuleSettings`. ``name_map``:
    name in A -> name in B (or a JSON file of them) for parameters the automatic pairing does not find.
    ``skip_damaged``: a step with a damaged file is left out and listed (tag ``...skipped_damaged``) instead of
    stopping the comparison.
    """
    settings = rule_settings(rule, first_threshold, drop_threshold, precision)  # refused before any reading
    name_map = name_map_from(name_map)
    client_factory = LazyClient(tracking_uri)
    sources = [resolve_source(run_a, "A", client_factory), resolve_source(run_b, "B", client_factory)]
    folder_a, folder_b = local_dumps(*sources, client_factory, cache_dir, progress)
    scratch = None
    if output_dir is None and log_run:
        scratch = Path(tempfile.mkdtemp(prefix="msprobe-compare-"))
        output_dir = scratch / COMPARE_ARTIFACT_ROOT
    try:
        comparison = compare_dumps(folder_a, folder_b, output_dir, rule=settings, plots=plots,
                                   per_param_plots=per_param_plots, progress=progress, name_map=name_map,
                                   skip_damaged=skip_damaged, runs=(sources[0].run_id, sources[1].run_id))
        run_id = experiment_id = previous = None
        if log_run:
            run_id, experiment_id, previous = log_comparison_run(client_factory(), comparison, sources, experiment,
                                                                 run_name)
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    if scratch is not None:
        comparison.output_dir = None  # logged, then removed
    return RunComparison(run_id, comparison.verdict, comparison, experiment_id,
                         client_factory().tracking_uri if log_run else None, pair_key(sources),
                         previous.info.run_id if previous else None)
