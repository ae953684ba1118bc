"""A rank's status says how its training ended (finished, incomplete, failed, killed, missing), and a run whose
ranks failed ends FAILED, naming them: in one process (PyTorch, MindSpore's callback), under torchrun (2 gloo
ranks), and when a later ``upload`` finds a run a launcher left RUNNING. Under ``autolog()``, a rank > 0 that starts
its own run (the README's snippet copied into a torchrun script) leaves no empty run."""
from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest
from click.testing import CliRunner
from mlflow.tracking import MlflowClient

from mlflow_server import free_port
from mlflow_stores import sqlite_uri
from msprobe_mlflow.commands.cli import main as cli
from test_tracking_distributed import WORKER as DISTRIBUTED_WORKER, child_environment, torchrun

WORKER = Path(__file__).with_name("rank_lifecycle_worker.py")


def run_worker(tmp_path: Path, mode: str) -> tuple[subprocess.CompletedProcess, str]:
    uri = sqlite_uri(tmp_path)
    done = subprocess.run([sys.executable, str(WORKER), mode, str(tmp_path / "dump")], capture_output=True,
                          text=True, env=child_environment(uri), timeout=300, cwd=tmp_path)
    return done, uri


def run_id_in(text: str) -> str:
    lines = [line for line in text.splitlines() if line.startswith("RUN_ID ")]
    assert lines, text[-3000:]
    return lines[0].split()[1]


@pytest.mark.parametrize("mode", ["raise-uncaught", "raise-in-monitor-block", "raise-with-finally"])
def test_a_pytorch_training_that_raises_ends_its_run_failed_and_its_rank_failed(tmp_path, mode):
    done, uri = run_worker(tmp_path, mode)
    assert done.returncode == 1 and "training fails at step 2 on purpose" in done.stderr, done.stderr[-3000:]
    run = MlflowClient(uri).get_run(run_id_in(done.stdout))
    assert run.info.status == "FAILED"
    assert run.data.tags["msprobe_mlflow.rank0.status"] == "failed"
    assert run.data.tags["msprobe_mlflow.rank0.failure"] == "RuntimeError: training fails at step 2 on purpose"
    assert run.data.tags["msprobe_mlflow.failed_ranks"] == "0"
    # the steps before the failure are all there
    history = MlflowClient(uri).get_metric_history(run.info.run_id, "grad/rank0/total_norm")
    assert [m.step for m in history] == [0, 1]


def test_a_training_that_ends_normally_is_finished(tmp_path, tmp_sqlite_uri, monkeypatch):
    """The control: the same loop without the failure is not tagged failed."""
    import torch

    from msprobe_mlflow import GradProbeConfig
    from msprobe_mlflow.pytorch import GradientMonitor
    from tiny_models import fixed, total, train

    mlflow.set_tracking_uri(tmp_sqlite_uri)
    mlflow.set_experiment("control")  # not the experiment an earlier test made current in another store
    monkeypatch.chdir(tmp_path)
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    with mlflow.start_run() as run:
        with GradientMonitor(GradProbeConfig(dump_path=str(tmp_path / "dump"), level="L1"),
                             silent=True).monitor(model, optimizer) as monitor:
            train(model, 1, optimizer=optimizer, data=fixed(torch.ones(2, 8)), loss=total)
    assert monitor.failed_ranks == {}
    finished = MlflowClient().get_run(run.info.run_id)
    assert (finished.info.status, finished.data.tags["msprobe_mlflow.rank0.status"]) == ("FINISHED", "finished")
    assert "msprobe_mlflow.failed_ranks" not in finished.data.tags


def process_hooks():
    return sys.excepthook, signal.getsignal(signal.SIGTERM)


def train_two_steps(model, optimizer) -> None:
    import torch

    from tiny_models import fixed, total, train

    train(model, 2, optimizer=optimizer, data=fixed(torch.ones(2, 8)), loss=total)


