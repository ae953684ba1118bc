"""The always-on tier: statistics at every probed step, gradient directions only where they matter, so that a long
run keeps every step's max, min, norm (and buckets) at a fraction of a full probe's cost.

Directions are recorded at steps ``0, N, 2N...`` (``directions_every_n_steps`` = N; counted in optimizer steps, so
two runs with the same N hold directions at the same steps and compare there) and, with ``directions_on_anomaly``,
at the ``directions_steps_after_anomaly`` = K steps that follow a trigger: a non-finite gradient appearing (a
parameter's norm NaN or infinite where the step before had none) or a gradient-norm spike, by the anomaly flags'
rule (:class:`msprobe_mlflow.anomaly_rule.SpikeRule`, the monitor's ``spike_threshold`` and ``spike_window``).
A run that stays non-finite triggers once, not at every step.

Why the trigger arms the steps *after* it: deciding on the training thread whether the current step is anomalous
would need its statistics on the host, a synchronisation with the device at every step. Instead the trigger is
found on the writer thread, from the statistics it receives anyway, and the training thread only reads a counter
(no lock, no device access) when it launches the next step. The K steps start with the first step launched after
the trigger is found: on the CPU usually the step right after it; when the writer runs behind, a few later. The
alternative, computing the sign bits every step and copying them only when wanted, would also record the trigger
step itself, but keeps much of the cost the tier removes: on the CPU the sign pass is a quarter to a half of the
statistics' time on the training thread (``launch_step_statistics`` at L1 on 16 float32 gradients of 2048 x 2048:
64-97 ms with signs, 48-55 ms without, on a shared 2-CPU machine; ``benchmarks/tier_benchmark.py`` measures the
monitor's time in training), and on a device it would hold a packed copy of every gradient until the writer thread
decides.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from msprobe_mlflow.anomaly_rule import AnomalyFlags, SpikeRule
from msprobe_mlflow.config import GradProbeConfig
from msprobe_mlflow.notices import Notices
from msprobe_mlflow.records import StepRecord

TIER_OPTIONS_SOURCE = "monitor options"  # what an error about a tier option given to a monitor starts with


@dataclass(frozen=True)
class TierOptions:
    """The always-on tier's monitor options: each one given (not None) overrides the config's ``grad_probe`` key of
    the same name (see :class:`~msprobe_mlflow.config.GradProbeConfig`). Each value is checked here; whether the
    combination suits the config (its level records directions, some step gets them) when :meth:`applied_to` it."""

    directions_every_n_steps: int | None = None
    directions_on_anomaly: bool | None = None
    directions_steps_after_anomaly: int | None = None

    def __post_init__(self):
        # Alone, beside values that accept any other: the config's own checks, with the config's messages.
        GradProbeConfig(dump_path=".", level="L1", directions_on_anomaly=True, source=TIER_OPTIONS_SOURCE) \
            .replace(**self.given())

    def given(self) -> dict:
        return {key: value for key, value in asdict(self).items() if value is not None}

    def applied_to(self, config: GradProbeConfig) -> GradProbeConfig:
        return config.replace(**self.given(), source=TIER_OPTIONS_SOURCE) if self.given() else config


class DirectionsSchedule:
    """Whether a step records gradient directions (:meth:`wants`, on the training thread), and the trigger that
    arms the next steps (:meth:`trigger`, from any thread). ``steps_after_trigger`` 0: triggers arm nothing."""

    def __init__(self, every_n_steps: int = 1, steps_after_trigger: int = 0):
        self.every_n_steps = every_n_steps
        self.steps_after_trigger = steps_after_trigger
        self.triggers = 0  # written by the trigger's thread only, read by the training thread: no lock needed
        self._seen_triggers = 0
        self._armed_until = -1

    @classmethod
    def of(cls, config: GradProbeConfig) -> "DirectionsSchedule":
        return cls(config.directions_every_n_steps,
                   config.directions_steps_after_anomaly if config.directions_on_anomaly else 0)

    @property
    def every_step(self) -> bool:
        """Directions at every step (msprobe's behaviour): nothing to schedule, nothing to trigger."""
        return self.every_n_steps == 1

    def armed_until(self, next_step: int) -> int:
        """The last step of the armed window (-1: none yet); a trigger fired since the last call starts a window of
        ``steps_after_trigger`` steps at ``next_step``, the next step to be probed."""
        if self.triggers != self._seen_triggers:
            self._seen_triggers = self.triggers
            self._armed_until = next_step + self.steps_after_trigger - 1
        return self._armed_until

    def wants(self, step: int) -> bool:
        """Whether optimizer step ``step``, about to be probed, records directions. Reads no device value."""
        return (self.every_n_steps > 0 and step % self.every_n_steps == 0) or step <= self.armed_until(step)

    def trigger(self) -> None:
        """Arms directions for the ``steps_after_trigger`` steps from the next one probed."""
        self.triggers += 1


class DirectionsTrigger:
    """A sink (``handle``/``flush``/``close``, on the writer thread) that fires the schedule's trigger from each
    step's norms: a non-finite gradient appearing, or a spike by ``rule``. Logs each trigger; the anomaly flags
    sink, when on, reports the anomalies themselves."""

    def __init__(self, schedule: DirectionsSchedule, rule: SpikeRule, rank: int = 0, notices: Notices | None = None):
        self.schedule = schedule
        self.flags = AnomalyFlags(rule)
        self.rank = rank
        self.notices = notices or Notices()
        self._was_nonfinite = False

    def handle(self, record: StepRecord) -> None:
        flags = self.flags.flags_of(record)
        nonfinite = [flag for flag in flags if flag.kind == "nonfinite"]
        spikes = [flag for flag in flags if flag.kind != "nonfinite"]
        onset, self._was_nonfinite = bool(nonfinite) and not self._was_nonfinite, bool(nonfinite)
        if not onset and not spikes:
            return
        self.schedule.trigger()
        found = ", ".join(flag.describe() for flag in (nonfinite if onset else []) + spikes)
        self.notices.log(f"rank {self.rank}: step {record.step} has {'non-finite gradients' if onset else 'spikes'}"
                         f" ({found[:300]}); gradient directions are recorded for the next "
                         f"{self.schedule.steps_after_trigger} probed step(s)")

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def directions_sinks(schedule: DirectionsSchedule, rule: SpikeRule, rank: int, notices: Notices) -> list:
    """The trigger sink when the schedule has something to arm, else none."""
    if schedule.every_step or not schedule.steps_after_trigger:
        return []
    return [DirectionsTrigger(schedule, rule, rank, notices)]
