"""The gradient-probe configuration: msprobe's ``config.json`` (task ``grad_probe``), validated when loaded.

msprobe 1.0.3 accepts bad values silently (a string ``param_list`` matched as a substring, ``bounds: []`` giving a
CSV whose rows are longer than the header, booleans as bounds...). Here every such value is rejected at load time
with a ``ValueError`` that names the key, the value found and what is accepted.
"""
from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass, field, fields

from msprobe_mlflow.layout import CHECKSUMS
from msprobe_mlflow.levels import LEVELS

DIRECTION_FORMATS = ("packed", "npy")
DEFAULT_BOUNDS = (-1, 0, 1)  # msprobe's PyTorch default
# msprobe's MindSpore default (``grad_probe/global_context.py``): 13 distribution columns
MINDSPORE_DEFAULT_BOUNDS = (-10, -1, -0.1, -0.01, -0.001, 0, 0.001, 0.01, 0.1, 1, 10)
FRAMEWORK_DEFAULT_BOUNDS = {"pytorch": DEFAULT_BOUNDS, "mindspore": MINDSPORE_DEFAULT_BOUNDS}
# Ours, the always-on tier (monitoring/directions_schedule.py): key -> default, the default being msprobe's behaviour.
TIER_DEFAULTS = {"directions_every_n_steps": 1, "directions_on_anomaly": False, "directions_steps_after_anomaly": 10}
GRAD_PROBE_KEYS = ("grad_level", "param_list", "bounds", *TIER_DEFAULTS)


def _reject(source: str, key: str, value, accepted: str):
    raise ValueError(f"{source}: {key} = {value!r} is not accepted; expected {accepted}")


def _int_list(source: str, key: str, value) -> tuple[int, ...]:
    accepted = "a list of non-negative integers (empty = all)"
    if not isinstance(value, (list, tuple)):
        _reject(source, key, value, accepted)
    for item in value:
        if isinstance(item, bool) or not isinstance(item, int) or item < 0:
            _reject(source, key, value, f"{accepted}; {item!r} is not one")
    return tuple(value)


def _bounds(source: str, value) -> tuple[float, ...]:
    """Buckets are counted against the bounds cast to float32 (as msprobe), so they must stay finite and
    strictly ascending as float32 too: ``[1.0, 1.00000001]`` would give an empty bucket whose label lies."""
    accepted = "a non-empty list of finite numbers in strictly ascending order (also as float32), e.g. [-1, 0, 1]"
    if not isinstance(value, (list, tuple)) or not value:
        _reject(source, "grad_probe.bounds", value, accepted)
    for item in value:
        if isinstance(item, bool) or not isinstance(item, (int, float)) or not math.isfinite(item):
            _reject(source, "grad_probe.bounds", value, f"{accepted}; {item!r} is not one")
    if any(a >= b for a, b in zip(value, value[1:])):
        _reject(source, "grad_probe.bounds", value, accepted)
    try:
        as_float32 = [struct.unpack("f", struct.pack("f", item))[0] for item in value]
    except OverflowError:
        _reject(source, "grad_probe.bounds", value, accepted)
    if any(math.isinf(b) for b in as_float32) or any(a >= b for a, b in zip(as_float32, as_float32[1:])):
        _reject(source, "grad_probe.bounds", value, accepted)
    return tuple(value)


def _check_tier(source: str, level: str, every_n_steps, on_anomaly, steps_after_anomaly) -> None:
    """The always-on tier's keys: each alone, then together (a combination that records no direction at all, or
    tier options at a level that records none, is refused rather than silently ignored)."""
    if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 0:
        _reject(source, "grad_probe.directions_every_n_steps", every_n_steps,
                "an integer >= 0 (1: every step, as msprobe; N: steps 0, N, 2N...; 0: only after an anomaly)")
    if not isinstance(on_anomaly, bool):
        _reject(source, "grad_probe.directions_on_anomaly", on_anomaly, "true or false")
    if isinstance(steps_after_anomaly, bool) or not isinstance(steps_after_anomaly, int) or steps_after_anomaly < 1:
        _reject(source, "grad_probe.directions_steps_after_anomaly", steps_after_anomaly,
                "an integer >= 1 (the steps given directions after a non-finite gradient or a norm spike)")
    if not LEVELS[level].has_directions and (every_n_steps != 1 or on_anomaly):
        raise ValueError(f"{source}: grad_probe.directions_every_n_steps = {every_n_steps!r}, directions_on_anomaly "
                         f"= {on_anomaly!r} choose when gradient directions are recorded, but grad_level {level!r} "
                         f"records none; use grad_level L1 or L2, or leave these keys out")
    if every_n_steps == 0 and not on_anomaly:
        raise ValueError(f"{source}: grad_probe.directions_every_n_steps = 0 records directions only after an "
                         f"anomaly, but directions_on_anomaly is false: no step would have directions; set "
                         f"directions_on_anomaly to true, or directions_every_n_steps to N >= 1")


