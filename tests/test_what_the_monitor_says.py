"""What a monitor tells its user, on real torch, MindSpore and MLflow: one line on stderr when it starts (the run,
the dump folder, the level, the live verdict's baseline) and one when it ends (the steps, the dump's size, the
anomaly flags, the live verdict), silenced by ``silent=True``; its warnings as one line each, other libraries'
warnings untouched; and a failed rank's reason as the run's tag, without MindSpore's banner, never cut mid-word."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import mlflow
import pytest
import torch
from mlflow.tracking import MlflowClient

from msprobe_mlflow import GradProbeConfig
from msprobe_mlflow.dump import findings_dir, read_csv
from msprobe_mlflow.notices import MsprobeMlflowWarning, Notices
from msprobe_mlflow.pytorch import GradientMonitor
from msprobe_mlflow.session import failure_reason
from test_live_verdicts import PERTURBED_FROM, STEPS, monitored_training
from test_tracking_distributed import torchrun
from tiny_models import total, train

REPO = Path(__file__).resolve().parents[1]


def said(text: str) -> list[str]:
    """The monitor's lines in a stream (the start and end lines, and its warnings)."""
    return [line for line in text.splitlines() if line.startswith("msprobe-mlflow: ")]


def folder_size_in_kb(folder: Path) -> str:
    size = sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())
    assert 1000 <= size < 1_000_000  # this test's dumps
    return f"{size / 1000:.1f} KB"


def train_three_steps(dump: Path, nan_at: int | None = None, **options) -> GradientMonitor:
    """A linear layer trained 3 steps; ``nan_at``: that step's input is NaN."""
    torch.manual_seed(0)
    with GradientMonitor(GradProbeConfig(dump_path=str(dump), level="L1"), **options) as monitor:
        train(torch.nn.Linear(4, 2), 3, monitor=monitor, loss=total,
              data=lambda step, _: (torch.full((2, 4), float("nan") if step == nan_at else 1.0), None))
    return monitor


# --- the start and end lines ----------------------------------------------------------------------------------------

def test_a_monitor_says_where_its_steps_go_when_it_starts_and_what_it_left_when_it_ends(sqlite_store, tmp_experiment,
                                                                                          tmp_path, capsys):
    with mlflow.start_run() as run:
        train_three_steps(tmp_path / "dump")
    assert said(capsys.readouterr().err) == [
        f"msprobe-mlflow: probing gradients at level L1 into MLflow run {run.info.run_id} at {sqlite_store[0]}; "
        f"dump: {tmp_path / 'dump'}; no live verdict",
        f"msprobe-mlflow: done: 3 steps, {folder_size_in_kb(tmp_path / 'dump' / 'rank0')} in "
        f"{tmp_path / 'dump' / 'rank0'}; anomalies: none"]


def test_silent_sends_the_two_lines_to_the_logger_and_nothing_to_stderr(tmp_path, capsys, caplog):
    with caplog.at_level(logging.INFO, logger="msprobe_mlflow"):
        train_three_steps(tmp_path / "dump", log_to_mlflow=False, silent=True)
    assert said(capsys.readouterr().err) == []
    lines = [record.getMessage() for record in caplog.records if record.levelno == logging.INFO]
    assert lines == [f"msprobe-mlflow: probing gradients at level L1 into no MLflow run (the local dump only); "
                     f"dump: {tmp_path / 'dump'}; no live verdict",
                     f"msprobe-mlflow: done: 3 steps, {folder_size_in_kb(tmp_path / 'dump' / 'rank0')} in "
                     f"{tmp_path / 'dump' / 'rank0'}; anomalies: none"]


def test_the_end_line_counts_the_anomaly_flags_from_their_first_step(tmp_path, capsys):
    with pytest.warns(UserWarning, match="non-finite gradients at step 2"):
        train_three_steps(tmp_path / "dump", nan_at=2, log_to_mlflow=False)
    flags = findings_dir(tmp_path / "dump", 0) / "anomalies.csv"
    rows = read_csv(flags)[1:]
    assert [(row[0], row[2], row[3]) for row in rows] == [("2", "weight", "nonfinite")]  # d/d bias is 1 still
    assert said(capsys.readouterr().err)[-1].endswith(f"; anomalies: 1 flag from step 2 ({flags})")


