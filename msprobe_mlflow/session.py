"""What every gradient monitor shares, whatever the framework: the config, the writer thread, the local dump
and the MLflow sink. A monitor only turns its framework's gradients into a pending :class:`StepRecord`."""
from __future__ import annotations

import atexit
import json
import os
import warnings
import weakref
from pathlib import Path
from typing import Callable

from msprobe_mlflow.background import BackgroundStepWriter, PendingStep, StepHandler
from msprobe_mlflow.config import GradProbeConfig
from msprobe_mlflow.dump import write_step
from msprobe_mlflow.safe_paths import atomic_write_bytes
from msprobe_mlflow.tracking.options import TrackingOptions

DUMP_CONFIG_FILE_NAME = "msprobe_mlflow_config.json"


def load_config(config: GradProbeConfig | str | os.PathLike | dict) -> GradProbeConfig:
    """A config given as the dataclass, a ``config.json`` path or its parsed dict."""
    if isinstance(config, GradProbeConfig):
        return config
    if isinstance(config, dict):
        return GradProbeConfig.from_dict(config)
    return GradProbeConfig.from_json(config)


def ensure_writable_folder(path: str) -> None:
    """Fails before training starts, not mid-run, when the dump folder cannot be written."""
    folder = Path(path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".msprobe-mlflow-write-test-{os.getpid()}"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"dump_path = {path!r} is not a writable folder ({e.strerror or e})") from e


class ProbeSession:
    """One monitoring session: a writer thread that writes each step to the local dump, then hands it to the
    MLflow sink (when a run is found: ``tracking``) and to ``handlers``.

    ``share_run_id`` turns this process's run ID into the one every rank uses (a broadcast from rank 0 under
    torch.distributed); it must be called on every rank, so sessions of a distributed job start together.
    """

    def __init__(self, config: GradProbeConfig, *, framework: str, rank: int = 0, world_size: int = 1,
                 tracking=None, share_run_id: Callable[[str | None], str | None] = lambda run_id: run_id,
                 handlers: list[StepHandler] = ()):
        ensure_writable_folder(config.dump_path)
        self.config = config
        self.framework = framework
        atomic_write_bytes(Path(config.dump_path) / DUMP_CONFIG_FILE_NAME, json.dumps(
            {"framework": framework, "config": config.to_msprobe_dict()}, indent=2).encode())
        self.sink = None
        if tracking is not None:
            run_id = share_run_id(tracking.local_run_id())
            if run_id and config.wants_rank(rank):
                from msprobe_mlflow.tracking.sink import MlflowSink

                self.sink = MlflowSink(run_id, config, tracking, framework=framework, rank=rank,
                                       world_size=world_size)
        sinks = [self.sink] if self.sink else []
        self._writer = BackgroundStepWriter([self._write_local_dump, *sinks, *handlers])
        self.closed = False
        _open_sessions.add(self)

    @property
    def run_id(self) -> str | None:
        return self.sink.run_id if self.sink else None

    def _write_local_dump(self, record) -> None:
        write_step(self.config.dump_path, record, self.config.direction_format)

    def submit(self, pending: PendingStep) -> None:
        self._writer.submit(pending)

    @property
    def errors(self) -> list[str]:
        """What the writer thread could not do (each also logged)."""
        return list(self._writer.errors)

    def flush(self) -> None:
        """Waits until every submitted step is on disk and handed to every handler."""
        self._writer.flush()

    def close(self) -> None:
        """Writes what is pending, then lets the sink finish its uploads. Safe to call twice; ``errors`` and
        ``run_id`` stay readable afterwards."""
        if self.closed:
            return
        self.closed = True
        self._writer.close()
        if self.sink:
            self.sink.close()
        _open_sessions.discard(self)
        if self._writer.errors:
            warnings.warn(f"msprobe-mlflow: {len(self._writer.errors)} write failure(s); first: "
                          f"{self._writer.errors[0]}")


class SessionMonitor:
    """What both framework monitors offer on top of their one :class:`ProbeSession`; each adds ``monitor()``,
    ``stop()`` (which must close the session) and its way of turning gradients into pending steps.

    MLflow: into ``run_id``, else the active run (else ``MLFLOW_RUN_ID``); with none, the local dump only;
    ``log_to_mlflow=False`` turns it off. ``handlers`` run on the writer thread after the local dump for each
    :class:`StepRecord`.
    """

    def __init__(self, config: GradProbeConfig | str | os.PathLike | dict, *, run_id: str | None = None,
                 tracking_uri: str | None = None, log_every_n_steps: int = 1, param_metrics=(),
                 log_to_mlflow: bool = True, silent: bool = False, handlers: list[StepHandler] = ()):
        self.config = load_config(config)
        self.tracking = TrackingOptions(run_id, tracking_uri, log_every_n_steps, param_metrics, silent) \
            if log_to_mlflow else None
        self.step = 0
        self._extra_handlers = list(handlers)
        self._session: ProbeSession | None = None

    @property
    def run_id(self) -> str | None:
        """The MLflow run this monitor logs into (None: the local dump only)."""
        return self._session.run_id if self._session else None

    @property
    def errors(self) -> list[str]:
        """What the writer thread could not do (each also logged); still readable after ``stop()``."""
        return self._session.errors if self._session else []

    def flush(self) -> None:
        """Waits until every probed step is on disk (and through the other handlers)."""
        if self._session:
            self._session.flush()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


_open_sessions: "weakref.WeakSet[ProbeSession]" = weakref.WeakSet()


@atexit.register
def _close_open_sessions() -> None:
    """Interpreter exit writes and uploads what training submitted but the threads had not finished."""
    for session in list(_open_sessions):
        session.close()
