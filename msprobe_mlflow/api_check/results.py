"""What the API checker found: one ``OutputResult`` per compared output (a row of the details CSV), one
``SideResult`` per forward or backward entry, one ``ApiResult`` per API call (a row of the result CSV)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from msprobe_mlflow.api_check.metrics import ERROR, PASS, SKIP


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
    ``skip`` when it could not be checked here."""

    status: str
    message: str = ""
    outputs: list[OutputResult] = field(default_factory=list)


def side_from_outputs(outputs: list[OutputResult]) -> SideResult:
    failed = [output for output in outputs if output.status != PASS]
    if not outputs:
        return SideResult(ERROR, "there is no output to compare", outputs)
    status = ERROR if any(output.status == ERROR for output in failed) else (SKIP if failed else PASS)
    return SideResult(status, " ".join(output.message for output in failed if output.message), outputs)


@dataclass
class ApiResult:
    """One API call. ``forward``/``backward`` are ``None`` when the dump has no such entry. ``status`` is ``error``
    when a side failed, else ``skip`` when a side could not be checked (or the call is not checked at all), else
    ``pass``; ``message`` joins the texts of the sides that did not pass. ``inputs`` describes the recorded
    arguments, one text per top-level argument (``input_args.0``, ``input_kwargs.dim``)."""

    name: str
    status: str
    message: str
    forward: SideResult | None = None
    backward: SideResult | None = None
    inputs: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_sides(cls, name: str, forward: SideResult | None, backward: SideResult | None,
                   inputs: dict[str, str]) -> ApiResult:
        sides = [side for side in (forward, backward) if side is not None]
        statuses = {side.status for side in sides}
        status = ERROR if ERROR in statuses else SKIP if (SKIP in statuses or not sides) else PASS
        messages = [side.message for side in sides if side.status != PASS and side.message]
        message = " ".join(dict.fromkeys(messages))  # once each, in order: both sides often share the reason
        return cls(name, status, message, forward, backward, inputs)

    def output_rows(self) -> list[OutputResult]:
        """The details-CSV rows: every side's outputs, or one row named after the call when it has no side."""
        rows = [output for side in (self.forward, self.backward) if side is not None for output in side.outputs]
        return rows or [OutputResult(self.name, self.status, self.message)]


@dataclass
class ApiCheckReport:
    """The whole check: results in dump order, the two CSVs written, and the MLflow run holding them (if logged)."""

    results: list[ApiResult]
    details_csv: Path | None = None
    result_csv: Path | None = None
    run_id: str | None = None

    def count(self, status: str) -> int:
        """How many APIs have ``status``: ``pass``, ``error`` or ``skip``."""
        return len(self.with_status(status))

    def with_status(self, status: str) -> list[ApiResult]:
        return [result for result in self.results if result.status == status]