def test_the_hooks_that_mark_a_run_failed_are_given_back_at_stop_and_installed_again_by_the_next_monitor(
        tmp_path, tmp_sqlite_uri, monkeypatch, capsys):
    """``sys.excepthook`` and the SIGTERM handler are the monitor's while it runs: ``stop()`` puts back the very
    ones found before ``monitor()``, and the next monitor installs them again, where an uncaught exception still
    marks its run failed."""
    import torch

    from msprobe_mlflow import GradProbeConfig
    from msprobe_mlflow.pytorch import GradientMonitor

    mlflow.set_tracking_uri(tmp_sqlite_uri)
    mlflow.set_experiment("hooks")
    monkeypatch.chdir(tmp_path)
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    config = GradProbeConfig(dump_path=str(tmp_path / "dump"), level="L1")
    found = process_hooks()
    assert found[1] is signal.SIG_DFL  # the one action a SIGTERM handler of the monitor's replaces
    with mlflow.start_run() as first:
        monitor = GradientMonitor(config, silent=True).monitor(model, optimizer)
        assert all(now is not before for now, before in zip(process_hooks(), found))
        train_two_steps(model, optimizer)
        monitor.stop()
    assert all(now is before for now, before in zip(process_hooks(), found))
    assert MlflowClient().get_run(first.info.run_id).info.status == "FINISHED"

    with mlflow.start_run() as second:
        monitor = GradientMonitor(config, silent=True).monitor(model, optimizer)
        assert all(now is not before for now, before in zip(process_hooks(), found))
        train_two_steps(model, optimizer)
        try:
            raise RuntimeError("uncaught on purpose")
        except RuntimeError as error:
            sys.excepthook(type(error), error, error.__traceback__)  # what the interpreter does as it dies of it
        monitor.stop()
    assert all(now is before for now, before in zip(process_hooks(), found))
    assert "RuntimeError: uncaught on purpose" in capsys.readouterr().err  # the hook found, called first
    run = MlflowClient().get_run(second.info.run_id)
    assert (run.info.status, run.data.tags["msprobe_mlflow.rank0.status"]) == ("FAILED", "failed")
    assert run.data.tags["msprobe_mlflow.rank0.failure"] == "RuntimeError: uncaught on purpose"


def test_a_session_dropped_without_closing_gives_the_hooks_back_when_it_is_collected(tmp_path):
    import gc

    from msprobe_mlflow import GradProbeConfig
    from msprobe_mlflow.session import ProbeSession

    found = process_hooks()
    session = ProbeSession(GradProbeConfig(dump_path=str(tmp_path / "dump")), framework="pytorch")
    assert all(now is not before for now, before in zip(process_hooks(), found))
    del session  # never closed: a monitor a training dropped without stop()
    gc.collect()
    assert all(now is before for now, before in zip(process_hooks(), found))


def test_an_excepthook_the_user_sets_while_a_monitor_runs_is_left_in_place_at_stop(tmp_path, monkeypatch):
    import torch

    from msprobe_mlflow import GradProbeConfig
    from msprobe_mlflow.pytorch import GradientMonitor

    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    monitor = GradientMonitor(GradProbeConfig(dump_path=str(tmp_path / "dump"), level="L1"), log_to_mlflow=False,
                              silent=True).monitor(model, optimizer)

    def users_hook(kind, error, traceback):
        pass

    monkeypatch.setattr(sys, "excepthook", users_hook)
    train_two_steps(model, optimizer)
    monitor.stop()
    assert sys.excepthook is users_hook
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_mindspore_model_train_that_raises_tags_rank_0_failed(tmp_path, tmp_sqlite_uri, monkeypatch):
    pytest.importorskip("mindspore", reason="MindSpore is not installed (the torch-only stage)")
    from mindspore_training import batches, dense, sgd_model
    from msprobe_mlflow import GradProbeConfig
    from msprobe_mlflow.mindspore import GradProbeCallback
    from test_mindspore_callback import FailAtStep

    mlflow.set_tracking_uri(tmp_sqlite_uri)
    mlflow.set_experiment("Default")  # not the experiment an earlier test made current in another store
    monkeypatch.chdir(tmp_path)
    callback = GradProbeCallback(GradProbeConfig(dump_path=str(tmp_path / "dump")), silent=True)
    with pytest.raises(RuntimeError, match="the training failed"):
        sgd_model(dense()).train(1, batches(), callbacks=[callback, FailAtStep(2)], dataset_sink_mode=False)
    (run,) = MlflowClient().search_runs([mlflow.get_experiment_by_name("Default").experiment_id])
    assert run.info.status == "FAILED"
    assert run.data.tags["msprobe_mlflow.rank0.status"] == "failed"
    assert run.data.tags["msprobe_mlflow.rank0.failure"] == "RuntimeError: the training failed"
    assert callback.monitor.failed_ranks == {0: "failed"}


