"""A monitored run's dump as a local folder, for the comparator and :func:`read_statistics`.

The run's ``grad_probe/`` artifacts mirror the local dump. When the artifact store is a local folder (the embedded
SQLite/file store), the dump is read where it lies. Otherwise only the files asked for (the ranks and steps being
compared, or only the summary CSVs) are downloaded, in parallel, into a cache keyed by run ID
(``~/.cache/msprobe-mlflow/runs/<run_id>/``); a file already cached with the listed size is not fetched again. Each
destination is confined to the cache folder (``safe_paths.confined_path``) and written by rename, so an
interrupted download leaves no half file. Steps a run holds as ``steps_{ranges}.zip`` archives
(``archive_every_n_steps``) are always fetched into the cache and expanded there into the same layout.
"""
from __future__ import annotations

import os
import re
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urlparse

from mlflow.entities import Run
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from msprobe_mlflow.dump import (extract_steps_archive, parse_archive_name, parse_rank_folder, parse_step_folder,
                                 parse_summary_name, read_statistics_table, relative_rank_dir, relative_step_dir,
                                 relative_summary_path, step_dir)
from msprobe_mlflow.exponents import exponents_file_name
from msprobe_mlflow.levels import LEVELS
from msprobe_mlflow.progress import ProgressLine
from msprobe_mlflow.safe_paths import confined_path
from msprobe_mlflow.vocabulary import ARTIFACT_ROOT, LEVEL_TAG
from msprobe_mlflow.tracking.server import require_existing_store

DOWNLOAD_WORKERS = 8
_PLAIN_RUN_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # MLflow's are 32 hex digits; the cache folder is named by it


class RunDumpError(ValueError):
    """The run holds no comparable dump (no ``grad_probe/`` artifacts, or an L0 dump)."""


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "msprobe-mlflow" / "runs"


@dataclass
class RunDumpListing:
    """What a run's ``grad_probe/`` holds: ``summaries[rank]`` the steps with a summary CSV, ``steps[rank]`` those
    with both a summary CSV and a ``step{S}/`` folder (the sink uploads the CSV last, so such a step is complete)."""

    run: Run
    steps: dict[int, list[int]] = field(default_factory=dict)
    summaries: dict[int, list[int]] = field(default_factory=dict)
    file_sizes: dict[str, int | None] = field(default_factory=dict)  # artifact path of each summary CSV -> bytes
    archived: dict[tuple[int, int], str] = field(default_factory=dict)  # (rank, step) -> the archive holding it

    @property
    def run_id(self) -> str:
        return self.run.info.run_id

    def summary_files(self, steps: dict[int, list[int]]) -> list[tuple[str, int | None]]:
        """Artifact path and listed size of the summary CSV of each rank and step in ``steps``, and of its exponent
        counts where the run holds them."""
        paths = [f"{ARTIFACT_ROOT}/{relative_summary_path(rank, step)}"
                 for rank, rank_steps in steps.items() for step in rank_steps if (rank, step) not in self.archived]
        exponents = [f"{ARTIFACT_ROOT}/{relative_rank_dir(rank)}/{exponents_file_name(step)}"
                     for rank, rank_steps in steps.items() for step in rank_steps if (rank, step) not in self.archived]
        paths += [path for path in exponents if path in self.file_sizes]
        return [(path, self.file_sizes.get(path)) for path in paths]

    def archives(self, steps: dict[int, list[int]]) -> list[tuple[str, int | None]]:
        """Artifact path and listed size of the archives holding any of ``steps``."""
        paths = dict.fromkeys(self.archived[(rank, step)] for rank, rank_steps in steps.items()
                              for step in rank_steps if (rank, step) in self.archived)
        return [(path, self.file_sizes.get(path)) for path in paths]


def _name(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1]


def get_run(client: MlflowClient, run_id: str, label: str) -> Run:
    """The run; one the store does not know is bad input, ``{label}: no such folder, and no MLflow run with this
    ID at ...`` (a server that fails or cannot be reached raises as it is: not a mistyped source)."""
    try:
        return client.get_run(run_id)
    except MlflowException as e:
        if e.get_http_status_code() >= 500:
            raise
        raise RunDumpError(f"{label}: no such folder, and no MLflow run with this ID at {client.tracking_uri} "
                           f"({e.message.splitlines()[0]})") from None


