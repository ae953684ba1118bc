"""Each monitor's aggregation group (the gloo group of ``pytorch.distributed.summary_all_gather``) is destroyed at
``stop()`` on every rank: over start/stop cycles under torchrun the number of process groups a rank holds comes back
to what it was, and the job ends (destroying is no collective, so no rank waits for another)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from mlflow_server import free_port

WORKER = Path(__file__).with_name("gather_group_worker.py")


def test_each_monitors_gloo_group_is_destroyed_at_stop_on_every_rank(tmp_path, tmp_sqlite_uri):
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
               "--master-port", str(free_port()), str(WORKER), "--dump", str(tmp_path / "dump"), "--tracking-uri",
               tmp_sqlite_uri]
    env = {**os.environ, "MSPROBE_MLFLOW_RANK_WAIT_SECONDS": "5", "MSPROBE_MLFLOW_GATHER_TIMEOUT_SECONDS": "60"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    for rank in (0, 1):
        lines = [line.split() for line in (tmp_path / "dump" / f"groups_rank{rank}.txt").read_text().splitlines()]
        assert lines[0][0] == "before" and [words[0] for words in lines[1:]] == ["cycle"] * 3, lines
        before = int(lines[0][1])
        for _, during, after, errors in lines[1:]:
            assert int(during) == before + 1, lines  # the monitor made its group: the count can move
            assert int(after) == before, lines
            assert errors == "0", lines
