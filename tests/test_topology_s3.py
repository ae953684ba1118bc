"""The artifact path of the deployment in docker/ (MinIO behind the tracking server's artifact proxy), with an S3
endpoint on 127.0.0.1: moto's server stands in for MinIO, boto3 is MLflow's S3 client. Two 2-rank trainings log
through the proxy into the bucket; compare and read_statistics read them back through it."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pandas
import pytest
from mlflow.tracking import MlflowClient

from msprobe_mlflow import read_statistics
from mlflow_server import MlflowServer, free_port
from test_topology import cli, expected_files
from test_tracking_distributed import run_id_of, torchrun

boto3 = pytest.importorskip("boto3")  # requirements-dev.txt installs it, with moto
pytest.importorskip("moto")
pytestmark = pytest.mark.topology

BUCKET, PREFIX = "msprobe-artifacts", "mlflow"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


class S3Endpoint:
    """``python -m moto.server`` on a free port of 127.0.0.1: an in-memory S3, gone when it stops."""

    def __init__(self, folder: Path):
        self.port = free_port()
        self.log = open(folder / "s3.log", "ab")
        self.process = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                        stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(self.url, timeout=2).close()
                return
            except OSError:
                assert self.process.poll() is None, (folder / "s3.log").read_text()[-3000:]
                assert time.monotonic() < deadline, "the S3 endpoint did not answer in 60 s"
                time.sleep(0.3)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self):
        return boto3.client("s3", endpoint_url=self.url, aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
                            aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
                            region_name=CREDENTIALS["AWS_DEFAULT_REGION"])

    def stop(self) -> None:
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        self.log.close()


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory):
    """A tracking server whose artifact proxy writes to ``s3://{BUCKET}/{PREFIX}`` on the local endpoint."""
    folder = tmp_path_factory.mktemp("s3_topology")
    s3 = S3Endpoint(folder)
    server = None
    try:
        s3.client().create_bucket(Bucket=BUCKET)
        server = MlflowServer(folder / "server", artifacts_destination=f"s3://{BUCKET}/{PREFIX}",
                              env={**CREDENTIALS, "MLFLOW_S3_ENDPOINT_URL": s3.url}).start()
        yield s3, server
    finally:
        if server is not None:
            server.stop()
        s3.stop()


def bucket_files(s3: S3Endpoint, run_id: str) -> dict[str, bytes]:
    """The run's ``grad_probe/`` objects in the bucket: ``grad_probe/...`` path -> content."""
    client, found = s3.client(), {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=f"{PREFIX}/"):
        for item in page.get("Contents", []):
            marker = f"/{run_id}/artifacts/"
            if marker in item["Key"] and "/grad_probe/rank" in item["Key"]:
                relative = item["Key"].split(marker, 1)[1]
                found[relative] = client.get_object(Bucket=BUCKET, Key=item["Key"])["Body"].read()
    return found


def test_trainings_log_into_the_bucket_and_compare_reads_them_back_through_the_proxy(s3_server, tmp_path,
                                                                                       monkeypatch, capsys):
    s3, server = s3_server
    monkeypatch.setenv("MLFLOW_TRACKING_URI", server.uri)
    experiment_id = MlflowClient(server.uri).create_experiment(f"s3-{uuid.uuid4().hex[:8]}")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_ID", experiment_id)
    runs = {}
    for name, extra in (("baseline", []), ("perturbed", ["--perturb-from", "2"])):
        done = torchrun(server.uri, "--dump", str(tmp_path / name), "--steps", "4", "--run-name", name, *extra)
        assert done.returncode == 0, done.stderr[-3000:]
        runs[name] = run_id_of(done)

    for name, run_id in runs.items():  # every file of both ranks is in the bucket, byte for byte
        stored = bucket_files(s3, run_id)
        wanted = expected_files(0, list(range(4))) | expected_files(1, list(range(4)))
        assert set(stored) == wanted
        for path, content in stored.items():
            assert content == (tmp_path / name / path.removeprefix("grad_probe/")).read_bytes(), path

    cache = tmp_path / "cache"
    compared = cli("compare", runs["baseline"], runs["perturbed"], "--tracking-uri", server.uri, "--cache-dir",
                   str(cache), "--no-plots")
    assert compared.returncode == 0, compared.stderr[-3000:]
    assert "rank 0: first suspicious step 2" in compared.stdout and "rank 1: first suspicious step 2" in compared.stdout
    for name, run_id in runs.items():  # what compare downloaded through the proxy is what the ranks wrote
        for path in expected_files(0, list(range(4))) | expected_files(1, list(range(4))):
            assert (cache / run_id / path).read_bytes() == (tmp_path / name / path.removeprefix("grad_probe/")) \
                .read_bytes(), path

    statistics_cache = tmp_path / "statistics_cache"
    from_bucket = read_statistics(runs["perturbed"], tracking_uri=server.uri, cache_dir=statistics_cache)
    pandas.testing.assert_frame_equal(from_bucket, read_statistics(tmp_path / "perturbed"))
    fetched = sorted(p.relative_to(statistics_cache).as_posix() for p in statistics_cache.rglob("*") if p.is_file())
    assert fetched == sorted(f"{runs['perturbed']}/grad_probe/rank{r}/grad_summary_{s}.csv"
                             for r in (0, 1) for s in range(4))  # the summaries only, not the directions
    with capsys.disabled():
        print(f"\n[topology s3] {len(bucket_files(s3, runs['baseline']))} files per run in s3://{BUCKET}/{PREFIX}")