def list_run_dump(client: MlflowClient, run: Run, directions: bool = True) -> RunDumpListing:
    """Lists the run's ranks and steps (one request per rank), refusing an empty run, and with ``directions`` an
    L0 run too (the comparator's need)."""
    run_id = run.info.run_id
    level = run.data.tags.get(LEVEL_TAG)
    if directions and level in LEVELS and not LEVELS[level].has_directions:
        raise RunDumpError(f"run {run_id}: tag {LEVEL_TAG} = {level!r}: an {level} run records no gradient "
                           f"directions; compare needs grad_level L1 or L2 in both runs")
    listing = RunDumpListing(run)
    rank_folders = [info for info in client.list_artifacts(run_id, ARTIFACT_ROOT) if info.is_dir]
    for folder in rank_folders:
        rank = parse_rank_folder(_name(folder.path))
        if rank is None:
            continue
        entries = client.list_artifacts(run_id, folder.path)
        summaries = {parse_summary_name(_name(e.path)) for e in entries if not e.is_dir} - {None}
        listing.file_sizes.update({e.path: e.file_size for e in entries if not e.is_dir})
        step_folders = {parse_step_folder(_name(e.path)) for e in entries if e.is_dir} - {None}
        for entry in entries:  # an archive holds its steps' CSVs and directions (none at L0: refused above)
            archived = [] if entry.is_dir else parse_archive_name(_name(entry.path)) or []
            listing.archived.update({(rank, step): entry.path for step in archived})
            summaries.update(archived)
            step_folders.update(archived)
        if directions and summaries and not step_folders:
            raise RunDumpError(f"run {run_id}: {folder.path}/ holds grad_summary_*.csv but no step<N>/ folders: "
                               f"an L0 dump records no gradient directions (nor does an always-on tier run none "
                               f"of whose steps recorded them); compare needs grad_level L1 or L2")
        listing.summaries[rank] = sorted(summaries)
        listing.steps[rank] = sorted(summaries & step_folders)
    if not listing.steps:
        raise RunDumpError(f"run {run_id} has no {ARTIFACT_ROOT}/rank<N>/ artifacts; expected a run logged by "
                           f"msprobe-mlflow's monitor (autolog, GradientMonitor) or by 'msprobe-mlflow upload'")
    return listing


def local_artifact_dump(run: Run) -> Path | None:
    """The run's ``grad_probe/`` folder when its artifact store is on this file system, else None."""
    parsed = urlparse(run.info.artifact_uri)
    if parsed.scheme not in ("", "file"):
        return None
    folder = Path(unquote(parsed.path)) / ARTIFACT_ROOT
    return folder if folder.is_dir() else None


def _download(client: MlflowClient, run_id: str, artifact_path: str, destination: Path, scratch: Path) -> None:
    """One file, fetched into a folder of its own (MLflow names it by its base name), then renamed into place."""
    own_folder = tempfile.mkdtemp(dir=scratch)
    fetched = Path(client.download_artifacts(run_id, artifact_path, own_folder))
    destination.parent.mkdir(parents=True, exist_ok=True)
    os.replace(fetched, destination)


def run_cache(client: MlflowClient, run_id: str, cache_dir: str | os.PathLike | None) -> Path:
    """The run's cache folder (not created), refusing a run ID that is no plain name before anything is asked."""
    if not _PLAIN_RUN_ID.match(run_id):
        raise RunDumpError(f"run ID {run_id!r} from {client.tracking_uri} is not a plain name (1 to 64 letters, "
                           f"digits, '-' or '_'); refusing to name a cache folder after it")
    return (Path(cache_dir) if cache_dir is not None else default_cache_dir()) / run_id


def fetch_artifacts(client: MlflowClient, run_id: str, run_root: Path, wanted: list[tuple[str, int | None]],
           progress: bool | None, archives: list[tuple[str, int | None]] = ()) -> Path:
    """Downloads into ``run_root`` each ``(artifact path, size)`` not already there with that size, and each of
    ``archives``, expanded beside it into its steps' files."""
    wanted = [*wanted, *archives]
    run_root.mkdir(parents=True, exist_ok=True)
    missing = []
    for artifact_path, size in wanted:
        destination = confined_path(run_root, artifact_path, f"run {run_id}: artifact path")
        if not destination.is_file() or (size is not None and destination.stat().st_size != size):
            missing.append((artifact_path, destination))
    if missing:
        scratch = Path(tempfile.mkdtemp(prefix=".download-", dir=run_root))
        line = ProgressLine(f"downloading run {run_id[:8]}", len(missing), progress)
        try:
            with ThreadPoolExecutor(DOWNLOAD_WORKERS, thread_name_prefix="msprobe-download") as pool:
                for _ in pool.map(lambda item: _download(client, run_id, *item, scratch), missing):
                    line.advance()
        finally:
            line.close()
            shutil.rmtree(scratch, ignore_errors=True)
    for artifact_path, _ in archives:
        archive = confined_path(run_root, artifact_path, f"run {run_id}: artifact path")
        extract_steps_archive(archive, archive.parent)
    return run_root / ARTIFACT_ROOT


