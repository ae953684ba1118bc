"""Every Python snippet of docs/mindspore_monitor.md and of the README's MindSpore section runs as written, each in
a fresh interpreter, and probes the training it shows.

The snippets use what a user already has (a network ``net``, ``loss_fn``, ``optimizer``, ``dataset``, ``grad_fn``,
``train_net``, ``model``, ``epochs`` and a ``config.json``): they cannot run without them, so :data:`USERS_OWN`
defines tiny ones first. Nothing of a snippet's own text is changed.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

pytest.importorskip("mindspore", reason="MindSpore is not installed (the torch-only stage)")

from mlflow_stores import sqlite_uri  # noqa: E402
from msprobe_mlflow.dump import summary_steps  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

USERS_OWN = """
import json
import mindspore, mlflow, numpy as np
from mindspore import nn
mlflow.set_tracking_uri("sqlite:///mlflow.db")
rng = np.random.default_rng(0)
net = nn.Dense(5, 3)
loss_fn = nn.MSELoss()
optimizer = nn.SGD(net.trainable_params(), learning_rate=0.01)
dataset = mindspore.dataset.NumpySlicesDataset({"x": rng.standard_normal((12, 5)).astype(np.float32),
                                                "y": rng.standard_normal((12, 3)).astype(np.float32)},
                                               shuffle=False).batch(4)  # 3 steps an epoch
grad_fn = mindspore.value_and_grad(lambda x, y: loss_fn(net(x), y), None, net.trainable_params())
train_net = nn.TrainOneStepCell(nn.WithLossCell(net, loss_fn), optimizer)
model = mindspore.train.Model(net, loss_fn=loss_fn, optimizer=optimizer)
epochs = 2
with open("config.json", "w") as config:
    json.dump({"task": "grad_probe", "dump_path": "dump", "grad_probe": {"grad_level": "L1"}}, config)
"""


def python_snippets(path: Path, section: str | None = None) -> list[tuple[str, str]]:
    """``(id, code)`` of each fenced ``python`` block of ``path`` (of its ``## {section}`` only, if given)."""
    text = path.read_text(encoding="utf-8")
    if section is not None:
        text = text.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)
    return [(f"{path.name}-{number}", code) for number, code in enumerate(blocks)]


SNIPPETS = python_snippets(REPO / "docs" / "mindspore_monitor.md") + python_snippets(
    REPO / "README.md", "Gradient monitor (MindSpore)")


def test_the_snippets_are_found():
    """Guards the extraction: the docs show five MindSpore snippets, the README one."""
    assert [name.rsplit("-", 1)[0] for name, _ in SNIPPETS] == ["mindspore_monitor.md"] * 5 + ["README.md"]


@pytest.mark.parametrize("code", [code for _, code in SNIPPETS], ids=[name for name, _ in SNIPPETS])
def test_a_snippet_runs_as_written_and_probes_its_training(tmp_path, code):
    script = tmp_path / "snippet.py"
    script.write_text(f"{USERS_OWN}\n# the snippet, as written\n{code}")
    env = {name: value for name, value in os.environ.items() if not name.startswith("MLFLOW_")}
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={**env, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr[-3000:]
    # the dump: config.json's, or autolog's default ./msprobe_dump/{run_id}; every step of the training it shows
    dumps = sorted(tmp_path.glob("**/rank0"))
    assert dumps, f"no dump under {tmp_path}"
    for dump in dumps:
        steps = summary_steps(dump)
        assert len(steps) >= 3 and steps == list(range(len(steps))), (dump, steps)
    # every run the snippet logged into got each probed step
    client = MlflowClient(sqlite_uri(tmp_path))  # USERS_OWN's sqlite:///mlflow.db, in the snippet's folder
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    for run in runs:
        logged = [m.step for m in client.get_metric_history(run.info.run_id, "grad/rank0/total_norm")]
        assert logged in [summary_steps(dump) for dump in dumps], (run.info.run_name, logged)
    assert runs or not re.search(r"\bmlflow\.", code), "the snippet uses MLflow but no run was logged into"
