"""What the API checker found: one ``OutputResult`` per compared output (a row of the details CSV), one
``SideResult`` per forward or backward entry, one ``ApiResult`` per API call (a row of the result CSV); and these
two tables, which ``report`` writes as msprobe's CSVs and ``ApiCheckReport`` hands out as pandas DataFrames."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from msprobe_mlflow.api_check.metrics import ERROR, OUT_OF_MEMORY, PASS, SKIP

if TYPE_CHECKING:
    import pandas

# Why an API was skipped, the groups the command's summary lists skips under: most skips are the platform (this
# device's MindSpore lacks a kernel), not the model, and the summary must say which.
NO_KERNEL = "no MindSpore kernel for it on this device (the platform, not your model)"
MINDSPORE_CANNOT_RUN = "MindSpore cannot run it here"
NOT_IN_MINDSPORE = "not in this MindSpore version"
NO_BENCHMARK = "torch has no such function or cannot run the inputs"
UNKNOWN_API = "neither MindSpore nor torch has such a function (check the name in the dump)"
NO_GRADIENT = "no gradient to compare"
NOT_MINT = "not a mint API (only Mint and MintFunctional calls are checked)"
INCOMPLETE_ENTRY = "the dump lacks what the check needs"
# The status of several results (a side's outputs, an API's sides): the first of these that one of them has, else
# pass. A lack of memory is the machine's, not the model's: it never hides an error, and outranks a skip as the
# thing to act on (check the call on a bigger machine).
FIRST_STATUS = (ERROR, OUT_OF_MEMORY, SKIP)


@dataclass
class OutputResult:
    """``name`` is ``Mint.add.0.forward.output.0``; for a side that produced nothing to compare (skipped, or its
    inputs could not be made) it is ``Mint.add.0.forward`` and the dtypes, shape and metrics are empty."""

    name: str
    status: str
    message: str = ""
    bench_dtype: str = ""
    tested_dtype: str = ""
    shape: tuple[int, ...] | None = None
    cosine: float | None = None
    max_abs_err: float | None = None
    max_relative_err: float | None = None


@dataclass
class SideResult:
    """The forward or backward check of one API: ``pass`` when every output passes, ``error`` when one fails,
    ``skip`` when it could not be checked here (``skip_group`` says why, one of the groups above),
    ``out_of_memory`` when this machine lacks the memory it needs."""

    status: str
    message: str = ""
    outputs: list[OutputResult] = field(default_factory=list)
    skip_group: str = ""


def side_from_outputs(outputs: list[OutputResult]) -> SideResult:
    failed = [output for output in outputs if output.status != PASS]
    if not outputs:
        return SideResult(ERROR, "there is no output to compare", outputs)
    status = _first_status({output.status for output in failed}, PASS)
    return SideResult(status, " ".join(output.message for output in failed if output.message), outputs)


def _first_status(statuses: set[str], otherwise: str) -> str:
    return next((status for status in FIRST_STATUS if status in statuses), otherwise)


@dataclass
class ApiResult:
    """One API call. ``forward``/``backward`` are ``None`` when the dump has no such entry. ``status`` is ``error``
    when a side failed, else ``out_of_memory`` when a side needs more memory than this machine has, else ``skip``
    when a side could not be checked (or the call is not checked at all), else ``pass``; ``message`` joins the
    texts of the sides that did not pass. ``inputs`` describes the recorded arguments, one text per top-level
    argument (``input_args.0``, ``input_kwargs.dim``). ``skip_group``: why a ``skip`` was skipped (its first
    skipped side's group)."""

    name: str
    status: str
    message: str
    forward: SideResult | None = None
    backward: SideResult | None = None
    inputs: dict[str, str] = field(default_factory=dict)
    skip_group: str = ""

    @classmethod
    def from_sides(cls, name: str, forward: SideResult | None, backward: SideResult | None,
                   inputs: dict[str, str]) -> ApiResult:
        sides = [side for side in (forward, backward) if side is not None]
        statuses = {side.status for side in sides}
        status = _first_status(statuses, PASS if sides else SKIP)
        messages = [side.message for side in sides if side.status != PASS and side.message]
        message = " ".join(dict.fromkeys(messages))  # once each, in order: both sides often share the reason
        skip_group = next((side.skip_group for side in sides if side.status == SKIP), "") if status == SKIP else ""
        return cls(name, status, message, forward, backward, inputs, skip_group)

    def output_rows(self) -> list[OutputResult]:
        """The details-CSV rows: every side's outputs, or one row named after the call when it has no side."""
        rows = [output for side in (self.forward, self.backward) if side is not None for output in side.outputs]
        return rows or [OutputResult(self.name, self.status, self.message)]


@dataclass
class ApiCheckReport:
    """The whole check: results in dump order, the two CSVs written, the MLflow run holding them (if logged), the
    dump file checked (the one found, when given a folder), and in the tensor task the folder its ``.npy`` files
    were read from with how its ``dump_data_dir`` was taken (``'dump_tensor_data', relative to the current
    folder``)."""

    results: list[ApiResult]
    details_csv: Path | None = None
    result_csv: Path | None = None
    run_id: str | None = None
    api_info: Path | None = None
    dump_data_dir: Path | None = None
    dump_data_dir_found: str = ""

    def count(self, status: str) -> int:
        """How many APIs have ``status``: ``pass``, ``error``, ``skip`` or ``out_of_memory``."""
        return len(self.with_status(status))

    def with_status(self, status: str) -> list[ApiResult]:
        return [result for result in self.results if result.status == status]

    def skips_by_group(self) -> dict[str, list[ApiResult]]:
        """The skipped APIs by why they were skipped (``NO_KERNEL``...), groups in order of first appearance."""
        groups: dict[str, list[ApiResult]] = {}
        for result in self.with_status(SKIP):
            groups.setdefault(result.skip_group, []).append(result)
        return groups

    def details_frame(self) -> pandas.DataFrame:
        """The details CSV as a DataFrame, one row per compared output: the metrics as float64 (NaN where the CSV
        cell is empty), Shape as a tuple."""
        header, *rows = details_rows(self.results)
        return _frame(rows, header).astype({column: "float64" for column in METRIC_COLUMNS})

    def results_frame(self) -> pandas.DataFrame:
        """The result CSV as a DataFrame, one row per API, plus the API's own status as ``Status`` (the CSV has
        only the forward and backward ones); ``None`` for a side the dump does not have."""
        header, *rows = result_rows(self.results)
        return _frame([[*row, result.status] for row, result in zip(rows, self.results)], [*header, "Status"])


DETAILS_HEADER = ["API Name", "Bench Dtype", "Tested Dtype", "Shape", "Cosine", "MaxAbsErr", "MaxRelativeErr",
                  "Status", "Message"]
RESULT_HEADER = ["API Name", "Forward Test Success", "Backward Test Success", "Message"]
METRIC_COLUMNS = ("Cosine", "MaxAbsErr", "MaxRelativeErr")


def details_rows(results: list[ApiResult]) -> list[list]:
    """The details table, header first, one row per compared output."""
    return [DETAILS_HEADER, *(_details_row(row) for result in results for row in result.output_rows())]


def _details_row(row: OutputResult) -> list:
    """Shape as a Python tuple (``(2, 3)``), metrics as Python floats, ``None`` for what is missing."""
    metrics = [None if value is None else float(value) for value in (row.cosine, row.max_abs_err, row.max_relative_err)]
    shape = None if row.shape is None else tuple(row.shape)
    return [row.name, row.bench_dtype, row.tested_dtype, shape, *metrics, row.status, row.message]


def result_rows(results: list[ApiResult]) -> list[list]:
    """The result table, header first, one row per API; ``None`` for a side the dump does not have, the API's status
    in both cells for an entry that is neither side (its key's suffix is not ``forward``/``backward``)."""
    rows = [RESULT_HEADER]
    for result in results:
        forward = result.forward.status if result.forward is not None else None
        backward = result.backward.status if result.backward is not None else None
        if result.forward is None and result.backward is None:  # a key whose suffix is neither: never blank
            forward = backward = result.status
        rows.append([result.name, forward, backward, result.message])
    return rows


def _frame(rows: list[list], columns: list[str]) -> pandas.DataFrame:
    import pandas  # here, not at the top: the package must import with numpy only

    return pandas.DataFrame(rows, columns=columns)
