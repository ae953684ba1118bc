"""compare_runs and the 'compare' command against real MLflow stores (SQLite, and a real server)."""
from __future__ import annotations

import csv
import hashlib
import io
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path
from urllib.parse import quote

import mlflow
import pytest
import torch
from click.testing import CliRunner
from mlflow.tracking import MlflowClient
from mlflow.utils.validation import MAX_TAG_VAL_LENGTH

from msprobe_mlflow import GradProbeConfig, compare_runs
from msprobe_mlflow.compare.engine import DumpComparison, RankComparison
from msprobe_mlflow.compare.verdict import RankVerdict, RuleSettings, Verdict
from msprobe_mlflow.tracking.comparison_run import ComparisonSource, log_comparison_run
from msprobe_mlflow.commands.cli import main
from msprobe_mlflow.pytorch import GradientMonitor
from mlflow_server import MlflowServer
from test_compare_dumps import FLIPS, base_signs, flipped, write_msprobe_style, write_ours

REPO = Path(__file__).resolve().parents[1]
HAND_SUMMARY = [1.0, 22 / 23, 16 / 23]  # see test_compare_dumps: 23 elements, 1 then 7 of them flipped


@pytest.fixture(scope="module")
def store(sqlite_store):
    return sqlite_store


@pytest.fixture
def experiment_id(store):
    uri, folder = store
    return mlflow.create_experiment(f"compare-{uuid.uuid4().hex[:8]}", artifact_location=str(folder / "artifacts"))


@pytest.fixture
def hand_dumps(tmp_path):
    a = {step: base_signs(step) for step in FLIPS}
    b = {step: flipped(a[step], FLIPS[step]) for step in FLIPS}
    return write_ours(tmp_path / "dump_a", a), write_ours(tmp_path / "dump_b", b, "npy")


def log_dump_run(dump: Path, experiment_id: str, name: str, level: str = "L1") -> str:
    """A run as the monitor leaves it: the dump under grad_probe/, the level tag."""
    with mlflow.start_run(experiment_id=experiment_id, run_name=name) as run:
        mlflow.log_artifacts(str(dump), "grad_probe")
        mlflow.set_tag("msprobe_mlflow.level", level)
    return run.info.run_id


def csv_rows(text: str) -> list[list[str]]:
    return list(csv.reader(io.StringIO(text.lstrip("\ufeff"), newline="")))


def runs_in(experiment_id: str) -> list:
    return MlflowClient().search_runs([experiment_id])


def test_compare_runs_logs_metrics_tags_and_artifacts(hand_dumps, experiment_id):
    run_a = log_dump_run(hand_dumps[0], experiment_id, "baseline")
    run_b = log_dump_run(hand_dumps[1], experiment_id, "candidate")
    result = compare_runs(run_a, run_b, rule="msprobe")
    client = MlflowClient()
    run = client.get_run(result.run_id)
    assert run.info.experiment_id == experiment_id and run.info.status == "FINISHED"
    assert run.info.run_name == "suspicious at step 1: baseline vs candidate"  # what differs between comparisons first
    tags = run.data.tags
    assert (tags["msprobe_mlflow.compare.run_a"], tags["msprobe_mlflow.compare.run_b"]) == (run_a, run_b)
    assert tags["msprobe_mlflow.compare.verdict"] == "suspicious"
    assert tags["msprobe_mlflow.compare.first_suspicious_step"] == "1"
    assert tags["msprobe_mlflow.compare.rank0.suspicious_parameters"].startswith("fc.weight (fell 0.0667)")
    history = client.get_metric_history(result.run_id, "summary_similarity/rank0")
    assert [(m.step, m.value) for m in sorted(history, key=lambda m: m.step)] == \
        [(0, 1.0), (1, pytest.approx(22 / 23)), (2, pytest.approx(16 / 23))]
    assert run.data.metrics["verdict/suspicious"] == 1.0
    assert run.data.metrics["verdict/first_suspicious_step"] == 1.0
    assert run.data.params == {"rule": "msprobe", "first_threshold": "0.97", "drop_threshold": "0.03"}
    assert tags["msprobe_mlflow.compare.rule"] == "msprobe"
    listed = {i.path for i in client.list_artifacts(result.run_id, "grad_compare/rank0/similarities_picture")}
    assert listed == {"grad_compare/rank0/similarities_picture/summary_similarities.png",
                      "grad_compare/rank0/similarities_picture/similarity_heatmap.png"}
    text = mlflow.artifacts.load_text(f"runs:/{result.run_id}/grad_compare/rank0/similarities.csv")
    assert csv_rows(text)[-1] == ["summary", *[repr(v) for v in HAND_SUMMARY]]
    verdict = mlflow.artifacts.load_dict(f"runs:/{result.run_id}/grad_compare/verdict.json")
    assert verdict["verdict"]["ranks"][0]["first_suspicious_step"] == 1


