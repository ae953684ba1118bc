"""The shared-service topology of docker/docker-compose.yml, without Docker, and how it behaves under faults.

PostgreSQL (from the OS packages, a cluster of this module's own) backs an ``mlflow server`` with proxied artifacts
and basic authentication (``--app-name basic-auth``, users in PostgreSQL too) on 127.0.0.1. 2-rank ``torchrun``
(gloo) jobs log into it as a non-admin user, as a multi-node job would with ``MLFLOW_TRACKING_URI``,
``MLFLOW_TRACKING_USERNAME`` and ``MLFLOW_TRACKING_PASSWORD``. What the ranks sent is their local dump (the sink
sends exactly what it wrote): every metric value and artifact on the server is counted against it, per rank and
step. Faults: the server killed mid-training, PostgreSQL down mid-training, wrong credentials, an unwritable or
full dump folder, a rank dying.
"""
from __future__ import annotations

import csv
import math
import os
import re
import secrets
import subprocess
import sys
import time
import uuid
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from mlflow.server.auth.client import AuthServiceClient
from mlflow.tracking import MlflowClient

from msprobe_mlflow import GradProbeConfig
from msprobe_mlflow.pytorch import GradientMonitor
from mlflow_server import MlflowServer, basic_auth_env
from postgres import PostgresCluster, PostgresUnavailable
from test_tracking_distributed import artifact_files, launch_ranks_separately, run_id_of, torchrun

pytestmark = pytest.mark.topology

ADMIN, TRAINER, VIEWER = "admin", "trainer", "viewer"
# The worker's config: L2 with the default bounds [-1, 0, 1]. Per rank and step: total_norm, max, min, one share
# per bucket (len(bounds) + 1 = 4) and the share of zeros.
METRICS_PER_STEP = 3 + 4 + 1
FILES_PER_STEP = 2  # grad_summary_{S}.csv and step{S}/directions.npz


@dataclass
class Topology:
    postgres: PostgresCluster
    server: MlflowServer
    passwords: dict[str, str]
    experiment_id: str

    @property
    def uri(self) -> str:
        return self.server.uri


def log_in(env: pytest.MonkeyPatch, user: str, password: str) -> None:
    """MLflow's client reads these two variables at every request, as every rank of a training job does."""
    env.setenv("MLFLOW_TRACKING_USERNAME", user)
    env.setenv("MLFLOW_TRACKING_PASSWORD", password)


@pytest.fixture(scope="module")
def topology(tmp_path_factory):
    try:
        postgres = PostgresCluster()
    except PostgresUnavailable as e:
        pytest.skip(str(e))
    server = None
    with pytest.MonkeyPatch.context() as env:
        try:
            postgres.start()
            folder = tmp_path_factory.mktemp("mlflow_server")
            passwords = {user: secrets.token_hex(10) for user in (ADMIN, TRAINER, VIEWER)}
            server = MlflowServer(folder, backend_uri=postgres.create_database("mlflow"),
                                  extra_args=["--app-name", "basic-auth"],
                                  env=basic_auth_env(folder, postgres.create_database("mlflow_auth"), ADMIN,
                                                     passwords[ADMIN]))
            server.start()
            env.setenv("MLFLOW_TRACKING_URI", server.uri)
            log_in(env, ADMIN, passwords[ADMIN])
            users = AuthServiceClient(server.uri)  # the accounts, as docker/README.md "Accounts" creates them
            for user in (TRAINER, VIEWER):
                users.create_user(user, passwords[user])
            experiment_id = MlflowClient(server.uri).create_experiment(f"topology-{uuid.uuid4().hex[:8]}")
            users.grant_user_permission(TRAINER, "experiment", experiment_id, "EDIT")  # the viewer keeps READ
            log_in(env, TRAINER, passwords[TRAINER])
            env.setenv("MLFLOW_EXPERIMENT_ID", experiment_id)
            env.setenv("MSPROBE_MLFLOW_RANK_WAIT_SECONDS", "20")
            yield Topology(postgres, server, passwords, experiment_id)
        finally:
            if server is not None:
                server.stop()
            postgres.remove()


