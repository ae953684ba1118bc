"""What a run page shows: MLflow's UI makes each metric key's part before the last ``/`` a section and the rest a
chart's title. The L2 bucket charts are titled in plain words, and the words are checked here by a reader that
knows only those words, against shares counted with numpy from the gradients the optimizer applied; no chart is
flat by construction; a loop that records before clipping says so on the run."""
from __future__ import annotations

import math
import re

import mlflow
import numpy as np
import torch
from mlflow.tracking import MlflowClient

from msprobe_mlflow import GradProbeConfig
from msprobe_mlflow.pytorch import GradientMonitor
from tiny_models import mlp, train

BOUNDS = [-0.05, 0, 0.05]
STEPS = 3


def read_title(title: str):
    """The test ``g`` must pass for a bucket chart titled ``title`` (``2 over -0.05 up to 0``, ``exactly 0``)."""
    if title == "exactly 0":
        return lambda g: g == 0
    words = re.fullmatch(r"\d+ (?:over (\S+))? ?(?:(?:up to|at most) (\S+))?", title)
    assert words, f"a bucket title not in plain words: {title!r}"
    low, high = (float(w) if w else None for w in words.groups())
    return lambda g: (g > low if low is not None else True) & (g <= high if high is not None else True)


def recorded_training(monitor: GradientMonitor, *, clip: float | None = None, before_clipping: bool = False):
    """A few SGD steps of a small model under ``monitor`` (stopped after them); returns the gradients of each step
    as recorded (float64 numpy)."""
    recorded = []

    def record(step, model):
        if before_clipping:
            monitor.record_gradients()
        recorded.append(np.concatenate([p.grad.double().numpy().ravel() for p in model.parameters()]))
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)

    train(mlp(8, 16, 3), STEPS, monitor=monitor, after_backward=record,
          data=lambda step, generator: (torch.randn(32, 8, generator=generator),
                                        3 * torch.randn(32, 3, generator=generator)))
    monitor.stop()
    return recorded


def histories(run_id: str) -> dict[str, list[float]]:
    client = MlflowClient()
    return {key: [m.value for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)]
            for key in client.get_run(run_id).data.metrics}


def test_bucket_chart_titles_say_in_words_what_their_values_count(tmp_experiment, tmp_path):
    with mlflow.start_run() as run:
        grads = recorded_training(GradientMonitor(GradProbeConfig(dump_path=str(tmp_path / "dump"), level="L2",
                                                                  bounds=BOUNDS)))
    charts = histories(run.info.run_id)
    sections = {}
    for key in charts:
        section, title = key.rsplit("/", 1)
        sections.setdefault(section, []).append(title)
    assert {section: sorted(titles) for section, titles in sections.items()} == {
        "grad/rank0": ["max", "min", "total_norm"],
        "grad/rank0/share of gradient elements": ["1 at most -0.05", "2 over -0.05 up to 0", "3 over 0 up to 0.05",
                                                  "4 over 0.05", "exactly 0"]}
    for title in sections["grad/rank0/share of gradient elements"]:
        expected = [float(np.mean(read_title(title)(g.astype(np.float32)))) for g in grads]
        assert charts[f"grad/rank0/share of gradient elements/{title}"] == expected, title
    for key in ("grad/rank0/total_norm", "grad/rank0/max", "grad/rank0/min"):  # none of them flat by construction
        assert len(set(charts[key])) == STEPS, key


def test_a_loop_that_records_before_clipping_says_its_total_norm_is_the_norm_before_clipping(tmp_experiment,
                                                                                              tmp_path):
    with mlflow.start_run() as run:
        grads = recorded_training(GradientMonitor(GradProbeConfig(dump_path=str(tmp_path / "dump"), level="L1")),
                                  clip=0.01, before_clipping=True)
    norms = histories(run.info.run_id)["grad/rank0/total_norm"]
    np.testing.assert_allclose(norms, [np.linalg.norm(g) for g in grads], rtol=1e-6)
    assert min(norms) > 10 * 0.01 and not math.isclose(norms[0], norms[-1])  # not the clip value: the real norm
    assert MlflowClient().get_run(run.info.run_id).data.tags["msprobe_mlflow.gradients_recorded"] == \
        "at record_gradients(), before clipping: total_norm is the norm before clipping"
