"""Which steps a monitor traces, and how: ``trace_steps``, ``trace_level`` (msprobe's L0 modules, L1 operators,
mix both), or msprobe's own data-dump ``config.json`` (task ``statistics``: its ``step``, ``level``, ``scope`` and
``list``) as it is. ``MSPROBE_MLFLOW_TRACE_STEPS`` adds steps, so a training script reruns unchanged with a trace."""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

LEVELS = ("L0", "L1", "mix")
TRACE_STEPS_VARIABLE = "MSPROBE_MLFLOW_TRACE_STEPS"
TRACE_SAVE_VARIABLE = "MSPROBE_MLFLOW_TRACE_SAVE"  # calls whose inputs are saved for the replay: "A.b.c.0.forward,..."
_CALL_NAME = re.compile(r"^[A-Za-z_][\w.]*\.\d+\.(forward|backward)$")
_STEP_LIST = re.compile(r"^\s*\d+(\s*-\s*\d+)?(\s*,\s*\d+(\s*-\s*\d+)?)*\s*$")


@dataclass(frozen=True)
class TracePlan:
    """What a monitor traces, resolved: the steps (the environment's included), level, scope and list."""
    steps: frozenset[int]
    level: str = "mix"
    scope: tuple[str, ...] = ()
    api_list: tuple[str, ...] = ()
    save: tuple[str, ...] = ()  # call names whose inputs and outputs are saved (which side is wrong)


@dataclass(frozen=True)
class TraceOptions:
    trace_steps: tuple[int, ...] = ()
    trace_level: str = "mix"
    trace_config: str | None = None  # msprobe's config.json, task "statistics"
    trace_save: tuple[str, ...] = ()  # call names (``Aten.gelu.default.1.forward``) whose inputs are saved

    def __post_init__(self):
        steps = self.trace_steps
        if not isinstance(steps, (list, tuple, set, frozenset, range)) or \
                not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in steps):
            raise ValueError(f"trace_steps = {steps!r} is not accepted; expected a list of steps (integers >= 0), "
                             f"e.g. [120]")
        object.__setattr__(self, "trace_steps", tuple(sorted(set(steps))))
        if self.trace_level not in LEVELS:
            raise ValueError(f"trace_level = {self.trace_level!r} is not accepted; expected one of msprobe's "
                             f"{', '.join(LEVELS)}")
        if not isinstance(self.trace_save, (list, tuple)) or not all(_CALL_NAME.match(str(n)) for n in self.trace_save):
            raise ValueError(f"trace_save = {self.trace_save!r} is not accepted; expected call names as locate prints "
                             f"them, e.g. ['Aten.gelu.default.1.forward']")
        object.__setattr__(self, "trace_save", tuple(self.trace_save))
        if self.trace_config is not None:
            self.plan(environment={})  # a bad config is refused now, not at the traced step

    def plan(self, environment=os.environ) -> TracePlan:
        steps, level, scope, api_list = set(self.trace_steps), self.trace_level, (), ()
        if self.trace_config is not None:
            config_steps, level, scope, api_list = _msprobe_config(self.trace_config)
            steps |= config_steps
        steps |= steps_from_environment(environment.get(TRACE_STEPS_VARIABLE))
        save = tuple(self.trace_save) + calls_from_environment(environment.get(TRACE_SAVE_VARIABLE))
        return TracePlan(frozenset(steps), level, scope, api_list, save)


def steps_from_environment(value: str | None) -> set[int]:
    """``"120"``, ``"120,130"`` or ``"120-122"``; empty or unset: none."""
    if value is None or not value.strip():
        return set()
    if not _STEP_LIST.match(value):
        raise ValueError(f"{TRACE_STEPS_VARIABLE}={value!r} is not accepted; expected steps such as 120, "
                         f"120,130 or 120-122")
    steps = set()
    for part in value.split(","):
        first, _, last = part.partition("-")
        steps.update(range(int(first), int(last or first) + 1))
    return steps


def calls_from_environment(value: str | None) -> tuple[str, ...]:
    """``"Aten.gelu.default.1.forward"``, several separated by commas; empty or unset: none."""
    names = tuple(n.strip() for n in (value or "").split(",") if n.strip())
    bad = [n for n in names if not _CALL_NAME.match(n)]
    if bad:
        raise ValueError(f"{TRACE_SAVE_VARIABLE}={value!r} is not accepted: {bad[0]!r} is no call name as locate "
                         f"prints them (e.g. Aten.gelu.default.1.forward)")
    return names


def _msprobe_config(path: str) -> tuple[set[int], str, tuple[str, ...], tuple[str, ...]]:
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"trace_config = {path!r} cannot be read as msprobe's config.json: {e}") from None
    if not isinstance(config, dict) or config.get("task") != "statistics":
        task = config.get("task") if isinstance(config, dict) else None
        raise ValueError(f"{path}: task is {task!r}; a trace is msprobe's data dump with task 'statistics'")
    level = config.get("level", "L1")
    if level not in LEVELS:
        raise ValueError(f"{path}: level is {level!r}; a trace takes msprobe's {', '.join(LEVELS)}")
    steps = config.get("step") or []
    if not isinstance(steps, list) or not all(isinstance(s, int) and s >= 0 for s in steps):
        raise ValueError(f"{path}: step is {steps!r}; expected a list of steps")
    if not steps:
        raise ValueError(f"{path}: step is empty, which msprobe reads as every step; a trace records the steps "
                         f"named: give them (e.g. \"step\": [120])")
    task = config.get("statistics") or {}
    scope, api_list = task.get("scope") or [], task.get("list") or []
    for name, value in (("statistics.scope", scope), ("statistics.list", api_list)):
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ValueError(f"{path}: {name} is {value!r}; expected a list of names")
    if scope and len(scope) != 2:
        raise ValueError(f"{path}: statistics.scope is {scope!r}; expected its first and last entry")
    return set(steps), level, tuple(scope), tuple(api_list)
