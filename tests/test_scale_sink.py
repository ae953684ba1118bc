"""The sink at scale, in one process on a real SQLite store: steps archived per N steps and read back through the
run like today's layout, a bounded stop() that names what it left, and the rank-0 exchange of summary vectors."""
from __future__ import annotations

import math
import zipfile

import mlflow
import numpy as np
import pandas
import pytest
from mlflow.tracking import MlflowClient

from msprobe_mlflow.config import GradProbeConfig
from msprobe_mlflow.directions import read_step_directions
from msprobe_mlflow.metrics import record_metrics
from msprobe_mlflow.dump import (extract_steps_archive, parse_archive_name, read_statistics_table,
                                 relative_archive_path, step_dir, step_ranges, summary_csv_path, write_step,
                                 write_steps_archive)
from msprobe_mlflow.pytorch import GradientMonitor
from msprobe_mlflow.records import StepRecord
from msprobe_mlflow.session import RankPolicy
from msprobe_mlflow.sinks import mlflow as sink_module
from msprobe_mlflow.sinks.mlflow import settings as sink_settings
from msprobe_mlflow.tracking.aggregate import END_OF_RUN, RANK_STATUSES, RankZeroMetrics, aggregation_wanted
from msprobe_mlflow.tracking.options import TrackingOptions
from msprobe_mlflow.tracking.run_dump import RunBaseline, read_statistics
from msprobe_mlflow.tracking.upload import packed_directions_file, upload_dump
from tiny_models import gaussian, mlp, train


def test_step_ranges_name_an_archive_and_read_back():
    assert step_ranges([9, 0, 1, 2, 3, 7, 10]) == "0-3,7,9-10"
    every_other = range(0, 20_000, 2)  # "0,2,4,...": far over a tag's length
    cut = step_ranges(every_other, limit=100)
    assert len(cut) <= 100 and cut.endswith(",...")
    assert cut[:-len(",...")].split(",") == [str(s) for s in every_other][:len(cut[:-4].split(","))]
    assert step_ranges(every_other[:3], limit=100) == "0,2,4"
    assert relative_archive_path(3, [0, 1, 2, 12]) == "rank3/steps_0-2_12.zip"
    assert parse_archive_name("steps_0-2_12.zip") == [0, 1, 2, 12]
    assert parse_archive_name("steps_5.zip") == [5]
    for other in ("steps_.zip", "steps_1-2.csv", "grad_summary_1.csv", "steps_1,2.zip", "steps_0-100000.zip"):
        assert parse_archive_name(other) is None


def record(step: int, rank: int = 0) -> StepRecord:
    rng = np.random.default_rng(step + 100 * rank)
    return StepRecord(rank=rank, step=step, level="L1", bounds=(-1, 0, 1), names=["w", "b"], shapes=[(3, 5), (5,)],
                      values=rng.standard_normal((2, 3)).astype(np.float32),
                      directions=np.concatenate([np.packbits(rng.random(15) > 0.5), np.packbits(rng.random(5) > 0.5)]))


def test_an_archive_expands_into_the_dump_layout_byte_for_byte(tmp_path):
    for step in (0, 1, 3):
        write_step(tmp_path / "dump", record(step))
    archive = write_steps_archive(tmp_path / "dump", 0, [0, 1, 3], tmp_path, packed_directions_file)
    assert archive.name == "steps_0-1_3.zip"
    with zipfile.ZipFile(archive) as opened:  # sign bits do not compress: stored, not deflated again
        assert {info.filename: info.compress_type for info in opened.infolist()} == {
            **{f"step{step}/directions.npz": zipfile.ZIP_STORED for step in (0, 1, 3)},
            **{f"grad_summary_{step}.csv": zipfile.ZIP_DEFLATED for step in (0, 1, 3)}}
    assert extract_steps_archive(archive, tmp_path / "out" / "rank0") == [0, 1, 3]
    for step in (0, 1, 3):
        assert summary_csv_path(tmp_path / "out", 0, step).read_bytes() == \
            summary_csv_path(tmp_path / "dump", 0, step).read_bytes()
        assert (step_dir(tmp_path / "out", 0, step) / "directions.npz").read_bytes() == \
            (step_dir(tmp_path / "dump", 0, step) / "directions.npz").read_bytes()


