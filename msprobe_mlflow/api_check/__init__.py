"""The MindSpore API accuracy checker: ``mindspore.mint`` calls recorded by msprobe's dump are run again in MindSpore
(tested) and torch (benchmark), forward and backward, compared, written as msprobe's two CSVs and recorded in MLflow
(one run for the check, one nested run per API). See docs/api_check.md (its Inputs and Outputs sections are the
formats).

Importing this package (and its ``parser``, ``metrics``, ``results``, ``report`` and ``replay``) needs numpy only:
torch and MindSpore are imported with the runner, once the whole input has been checked, so bad input fails in a
moment; and only in the worker processes when the calls run there (``replay``). Both must be installed (the extras
``torch`` and ``mindspore``): the check refuses to start without them rather than report every API as an error.
"""
from __future__ import annotations

import importlib.util
import math
import os
import re
import sys
from contextlib import nullcontext
from pathlib import Path
from typing import Callable

from msprobe_mlflow import notices
from msprobe_mlflow.api_check.metrics import Thresholds
from msprobe_mlflow.api_check.parser import ApiCall, read_api_info
from msprobe_mlflow.api_check.replay import check_workers, replay_calls
from msprobe_mlflow.api_check.report import write_reports
from msprobe_mlflow.api_check.results import ApiCheckReport, ApiResult, OutputResult, SideResult
from msprobe_mlflow.dump import short_list

__all__ = ["check_api_accuracy", "ApiCheckReport", "ApiResult", "OutputResult", "SideResult", "Thresholds"]

# What the calls run in, and the extra of msprobe-mlflow that installs each: torch the benchmark, MindSpore the
# tested side (its tensors are made in the tensor task too).
FRAMEWORK_EXTRAS = {"torch": "torch", "mindspore": "mindspore"}


def check_api_accuracy(path: str | os.PathLike, *, output_dir: str | os.PathLike = ".",
                       experiment: str | None = None, parent_run_id: str | None = None, nested: bool = True,
                       api_filter: str | None = None, cosine_threshold: float = 0.99,
                       max_abs_threshold: float = 0.001, log_to_mlflow: bool = True, tracking_uri: str | None = None,
                       on_progress: Callable[[int, int, str], None] | None = None, workers: int = 1) -> ApiCheckReport:
    """Checks every API call of an msprobe MindSpore dump (``api_info.json`` / ``dump.json``, or a folder holding
    exactly one, also below it in msprobe's layout ``step{S}/rank{R}/``) and reports.

    ``api_filter``: a regular expression searched in the call name (``Mint.add.0``); calls that do not match are
    left out. An API passes when every output has ``Cosine > cosine_threshold`` and ``MaxAbsErr <
    max_abs_threshold``. The CSVs go to ``output_dir`` (written before anything is logged); with ``log_to_mlflow``
    one MLflow run holds them (nested under ``parent_run_id``, else under the active run if there is one; in
    ``experiment`` if given; ``tracking_uri`` None: MLflow's active one) with one nested run per API unless
    ``nested`` is false. ``on_progress(done, total, name)`` is called after each call.

    The process is left as it was found: MindSpore's execution mode and launch blocking are as they were (graph
    mode in a training script stays graph mode), because the calls run in ``workers`` child processes unless they
    can run here without a lasting change (see ``replay``). The report lists the calls in dump order whatever the
    number of workers.

    Raises ``ValueError`` only for what stops the whole check (a missing or unreadable file, a folder with no
    dump or several, no ``task``/``data``, a tensor task whose ``dump_data_dir`` holds none of its files, a bad
    ``api_filter`` or ``workers``, a threshold that is NaN or not a number, an ``output_dir`` that cannot be made,
    an ``experiment`` that is not the parent's), before torch or MindSpore is imported and before any API is run;
    ``ModuleNotFoundError`` naming the extra to install when torch or MindSpore is not installed. Every problem of
    one entry becomes that API's ``error`` or ``skip`` row.
    """
    dump = read_api_info(path)
    pattern = _api_pattern(api_filter)
    thresholds = _thresholds(cosine_threshold, max_abs_threshold)
    workers = check_workers(workers)
    target = _run_target(log_to_mlflow, experiment, parent_run_id, tracking_uri)
    _make_output_dir(output_dir)
    calls = [call for call in dump.calls if pattern is None or pattern.search(call.name)]
    _say_if_keywords_unrecorded(calls)
    with _check_run(target, dump, thresholds, api_filter, nested) as run:  # the check's run lasts as long as the check
        results = replay_calls(calls, dump.task, thresholds, workers, _progress_counter(on_progress, len(calls)))
        details_csv, result_csv = write_reports(results, output_dir)
        report = ApiCheckReport(results, details_csv, result_csv, api_info=dump.path,
                                dump_data_dir=dump.dump_data_dir, dump_data_dir_found=dump.dump_data_dir_found)
        if run is not None:
            run.log(report)
            report.run_id = run.run_id
    return report