def test_the_end_line_gives_the_live_verdict(tmp_path, capsys):
    monitored_training(tmp_path / "baseline").stop()
    monitored_training(tmp_path / "same", baseline=str(tmp_path / "baseline")).stop()
    assert said(capsys.readouterr().err)[-1].endswith(f"; live verdict: consistent, {STEPS} steps compared")
    with pytest.warns(UserWarning, match="is suspicious against baseline"):
        monitored_training(tmp_path / "other", baseline=str(tmp_path / "baseline"), perturbation="data").stop()
    lines = said(capsys.readouterr().err)
    assert lines[0].endswith(f"; live verdict against baseline {tmp_path / 'baseline'}")
    verdict = findings_dir(tmp_path / "other", 0) / "verdict.json"
    assert lines[-1].endswith(f"; live verdict: suspicious from step {PERTURBED_FROM} ({verdict})")


def test_under_torchrun_the_start_is_said_once_and_each_rank_says_its_end(tmp_path, tmp_sqlite_uri):
    done = torchrun(tmp_sqlite_uri, "--dump", str(tmp_path / "dump"), "--steps", "3", "--level", "L1")
    assert done.returncode == 0, done.stderr[-3000:]
    run_id = done.stdout.split("RUN_ID ")[1].split()[0]
    lines = said(done.stderr)
    assert [line for line in lines if "probing gradients" in line] == [
        f"msprobe-mlflow: probing gradients at level L1 (2 ranks) into MLflow run {run_id} at "
        f"{tmp_sqlite_uri}; dump: {tmp_path / 'dump'}; no live verdict"]
    ends = sorted(line for line in lines if "done:" in line)
    assert [line.split(" in ")[0].rsplit(",", 1)[0] for line in ends] == [
        "msprobe-mlflow: rank 0: done: 3 steps", "msprobe-mlflow: rank 1: done: 3 steps"]
    assert all(line.endswith(f"in {tmp_path / 'dump' / f'rank{rank}'}; anomalies: none")
               for rank, line in enumerate(ends))


def test_mindspore_model_train_says_the_same_two_lines(tmp_path, capsys):
    pytest.importorskip("mindspore", reason="MindSpore is not installed (the torch-only stage)")
    from mindspore_training import STEPS as MINDSPORE_STEPS, batches, dense, sgd_model
    from msprobe_mlflow.mindspore import GradProbeCallback

    callback = GradProbeCallback(GradProbeConfig(dump_path=str(tmp_path / "dump")), log_to_mlflow=False)
    sgd_model(dense()).train(1, batches(), callbacks=[callback], dataset_sink_mode=False)
    assert said(capsys.readouterr().err) == [
        f"msprobe-mlflow: probing gradients at level L1 into no MLflow run (the local dump only); dump: "
        f"{tmp_path / 'dump'}; no live verdict",
        f"msprobe-mlflow: done: {MINDSPORE_STEPS} steps, {folder_size_in_kb(tmp_path / 'dump' / 'rank0')} in "
        f"{tmp_path / 'dump' / 'rank0'}; anomalies: none"]


# --- warnings -------------------------------------------------------------------------------------------------------

WARNING_SCRIPT = textwrap.dedent("""
    import warnings

    import torch

    from msprobe_mlflow import GradProbeConfig
    from msprobe_mlflow.pytorch import GradientMonitor

    def train(dump, steps, **options):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        config = GradProbeConfig(dump_path=dump, level="L1", param_list=["weight", "bias", "missing"])
        with GradientMonitor(config, log_to_mlflow=False, **options).monitor(model, optimizer):
            for step in range(steps):
                optimizer.zero_grad()
                model(torch.ones(2, 4)).sum().backward()
                optimizer.step()

    before = warnings.formatwarning
    train("baseline", 2)
    train("candidate", 3, baseline="baseline")  # step 2 is not in the baseline: said by the comparison's thread
    warnings.warn("a warning of another library")
    print("restored", warnings.formatwarning is before)
""")