@pytest.fixture
def fail_fast(monkeypatch):
    """A dead server or database answers at once instead of after MLflow's retries with back-off (minutes)."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")


# --- what the ranks sent, what the server holds ------------------------------------------------------------
def local_steps(dump: Path) -> dict[int, list[int]]:
    """Rank -> steps with a summary CSV in the local dump (directions are written before the CSV)."""
    return {int(rank.name[4:]): sorted(int(p.stem.rsplit("_", 1)[1]) for p in rank.glob("grad_summary_*.csv"))
            for rank in sorted(dump.glob("rank*"))}


def expected_files(rank: int, steps: list[int]) -> set[str]:
    return ({f"grad_probe/rank{rank}/grad_summary_{s}.csv" for s in steps}
            | {f"grad_probe/rank{rank}/step{s}/directions.npz" for s in steps})


def server_steps(client: MlflowClient, run_id: str, rank: int) -> tuple[list[int], list[int]]:
    """Steps of ``rank`` with a ``total_norm`` value and with a summary CSV artifact on the server."""
    metric = sorted(m.step for m in client.get_metric_history(run_id, f"grad/rank{rank}/total_norm"))
    csvs = sorted(int(i.path.rsplit("_", 1)[1][:-4]) for i in client.list_artifacts(run_id, f"grad_probe/rank{rank}")
                  if i.path.endswith(".csv"))
    return metric, csvs


def count_against_dump(client: MlflowClient, run_id: str, dump: Path, ranks: list[int] | None = None) -> dict:
    """Asserts the run holds, for each rank, exactly the steps of its local dump: every metric key with one value
    per step, and every file; returns the counts (metric values, files) per rank."""
    run = client.get_run(run_id)
    sent = local_steps(dump)
    counts = {}
    for rank in ranks if ranks is not None else sorted(sent):
        keys = [k for k in run.data.metrics if k.startswith(f"grad/rank{rank}/")]
        assert len(keys) == METRICS_PER_STEP, keys
        values = 0
        for key in keys:
            history = client.get_metric_history(run_id, key)
            assert sorted(m.step for m in history) == sent[rank], (key, history)
            values += len(history)
        files = artifact_files(client, run_id, f"grad_probe/rank{rank}")
        assert sorted(files) == sorted(expected_files(rank, sent[rank]))
        counts[rank] = {"steps": len(sent[rank]), "metric_values": values, "files": len(files)}
        assert values == METRICS_PER_STEP * len(sent[rank])
    assert [i.path for i in client.list_artifacts(run_id, "grad_probe") if not i.is_dir] == ["grad_probe/config.json"]
    return counts


def wait_until(condition, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.3)


def run_id_by_name(client: MlflowClient, experiment_id: str, run_name: str) -> str | None:
    runs = client.search_runs([experiment_id], filter_string=f"attributes.run_name = '{run_name}'")
    return runs[0].info.run_id if runs else None


def cli(*args: str) -> subprocess.CompletedProcess:
    """``msprobe-mlflow ...`` in a fresh process with this process's environment (URI and credentials)."""
    return subprocess.run([sys.executable, "-m", "msprobe_mlflow", *args], capture_output=True, text=True,
                          timeout=300)


def show_counts(capsys, label: str, counts) -> None:
    """Prints the server's counts whatever pytest captures (they go into the issue's closing note)."""
    with capsys.disabled():
        print(f"\n[topology] {label}: {counts}")


def csv_norms(path: Path) -> list[float]:
    with open(path, encoding="utf-8-sig", newline="") as f:
        rows = list(csv.reader(f))
    column = [cell.lower() for cell in rows[0]].index("norm")
    return [float(row[column]) for row in rows[1:]]