@pytest.mark.parametrize("member", ["../evil.csv", "grad_summary_2.csv", "step0/other.npy", "/etc/x"])
def test_an_archive_member_its_name_does_not_announce_is_refused_before_anything_is_written(tmp_path, member):
    path = tmp_path / "steps_0-1.zip"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("grad_summary_0.csv", "param_name,max,min,norm,shape\r\n")
        archive.writestr(member, "x")
    with pytest.raises(ValueError, match=f"member {member!r} is not one of the step files"):
        extract_steps_archive(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_archived_steps_read_back_through_the_run_like_the_local_dump(tmp_experiment, tmp_path):
    dump = tmp_path / "dump"
    with mlflow.start_run() as run:
        monitor = GradientMonitor(GradProbeConfig(dump_path=str(dump), level="L1"), archive_every_n_steps=2)
        train(mlp(6, 4, 2), 3, monitor=monitor, data=gaussian(8, 6), seed=None)
        monitor.stop()
    assert monitor.errors == []
    client = MlflowClient()
    names = sorted(info.path for info in client.list_artifacts(run.info.run_id, "grad_probe/rank0"))
    assert names == ["grad_probe/rank0/steps_0-1.zip", "grad_probe/rank0/steps_2.zip"]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "grad/rank0/total_norm")] == [0, 1, 2]
    from_run = read_statistics(run.info.run_id, cache_dir=tmp_path / "cache")
    pandas.testing.assert_frame_equal(from_run, read_statistics_table(dump))
    baseline = RunBaseline(run.info.run_id, cache_dir=tmp_path / "cache")
    assert baseline.steps(0) == [0, 1, 2]
    for name, (shape, bits) in read_step_directions(baseline.step_folder(0, 2)).items():
        expected_shape, expected_bits = read_step_directions(step_dir(dump, 0, 2))[name]
        assert shape == expected_shape and np.array_equal(bits, expected_bits)
    report = upload_dump(dump, run.info.run_id)  # the archives count as sent: nothing goes up twice
    assert (report.metrics_logged, report.files_uploaded) == (0, 0)


def test_a_stop_out_of_drain_time_names_the_unsent_steps_and_upload_completes_the_rank(tmp_experiment, tmp_path,
                                                                                       monkeypatch):
    monkeypatch.setattr(sink_settings, "DRAIN_SECONDS", 0.0)  # stop() may not wait at all
    monkeypatch.setattr(sink_settings, "SEND_INTERVAL_SECONDS", 600.0)  # steps after the first round wait in the queue
    dump = tmp_path / "dump"
    config = GradProbeConfig(dump_path=str(dump), level="L1")
    run_id = MlflowClient().create_run(tmp_experiment).info.run_id
    sink = sink_module.MlflowSink(run_id, config, TrackingOptions(run_id), RankPolicy(), framework="pytorch")
    for step in range(4):
        write_step(dump, record(step))
        sink.handle(record(step))
        if step == 0:
            sink.flush()  # step 0 is sent; steps 1..3 wait for the next round, which stop() has no time for
    sink.close()
    client = MlflowClient()
    tags = client.get_run(run_id).data.tags
    assert tags["msprobe_mlflow.rank0.status"] == "incomplete"
    assert tags["msprobe_mlflow.rank0.unsent_steps"] == "1-3"
    assert [m.step for m in client.get_metric_history(run_id, "grad/rank0/total_norm")] == [0]
    upload_dump(dump, run_id)
    tags = client.get_run(run_id).data.tags
    assert tags["msprobe_mlflow.rank0.status"] == "finished" and "msprobe_mlflow.rank0.unsent_steps" not in tags
    assert [m.step for m in client.get_metric_history(run_id, "grad/rank0/total_norm")] == [0, 1, 2, 3]