@dataclass(frozen=True)
class GradProbeConfig:
    """What to probe and where to write it.

    ``level``: ``L0`` (MD5, max, min, norm, shape), ``L1`` (max, min, norm, shape + directions) or ``L2`` (L1 +
    bucket fractions over ``bounds`` and the ``=0`` fraction). Empty ``rank``/``step``/``param_list`` mean all.
    ``bounds`` None (or absent from ``config.json``): msprobe's default of the framework, ``[-1, 0, 1]`` until a
    monitor applies its own (:meth:`for_framework`); ``bounds_are_default`` says which.
    ``direction_format``: ``packed`` (1 bit per element, one archive per rank and step) or ``npy`` (msprobe's
    boolean ``.npy`` per parameter). ``checksum``: what L0's ``MD5`` column holds, ``md5`` (msprobe's, hashed on
    the host) or ``mix64`` (a checksum computed where the gradients are, written ``mix64:<16 hex digits>``: equal
    gradients give equal values, at device speed; see docs/monitor.md).

    The always-on tier (ours; the defaults are msprobe's behaviour, directions at every step): statistics at every
    probed step, directions only at steps ``0, N, 2N...`` (``directions_every_n_steps`` = N; 0: none on schedule)
    and, with ``directions_on_anomaly``, at the ``directions_steps_after_anomaly`` steps that follow a non-finite
    gradient or a gradient-norm spike (see :mod:`msprobe_mlflow.monitoring.directions_schedule`).
    """

    dump_path: str
    level: str = "L1"
    bounds: tuple[float, ...] | None = None
    param_list: tuple[str, ...] = ()
    rank: tuple[int, ...] = ()
    step: tuple[int, ...] = ()
    direction_format: str = "packed"
    checksum: str = "md5"
    directions_every_n_steps: int = TIER_DEFAULTS["directions_every_n_steps"]
    directions_on_anomaly: bool = TIER_DEFAULTS["directions_on_anomaly"]
    directions_steps_after_anomaly: int = TIER_DEFAULTS["directions_steps_after_anomaly"]
    source: str = field(default="GradProbeConfig", compare=False, repr=False)
    bounds_are_default: bool = field(default=False, init=False, compare=False, repr=False)

    def __post_init__(self):
        src = self.source
        if not isinstance(self.dump_path, (str, os.PathLike)) or not str(self.dump_path):
            _reject(src, "dump_path", self.dump_path, "a non-empty folder path")
        if not isinstance(self.level, str) or self.level not in LEVELS:  # a list would not hash
            _reject(src, "grad_probe.grad_level", self.level, f"one of {', '.join(LEVELS)} (exact case)")
        if self.direction_format not in DIRECTION_FORMATS:
            _reject(src, "direction_format", self.direction_format, f"one of {', '.join(DIRECTION_FORMATS)}")
        if self.checksum not in CHECKSUMS:
            _reject(src, "checksum", self.checksum, f"one of {', '.join(CHECKSUMS)}")
        if not isinstance(self.param_list, (list, tuple)) or not all(isinstance(p, str) for p in self.param_list):
            _reject(src, "grad_probe.param_list", self.param_list, "a list of exact parameter names (empty = all)")
        object.__setattr__(self, "dump_path", str(self.dump_path))
        object.__setattr__(self, "param_list", tuple(self.param_list))
        object.__setattr__(self, "bounds_are_default", self.bounds is None)
        object.__setattr__(self, "bounds", DEFAULT_BOUNDS if self.bounds is None else _bounds(src, self.bounds))
        object.__setattr__(self, "rank", _int_list(src, "rank", self.rank))
        object.__setattr__(self, "step", _int_list(src, "step", self.step))
        _check_tier(src, self.level, *self.tier_options(defaults=True).values())

    @property
    def has_directions(self) -> bool:
        return LEVELS[self.level].has_directions

    def tier_options(self, defaults: bool = False) -> dict:
        """The always-on tier's keys and values (those that differ from msprobe's behaviour, unless ``defaults``)."""
        return {key: getattr(self, key) for key, default in TIER_DEFAULTS.items()
                if defaults or getattr(self, key) != default}

    def wants_step(self, step: int) -> bool:
        return not self.step or step in self.step

    def wants_param(self, name: str) -> bool:
        return not self.param_list or name in self.param_list

    def replace(self, **changes) -> "GradProbeConfig":
        values = {f.name: getattr(self, f.name) for f in fields(self) if f.init}
        if self.bounds_are_default:
            values["bounds"] = None
        values.update(changes)
        return GradProbeConfig(**values)

    def for_framework(self, framework: str) -> "GradProbeConfig":
        """This config with msprobe's default bounds of ``framework`` (``pytorch``, ``mindspore``) when it has
        none of its own, so an unchanged ``config.json`` gives msprobe's CSV columns on either framework."""
        if not self.bounds_are_default:
            return self
        return self.replace(bounds=FRAMEWORK_DEFAULT_BOUNDS[framework])

    def to_msprobe_dict(self) -> dict:
        """The config as msprobe's ``config.json`` would hold it, plus our ``direction_format``, and ``checksum`` and
        the always-on tier's keys when they are not msprobe's behaviour."""
        return {
            "task": "grad_probe",
            "dump_path": self.dump_path,
            "rank": list(self.rank),
            "step": list(self.step),
            "grad_probe": {"grad_level": self.level, "param_list": list(self.param_list),
                           "bounds": list(self.bounds), **self.tier_options()},
            "direction_format": self.direction_format,
            **({"checksum": self.checksum} if self.checksum != "md5" else {}),
        }

    @classmethod
    def from_dict(cls, data: dict, source: str = "config", **overrides) -> "GradProbeConfig":
        """Reads msprobe's config layout; ``overrides`` (our own options, or any field) win over the file."""
        if not isinstance(data, dict):
            _reject(source, "(top level)", data, "a JSON object")
        if data.get("task") != "grad_probe":
            found = f"task = {data['task']!r}" if "task" in data else \
                f"no task key (top-level keys: {', '.join(sorted(map(str, data))) or 'none'})"
            raise ValueError(f"{source}: {found}; expected msprobe's grad_probe config.json, with \"task\": "
                             f"\"grad_probe\" (the only task this tool runs), \"dump_path\" and a \"grad_probe\" "
                             f"section")
        section = data.get("grad_probe", {})
        if not isinstance(section, dict):
            _reject(source, "grad_probe", section, "an object with grad_level, param_list, bounds")
        unknown = sorted(set(section) - set(GRAD_PROBE_KEYS))
        if unknown:  # a misspelt key would otherwise silently fall back to its default
            _reject(source, "grad_probe", section, f"only the keys {', '.join(GRAD_PROBE_KEYS)}; "
                                                   f"unknown: {', '.join(unknown)}")
        if "dump_path" not in data and "dump_path" not in overrides:
            _reject(source, "dump_path", None, "a folder path (the key is missing)")
        values = {
            "dump_path": data.get("dump_path"),
            "level": section.get("grad_level", "L1"),
            "bounds": section.get("bounds"),
            "param_list": section.get("param_list", []),
            "rank": data.get("rank", []),
            "step": data.get("step", []),
            "direction_format": data.get("direction_format", "packed"),
            "checksum": data.get("checksum", "md5"),
            **{key: section[key] for key in TIER_DEFAULTS if key in section},
        }
        values.update(overrides)
        return cls(**values, source=source)

    @classmethod
    def from_json(cls, path: str | os.PathLike, **overrides) -> "GradProbeConfig":
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from e
        return cls.from_dict(data, source=str(path), **overrides)


def load_config(config: GradProbeConfig | str | os.PathLike | dict) -> GradProbeConfig:
    """A config given as the dataclass, a ``config.json`` path or its parsed dict."""
    if isinstance(config, GradProbeConfig):
        return config
    if isinstance(config, dict):
        return GradProbeConfig.from_dict(config)
    return GradProbeConfig.from_json(config)


AUTOLOG_DUMP_PATH = "msprobe_dump"  # autolog()'s dump folder when it is given no config


def autolog_config(config, *, level: str | None = None, bounds=None, dump_path: str | None = None) -> GradProbeConfig:
    """What both frameworks' ``autolog()`` monitor with: ``config`` (or level L1 in ``./msprobe_dump``) with the
    ``level``, ``bounds`` and ``dump_path`` given overriding it."""
    overrides = {key: value for key, value in (("level", level), ("bounds", bounds), ("dump_path", dump_path))
                 if value is not None}
    if config is None:
        return GradProbeConfig(**{"dump_path": AUTOLOG_DUMP_PATH, **overrides}, source="autolog()")
    return load_config(config).replace(**overrides)