# --- the story: two trainings, one comparison ----------------------------------------------------------------
def test_two_trainings_log_every_value_and_file_and_compare_names_the_perturbed_step(topology, tmp_path, capsys):
    baseline = torchrun(topology.uri, "--dump", str(tmp_path / "baseline"), "--steps", "5", "--run-name", "baseline")
    assert baseline.returncode == 0, baseline.stderr[-3000:]
    perturbed = torchrun(topology.uri, "--dump", str(tmp_path / "perturbed"), "--steps", "5", "--run-name",
                         "perturbed", "--perturb-from", "3")
    assert perturbed.returncode == 0, perturbed.stderr[-3000:]
    client = MlflowClient(topology.uri)
    runs = {"baseline": run_id_of(baseline), "perturbed": run_id_of(perturbed)}
    report = {}
    for name, run_id in runs.items():
        run = client.get_run(run_id)
        assert run.info.experiment_id == topology.experiment_id and run.info.user_id == TRAINER
        assert [run.data.tags[f"msprobe_mlflow.rank{r}.status"] for r in (0, 1)] == ["finished", "finished"]
        assert "msprobe_mlflow.missing_ranks" not in run.data.tags
        report[name] = count_against_dump(client, run_id, tmp_path / name)
        assert report[name] == {r: {"steps": 5, "metric_values": 5 * METRICS_PER_STEP, "files": 5 * FILES_PER_STEP}
                                for r in (0, 1)}
        for rank in (0, 1):  # the values too: total_norm = sqrt(sum of the parameters' squared norms), by hand
            history = sorted(client.get_metric_history(run_id, f"grad/rank{rank}/total_norm"), key=lambda m: m.step)
            by_hand = [math.sqrt(sum(n * n for n in csv_norms(tmp_path / name / f"rank{rank}" /
                                                              f"grad_summary_{s}.csv"))) for s in range(5)]
            assert [m.value for m in history] == pytest.approx(by_hand, rel=1e-12)

    cache = tmp_path / "cache"
    compared = cli("compare", runs["baseline"], runs["perturbed"], "--tracking-uri", topology.uri,
                   "--cache-dir", str(cache))
    assert compared.returncode == 0, compared.stderr[-3000:]
    assert "rank 0: first suspicious step 3" in compared.stdout and "rank 1: first suspicious step 3" in compared.stdout
    comparison_id = [line.split()[-1] for line in compared.stdout.splitlines() if line.startswith("comparison run:")][0]
    comparison = client.get_run(comparison_id)
    tags = comparison.data.tags
    assert (tags["msprobe_mlflow.compare.run_a"], tags["msprobe_mlflow.compare.run_b"]) == \
        (runs["baseline"], runs["perturbed"])
    assert tags["msprobe_mlflow.compare.verdict"] == "suspicious"
    assert tags["msprobe_mlflow.compare.first_suspicious_step"] == "3"
    assert comparison.data.metrics["verdict/first_suspicious_step"] == 3
    for rank in (0, 1):
        similarity = client.get_metric_history(comparison_id, f"summary_similarity/rank{rank}")
        assert sorted(m.step for m in similarity) == [0, 1, 2, 3, 4]
        assert [m.value for m in sorted(similarity, key=lambda m: m.step)][:3] == [1.0, 1.0, 1.0]  # same training
    compare_files = artifact_files(client, comparison_id, "grad_compare")
    assert {"grad_compare/verdict.json", "grad_compare/rank0/similarities.csv",
            "grad_compare/rank1/similarities.csv"} <= set(compare_files)
    # What compare downloaded through the server's artifact proxy is, byte for byte, what the ranks wrote.
    for name, run_id in runs.items():
        for rank in (0, 1):
            for path in expected_files(rank, list(range(5))):
                local = tmp_path / name / path.removeprefix("grad_probe/")
                assert (cache / run_id / path).read_bytes() == local.read_bytes(), path
    show_counts(capsys, "two trainings, per run and rank (plus grad_probe/config.json each)", report)
    show_counts(capsys, "comparison run", {"metric keys": len(comparison.data.metrics), "files": len(compare_files)})


# --- faults -------------------------------------------------------------------------------------------------
def train_through_a_fault(topology: Topology, tmp_path: Path, run_name: str, fault, repair=None):
    """A 2-rank, 6-step training that pauses before step 2 until both ranks' steps 0 and 1 are on the server;
    then ``fault()`` breaks something, the training resumes and finishes, ``repair()`` (if any) runs."""
    client = MlflowClient(topology.uri)
    dump, resume = tmp_path / "dump", tmp_path / "resume"
    with ThreadPoolExecutor(1) as pool:
        job = pool.submit(torchrun, topology.uri, "--dump", str(dump), "--steps", "6", "--run-name", run_name,
                          "--pause-at", "2", "--resume-file", str(resume))
        try:
            wait_until(lambda: run_id_by_name(client, topology.experiment_id, run_name), f"run {run_name}")
            run_id = run_id_by_name(client, topology.experiment_id, run_name)
            wait_until(lambda: all(server_steps(client, run_id, r) == ([0, 1], [0, 1]) for r in (0, 1)),
                       "steps 0 and 1 of both ranks on the server")
            fault()
        finally:
            resume.touch()
        done = job.result()
    if repair:
        repair()
    assert done.returncode == 0, done.stderr[-3000:]
    assert local_steps(dump) == {0: list(range(6)), 1: list(range(6))}  # training went on: the dump is complete
    return client, run_id, dump, done