def test_distributions_rank_0_could_not_send_are_named_and_upload_of_every_ranks_dump_completes_them(
        tmp_experiment, tmp_path, monkeypatch):
    monkeypatch.setattr(sink_settings, "DRAIN_SECONDS", 0.0)
    monkeypatch.setattr(sink_settings, "SEND_INTERVAL_SECONDS", 600.0)
    monkeypatch.setattr(sink_settings, "RANK_WAIT_SECONDS", 0.0)  # rank 1 has no sink here to report itself
    dump = tmp_path / "dump"
    for step in range(3):
        write_step(dump, record(step, rank=1))  # rank 1's own dump, the source of truth for its values

    def gather(vector):  # the all-gather as rank 0 sees it: rank 1's summary of the same step beside its own
        theirs = record_metrics(record(int(vector[0]), rank=1))
        return np.stack([vector, [vector[0], *(theirs[k] for k in sorted(theirs))]])

    run_id = MlflowClient().create_run(tmp_experiment).info.run_id
    config = GradProbeConfig(dump_path=str(dump), level="L1")
    sink = sink_module.MlflowSink(run_id, config, TrackingOptions(run_id), RankPolicy(0, 2), framework="pytorch",
                                  gather=gather)
    for step in range(3):
        write_step(dump, record(step))
        sink.handle(record(step))
        if step == 0:
            sink.flush()
    sink.close()
    client = MlflowClient()
    tags = client.get_run(run_id).data.tags
    assert tags["msprobe_mlflow.rank_summary"] == "distribution over ranks"
    assert tags["msprobe_mlflow.unsent_distribution_steps"] == "1-2"
    assert [m.step for m in client.get_metric_history(run_id, "grad/ranks/total_norm median")] == [0]
    report = upload_dump(dump, run_id)
    assert "msprobe_mlflow.unsent_distribution_steps" not in client.get_run(run_id).data.tags
    assert report.unsent_distributions == ""
    for suffix in ("total_norm", "max", "min"):
        values = np.array([[record_metrics(record(s, rank=r))[f"grad/rank{r}/{suffix}"] for r in (0, 1)]
                           for s in range(3)])
        expected = {"min": values.min(axis=1), "median": np.median(values, axis=1), "max": values.max(axis=1),
                    "min rank": values.argmin(axis=1), "max rank": values.argmax(axis=1)}
        for statistic, column in expected.items():
            history = client.get_metric_history(run_id, f"grad/ranks/{suffix} {statistic}")
            assert [(m.step, m.value) for m in history] == [(s, float(column[s])) for s in range(3)]
    assert not [key for key in client.get_run(run_id).data.metrics if key.startswith("grad/rank1/")]


def test_a_dump_without_every_rank_cannot_complete_the_distributions_and_says_which_steps_lack_them(
        tmp_experiment, tmp_path):
    dump = tmp_path / "dump"
    write_step(dump, record(0, rank=1))
    client = MlflowClient()
    run_id = client.create_run(tmp_experiment, tags={"msprobe_mlflow.rank_summary": "distribution over ranks",
                                                     "msprobe_mlflow.world_size": "2",
                                                     "msprobe_mlflow.unsent_distribution_steps": "0"}).info.run_id
    report = upload_dump(dump, run_id)
    assert report.unsent_distributions == "0"
    assert client.get_run(run_id).data.tags["msprobe_mlflow.unsent_distribution_steps"] == "0"
    assert not [key for key in client.get_run(run_id).data.metrics if key.startswith("grad/rank")]


def metrics_of(rank: int, total_norm: float, maximum: float) -> dict[str, float]:
    prefix = f"grad/rank{rank}"
    return {f"{prefix}/total_norm": total_norm, f"{prefix}/max": maximum, f"{prefix}/param/w/norm": 7.0}