def test_the_description_says_the_verdict_first_links_both_runs_and_keeps_the_table_aligned(hand_dumps,
                                                                                             experiment_id):
    run_a = log_dump_run(hand_dumps[0], experiment_id, "baseline")
    run_b = log_dump_run(hand_dumps[1], experiment_id, "candidate")
    result = compare_runs(run_a, run_b, rule="msprobe")
    description = MlflowClient().get_run(result.run_id).data.tags["mlflow.note.content"]
    lines = description.splitlines()
    # step 1: fc.weight 15/15 -> 14/15, the summary 23/23 -> 22/23 (see test_compare_dumps)
    assert lines[0] == ("**Suspicious**: the runs part at step 1 on rank 0 (summary 1.0000 -> 0.9565; "
                        "fc.weight 1.0000 -> 0.9333 (fell 0.0667)) [msprobe rule]")
    for side, name, run_id in (("A", "baseline", run_a), ("B", "candidate", run_b)):  # links within the MLflow UI
        assert f"- {side}: [{name}](#/experiments/{experiment_id}/runs/{run_id}?workflowType=machine_learning) " \
               f"`{run_id}`" in lines
    fenced = description[description.index("```text\n") + 8:description.rindex("\n```")]
    assert fenced.startswith(result.verdict.describe())
    table = [line for line in fenced.splitlines() if line.startswith(("  step", "  summary"))]
    assert table == ["  step            0        1        2", "  summary    1.0000   0.9565   0.6957"]


def test_a_consistent_comparison_says_so_in_its_first_line(hand_dumps, tmp_path, experiment_id):
    run_a = log_dump_run(hand_dumps[0], experiment_id, "baseline")
    result = compare_runs(run_a, str(hand_dumps[0]))
    description = MlflowClient().get_run(result.run_id).data.tags["mlflow.note.content"]
    assert description.splitlines()[0] == ("**Consistent**: no suspicious step on 1 rank (noise-aware rule: beyond "
                                           "the pair's own numerical noise)")
    assert f"- B: `{hand_dumps[0].resolve()}`" in description.splitlines()