def test_torchrun_rank_1_raising_ends_the_run_failed_with_both_ranks_saying_how_they_ended(tmp_path, tmp_sqlite_uri):
    """Rank 1 raises at step 2; rank 0's all-reduce then fails (failed) or torchrun stops it with SIGTERM
    (killed), whichever comes first: either way it says so, and the run does not end FINISHED."""
    done = torchrun(tmp_sqlite_uri, "--dump", str(tmp_path / "dump"), "--steps", "4", "--level", "L1",
                    "--raise-at", "1", "2")
    assert done.returncode != 0 and "training fails at step 2 on purpose" in done.stdout + done.stderr
    run = MlflowClient(tmp_sqlite_uri).get_run(run_id_in(done.stdout))
    tags = run.data.tags
    assert run.info.status == "FAILED"
    assert tags["msprobe_mlflow.rank1.status"] == "failed"
    assert tags["msprobe_mlflow.rank1.failure"] == "RuntimeError: training fails at step 2 on purpose"
    assert tags["msprobe_mlflow.rank0.status"] in ("failed", "killed"), tags
    assert tags["msprobe_mlflow.failed_ranks"] in ("1", "0-1")


def crashed_job_run(tmp_path: Path) -> tuple[str, str]:
    """A run as msrun leaves it when rank 1 raised and rank 0 was SIGKILLed: rank 1 tagged itself failed and ended
    the run FAILED; rank 0 never said anything. Made by two real processes launched apart (rank 1 raises before its
    step 2, rank 0 is killed by the test once rank 1 is gone)."""
    uri = sqlite_uri(tmp_path)
    port = str(free_port())
    processes = []
    for rank in (0, 1):
        env = child_environment(uri, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                MASTER_PORT=port, MSPROBE_MLFLOW_RANK_WAIT_SECONDS="300")
        processes.append(subprocess.Popen(
            [sys.executable, str(DISTRIBUTED_WORKER), "--dump", str(tmp_path / "dump"), "--steps", "4", "--level",
             "L1", "--die-at", "99", "--raise-at", "1", "2", "--pause-at", "3", "--resume-file",
             str(tmp_path / "never")], env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    _, rank1_err = processes[1].communicate(timeout=300)
    assert processes[1].returncode == 1, rank1_err[-3000:]
    processes[0].kill()  # as msrun does: SIGKILL, nothing of rank 0 runs any more
    rank0_out, _ = processes[0].communicate(timeout=60)
    return uri, run_id_in(rank0_out)


def test_upload_closes_a_run_whose_job_lost_its_ranks(tmp_path, monkeypatch):
    uri, run_id = crashed_job_run(tmp_path)
    client = MlflowClient(uri)
    before = client.get_run(run_id)
    assert (before.data.tags["msprobe_mlflow.rank0.status"], before.data.tags["msprobe_mlflow.rank1.status"]) == \
        ("running", "failed")
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(cli, ["upload", str(tmp_path / "dump"), "--run-id", run_id, "--tracking-uri", uri])
    assert result.exit_code == 0, result.output
    assert "ranks 0 never said how they ended: tagged missing" in result.output
    after = client.get_run(run_id)
    assert after.info.status == "FAILED"
    assert after.data.tags["msprobe_mlflow.rank0.status"] == "missing"
    assert (after.data.tags["msprobe_mlflow.missing_ranks"], after.data.tags["msprobe_mlflow.failed_ranks"]) == \
        ("0", "1")
    again = CliRunner().invoke(cli, ["upload", str(tmp_path / "dump"), "--run-id", run_id, "--tracking-uri", uri])
    assert again.exit_code == 0 and "missing" not in again.output  # nothing left to close


def test_upload_ends_a_single_process_run_once_its_process_was_sigkilled_and_not_before(tmp_path, tmp_sqlite_uri,
                                                                                         monkeypatch):
    """A training SIGKILLed (the out-of-memory killer, ``kill -9``) says nothing: its run stays RUNNING, rank 0
    ``running``. ``upload`` ends it FAILED with rank 0 ``missing``, its steps all there; run while the same training
    lives, it leaves the run alone."""
    uri, dump = tmp_sqlite_uri, tmp_path / "dump"
    training = subprocess.Popen([sys.executable, str(WORKER), "wait-to-be-killed", str(dump)], cwd=tmp_path,
                                env=child_environment(uri), text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        run_id = run_id_in(training.stdout.readline())
        assert training.stdout.readline().strip() == "TRAINED"  # its 3 steps are in the dump and the run
        monkeypatch.chdir(tmp_path)
        upload = ["upload", str(dump), "--run-id", run_id, "--tracking-uri", uri]
        alive = CliRunner().invoke(cli, upload)
        assert alive.exit_code == 0 and "missing" not in alive.output, alive.output
        run = MlflowClient(uri).get_run(run_id)
        assert (run.info.status, run.data.tags["msprobe_mlflow.rank0.status"]) == ("RUNNING", "running")
    finally:
        training.kill()
        training.wait(timeout=60)
    assert training.returncode == -signal.SIGKILL

    result = CliRunner().invoke(cli, upload)
    assert result.exit_code == 0, result.output
    assert "ranks 0 never said how they ended" in result.output and "tagged missing" in result.output
    after = MlflowClient(uri).get_run(run_id)
    assert after.info.status == "FAILED"
    assert after.data.tags["msprobe_mlflow.rank0.status"] == "missing"
    assert after.data.tags["msprobe_mlflow.missing_ranks"] == "0"
    assert [m.step for m in MlflowClient(uri).get_metric_history(run_id, "grad/rank0/total_norm")] == [0, 1, 2]
    again = CliRunner().invoke(cli, upload)
    assert again.exit_code == 0 and "missing" not in again.output  # nothing left to close


def test_under_autolog_every_rank_starting_a_run_leaves_one_run_with_both_ranks(tmp_path, tmp_sqlite_uri):
    client = MlflowClient(tmp_sqlite_uri)
    client.search_experiments()  # the store's tables exist before two ranks open it at once
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
         "--master-port", str(free_port()), str(WORKER), "autolog-every-rank", str(tmp_path / "dump")],
        capture_output=True, text=True, env=child_environment(tmp_sqlite_uri), timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    run_id = run_id_in(done.stdout)
    assert "under torch.distributed every rank logs into rank 0's run" in done.stderr  # told at once
    assert "deleted the empty run" in done.stderr
    runs = client.search_runs([client.get_run(run_id).info.experiment_id])
    assert [run.info.run_id for run in runs] == [run_id]  # rank 1's own run is gone (soft-deleted)
    for rank in (0, 1):
        assert [m.step for m in client.get_metric_history(run_id, f"grad/rank{rank}/total_norm")] == [0, 1]
    deleted = client.search_runs([runs[0].info.experiment_id], run_view_type=mlflow.entities.ViewType.DELETED_ONLY)
    assert len(deleted) == 1 and not deleted[0].data.metrics



def test_compare_closes_a_run_whose_job_lost_its_ranks_and_says_so(tmp_path, monkeypatch):
    uri, run_id = crashed_job_run(tmp_path)
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(cli, ["compare", run_id, run_id, "--tracking-uri", uri, "--no-mlflow", "--no-plots"])
    assert result.exit_code == 0, result.output
    assert "ranks 0 never said how they ended: tagged missing" in result.output
    after = MlflowClient(uri).get_run(run_id)
    assert after.info.status == "FAILED" and after.data.tags["msprobe_mlflow.rank0.status"] == "missing"
