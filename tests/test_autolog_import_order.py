"""``msprobe_mlflow.autolog()`` and the frameworks in any import order, each in a fresh interpreter (the order is
what is tested, and this process has imported both already).

The order MLflow users write, autolog first, once killed the interpreter with MindSpore: the patch went in from a
hook on ``mindspore.train``, which ran while ``mindspore/__init__.py`` was half done ("partially initialized
module 'mindspore'", then "Fatal Python error: PyThreadState_Get", exit 134). Each script trains, and the test
reads back from MLflow that every framework's training was probed.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from mlflow_stores import sqlite_uri

pytest.importorskip("mindspore", reason="MindSpore is not installed (the torch-only stage)")

TESTS = Path(__file__).resolve().parent

SCRIPT = """
import sys
from pathlib import Path
sys.path[:0] = [{tests!r}, {repo!r}]
import mlflow, msprobe_mlflow
mlflow.set_tracking_uri({uri!r})
{before}
msprobe_mlflow.autolog(dump_path={dump!r})
{after}
if "mindspore" in sys.modules:
    from mindspore_training import assert_steps_match_numpy, batches, dense, sgd_model
    net = dense()
    with mlflow.start_run() as run:
        sgd_model(net).train(1, batches(), dataset_sink_mode=False)
    assert_steps_match_numpy(Path({dump!r}, run.info.run_id), [p.name for p in net.trainable_params()])
    print("mindspore", run.info.run_id)
if "torch" in sys.modules:
    import torch
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with mlflow.start_run() as run:
        for _ in range(3):
            optimizer.zero_grad()
            model(torch.ones(4, 3)).sum().backward()
            optimizer.step()
    print("torch", run.info.run_id)
"""



def probed_frameworks(tmp_path: Path, before: str, after: str) -> dict[str, list[int]]:
    """Runs the script with ``before`` and ``after`` around ``autolog()``; returns, per framework it trained, the
    steps at which that training's run got ``grad/rank0/total_norm``."""
    uri = sqlite_uri(tmp_path)
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(tests=str(TESTS), repo=str(TESTS.parent), uri=uri, before=before, after=after,
                                    dump=str(tmp_path / "dump")))
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"exit code {done.returncode}\n{done.stderr[-3000:]}"
    runs = dict(line.split() for line in done.stdout.splitlines() if line.startswith(("mindspore ", "torch ")))
    return {framework: [m.step for m in MlflowClient(uri).get_metric_history(run_id, "grad/rank0/total_norm")]
            for framework, run_id in runs.items()}


@pytest.mark.parametrize("first_import", ["import mindspore", "import mindspore.train", "from mindspore import nn"])
def test_autolog_before_mindspore_is_imported(tmp_path, first_import):
    after = f"assert 'mindspore' not in sys.modules, 'autolog() imported mindspore'\n{first_import}"
    assert probed_frameworks(tmp_path, "", after) == {"mindspore": [0, 1, 2]}


@pytest.mark.parametrize("before, after", [
    ("", "import torch\nimport mindspore"),
    ("", "import mindspore\nimport torch"),
    ("import torch", "import mindspore"),
    ("import mindspore", "import torch"),
], ids=["autolog-torch-mindspore", "autolog-mindspore-torch", "torch-autolog-mindspore", "mindspore-autolog-torch"])
def test_both_frameworks_in_any_order(tmp_path, before, after):
    pytest.importorskip("torch", reason="the MindSpore-only stage")
    assert probed_frameworks(tmp_path, before, after) == {"mindspore": [0, 1, 2], "torch": [0, 1, 2]}
