"""The exponent pictures (:mod:`msprobe_mlflow.exponent_pictures`) of a rank into its run: the whole model's and
each parameter group's at :data:`SLIDER_STEPS` steps spread over the run, each filled up to its step, as MLflow's
step-slider images (``log_image(key=..., step=...)``: the run page's image charts), and every panel at the last
step as the summary figure ``grad_probe/rank{R}/gradient_exponents.png``, drawn again when an image was logged.

Drawn from the local dump by the live sink's rank that owns the run, while training runs at the first and the
latest step (after ``sinks/mlflow/settings.PICTURE_SECONDS``, then twice as long after each: a long run's slider
grows by a picture per doubling, and a user watching it sees where its gradients sit) and when the run ends, and by
``msprobe-mlflow upload``. A picture costs a tenth of a second of the interpreter, which training shares (unless the
sink's requests run in a process of their own). An image already in the run at its key and step is not logged
again."""
from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

from mlflow.tracking import MlflowClient

from msprobe_mlflow.dump import exponents_path, rank_dir, relative_rank_dir, summary_steps
from msprobe_mlflow.vocabulary import (ARTIFACT_ROOT, EXPONENT_IMAGES_KEY, EXPONENT_SUMMARY_FILE_NAME,
                                       MLFLOW_IMAGES_FOLDER)

SLIDER_STEPS = 6  # images per panel: 9 panels at most, a few seconds of drawing and 2 files each
_NOT_IN_KEYS = re.compile(r"[^A-Za-z0-9_\-./ ]")  # what MLflow's log_image refuses in a key


def image_key(rank: int, index: int, panel: str) -> str:
    """``gradient exponents/rank{R}/{index} {panel}``: the run page orders its charts by name, the whole model
    (index 0) first, then the groups in the model's order (at most 9 panels: one digit)."""
    return _NOT_IN_KEYS.sub("_", f"{EXPONENT_IMAGES_KEY}/rank{rank}/{index} {panel}")


def logged_images(client: MlflowClient, run_id: str) -> set[tuple[str, int]]:
    """(key, step) of the step-slider images in the run: MLflow names them ``images/{key, / as ~}+step+{S}+...``
    (``%`` before MLflow 3.10)."""
    found = set()
    for info in client.list_artifacts(run_id, MLFLOW_IMAGES_FOLDER):
        parts = re.split(r"[+%]", info.path.rsplit("/", 1)[-1])
        if len(parts) > 2 and parts[1] == "step" and parts[2].isdigit():
            found.add((parts[0].replace("~", "/"), int(parts[2])))
    return found


def log_exponent_pictures(client: MlflowClient, run_id: str, dump_path: str | os.PathLike, rank: int,
                          mlflow_step_offset: int = 0, first_and_latest: bool = False) -> int:
    """Logs ``rank``'s pictures (see the module docstring), at :data:`SLIDER_STEPS` steps or, ``first_and_latest``
    (while training runs), at the first and the last step in the dump (MLflow's slider opens at step 0); returns
    how many files it sent (an image is two: its PNG and MLflow's smaller copy; 0 where the dump holds no exponent
    counts)."""
    steps = [s for s in summary_steps(rank_dir(dump_path, rank)) if exponents_path(dump_path, rank, s).is_file()]
    if not steps:
        return 0
    # matplotlib (a quarter of a second) only here: the live sink imports this module when a monitor starts
    from msprobe_mlflow.exponent_pictures import ExponentHistory, drawn_steps, pictures, save_summary

    history = ExponentHistory.read(dump_path, rank, steps)
    ends = sorted({history.steps[0], history.steps[-1]})
    slider = ends if first_and_latest else drawn_steps(history.steps, SLIDER_STEPS)
    present, logged = logged_images(client, run_id), 0
    for index, panel in enumerate(history.counts):
        key = image_key(rank, index, panel)
        wanted = [s for s in slider if (key, s + mlflow_step_offset) not in present]
        for step, image in zip(wanted, pictures(history, panel, wanted, f"rank {rank}: {panel}")):
            client.log_image(run_id, image, key=key, step=step + mlflow_step_offset)
            logged += 2
    folder = f"{ARTIFACT_ROOT}/{relative_rank_dir(rank)}"
    summary = f"{folder}/{EXPONENT_SUMMARY_FILE_NAME}"
    if not logged and summary in {info.path for info in client.list_artifacts(run_id, folder)}:
        return 0  # every picture was there: the run holds these steps already
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / EXPONENT_SUMMARY_FILE_NAME
        save_summary(history, path, f"rank {rank}, steps {history.steps[0]} to {history.steps[-1]}")
        client.log_artifact(run_id, str(path), folder)
    return logged + 1