def _api_pattern(api_filter: str | None) -> re.Pattern | None:
    """``api_filter`` compiled (None: every call), refused with its own error when it is no regular expression."""
    try:
        return re.compile(api_filter) if api_filter else None
    except re.error as error:
        raise ValueError(f"api_filter = {api_filter!r} is not a regular expression ({error})") from None


def _run_target(log_to_mlflow: bool, experiment: str | None, parent_run_id: str | None, tracking_uri: str | None):
    """Where the check's run goes (None: not logged), found before anything is made or recorded: an unreachable
    server fails at once, a missing framework before any lookup, a wrong run ID leaves no empty output folder."""
    if log_to_mlflow:
        from msprobe_mlflow.tracking.server import require_tracking_server

        require_tracking_server(tracking_uri)  # an unreachable server fails now, not after the last API
    _require_frameworks()  # before anything is made or recorded
    if not log_to_mlflow:
        return None
    from msprobe_mlflow.tracking.api_check_runs import resolve_target

    return resolve_target(experiment, parent_run_id, tracking_uri)


def _check_run(target, dump, thresholds: Thresholds, api_filter: str | None, nested: bool):
    """The check's MLflow run, as a context; one that yields None where the check is not logged (``target`` None)."""
    if target is None:
        return nullcontext()
    from msprobe_mlflow.tracking.api_check_runs import check_run

    return check_run(target, api_info=dump.path, task=dump.task, thresholds=thresholds, api_filter=api_filter,
                     nested=nested)


def _make_output_dir(output_dir: str | os.PathLike) -> None:
    """Made before any API runs: a folder that cannot be made stops the check before its work, not after."""
    try:
        Path(output_dir).mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ValueError(f"output_dir = {str(output_dir)!r} cannot be created ({error.strerror or error})") from None


def _progress_counter(on_progress: Callable[[int, int, str], None] | None,
                      total: int) -> Callable[[int, ApiResult], None]:
    """The callback ``replay_calls`` makes after each result: counts them and passes the count on to
    ``on_progress``."""
    done = 0

    def on_result(index: int, result: ApiResult) -> None:
        nonlocal done
        done += 1
        if on_progress is not None:
            on_progress(done, total, result.name)

    return on_result


def _say_if_keywords_unrecorded(calls: list[ApiCall]) -> None:
    """A forward entry without ``input_kwargs`` is run without keyword arguments: one warning names them."""
    names = [f"{call.name}.forward" for call in calls if call.forward is not None and not call.forward.kwargs_recorded]
    if names:
        notices.warn(f"{len(names)} forward entr{'y has' if len(names) == 1 else 'ies have'} no input_kwargs and "
                     f"{'is' if len(names) == 1 else 'are'} run without keyword arguments: {short_list(names)}. "
                     f"msprobe writes input_kwargs in every forward entry ({{}} when there are none); if the "
                     f"training passed keyword arguments (dim=, dtype=...), these checks are not of its calls",
                     stacklevel=3)


def _require_frameworks() -> None:
    """Without torch or MindSpore every call would fail alike: the environment, reported as the model's inaccuracy.
    Looked up without importing them, so that this process stays free of them."""
    missing = [module for module in FRAMEWORK_EXTRAS if importlib.util.find_spec(module) is None]
    if missing:
        extras = ",".join(FRAMEWORK_EXTRAS[module] for module in missing)
        raise ModuleNotFoundError(f"the API checker needs {' and '.join(missing)}, which this Python "
                                  f"({sys.executable}) cannot import; install the extra: "
                                  f'pip install "msprobe-mlflow[{extras}]" (from a clone of the repository: '
                                  f'pip install ".[{extras}]")', name=missing[0])


def _thresholds(cosine_threshold: float, max_abs_threshold: float) -> Thresholds:
    """The pass rule. Any number is accepted (-2 passes every Cosine, 0 fails every MaxAbsErr); NaN is refused:
    every comparison with it is false, so it would fail every output without saying why."""
    for name, value in (("cosine_threshold", cosine_threshold), ("max_abs_threshold", max_abs_threshold)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
            raise ValueError(f"{name} = {value!r} is not accepted; expected a number")
    return Thresholds(cosine=cosine_threshold, max_abs_err=max_abs_threshold)
