"""The options of a gradient monitor as one validated object, :class:`MonitorOptions`, taken by both monitors, the
callbacks and ``autolog()``. Their keywords (``GradientMonitor(config, log_every_n_steps=10)``) become the object in
one place, :meth:`MonitorOptions.of`; ``options=MonitorOptions(...)`` passes it whole. The table of every option:
``docs/options.md``. Imports no MLflow, torch or MindSpore."""
from __future__ import annotations

import difflib
from dataclasses import MISSING, dataclass, fields, replace

from msprobe_mlflow.compare.verdict import RuleSettings
from msprobe_mlflow.config import GradProbeConfig
from msprobe_mlflow.monitoring.directions_schedule import TierOptions
from msprobe_mlflow.sinks import StepSink
from msprobe_mlflow.sinks.anomalies import AnomalyOptions
from msprobe_mlflow.sinks.baseline import BaselineOptions
from msprobe_mlflow.statistics_table import EXPONENTS, OPT_IN, PARAMETER_NORM, refuse_unknown
from msprobe_mlflow.trace.options import TraceOptions
from msprobe_mlflow.tracking.options import TrackingOptions

# Each group's fields are its keywords (``tracking_uri`` is both MLflow's and the baseline run's: one keyword).
GROUPS = {"live_verdict": BaselineOptions, "anomalies": AnomalyOptions, "tier": TierOptions,
          "trace": TraceOptions, "tracking": TrackingOptions}
BOOLEANS = ("log_to_mlflow", "metrics_file", "silent")
# Options there were, refused saying why they went (``options.md``), not taken for a misspelling.
REMOVED = {"overlap": "overlap was removed: the step kernel reads gradients at memory speed, so computing during "
                      "backward was slower on every measured setting; leave it out"}


