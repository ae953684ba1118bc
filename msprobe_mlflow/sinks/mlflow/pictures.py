"""The exponent pictures while training runs (``tracking/exponent_images.py``), drawn by the run owner's sink at
the latest step (and once at the first, where MLflow's slider opens) after ``settings.PICTURE_SECONDS``, then after
twice as long each time: a user watching a long run sees where its gradients sit long before it ends, its slider
gains a picture per doubling (8 over three days at the default 600 s), and the drawing costs a few seconds in all.
The full set is drawn when the run ends (``MlflowSink.close``)."""
from __future__ import annotations

import math
import time

from msprobe_mlflow.notices import Notices
from msprobe_mlflow.sinks.mlflow import settings
from msprobe_mlflow.tracking.request_process import RoundRequests


class PicturesWhileTraining:
    def __init__(self, requests: RoundRequests, dump_path: str, rank: int, mlflow_step_offset: int,
                 notices: Notices):
        self.requests, self.dump_path, self.rank, self.offset = requests, dump_path, rank, mlflow_step_offset
        self.notices = notices
        self.counted = False  # a step with exponent counts was handed in: there is something to draw
        self._wait = settings.PICTURE_SECONDS
        self._due = time.monotonic() + self._wait

    def between_rounds(self) -> None:
        """Draws and logs the pictures at the latest step (and the first) when they are due (the sink's thread,
        after a round that went through); a failure is said once, and the pictures wait for the run's end."""
        if not self.counted or time.monotonic() < self._due:
            return
        try:
            self.requests.send_exponent_pictures(self.dump_path, self.rank, self.offset, True)
        except Exception as e:
            self._due = math.inf
            self.notices.warn(f"rank {self.rank}: the exponent pictures could not be drawn while training runs "
                              f"({e}); they are drawn when the run ends, or by `msprobe-mlflow upload`")
            return
        self._wait *= 2
        self._due = time.monotonic() + self._wait