def test_repeated_comparisons_of_a_pair_share_its_key_and_each_links_the_previous_one(hand_dumps, experiment_id):
    run_a = log_dump_run(hand_dumps[0], experiment_id, "baseline")
    run_b = log_dump_run(hand_dumps[1], experiment_id, "candidate")
    first = compare_runs(run_a, run_b, rule="msprobe")
    second = compare_runs(run_a, run_b)
    other_way = compare_runs(run_b, run_a)
    with_folder = compare_runs(run_a, str(hand_dumps[1]))
    tags = {result.run_id: MlflowClient().get_run(result.run_id).data.tags
            for result in (first, second, other_way, with_folder)}
    expected = hashlib.sha256(f"run:{run_a}\nrun:{run_b}".encode()).hexdigest()[:16]
    assert first.pair == second.pair == expected == tags[first.run_id]["msprobe_mlflow.compare.pair"] \
        == tags[second.run_id]["msprobe_mlflow.compare.pair"]
    assert other_way.pair != first.pair and with_folder.pair not in (first.pair, other_way.pair)
    assert first.previous_run_id is None and "msprobe_mlflow.compare.previous_run" not in tags[first.run_id]
    assert second.previous_run_id == tags[second.run_id]["msprobe_mlflow.compare.previous_run"] == first.run_id
    assert other_way.previous_run_id is None and with_folder.previous_run_id is None
    found = MlflowClient().search_runs([experiment_id], f"tags.msprobe_mlflow.compare.pair = '{first.pair}'")
    assert sorted(run.info.run_id for run in found) == sorted([first.run_id, second.run_id])
    previous_line = next(line for line in tags[second.run_id]["mlflow.note.content"].splitlines()
                         if line.startswith("- previous comparison of this pair: "))
    assert previous_line.startswith(f"- previous comparison of this pair: [suspicious at step 1: baseline vs "
                                    f"candidate](#/experiments/"
                                    f"{experiment_id}/runs/{first.run_id}?workflowType=machine_learning) (suspicious); "
                                    f"[all of them](#/experiments/{experiment_id}/runs?searchFilter=")
    assert quote(f"tags.msprobe_mlflow.compare.pair = '{first.pair}'") in previous_line


def test_the_verdict_tag_filters_comparison_runs_in_and_out_of_the_training_runs(hand_dumps, experiment_id):
    """The searches docs/compare.md gives for the runs table's search box, run against a real store."""
    run_a = log_dump_run(hand_dumps[0], experiment_id, "baseline")
    run_b = log_dump_run(hand_dumps[1], experiment_id, "candidate")
    suspicious = compare_runs(run_a, run_b, rule="msprobe").run_id
    consistent = compare_runs(run_a, run_a).run_id

    def found(search: str) -> set[str]:
        return {run.info.run_id for run in MlflowClient().search_runs([experiment_id], search)}

    assert found("tags.msprobe_mlflow.compare.verdict IS NULL") == {run_a, run_b}
    assert found("tags.msprobe_mlflow.compare.verdict IS NOT NULL") == {suspicious, consistent}
    assert found("tags.msprobe_mlflow.compare.verdict = 'suspicious'") == {suspicious}
    ordered = MlflowClient().search_runs([experiment_id], "tags.msprobe_mlflow.compare.verdict IS NOT NULL",
                                         order_by=["tags.`msprobe_mlflow.compare.verdict` DESC"])
    assert [run.info.run_id for run in ordered] == [suspicious, consistent]


def test_a_long_comparison_is_cut_to_fit_mlflows_limit_inside_its_fenced_block(store, experiment_id, tmp_path):
    steps = list(range(3000))  # about 60 000 characters of printed table
    rank = RankComparison(0, steps, ["w"], {"w": [(1, 1)] * len(steps)}, [(1, 1)] * len(steps))
    comparison = DumpComparison(tmp_path / "a", tmp_path / "b", [rank],
                                Verdict(RuleSettings("msprobe"), [RankVerdict(0)]))
    sources = [ComparisonSource("a", folder=tmp_path / "a"), ComparisonSource("b", folder=tmp_path / "b")]
    run_id, _, _ = log_comparison_run(MlflowClient(), comparison, sources, experiment=mlflow.get_experiment(
        experiment_id).name)
    description = MlflowClient().get_run(run_id).data.tags["mlflow.note.content"]
    assert len(description) <= MAX_TAG_VAL_LENGTH
    assert description.startswith("**Consistent**") and description.endswith("...\n```")
    assert description.count("```") == 2