def complete_with_upload(client: MlflowClient, run_id: str, dump: Path) -> dict:
    """``msprobe-mlflow upload`` sends exactly steps 2..5 of both ranks, then nothing more when run again."""
    uploaded = cli("upload", str(dump), "--run-id", run_id)
    assert uploaded.returncode == 0, uploaded.stderr[-3000:]
    missing_steps = 2 * 4  # ranks 0 and 1, steps 2..5
    assert (f"run {run_id}: {missing_steps * METRICS_PER_STEP} metric values and {missing_steps * FILES_PER_STEP} "
            f"files sent ({missing_steps} step(s) completed)") in uploaded.stdout
    counts = count_against_dump(client, run_id, dump)
    again = cli("upload", str(dump), "--run-id", run_id)
    assert f"run {run_id}: 0 metric values and 0 files sent (0 step(s) completed)" in again.stdout, again.stderr
    assert count_against_dump(client, run_id, dump) == counts
    return counts


def test_server_killed_mid_training_then_restarted_upload_completes_the_run(topology, tmp_path, fail_fast, capsys):
    client, run_id, dump, done = train_through_a_fault(topology, tmp_path, "server-killed", topology.server.stop,
                                                       repair=topology.server.start)
    assert f"msprobe-mlflow upload {dump} --run-id {run_id}" in done.stderr
    assert [server_steps(client, run_id, r) for r in (0, 1)] == [([0, 1], [0, 1])] * 2  # nothing after the kill
    counts = complete_with_upload(client, run_id, dump)
    assert counts == {r: {"steps": 6, "metric_values": 6 * METRICS_PER_STEP, "files": 6 * FILES_PER_STEP}
                      for r in (0, 1)}
    show_counts(capsys, "server killed at step 2 after upload, per rank", counts)


def test_postgres_down_mid_training_then_restarted_upload_completes_the_run(topology, tmp_path, fail_fast, capsys):
    client, run_id, dump, done = train_through_a_fault(topology, tmp_path, "postgres-restart", topology.postgres.stop,
                                                       repair=topology.postgres.start)
    assert f"msprobe-mlflow upload {dump} --run-id {run_id}" in done.stderr
    counts = complete_with_upload(client, run_id, dump)
    assert counts == {r: {"steps": 6, "metric_values": 6 * METRICS_PER_STEP, "files": 6 * FILES_PER_STEP}
                      for r in (0, 1)}
    show_counts(capsys, "PostgreSQL down from step 2 after upload, per rank", counts)


@pytest.mark.parametrize("user, password, refusal", [
    (TRAINER, "not-the-password", "401 not authenticated"),
    (VIEWER, None, "403 permission denied"),  # a real account that may only read the trainer's experiment
])
def test_refused_credentials_warn_once_at_start_and_training_keeps_the_local_dump(
        topology, tmp_path, monkeypatch, user, password, refusal):
    client = MlflowClient(topology.uri)
    run_id = client.create_run(topology.experiment_id, run_name=f"refused-{user}").info.run_id
    log_in(monkeypatch, user, password or topology.passwords[user])
    config = GradProbeConfig(dump_path=str(tmp_path / "dump"), level="L1")
    with pytest.warns(UserWarning) as at_start:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        monitor = GradientMonitor(config, run_id=run_id, tracking_uri=topology.uri).monitor(model, optimizer)
    [warning] = [str(w.message) for w in at_start]
    assert f"the MLflow tracking server at {topology.uri} refused the credentials ({refusal})" in warning
    assert "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD" in warning
    assert f"msprobe-mlflow upload {config.dump_path} --run-id {run_id}" in warning
    with warnings.catch_warnings(record=True) as later:
        warnings.simplefilter("always")
        for _ in range(3):
            optimizer.zero_grad()
            model(torch.randn(5, 4)).square().mean().backward()
            optimizer.step()
        monitor.stop()
    assert [str(w.message) for w in later if "msprobe-mlflow" in str(w.message)] == []  # one warning, not one a step
    assert local_steps(tmp_path / "dump") == {0: [0, 1, 2]}
    log_in(monkeypatch, TRAINER, topology.passwords[TRAINER])
    run = client.get_run(run_id)
    assert run.data.metrics == {} and client.list_artifacts(run_id) == []
    assert not any(key.startswith("msprobe_mlflow.") for key in run.data.tags)


