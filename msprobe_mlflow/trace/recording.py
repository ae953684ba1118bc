"""What both frameworks' tracers share while they record a step: msprobe's ``scope`` and ``list`` selection, the
call site as ``stack.json`` writes it, a tensor summary whose statistics wait for the one device-to-host copy, and
the checksum's text (the sums themselves are each framework's: :mod:`msprobe_mlflow.torch_kernels.bit_checksum`,
:mod:`msprobe_mlflow.mindspore.operator_trace`)."""
from __future__ import annotations

import sys

import numpy as np

from msprobe_mlflow.trace.files import OUR_CHECKSUM, TensorSummary

CHECKSUM_MASK = 0xFFFFFFFF  # each of the checksum's two sums is read mod 2^32
STACK_DEPTH = 30


def checksum_hex(sums) -> str:
    """The two sums (read mod 2^32) as 16 hex digits."""
    total, weighted = (int(s) & CHECKSUM_MASK for s in sums)
    return f"{total:08x}{weighted:08x}"


class Selection:
    """msprobe's ``scope`` (a first and a last entry, inclusive) and ``list`` (names containing any): asked once
    per entry, in the order the entries are made."""

    def __init__(self, scope: tuple[str, ...] = (), api_list: tuple[str, ...] = ()):
        self.scope, self.api_list = tuple(scope), tuple(api_list)
        self._in_scope = not self.scope

    def wants(self, name: str) -> bool:
        if self.scope and name == self.scope[0]:
            self._in_scope = True
        wanted = self._in_scope and (not self.api_list or any(part in name for part in self.api_list))
        if self.scope and name == self.scope[-1]:
            self._in_scope = False
        return wanted


def call_site(own_files: tuple[str, ...]) -> tuple[str, ...]:
    """The Python frames that made the current call, innermost first, as msprobe's stack.json writes them, the
    tracer's own (``own_files``) left out."""
    frame, lines = sys._getframe(2), []
    while frame is not None and len(lines) < STACK_DEPTH:
        code = frame.f_code
        if code.co_filename not in own_files:
            lines.append(f"File {code.co_filename}, line {frame.f_lineno}, in {code.co_name}")
        frame = frame.f_back
    return tuple(lines)


class PendingSummary(TensorSummary):
    """A tensor's summary whose statistics are row ``slot`` of the batch still on the device (None: none); its
    checksum is the text already, or the row of the checksums' batch."""

    def __init__(self, dtype: str, shape: tuple, requires_grad: bool, slot: int | None, checksum: str | int | None):
        super().__init__(dtype, shape, requires_grad=requires_grad)
        object.__setattr__(self, "slot", slot)
        object.__setattr__(self, "pending_checksum", checksum)

    def fill(self, values: np.ndarray, sums: np.ndarray) -> TensorSummary:
        high = low = mean = norm = None
        if self.slot is not None:
            high, low, mean, norm = (float(v) if not np.isnan(v) else None for v in values[self.slot])
        checksum = self.pending_checksum
        if isinstance(checksum, int):
            checksum = f"{OUR_CHECKSUM}:{checksum_hex(sums[checksum])}"
        return TensorSummary(self.dtype, self.shape, high, low, mean, norm, checksum, self.requires_grad)


def filled(calls: list, values: np.ndarray, sums: np.ndarray) -> list:
    """``calls`` with every pending summary of their arguments filled from the copied batches."""
    for call in calls:
        for arguments in (call.inputs, call.outputs):
            for index, argument in enumerate(arguments):
                if isinstance(argument, PendingSummary):
                    arguments[index] = argument.fill(values, sums)
    return calls