def fetch_run_dump(client: MlflowClient, listing: RunDumpListing, steps: dict[int, list[int]],
                   cache_dir: str | os.PathLike | None = None, progress: bool | None = None) -> Path:
    """A local dump folder holding at least ``steps[rank]`` of every rank in ``steps`` (read in place when the
    artifact store is local, else downloaded into ``{cache_dir}/{run_id}/grad_probe``)."""
    in_place = local_artifact_dump(listing.run)
    if in_place is not None and not listing.archives(steps):
        return in_place
    run_id = listing.run_id
    run_root = run_cache(client, run_id, cache_dir)
    folders = [f"{ARTIFACT_ROOT}/{relative_step_dir(rank, step)}" for rank, rank_steps in steps.items()
               for step in rank_steps]
    with ThreadPoolExecutor(DOWNLOAD_WORKERS, thread_name_prefix="msprobe-list") as pool:
        wanted = [(e.path, e.file_size) for entries in pool.map(lambda f: client.list_artifacts(run_id, f), folders)
                  for e in entries if not e.is_dir]
    return fetch_artifacts(client, run_id, run_root, wanted + listing.summary_files(steps), progress,
                           listing.archives(steps))


def read_statistics(source: str | os.PathLike, tracking_uri: str | None = None,
                    cache_dir: str | os.PathLike | None = None, progress: bool | None = None):
    """A monitored run's statistics across steps as a ``pandas.DataFrame``: a row per rank, step and parameter
    with ``max``, ``min``, ``norm``, the bucket fractions (L2) and the shape (see ``dump.read_statistics_table``).

    ``source``: a dump folder, or the ID of a run logged by the monitor or by ``msprobe-mlflow upload`` (at
    ``tracking_uri``, default the active one). A run's summary CSVs are read in place when its artifacts are on
    this file system, else only they are downloaded (not the directions), cached under ``cache_dir``.
    """
    if Path(source).is_dir():
        return read_statistics_table(source)
    require_existing_store(tracking_uri, f"source = {str(source)!r}")
    client = MlflowClient(tracking_uri)
    listing = list_run_dump(client, get_run(client, str(source), f"source = {str(source)!r}"), directions=False)
    folder = local_artifact_dump(listing.run)
    if folder is None or listing.archives(listing.summaries):
        folder = fetch_artifacts(client, listing.run_id, run_cache(client, listing.run_id, cache_dir),
                        listing.summary_files(listing.summaries), progress, listing.archives(listing.summaries))
    return read_statistics_table(folder)


class RunBaseline:
    """A monitored run read step by step, as the live verdict's baseline: in place when its artifacts are on this
    file system, else each step downloaded into the cache (``cache_dir``, default ``default_cache_dir()``) when
    asked. Raises :class:`RunDumpError` (or MLflow's error) when the run cannot be compared with."""

    def __init__(self, run_id: str, tracking_uri: str | None = None, cache_dir: str | os.PathLike | None = None):
        self.client = MlflowClient(tracking_uri)
        self.listing = list_run_dump(self.client, get_run(self.client, run_id, f"baseline = {run_id!r}"))
        self.in_place = local_artifact_dump(self.listing.run)
        self.cache_dir = cache_dir

    def steps(self, rank: int) -> list[int]:
        if rank not in self.listing.steps:
            raise RunDumpError(f"run {self.listing.run_id} has no {ARTIFACT_ROOT}/rank{rank}/ artifacts (it has "
                               f"ranks {sorted(self.listing.steps)})")
        return self.listing.steps[rank]

    def step_folder(self, rank: int, step: int) -> Path:
        in_place = self.in_place if (rank, step) not in self.listing.archived else None
        root = in_place or fetch_run_dump(self.client, self.listing, {rank: [step]}, self.cache_dir)
        return step_dir(root, rank, step)