def test_unwritable_dump_path_is_refused_before_the_first_step(topology, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    client = MlflowClient(topology.uri)
    run_id = client.create_run(topology.experiment_id, run_name="unwritable").info.run_id
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    before = [p.detach().clone() for p in model.parameters()]
    refusal = re.escape(f"dump_path = '{blocker / 'dump'}' is not a writable folder (Not a directory)")
    with pytest.raises(ValueError, match=refusal):
        GradientMonitor(GradProbeConfig(dump_path=str(blocker / "dump")), run_id=run_id,
                        tracking_uri=topology.uri).monitor(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert client.get_run(run_id).data.tags.get("msprobe_mlflow.rank0.status") is None


FULL_AND_READ_ONLY = """
import sys, torch
from msprobe_mlflow import GradProbeConfig
from msprobe_mlflow.pytorch import GradientMonitor
model = torch.nn.Linear(2, 1)
for path in sys.argv[1:]:
    try:
        GradientMonitor(GradProbeConfig(dump_path=path)).monitor(model, torch.optim.SGD(model.parameters(), lr=0.1))
        print("ACCEPTED", path)
    except ValueError as e:
        print("REFUSED", e)
"""


def test_full_or_read_only_dump_folder_is_refused_before_training(tmp_path):
    """A full file system (a 64 KiB tmpfs filled up) and a read-only one, mounted in a private mount namespace
    of the child process only (nothing to clean up); skipped where mounting is not permitted."""
    if os.geteuid() != 0:
        pytest.skip("mounting a full or read-only tmpfs needs root")
    (tmp_path / "full").mkdir()
    (tmp_path / "read_only").mkdir()
    script = ('set -e; mount -t tmpfs -o size=64k tmpfs "$1/full"; head -c 1048576 /dev/zero > "$1/full/filler" '
              '2>/dev/null || true; mount -t tmpfs -o ro,size=64k tmpfs "$1/read_only"; shift; exec "$@"')
    done = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", str(tmp_path),
                           sys.executable, "-c", FULL_AND_READ_ONLY, str(tmp_path / "full/dump"),
                           str(tmp_path / "read_only/dump")], capture_output=True, text=True, timeout=120)
    if done.returncode != 0 and ("Operation not permitted" in done.stderr or "permission denied" in done.stderr):
        pytest.skip(f"no private mount namespace here: {done.stderr.strip()[-300:]}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == [
        f"REFUSED dump_path = '{tmp_path}/full/dump' is not a writable folder (No space left on device)",
        f"REFUSED dump_path = '{tmp_path}/read_only/dump' is not a writable folder (Read-only file system)",
    ]


def test_a_dead_rank_is_named_in_the_run_and_the_other_rank_is_complete(topology, tmp_path, capsys):
    dump = tmp_path / "dump"
    rank0, rank1 = launch_ranks_separately(topology.uri, "--dump", str(dump), "--steps", "4", "--die-at", "2",
                                           "--run-name", "rank-dies")
    assert (rank0.returncode, rank1.returncode) == (0, 17), rank0.stderr[-3000:]
    run_id = run_id_of(rank0)
    client = MlflowClient(topology.uri)
    tags = client.get_run(run_id).data.tags
    assert tags["msprobe_mlflow.missing_ranks"] == "1"
    assert (tags["msprobe_mlflow.rank0.status"], tags["msprobe_mlflow.rank1.status"]) == ("finished", "missing")
    assert "ranks [1] did not finish" in rank0.stderr
    counts = count_against_dump(client, run_id, dump, ranks=[0])
    assert counts == {0: {"steps": 4, "metric_values": 4 * METRICS_PER_STEP, "files": 4 * FILES_PER_STEP}}
    # Rank 1 died before step 2: its writer thread may not even have written steps 0 and 1, and the sink sends
    # only what was written, so the server holds a part of rank 1's dump, never more.
    written = set(local_steps(dump).get(1, []))
    metric_steps, csv_steps = server_steps(client, run_id, 1)
    assert set(metric_steps) <= written <= {0, 1} and set(csv_steps) <= written
    show_counts(capsys, "rank 1 dies at step 2", {**counts, "rank 1 written": sorted(written),
                                                  "rank 1 on the server": (metric_steps, csv_steps)})