def test_a_warning_is_one_line_on_stderr_and_other_warnings_keep_pythons_format(tmp_path):
    (tmp_path / "train.py").write_text(WARNING_SCRIPT, encoding="utf-8")
    done = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == "restored True\n"
    lines = done.stderr.splitlines()
    missing = "msprobe-mlflow: warning: grad_probe.param_list names parameters the model does not have: ['missing']"
    assert [line for line in lines if line.startswith("msprobe-mlflow: warning: ")] == [
        missing, missing,  # each monitor's
        "msprobe-mlflow: warning: rank 0: step 2 not compared with the baseline: not in the baseline. Training goes "
        "on and the local dump stays complete; later steps like it are logged, and listed in "
        "candidate/rank0/findings/verdict.json"]
    others = [line for line in lines if not line.startswith("msprobe-mlflow: ")]
    line_number = WARNING_SCRIPT.splitlines().index('warnings.warn("a warning of another library")') + 1
    assert others == [f"{tmp_path / 'train.py'}:{line_number}: UserWarning: a warning of another library",
                      '  warnings.warn("a warning of another library")']


def test_our_warnings_are_user_warnings_shown_in_one_line_while_warned_and_the_format_is_put_back():
    before = warnings.formatwarning
    with pytest.warns(UserWarning, match="^msprobe-mlflow: the dump is fine$") as caught:
        Notices().warn("the dump is fine")
    assert [w.category for w in caught] == [MsprobeMlflowWarning] and issubclass(MsprobeMlflowWarning, UserWarning)
    shown = []
    with warnings.catch_warnings():  # Python's showwarning, which formats each warning as it shows it
        warnings.simplefilter("always")
        warnings.showwarning = lambda message, category, filename, lineno, file=None, line=None: shown.append(
            warnings.formatwarning(message, category, filename, lineno, line))
        Notices().warn("the dump is fine")
        warnings.warn("theirs")
    assert shown[0] == "msprobe-mlflow: warning: the dump is fine\n"
    assert shown[1].endswith(": UserWarning: theirs\n  warnings.warn(\"theirs\")\n")
    assert warnings.formatwarning is before


# --- a failed rank's reason -----------------------------------------------------------------------------------------

def test_a_mindspore_error_becomes_the_failure_tag_without_the_frameworks_banner(tmp_experiment, tmp_path):
    ms = pytest.importorskip("mindspore", reason="MindSpore is not installed (the torch-only stage)")
    import numpy as np
    from mindspore.train import Callback

    from mindspore_training import batches, dense, sgd_model
    from msprobe_mlflow.mindspore import GradProbeCallback

    class MatmulOfWrongShapesAtStep2(Callback):
        def on_train_step_end(self, run_context):
            if run_context.original_args().cur_step_num == 2:
                ms.ops.matmul(ms.Tensor(np.ones((2, 3), np.float32)), ms.Tensor(np.ones((4, 5), np.float32))).asnumpy()

    with mlflow.start_run() as run, pytest.raises(RuntimeError, match=r"C\+\+ Call Stack") as raised:
        callback = GradProbeCallback(GradProbeConfig(dump_path=str(tmp_path / "dump")), silent=True)
        sgd_model(dense()).train(1, batches(), callbacks=[callback, MatmulOfWrongShapesAtStep2()],
                                 dataset_sink_mode=False)
    message = str(raised.value).split("\n")[0]  # MindSpore's message, before its banner
    assert message == "For 'MatMulExt' op, shape1[-1] must be equal to shape2[-2], but got 3 and 4."
    tags = MlflowClient().get_run(run.info.run_id).data.tags
    assert tags["msprobe_mlflow.rank0.status"] == "failed"
    assert tags["msprobe_mlflow.rank0.failure"] == f"RuntimeError: {message}"


def test_a_long_failure_reason_is_cut_after_a_whole_word_and_ends_in_an_ellipsis():
    paths = [f"/data/run{i}/checkpoints/model.ckpt" for i in range(30)]
    reason = failure_reason(FileNotFoundError(f"none of these exists: {' '.join(paths)}"))
    assert len(reason) <= 500 and reason.endswith("...")
    words = reason.removesuffix("...").split(" ")
    assert words[:5] == ["FileNotFoundError:", "none", "of", "these", "exists:"]
    assert words[5:] == paths[:len(words) - 5]  # whole paths only
    assert len(" ".join(words + [paths[len(words) - 5]])) + 3 > 500  # the next path would not have fit
