"""FSDP1 (``FullyShardedDataParallel``, with and without ``use_orig_params``) on 2 gloo ranks records what one
unsharded process training the same model on the same global batch records: the original parameters' names, shapes
and order, every statistic, and directions the comparator finds equal (tests/fsdp1_worker.py trains)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from test_training_stacks import (STEPS, assert_comparable, assert_same_statistics, eager_dump,  # noqa: F401
                                  run)

WORKER = Path(__file__).with_name("fsdp1_worker.py")


@pytest.mark.parametrize("orig", [0, 1], ids=["flat_params", "use_orig_params"])
def test_fsdp1_on_two_ranks_records_the_unsharded_gradients_statistics(tmp_path, eager_dump, orig):  # noqa: F811
    dump = tmp_path / "fsdp1"
    run(WORKER, "--dump", str(dump), "--steps", str(STEPS), "--orig", str(orig), ranks=2)
    assert sorted(p.name for p in dump.glob("rank*")) == ["rank0", "rank1"]
    for rank in (0, 1):  # every rank holds the full statistics after the reduction
        assert_same_statistics(dump, rank, eager_dump)
        assert_same_directions(dump, rank, eager_dump)
    assert_comparable(dump, eager_dump)


def assert_same_directions(dump: Path, rank: int, eager: Path) -> None:
    """Bit for bit: the pieces' sign bits start mid-byte and a rank may hold none of a parameter, and the
    comparator's similarity alone would tolerate a few wrong bits."""
    for step in range(STEPS):
        with np.load(dump / f"rank{rank}" / f"step{step}" / "directions.npz") as mine, \
                np.load(eager / "rank0" / f"step{step}" / "directions.npz") as reference:
            assert sorted(mine.files) == sorted(reference.files)
            for key in reference.files:
                np.testing.assert_array_equal(mine[key], reference[key], err_msg=f"rank{rank} step {step} {key}")


def test_fsdp1_shards_the_monitor_cannot_place_warn_and_fail_every_probe_never_recording_them(tmp_path):
    """Monitoring what the root FSDP1 module wraps leaves its flat parameter without its sharding: ``monitor()``
    warns, naming FSDP1 and fully_shard, each probe fails into ``monitor.errors``, and no shard is recorded as if
    it were a parameter."""
    dump = tmp_path / "inner"
    done = run(WORKER, "--dump", str(dump), "--steps", "2", "--orig", "0", "--inner", ranks=2)
    for rank in (0, 1):
        lines = [line for line in done.stdout.splitlines() if line.startswith(f"rank {rank} errors")]
        assert len(lines) == 1, done.stdout
        (line,) = lines
        assert line.startswith(f"rank {rank} errors 2: ") and "FSDP1" in line and "fully_shard" in line, line
    assert done.stderr.count("msprobe-mlflow: warning: FSDP1 (FullyShardedDataParallel) as monitored here") == 2
    assert not list(dump.rglob("*.csv"))
