"""FSDP2, DDP and torch.compile record what an unsharded eager run of the same model and data records, under the
same names, and the comparator finds every parameter in common (tests/stacks_worker.py trains)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from mlflow_server import free_port
from msprobe_mlflow.commands.cli import main
from msprobe_mlflow.compare.engine import compare_dumps
from msprobe_mlflow.dump import read_summary

WORKER = Path(__file__).with_name("stacks_worker.py")
SHARDED_WORKER = Path(__file__).with_name("sharded_statistics_worker.py")
STEPS = 3
STATISTICS = ("max", "min", "norm")
BUCKETS = ("(-inf, -1]", "(-1, 0]", "(0, 1]", "(1, inf)", "=0")


def run(script: Path, *args: str, ranks: int = 1) -> subprocess.CompletedProcess:
    launcher = [sys.executable]
    if ranks > 1:
        launcher += ["-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-addr", "127.0.0.1",
                     "--master-port", str(free_port())]
    done = subprocess.run([*launcher, str(script), *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done


def train(stack: str, dump: Path, *worker_args: str) -> None:
    ranks = 2 if stack in ("fsdp2", "ddp") else 1
    run(WORKER, "--stack", stack, "--dump", str(dump), "--steps", str(STEPS), *worker_args, ranks=ranks)


@pytest.fixture(scope="module")
def eager_dump(tmp_path_factory) -> Path:
    dump = tmp_path_factory.mktemp("eager") / "dump"
    train("single", dump)
    return dump


def assert_same_statistics(dump: Path, rank: int, eager: Path) -> None:
    for step in range(STEPS):
        mine = read_summary(dump / f"rank{rank}" / f"grad_summary_{step}.csv")
        reference = read_summary(eager / "rank0" / f"grad_summary_{step}.csv")
        assert mine.column("param_name") == reference.column("param_name")
        assert mine.column("shape") == reference.column("shape")
        for column in STATISTICS:  # equal up to the order of float additions (DDP/FSDP average the halves)
            np.testing.assert_allclose(mine.numbers(column), reference.numbers(column), rtol=1e-5, atol=1e-8,
                                       err_msg=f"rank{rank} step {step} {column}")
        for column in BUCKETS:
            assert mine.numbers(column) == reference.numbers(column), f"rank{rank} step {step} {column}"


def assert_comparable(dump: Path, eager: Path) -> None:
    """``msprobe-mlflow compare`` exits 0 with --fail-on-suspicious; its engine's result holds every parameter."""
    output = dump.parent / f"{dump.name}-vs-eager"
    done = CliRunner().invoke(main, ["compare", str(dump), str(eager), "--output", str(output), "--no-mlflow",
                                     "--no-plots", "--fail-on-suspicious"])
    assert done.exit_code == 0, done.output
    assert "only in" not in done.output and "matched once wrapper prefixes" not in done.output
    comparison = compare_dumps(dump, eager, None, plots=False, progress=False)
    (rank,) = comparison.ranks
    names = read_summary(eager / "rank0" / "grad_summary_0.csv").column("param_name")
    assert rank.parameters == names and not rank.only_in_a and not rank.only_in_b
    assert rank.steps == list(range(STEPS))
    assert not comparison.verdict.suspicious, comparison.verdict.describe()
    assert min(rank.summary) > 0.99


def test_dtensor_statistics_equal_the_full_tensors_at_every_level_for_any_shard_layout():
    """Shards along dim 0 and 1, uneven and empty shards, replicated and plain tensors, NaN, inf, bf16, float64."""
    done = run(SHARDED_WORKER, ranks=2)
    assert done.stdout.count("sharded statistics equal") == 2


def test_fsdp2_on_two_ranks_records_the_unsharded_gradients_statistics(tmp_path, eager_dump):
    train("fsdp2", tmp_path / "fsdp2")
    assert sorted(p.name for p in (tmp_path / "fsdp2").glob("rank*")) == ["rank0", "rank1"]
    for rank in (0, 1):  # every rank holds the full statistics after the reduction
        assert_same_statistics(tmp_path / "fsdp2", rank, eager_dump)
    assert_comparable(tmp_path / "fsdp2", eager_dump)


def test_fsdp2_writing_on_rank_0_only_still_reduces_on_every_rank(tmp_path, eager_dump):
    """Rank 1 writes nothing but takes part in the collectives: without it rank 0 would wait forever."""
    train("fsdp2", tmp_path / "fsdp2", "--ranks", "0")
    assert sorted(p.name for p in (tmp_path / "fsdp2").glob("rank*")) == ["rank0"]
    assert_same_statistics(tmp_path / "fsdp2", 0, eager_dump)


def test_ddp_on_two_ranks_records_the_eager_names_and_statistics(tmp_path, eager_dump):
    train("ddp", tmp_path / "ddp")
    for rank in (0, 1):
        assert_same_statistics(tmp_path / "ddp", rank, eager_dump)
    assert_comparable(tmp_path / "ddp", eager_dump)


def test_compiled_model_records_the_eager_names_and_statistics(tmp_path, eager_dump):
    train("compile", tmp_path / "compile")
    assert_same_statistics(tmp_path / "compile", 0, eager_dump)
    assert_comparable(tmp_path / "compile", eager_dump)
