"""Anomaly flags on every run, no baseline needed: non-finite gradients and gradient-norm spikes
(:mod:`msprobe_mlflow.anomaly_rule`), reported on a thread of their own.

What lands where (the local dump first, ``{dump}/rank{R}/findings/anomalies.csv``; MLflow through the run's
``annotate``): every flag as a CSV row (``step,scope,parameter,kind,norm,median_norm,band_low,band_high``; scope
``parameter`` or ``total``); at steps with flags only, the metrics ``anomalies/rank{R}/flagged_params`` (parameters
flagged at that step) and ``anomalies/rank{R}/total_norm_spike`` (+1 explosion, -1 collapse): a series with few
points, so the UI's sampling (320 points spread over a metric's own steps) never drops a one-step spike; the tags
``msprobe_mlflow.first_nonfinite_step`` / ``nonfinite_parameters`` and ``msprobe_mlflow.first_spike_step`` /
``spike_parameters`` at the first step of each kind, with one warning each. The CSV goes to MLflow at those first
steps and at the end (not at every flag: a run gone NaN flags every parameter at every step).

With ``lossy_format`` (which records the exponent counts), the first step at which that format would hold more
than ``lossy_share`` of the gradient elements outside its normal range (:class:`msprobe_mlflow.formats.LossyFormat`)
is told the same way: tags ``msprobe_mlflow.first_lossy_step`` / ``lossy_parameters`` and one warning; its shares
per step are the metrics ``grad/rank{R}/formats/...`` (:func:`msprobe_mlflow.metrics.format_metrics`).
"""
from __future__ import annotations

import csv
from dataclasses import dataclass

from msprobe_mlflow.anomaly_rule import AnomalyFlags, Flag, SpikeRule
from msprobe_mlflow.background import BackgroundStepWriter
from msprobe_mlflow.dump import findings_dir
from msprobe_mlflow.formats import LossyFormat
from msprobe_mlflow.notices import Notices
from msprobe_mlflow.records import StepRecord
from msprobe_mlflow.vocabulary import anomaly_key, finding_tags

ANOMALIES_FILE_NAME = "anomalies.csv"
CSV_HEADER = ["step", "scope", "parameter", "kind", "norm", "median_norm", "band_low", "band_high"]


@dataclass(frozen=True)
class AnomalyOptions:
    """The anomaly flags' monitor options. ``anomaly_flags`` turns the flags on (the default); ``spike_threshold``
    and ``spike_window`` make the one :class:`SpikeRule` (:attr:`rule`) that both flags spikes and triggers the
    always-on tier's directions (``msprobe_mlflow.monitoring.directions_schedule``), the latter whether or not the
    flags are on. ``lossy_format`` and ``lossy_share`` make the format watch (:attr:`lossy`)."""

    anomaly_flags: bool = True
    spike_threshold: float = SpikeRule.threshold
    spike_window: int = SpikeRule.window
    lossy_format: str | None = None
    lossy_share: float = LossyFormat.share

    def __post_init__(self):
        if not isinstance(self.anomaly_flags, bool):
            raise ValueError(f"anomaly_flags = {self.anomaly_flags!r} is not accepted; expected True or False")
        self.rule  # a bad threshold or window is refused here
        LossyFormat(self.lossy_format or "float16", self.lossy_share)  # and a bad format or share
        if self.lossy_format is not None and not self.anomaly_flags:  # it would watch nothing, and say nothing
            raise ValueError(f"lossy_format = {self.lossy_format!r} is given with anomaly_flags=False; the format "
                             f"watch is one of the anomaly flags: leave anomaly_flags on, or lossy_format out")

    @property
    def lossy(self) -> LossyFormat | None:
        """What the flags watch the formats for: None without ``lossy_format``."""
        return LossyFormat(self.lossy_format, self.lossy_share) if self.lossy_format else None

    @property
    def rule(self) -> SpikeRule:
        return SpikeRule(self.spike_threshold, self.spike_window)

    @property
    def flag_rule(self) -> SpikeRule | None:
        """The rule of the flags sink: None when the flags are off."""
        return self.rule if self.anomaly_flags else None