@dataclass(frozen=True)
class MonitorOptions:
    """What a gradient monitor does beside writing its dump, grouped; every value is checked when made.

    - ``tracking`` (:class:`~msprobe_mlflow.tracking.options.TrackingOptions`): the MLflow run and what goes
      into it; ``log_to_mlflow=False``: the local dump only.
    - ``live_verdict`` (:class:`~msprobe_mlflow.sinks.baseline.BaselineOptions`, None: none): each step's
      directions compared with a baseline's as the step lands.
    - ``anomalies`` (:class:`~msprobe_mlflow.sinks.anomalies.AnomalyOptions`): the anomaly flags and their rule.
    - ``tier`` (:class:`~.directions_schedule.TierOptions`): the always-on tier, over the config's.
    - ``trace`` (:class:`~msprobe_mlflow.trace.options.TraceOptions`): the steps whose every operator is traced
      for ``locate`` (``trace_steps``, ``trace_level``, ``trace_config``; PyTorch).
    - ``metrics_file``: also each step's summary metrics in ``{dump_path}/rank{R}/metrics.jsonl``; ``sinks``: more
      outputs (``handle(record)``, ``flush()``, ``close()``), fed after the local dump; ``silent``: no
      warnings, problems go to the ``msprobe_mlflow`` logger only, and so do the monitor's start and end lines
      (``monitoring.status_lines``), at INFO.
    - ``statistics``: opt-in columns after ``norm`` in the summary CSV (names from
      :data:`msprobe_mlflow.statistics_table.OPT_IN`): the gradient's ``mean``, ``abs_mean`` (and their run
      metrics), then the parameter's own ``param_norm`` (the comparator judges it too); none by default, so
      the CSVs stay msprobe's byte for byte. ``exponents``: the exponent counts and format losses, beside the
      CSV (``lossy_format`` asks for them too).

    The keywords are the groups' field names and these (``docs/options.md``); a config-dependent check (the tier's
    combination, a baseline at a level without directions) comes when applied to a config (:meth:`applied_to`).
    """

    tracking: TrackingOptions = TrackingOptions()
    log_to_mlflow: bool = True
    live_verdict: BaselineOptions | None = None
    anomalies: AnomalyOptions = AnomalyOptions()
    tier: TierOptions = TierOptions()
    trace: TraceOptions = TraceOptions()
    metrics_file: bool = False
    sinks: tuple[StepSink, ...] = ()
    silent: bool = False
    statistics: tuple[str, ...] = ()

    def __post_init__(self):
        for name, kind in GROUPS.items():
            group = getattr(self, name)
            if not isinstance(group, kind) and not (name == "live_verdict" and group is None):
                raise ValueError(f"{name} = {group!r} is not accepted; expected a {kind.__name__}")
        for name in BOOLEANS:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} = {getattr(self, name)!r} is not accepted; expected True or False")
        if not isinstance(self.sinks, (list, tuple)) or not all(isinstance(sink, StepSink) for sink in self.sinks):
            raise ValueError(f"sinks = {self.sinks!r} is not accepted; expected a list of objects with handle(record), "
                             f"flush() and close()")
        object.__setattr__(self, "sinks", tuple(self.sinks))
        if not isinstance(self.statistics, (list, tuple)) or not all(isinstance(n, str) for n in self.statistics):
            raise ValueError(f"statistics = {self.statistics!r} is not accepted; expected a list of names, some of: "
                             f"{', '.join(OPT_IN)}")
        refuse_unknown(self.statistics)
        object.__setattr__(self, "statistics", tuple(dict.fromkeys(self.statistics)))
        live = self.live_verdict
        if live is not None and live.tracking_uri is None and self.tracking.tracking_uri is not None:
            object.__setattr__(self, "live_verdict", replace(live, tracking_uri=self.tracking.tracking_uri))

    @classmethod
    def of(cls, options: "MonitorOptions | None" = None, **keywords) -> "MonitorOptions":
        """``options`` (None: the defaults) with the keywords given changed: the one place keywords become options.
        An unknown keyword is refused naming the closest accepted one, a removed one saying why it went."""
        if options is not None and not isinstance(options, MonitorOptions):
            raise ValueError(f"options = {options!r} is not accepted; expected a MonitorOptions")
        unknown = sorted((name for name in keywords if name not in KEYWORDS), key=lambda name: name not in REMOVED)
        if unknown:
            raise TypeError(unknown_option_message(unknown[0]))
        if not keywords:
            return options or DEFAULT
        flat = {**(options or DEFAULT).keywords(), **keywords}
        RuleSettings(flat["rule"], flat["first_threshold"], flat["drop_threshold"],
                     flat["precision"])  # refused even without baseline
        if flat["baseline"] is None and flat["trace_on_suspicious"]:
            raise ValueError("trace_on_suspicious is given without baseline=; it traces the step after the first one "
                             "found suspicious against a baseline run: pass baseline=RUN_ID_OR_DUMP_FOLDER too")
        if flat["baseline"] is None and flat["on_suspicious"] is not None:
            raise ValueError("on_suspicious is given without baseline=; it is called when a step is suspicious "
                             "against a baseline run: pass baseline=RUN_ID_OR_DUMP_FOLDER too")
        groups = {name: kind(**{f.name: flat[f.name] for f in fields(kind)}) for name, kind in GROUPS.items()
                  if name != "live_verdict" or flat["baseline"] is not None}
        return cls(**groups, **{name: flat[name] for name in TOP_LEVEL})

    def keywords(self) -> dict:
        """The options as the keywords that make them (``MonitorOptions.of(**options.keywords()) == options``)."""
        flat = {}
        for name, kind in GROUPS.items():  # tracking last: its tracking_uri is the keyword's
            flat.update(_fields_of(kind, getattr(self, name)))
        return {**flat, **{name: getattr(self, name) for name in TOP_LEVEL}}

    def changed(self) -> dict:
        """The keywords whose values are not the defaults."""
        default = DEFAULT.keywords()
        return {name: value for name, value in self.keywords().items() if value != default[name]}

    @property
    def gradient_statistics(self) -> tuple[str, ...]:
        """The opt-in statistics of the gradient (every backend computes them), without the parameter's norm."""
        return tuple(name for name in self.statistics if name not in (PARAMETER_NORM, EXPONENTS))

    @property
    def parameter_norms(self) -> bool:
        return PARAMETER_NORM in self.statistics

    @property
    def exponent_counts(self) -> bool:
        """The exponent counts asked for: named in ``statistics``, or read by the ``lossy_format`` watch."""
        return EXPONENTS in self.statistics or self.anomalies.lossy is not None

    @property
    def mlflow(self) -> TrackingOptions | None:
        """What the MLflow sink gets: None with ``log_to_mlflow=False``."""
        return self.tracking if self.log_to_mlflow else None

    def applied_to(self, config: GradProbeConfig) -> GradProbeConfig:
        """``config`` with the tier's options over its own; refuses what cannot work with it (before training)."""
        config = self.tier.applied_to(config)
        if self.live_verdict is not None and not config.has_directions:
            raise ValueError(f"baseline = {self.live_verdict.baseline!r} needs gradient directions, which "
                             f"grad_probe.grad_level {config.level!r} does not record; use grad_level L1 or L2")
        return config


def _fields_of(kind, group) -> dict:
    """A group's fields by name (its defaults, baseline None, when the group is None)."""
    return {f.name: getattr(group, f.name) if group is not None else None if f.default is MISSING else f.default
            for f in fields(kind)}


TOP_LEVEL = tuple(f.name for f in fields(MonitorOptions) if f.name not in GROUPS)
KEYWORDS = tuple(dict.fromkeys(f.name for kind in GROUPS.values() for f in fields(kind))) + TOP_LEVEL
DEFAULT = MonitorOptions()


def unknown_option_message(name: str, accepted=KEYWORDS) -> str:
    if name in REMOVED:
        return REMOVED[name]
    close = difflib.get_close_matches(name, accepted, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else "."
    return (f"{name!r} is not an option of the gradient monitor{hint} Accepted: {', '.join(sorted(accepted))} "
            f"(see msprobe_mlflow.MonitorOptions and docs/options.md)")