def test_folder_and_run_mix_with_chosen_experiment_and_name(hand_dumps, experiment_id, tmp_path):
    msprobe_dump = write_msprobe_style(tmp_path / "msprobe", {step: base_signs(step) for step in FLIPS})
    run_b = log_dump_run(hand_dumps[1], experiment_id, "candidate")
    target = f"comparisons-{uuid.uuid4().hex[:8]}"  # made here: one compare made would keep artifacts in ./mlruns
    mlflow.create_experiment(target, artifact_location=str(tmp_path / "artifacts"))
    result = compare_runs(str(msprobe_dump), run_b, experiment=target, run_name="mine", output_dir=tmp_path / "out")
    run = MlflowClient().get_run(result.run_id)
    assert run.info.run_name == "mine"
    assert run.info.experiment_id == mlflow.get_experiment_by_name(target).experiment_id
    assert run.data.tags["msprobe_mlflow.compare.dump_path_a"] == str(msprobe_dump.resolve())
    assert run.data.tags["msprobe_mlflow.compare.run_b"] == run_b
    assert result.comparison.ranks[0].summary == pytest.approx(HAND_SUMMARY)
    assert csv_rows((tmp_path / "out" / "rank0" / "similarities.csv").read_text("utf-8-sig"))[-1][1:] == \
        [repr(v) for v in HAND_SUMMARY]


def test_unusable_runs_are_refused_before_any_run_is_created(hand_dumps, experiment_id, tmp_path):
    good = log_dump_run(hand_dumps[0], experiment_id, "good")
    l0 = log_dump_run(hand_dumps[1], experiment_id, "l0", level="L0")
    with mlflow.start_run(experiment_id=experiment_id, run_name="empty") as empty:
        mlflow.log_param("lr", 0.1)
    before = len(runs_in(experiment_id))
    with pytest.raises(ValueError, match=rf"run {l0}: tag msprobe_mlflow.level = 'L0'"):
        compare_runs(good, l0)
    with pytest.raises(ValueError, match=rf"run {empty.info.run_id} has no grad_probe/rank<N>/ artifacts"):
        compare_runs(good, empty.info.run_id)
    with pytest.raises(ValueError, match=r"B = 'no-such-run': no such folder, and no MLflow run with this ID"):
        compare_runs(good, "no-such-run")
    (tmp_path / "verdict.json").write_text("{}")
    with pytest.raises(ValueError, match=r"B = '.*verdict.json' is a file, not a folder; expected a grad_probe dump"):
        compare_runs(good, str(tmp_path / "verdict.json"))
    with pytest.raises(ValueError, match=r"rank0: no step in both sources \(A has steps \[0, 1, 2\], B has \[7\]\)"):
        compare_runs(good, str(write_ours(tmp_path / "late", {7: base_signs(7)})))
    assert len(runs_in(experiment_id)) == before