class AnomalySink:
    """Flags one rank's steps (see the module docstring). ``run`` is the MLflow run's ``annotate`` target, or None
    (findings in the local dump only)."""

    def __init__(self, rule: SpikeRule, dump_path: str, rank: int, *, run=None, notices: Notices | None = None,
                 several_ranks: bool = False, lossy: LossyFormat | None = None):
        self.flags = AnomalyFlags(rule)
        self.lossy = lossy
        self.path = findings_dir(dump_path, rank) / ANOMALIES_FILE_NAME
        self.rank = rank
        self.run = run
        self.notices = notices or Notices()
        self.several_ranks = several_ranks  # each rank's first findings are also tagged rank{R}.*
        self.first_step: dict[str, int] = {}  # "nonfinite" / "spike" / "lossy" -> the first step flagged so
        self.flag_count = 0
        self._worker = BackgroundStepWriter([self._flag], max_pending=100_000,
                                            name=f"msprobe-mlflow-anomalies-rank{rank}")

    def handle(self, record: StepRecord) -> None:
        values_only = StepRecord(record.rank, record.step, record.level, record.bounds, record.names, record.shapes,
                                 record.values, anomaly_flags=record.anomaly_flags)  # what the flags read: small
        if self.lossy is not None and "lossy" not in self.first_step:
            values_only.exponent_counts, values_only.loss_scale = record.exponent_counts, record.loss_scale
        self._worker.submit(lambda: values_only)  # the queue is long: the writer never waits

    def flush(self) -> None:
        self._worker.flush()

    def _flag(self, record: StepRecord) -> None:
        tags = self._lossy_tags(record)
        flags = self.flags.flags_of(record)
        if flags:
            self._append(flags)
        metrics = {anomaly_key(self.rank, "total_norm_spike"): 1.0 if f.kind == "explosion" else -1.0
                   for f in flags if f.parameter is None}
        parameters = {f.parameter for f in flags if f.parameter is not None}
        if parameters:
            metrics[anomaly_key(self.rank, "flagged_params")] = float(len(parameters))
        for kind, found in (("nonfinite", [f for f in flags if f.kind == "nonfinite"]),
                            ("spike", [f for f in flags if f.kind != "nonfinite"])):
            if found and kind not in self.first_step:
                self.first_step[kind] = record.step
                tags.update(self._first(kind, record.step, found))
        if self.run is not None and (metrics or tags):
            files = [self.path] if flags and tags else []
            self.run.annotate(step=record.step, metrics=metrics, tags=tags, files=files)

    def _lossy_tags(self, record: StepRecord) -> dict[str, str]:
        """The first step at which the watched format would lose more than its share: tags and one warning."""
        if record.exponent_counts is None or "lossy" in self.first_step:
            return {}
        found = self.lossy.losses(record.names, record.exponent_counts, record.loss_scale)
        if found is None:
            return {}
        self.first_step["lossy"] = record.step
        share, parameters = found
        names = ", ".join(f"{name} ({lost:.1%})" for name, lost in parameters)
        scale = f"loss scale {record.loss_scale:g}" if record.loss_scale is not None else "no loss scale"
        self.notices.warn(f"rank {self.rank}: {self.lossy.format} would hold {share:.2%} of the gradient elements "
                          f"outside its normal range at step {record.step} (underflowed to zero, subnormal or "
                          f"overflowed, at {scale}; more than the {self.lossy.share:g} watched): {names[:500]}; "
                          f"every step's shares are the metrics grad/rank{self.rank}/formats/...")
        return finding_tags("lossy", self.rank, record.step, names, self.several_ranks)

    def _first(self, kind: str, step: int, found: list[Flag]) -> dict[str, str]:
        names = ", ".join(f.describe() for f in found)
        what = "non-finite gradients" if kind == "nonfinite" else "gradient-norm spikes"
        self.notices.warn(f"rank {self.rank}: {what} at step {step}: {names[:500]}; every flag is listed in "
                          f"{self.path}")
        return finding_tags(kind, self.rank, step, names, self.several_ranks)

    def _append(self, flags: list[Flag]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8-sig", newline="") as file:  # no BOM when appending
            writer = csv.writer(file)
            if file.tell() == 0:
                writer.writerow(CSV_HEADER)
            writer.writerows(flag.csv_row() for flag in flags)
        self.flag_count += len(flags)

    def close(self) -> None:
        self._worker.close()
        if self._worker.errors:
            self.notices.warn(f"rank {self.rank}: the anomaly flags failed {len(self._worker.errors)} time(s); "
                              f"first: {self._worker.errors[0]}")
        if self.run is not None and self.flag_count:
            self.run.annotate(files=[self.path])