def test_rank_0_gets_each_summary_metrics_distribution_over_the_ranks_at_its_step():
    vectors = {}

    def gather(vector):  # what an all-gather returns: every rank's vector in rank order
        vectors[len(vectors)] = vector
        return np.stack([vector, [5, 1.0, 2.0], [5, 3.0, math.nan], [6, 4.0, 8.0]])  # ranks 1 to 3

    own, others = RankZeroMetrics(gather, 0).exchange(5, metrics_of(0, 0.5, 0.25))
    assert list(vectors[0]) == [5, 0.25, 0.5]  # step, then the summary values by sorted suffix: max, total_norm
    assert own == metrics_of(0, 0.5, 0.25)
    statistics = ("min", "median", "max", "min rank", "max rank")
    assert {k: v for k, v in others[5].items() if k.startswith("grad/ranks/max ")} == {
        f"grad/ranks/max {s}": v for s, v in zip(statistics, (0.25, 1.0, 3.0, 0, 2))}
    assert {k: v for k, v in others[5].items() if k.startswith("grad/ranks/total_norm ")} == {  # NaN left out
        f"grad/ranks/total_norm {s}": v for s, v in zip(statistics, (0.5, 1.25, 2.0, 0, 1))}
    assert others[6]["grad/ranks/total_norm max rank"] == 3 and others[6]["grad/ranks/max median"] == 4.0


@pytest.mark.parametrize("world_size", [2, 1024])
def test_the_values_rank_0_sends_per_step_do_not_grow_with_the_ranks(world_size):
    rng = np.random.default_rng(world_size)

    def gather(vector):
        return np.column_stack([np.full(world_size, vector[0]), rng.random((world_size, len(vector) - 1))])

    own, others = RankZeroMetrics(gather, 0).exchange(3, metrics_of(0, 0.5, 0.25))
    assert len(own) + len(others[3]) == 3 + 2 * 5  # rank 0's own 3, and 5 per summary metric (max, total_norm)
    assert not math.isnan(others[3]["grad/ranks/max median"])


def test_no_rank_with_a_finite_value_gives_nan_and_no_rank():
    own, others = RankZeroMetrics(lambda v: np.stack([v, [1, math.nan, math.inf]]), 0).exchange(
        1, metrics_of(0, math.nan, math.inf))
    assert all(math.isnan(v) for v in others[1].values())


def test_other_ranks_keep_only_their_per_parameter_metrics():
    own, others = RankZeroMetrics(lambda v: np.stack([v, v]), 1).exchange(0, metrics_of(1, 0.5, 0.25))
    assert own == {"grad/rank1/param/w/norm": 7.0} and others == {}


def test_aggregation_is_on_from_64_ranks_unless_forced():
    assert [aggregation_wanted(None, n) for n in (1, 63, 64)] == [False, False, True]
    assert aggregation_wanted(True, 2) and not aggregation_wanted(True, 1) and not aggregation_wanted(False, 1024)
    with pytest.raises(ValueError, match="aggregate_metrics = 'yes' is not accepted"):
        TrackingOptions(aggregate_metrics="yes")
    with pytest.raises(ValueError, match="archive_every_n_steps = 0 is not accepted"):
        TrackingOptions(archive_every_n_steps=0)


def test_the_end_of_run_exchange_hands_rank_0_every_rank_status_in_vectors_as_long_as_the_steps():
    sent = []

    def gather(vector):  # ranks 1 and 2 send the same layout: [END_OF_RUN, status index, padding]
        sent.append(vector)
        return np.stack([vector, [END_OF_RUN, 1.0, 0.0], [END_OF_RUN, 0.0, 0.0]])

    exchange = RankZeroMetrics(gather, 0)
    exchange.length = 3  # as after a step of [step, max, total_norm]
    assert exchange.exchange_statuses("incomplete") == {0: "incomplete", 1: "incomplete", 2: "finished"}
    assert list(sent[0]) == [END_OF_RUN, RANK_STATUSES.index("incomplete"), 0.0]


def test_a_rank_still_stepping_and_one_that_ended_are_told_apart_on_both_sides():
    still_stepping = RankZeroMetrics(lambda v: np.stack([v, [7, 1.0, 2.0]]), 1)
    still_stepping.length = 3
    with pytest.raises(ValueError, match=r"still exchanging steps \[-1.0, 7.0\]"):
        still_stepping.exchange_statuses("finished")
    ended = RankZeroMetrics(lambda v: np.stack([v, [END_OF_RUN, 0.0, 0.0]]), 0)
    with pytest.raises(ValueError, match=r"ranks \[1\] stopped monitoring while rank 0 probed step 5"):
        ended.exchange(5, metrics_of(0, 0.5, 0.25))