def train_logged(experiment_id: str, name: str, dump: Path, perturb_from: int | None) -> str:
    """A tiny real training monitored into an MLflow run by the live sink; other inputs from ``perturb_from`` on."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    inputs, noise = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
    with mlflow.start_run(experiment_id=experiment_id, run_name=name) as run:
        monitor = GradientMonitor(GradProbeConfig(dump_path=str(dump))).monitor(model, optimizer)
        for step in range(5):
            x = torch.randn(32, 6, generator=inputs)
            if perturb_from is not None and step >= perturb_from:
                x = x + torch.randn(32, 6, generator=noise)
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), torch.zeros(32, 2)).backward()
            optimizer.step()
        monitor.stop()
    return run.info.run_id


def run_cli(*args: str, env_uri: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    if env_uri:
        env["MLFLOW_TRACKING_URI"] = env_uri
    return subprocess.run([sys.executable, "-m", "msprobe_mlflow", "compare", *args], capture_output=True,
                          text=True, env=env, timeout=300)


def test_cli_end_to_end_names_the_perturbed_step(store, experiment_id, tmp_path):
    uri, _ = store
    baseline = train_logged(experiment_id, "baseline", tmp_path / "d_base", None)
    perturbed = train_logged(experiment_id, "perturbed", tmp_path / "d_pert", 2)
    done = run_cli(baseline, perturbed, "--tracking-uri", uri, "--fail-on-suspicious", "--output",
                   str(tmp_path / "out"))
    assert done.returncode == 3, done.stderr
    assert "rank 0: first suspicious step 2" in done.stdout
    assert f"mlflow ui --backend-store-uri {uri}" in done.stdout
    pair = hashlib.sha256(f"run:{baseline}\nrun:{perturbed}".encode()).hexdigest()[:16]
    assert f"every comparison of this pair (runs table search): tags.msprobe_mlflow.compare.pair = '{pair}'" \
        in done.stdout.splitlines()
    assert "previous comparison of this pair" not in done.stdout
    comparison_runs = [r for r in runs_in(experiment_id) if r.info.run_name.endswith(": baseline vs perturbed")]
    assert comparison_runs and comparison_runs[0].info.run_name.startswith(("break at step 2", "departure at step 2"))
    assert len(comparison_runs) == 1
    assert comparison_runs[0].data.tags["msprobe_mlflow.compare.first_suspicious_step"] == "2"
    assert (tmp_path / "out" / "rank0" / "similarities.csv").exists()
    same = run_cli(baseline, baseline, "--no-mlflow", "--fail-on-suspicious", env_uri=uri)
    assert same.returncode == 0, same.stderr
    assert "rank 0: no suspicious step" in same.stdout


def test_cli_on_folders_without_mlflow_and_bad_input(hand_dumps, tmp_path):
    done = run_cli(*map(str, hand_dumps), "--no-mlflow", "--no-plots", "--output", str(tmp_path / "out"),
                   "--rule", "msprobe")
    assert done.returncode == 0, done.stderr
    assert re.search(r"summary +1\.0000 +0\.9565 +0\.6957\n", done.stdout)  # 1, 22/23, 16/23
    assert "rank 0: first suspicious step 1" in done.stdout
    assert not (tmp_path / "out" / "rank0" / "similarities_picture").exists()
    bad = run_cli(str(hand_dumps[0]), str(tmp_path / "missing"), "--no-mlflow", "--rule", "msprobe",
                  "--drop-threshold", "0.5")
    assert bad.returncode == 2
    assert bad.stderr.startswith(f"msprobe-mlflow compare: error: B = '{tmp_path / 'missing'}': no such folder")
    threshold = run_cli(*map(str, hand_dumps), "--no-mlflow", "--rule", "msprobe", "--drop-threshold", "3")
    assert threshold.returncode == 2 and "drop_threshold = 3.0 is not accepted" in threshold.stderr
    other_rule = run_cli(*map(str, hand_dumps), "--no-mlflow", "--drop-threshold", "0.05")
    assert other_rule.returncode == 2 and "--drop-threshold applies to --rule msprobe only" in other_rule.stderr


@pytest.mark.server
def test_server_runs_download_only_the_common_steps_once(hand_dumps, tmp_path):
    server = MlflowServer(tmp_path / "server").start()
    previous = mlflow.get_tracking_uri()
    try:
        mlflow.set_tracking_uri(server.uri)
        experiment_id = mlflow.create_experiment("compare-server")
        extra = write_ours(tmp_path / "a_longer", {**{s: base_signs(s) for s in FLIPS}, 3: base_signs(3)})
        run_a = log_dump_run(extra, experiment_id, "longer")
        run_b = log_dump_run(hand_dumps[1], experiment_id, "candidate")
        cache = tmp_path / "cache"
        first = compare_runs(run_a, run_b, cache_dir=cache, plots=False)
        assert first.comparison.ranks[0].summary == pytest.approx(HAND_SUMMARY)
        assert first.run_url() == f"{server.uri}/#/experiments/{experiment_id}/runs/{first.run_id}" \
                                  "?workflowType=machine_learning"
        cached_a = cache / run_a / "grad_probe" / "rank0"
        assert sorted(p.name for p in cached_a.iterdir()) == [
            "grad_summary_0.csv", "grad_summary_1.csv", "grad_summary_2.csv", "step0", "step1", "step2"]
        files = sorted(p for p in cache.rglob("*") if p.is_file())
        stamps = [(p.stat().st_ino, p.stat().st_mtime_ns) for p in files]
        assert len([p for p in files if p.suffix == ".npy"]) == 3 * 4  # B: msprobe's form, 4 parameters a step
        second = compare_runs(run_a, run_b, cache_dir=cache, plots=False)
        assert second.comparison.ranks[0].summary == first.comparison.ranks[0].summary
        assert [(p.stat().st_ino, p.stat().st_mtime_ns) for p in files] == stamps  # nothing fetched again
        assert sorted(p for p in cache.rglob("*") if p.is_file()) == files
        cli_cache = tmp_path / "cli_cache"  # the command's --cache-dir
        compare_cli(run_a, run_b, "--no-mlflow", "--no-plots", "--cache-dir", str(cli_cache), "--tracking-uri",
                    server.uri)
        assert sorted(p.relative_to(cli_cache) for p in cli_cache.rglob("*") if p.is_file()) == \
            [p.relative_to(cache) for p in files]
    finally:
        mlflow.set_tracking_uri(previous)
        server.stop()


# --- every option of the 'compare' command, in process (its other options are used in the tests above) ---------
def compare_cli(*args: str):
    result = CliRunner().invoke(main, ["compare", *args])
    assert result.exit_code == 0, result.output
    return result


def test_cli_experiment_and_run_name_place_and_name_the_comparison_run(store, hand_dumps):
    uri, _ = store
    target = f"chosen-{uuid.uuid4().hex[:8]}"
    result = compare_cli(*map(str, hand_dumps), "--experiment", target, "--run-name", "bf16 vs fp32", "--no-plots",
                         "--tracking-uri", uri)
    run_id = [line.split()[-1] for line in result.stdout.splitlines() if line.startswith("comparison run:")][0]
    run = MlflowClient(uri).get_run(run_id)
    assert run.info.run_name == "bf16 vs fp32"
    assert run.info.experiment_id == MlflowClient(uri).get_experiment_by_name(target).experiment_id


@pytest.mark.parametrize("options, verdict", [
    # step 1: the summary falls 1 - 22/23 = 0.043 and fc.weight 1 - 14/15 = 0.067; step 2: fc.weight 5/15 more
    ([], "rank 0: first suspicious step 1"),
    (["--drop-threshold", "0.07"], "rank 0: first suspicious step 2"),
])
def test_cli_drop_threshold_decides_which_fall_is_suspicious(hand_dumps, options, verdict):
    result = compare_cli(*map(str, hand_dumps), "--no-mlflow", "--no-plots", "--rule", "msprobe", *options)
    assert verdict in result.stdout


@pytest.mark.parametrize("options, verdict", [
    # step 0 with one of fc.weight's 15 elements flipped: fc.weight 14/15 = 0.933, summary 22/23 = 0.957
    ([], "rank 0: first suspicious step 0"),
    (["--first-threshold", "0.9"], "rank 0: no suspicious step"),
])
def test_cli_first_threshold_judges_the_first_compared_step(tmp_path, options, verdict):
    a = {0: base_signs(0)}
    dump_a = write_ours(tmp_path / "a", a)
    dump_b = write_ours(tmp_path / "b", {0: flipped(a[0], {"fc.weight": [4]})})
    result = compare_cli(str(dump_a), str(dump_b), "--no-mlflow", "--no-plots", "--rule", "msprobe", *options)
    assert verdict in result.stdout


def test_cli_per_param_plots_draws_one_curve_per_parameter(hand_dumps, tmp_path):
    compare_cli(*map(str, hand_dumps), "--no-mlflow", "--output", str(tmp_path / "out"), "--per-param-plots")
    pictures = {p.name for p in (tmp_path / "out" / "rank0" / "similarities_picture").iterdir()}
    assert {f"{name}_similarities.png" for name in ("fc.weight", "NA", "scale")} <= pictures
