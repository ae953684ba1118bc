"""Every benchmark script's tiny mode (``--quick``) end to end in a temporary folder, so that a refactor that breaks a
script behind a published measurement (``benchmarks/results/``) fails here, not when the benchmark is next run: the
script exits 0 and writes results of the expected shape, with figures only the real code path gives. A tiny mode
writes only where it is told; without msprobe 1.0.3 (not in the development venv) it leaves msprobe's side out, saying
so. ``benchmarks/locate_benchmark.py`` has its own: tests/test_locate_benchmark_tiny.py."""
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
WITH_MSPROBE = importlib.util.find_spec("msprobe") is not None
NEEDS_MINDSPORE = pytest.mark.skipif(importlib.util.find_spec("mindspore") is None,
                                     reason="MindSpore is not installed (the torch-only stage)")


def run(script: str, *arguments, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """``benchmarks/SCRIPT ARGUMENTS`` with this interpreter, outside any MLflow store the test process set up."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("MLFLOW_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, str(BENCHMARKS / script), *map(str, arguments)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{script} exited {done.returncode}:\n{done.stderr[-4000:]}"
    return done


def table_rows(markdown: str, first_cell: str) -> list[list[str]]:
    """The cells of the markdown table rows whose first cell starts with ``first_cell``."""
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in markdown.splitlines()
            if line.startswith(f"| {first_cell}")]


def postgres_available() -> bool:
    """What ``tests/postgres.py`` needs: the binaries, or root with apt-get to install them; and psycopg."""
    sys.path.insert(0, str(ROOT / "tests"))
    from postgres import postgres_bin_dir

    return importlib.util.find_spec("psycopg") is not None and (
        postgres_bin_dir() is not None or (os.geteuid() == 0 and shutil.which("apt-get") is not None))


@pytest.mark.skipif(not postgres_available(), reason="the load test needs PostgreSQL and psycopg (the server extra)")
def test_load_test_quick_loses_nothing_in_every_mode(tmp_path):
    output = tmp_path / "out" / "load_test"
    done = run("load_test.py", "--quick", "--output", output, cwd=tmp_path)
    saved = json.loads(output.with_suffix(".json").read_text())
    rows = saved["rows"]
    assert saved["setup"]["command"] == "benchmarks/load_test.py --quick"
    assert [(row["workers"], row["ranks"], row["mode"]) for row in rows] == [
        (1, 3, "per-rank"), (1, 3, "aggregated"), (1, 3, "aggregated+archive")]
    for row in rows:
        # per rank: ranks x steps x 3 values; aggregated: rank 0's 3 and 5 per metric over the ranks, x steps
        values = 3 * 4 * 3 if row["mode"] == "per-rank" else 4 * (3 + 3 * 5)
        assert row["sent_values"] == values and row["sent_files"] == 3 * 4 * 2, row  # files: ranks x steps x 2
        assert row["held_values_after_upload"] == row["sent_values"], row
        assert row["held_files_after_upload"] == row["sent_files"], row
        assert row["lost_values"] == row["lost_files"] == 0, row
        assert row["ranks_naming_unsent_steps_after_upload"] == 0 and row["steps_unsent_at_close"] >= 0, row
        assert row["requests"] > 0 and row["latency_p50_ms"] > 0 and row["writer_cost_p50_ms"] > 0, row
    per_rank, aggregated, archived = rows
    # rank-0 aggregation: the other ranks send no metrics; archives: fewer artifact requests than a file a request
    assert aggregated["tracking_requests_per_rank_step"] < per_rank["tracking_requests_per_rank_step"]
    assert archived["artifact_requests_per_rank_step"] < per_rank["artifact_requests_per_rank_step"]
    markdown = output.with_suffix(".md").read_text()
    assert "| 1 | 3 | aggregated+archive |" in markdown and "lost after the upload: 0." in markdown
    assert "| 1 | 3 | aggregated+archive |" in done.stdout


def test_compare_benchmark_quick_agrees_with_the_reference(tmp_path):
    done = run("compare_benchmark.py", "--quick", "--out", tmp_path / "out", "--work-dir", tmp_path, cwd=tmp_path)
    result = json.loads((tmp_path / "out" / "compare.json").read_text())
    markdown = (tmp_path / "out" / "compare.md").read_text()
    ours = ["ours, npy, a plot per parameter", "ours, npy, default plots (summary + heat map)", "ours, npy, no plots",
            "ours, packed, default plots (summary + heat map)", "ours, packed, no plots"]
    assert result["quick"] and result["repeats"] == 1 and result["steps"] == 3
    assert result["results_identical_to_msprobe"] and result["csv_bytes_identical_to_msprobe"]
    assert result["summary_similarity"][0] == 1.0 and result["summary_similarity"][1] < 1.0  # B differs from step 1
    assert set(ours) <= set(result["median_seconds"]) and all(s > 0 for s in result["median_seconds"].values())
    assert result["speedup_vs_msprobe"][result["reference"]] == 1.0
    if WITH_MSPROBE:
        assert result["reference"].startswith("msprobe 1.0.3") and "| msprobe / this |" in markdown
    else:
        assert result["reference"] == ours[0] and result["reference"] in result["median_seconds"]
        assert "msprobe 1.0.3 is not installed" in done.stderr and "msprobe 1.0.3 not installed" in markdown
    assert [row[0] for row in table_rows(markdown, "ours")] == ours
    assert list(tmp_path.glob("compare-bench-*")) == []  # its dumps, deleted


def test_anomaly_rates_quick_flags_every_zeroed_layer(tmp_path):
    run("anomaly_rates.py", "--quick", "--out", tmp_path / "out", cwd=tmp_path)
    markdown = (tmp_path / "out" / "anomalies.md").read_text()
    assert "4 trainings of 60 steps" in markdown and "of 4 faults injected" in markdown
    rows = [row for name in ("MLP", "CNN", "transformer") for row in table_rows(markdown, name)]
    assert len(rows) == 4 * 3  # every training at every threshold
    assert {row[1] for row in rows} == {"6", "7", "8"}
    for row in rows:
        assert re.fullmatch(r"\d+ / [\d,]+", row[2]) and row[3].endswith(" / 60"), row
        recalls = [float(value) for value in row[4:8]]
        assert all(0 <= value <= 1 for value in recalls) and recalls[3] == 1.0, row  # a norm of 0 is always flagged
    assert "All trainings: threshold 6:" in markdown


@NEEDS_MINDSPORE
def test_api_check_benchmark_quick_checks_every_call_in_every_variant(tmp_path):
    run("api_check_benchmark.py", "--quick", "--out", tmp_path / "out", cwd=tmp_path, timeout=400)
    result = json.loads((tmp_path / "out" / "api_check.json").read_text())
    assert result["quick"] and result["calls"] == 20
    variants = {row["variant"]: row for row in result["variants"]}
    assert set(variants) == {"this process", "1 worker", "2 workers", "round-robin x2"}
    statuses = [row["statuses"] for row in variants.values()]
    assert all(sum(s.values()) == 20 and s == statuses[0] for s in statuses), statuses  # one report, however run
    assert statuses[0]["pass"] > 0
    assert all(row["seconds"] > 0 and row["startup_seconds"] > 0 for row in variants.values())
    assert "scaling_efficiency" in variants["2 workers"] and len(variants["round-robin x2"]["share_seconds"]) == 2
    logging = result["mlflow"]
    assert logging["calls"] == 5
    assert all(logging[key] > 0 for key in ("sqlite_flat", "sqlite_nested", "server_flat",
                                            "server_nested_one_at_a_time", "server_nested_at_once"))
    markdown = (tmp_path / "out" / "api_check.md").read_text()
    assert "| default | round-robin x2 |" in markdown and "| mlflow server, one run at a time |" in markdown


def test_first_step_quick_times_three_fresh_processes(tmp_path):
    run("first_step.py", "--quick", "--out", tmp_path / "out", cwd=tmp_path)
    result = json.loads((tmp_path / "out" / "first_step.json").read_text())
    assert result["level"] == "L2" and result["steps"] == 2
    assert list(result["variants"]) == ["no monitor", "L2, empty kernel cache (first process)",
                                        "L2, kernel cache filled (later processes)"]
    for timings in result["variants"].values():
        assert timings["import_s"] > 0 and timings["first_step_s"] > 0 and timings["later_step_ms"] > 0, timings
    markdown = (tmp_path / "out" / "first_step.md").read_text()
    assert len(table_rows(markdown, "L2, ")) == 2


def test_monitor_benchmark_quick_measures_every_variant(tmp_path):
    done = run("monitor_benchmark.py", "--quick", "--rounds", 1, "--iterations", 1, "--out", tmp_path / "out",
               cwd=tmp_path)
    result = json.loads((tmp_path / "out" / "monitor.json").read_text())
    assert result["settings"]["quick"] and len(result["models"]) == 2
    expected = {"no monitor", "ours L0", "ours L1", "ours L2", "ours L2 + MLflow", "ours L2 + exponents",
                "ours L2: probe only", "ours L2: + writer thread", "ours L2: + local dump"}
    if WITH_MSPROBE:
        expected |= {"msprobe 1.0.3 L0", "msprobe 1.0.3 L1", "msprobe 1.0.3 L2"}
        assert all(all(same.values()) for same in result["same_output_as_msprobe"].values())
    else:
        assert result["same_output_as_msprobe"] == {} and "msprobe 1.0.3 is not installed" in done.stderr
    for model in result["models"]:
        rows = model["variants"]
        assert set(rows) == expected
        assert all(rows[f"ours {level}"]["bytes_per_step"] > 0 for level in ("L0", "L1", "L2"))
        assert rows["ours L2"]["direction_bytes_per_element"] > 0
        assert rows["ours L2 + exponents"]["bytes_per_step"] > rows["ours L2"]["bytes_per_step"]  # their files
        assert rows["ours L0"]["direction_bytes_per_element"] == 0
        assert rows["ours L2 + MLflow"]["mlflow_artifact_bytes_per_step"] > 0
        # cut after the probe: next to nothing written (the dump's own bookkeeping), no directions
        assert rows["ours L2: probe only"]["bytes_per_step"] < rows["ours L2"]["bytes_per_step"] / 100
        assert rows["ours L2: probe only"]["direction_bytes_per_element"] == 0
        steady = model["mlflow_steady"]
        assert steady["iteration_s_ratio"] > 0 and steady["cpu_s_ratio"] > 0
    markdown = (tmp_path / "out" / "monitor.md").read_text()
    assert markdown.count("| ours L2 + MLflow |") == 2 and markdown.count("steady state (turns of 1.5 s") == 2


def test_divergence_benchmark_quick_names_the_steps_and_writes_only_into_its_work_folder(tmp_path):
    run("divergence_benchmark.py", "--quick", "--work", tmp_path / "work", "--out", tmp_path / "out", cwd=tmp_path,
        timeout=600)
    assert not (tmp_path / "out").exists()  # --quick: results in the work folder only
    result = json.loads((tmp_path / "work" / "quick" / "divergence.json").read_text())
    assert result["plan"]["seeds"] == [0] and len(result["scenarios"]) == 3
    assert "noise" in result["rules"] and "msprobe" in result["rules"]
    assert set(result["summary"]) == set(result["rules"]) and result["benign"] and result["harmful"]
    noise = result["summary"]["noise"]
    assert noise["exact"][1] > 0 and noise["exact"][0] >= noise["exact"][1] // 2, noise
    assert noise["live_equal_to_compare"][0] >= 1, noise
    # issue 47's decision 1: every valid case is on one side of its pair's own difference
    assert noise["exact_effect_beyond_pair"][1] + noise["exact_effect_within_pair"][1] == noise["exact"][1], noise
    assert all(case["effect"] >= 0 and case["pair_difference"] >= 0
               for case in result["harmful"] if case["truth"] is not None)
    assert all(case["verdicts"].keys() == set(result["rules"]) for case in result["harmful"])
    assert (tmp_path / "work" / "quick" / "divergence.md").read_text().startswith("# Divergence benchmark")


@NEEDS_MINDSPORE
def test_cross_framework_benchmark_quick_pairs_every_parameter_and_writes_only_into_its_work_folder(tmp_path):
    run("cross_framework_benchmark.py", "--quick", "--work", tmp_path / "work", "--out", tmp_path / "out",
        cwd=tmp_path, timeout=600)
    assert not (tmp_path / "out").exists()
    result = json.loads((tmp_path / "work" / "quick" / "cross_framework.json").read_text())
    assert result["plan"]["seeds"] == [0] and result["control_reproducible"]
    assert set(result["summary"]) == set(result["rules"]) >= {"noise", "msprobe"}
    noise = result["summary"]["noise"]
    assert noise["exact"][1] > 0 and noise["exact"][0] >= noise["exact"][1] // 2, noise
    assert noise["every_parameter_paired"][0] == noise["every_parameter_paired"][1] > 0, noise
    assert (tmp_path / "work" / "quick" / "cross_framework.md").read_text().startswith("# Cross-framework benchmark")


@NEEDS_MINDSPORE
def test_locate_across_frameworks_quick_judges_both_families_and_writes_only_where_told(tmp_path):
    run("locate_across_frameworks.py", "--quick", "--out", tmp_path / "out", cwd=tmp_path, timeout=600)
    result = json.loads((tmp_path / "out" / "locate_across_frameworks.json").read_text())
    assert {o["family"] for o in result["outcomes"]} == {"mlp-ln", "cnn-bn", "resmlp"}
    for group, families in (("in sample", 1), ("held out", 2)):
        summary = result["summary"][group]
        assert summary["exact"]["of"] > 0 and summary["benign_quiet"]["of"] == families, summary
        assert summary["module_share_min"] > 0
        assert summary["mindspore_exact"]["of"] > 0, summary
        assert summary["backward_module"]["of"] > 0 and summary["backward_below_noise"] > 0, summary
    faults = [o for o in result["outcomes"] if o["fault"]]
    assert all(o["error"] == 1e-2 for o in faults)
    assert {o["faulty_side"] for o in faults if o["fault"].startswith("Aten.")} == {"B", "B backward"}
    assert all(o["fault"].endswith(".backward") for o in faults if o["faulty_side"] == "B backward")
    assert {o["faulty_side"] for o in faults if not o["fault"].startswith("Aten.")} == {"A"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # MindSpore's compiler reports went elsewhere


def test_live_benchmark_quick_measures_the_live_verdicts(tmp_path):
    run("live_benchmark.py", "--quick", "--rounds", 1, "--out", tmp_path / "out", cwd=tmp_path)
    result = json.loads((tmp_path / "out" / "live.json").read_text())
    assert result["rounds"] == 1 and result["by_threads"]
    for models in result["by_threads"].values():
        assert [model["model"].endswith("(quick)") for model in models] == [True, True]
        for model in models:
            assert set(model["iteration_ms"]) == {"L1", "L1 + flags", "L1 + flags + baseline"}, model
            assert all(model[f"{key}_iteration_ratio"][0] > 0 for key in ("flags", "baseline", "both")), model
            # the baseline diverges during the turn: the live verdict's callback came, and took some time
            assert model["latency_ms"] and all(ms > 0 for ms in model["latency_ms"]), model
    assert "live_benchmark.py" in (tmp_path / "out" / "live.md").read_text()


def test_tier_benchmark_quick_measures_the_tier_variants(tmp_path):
    done = run("tier_benchmark.py", "--quick", "--rounds", 1, "--iterations", 2, "--out", tmp_path / "out",
               cwd=tmp_path)
    result = json.loads((tmp_path / "out" / "tier.json").read_text())
    assert result["rounds"] == 1 and result["iterations"] == 2 and result["every"] == 100
    for models in result["by_threads"].values():
        assert len(models) == 2
        for model in models:
            assert {"no monitor", "ours L1", "ours L1 tier", "ours L2", "ours L2 tier"} <= set(model["variants"])
    if not WITH_MSPROBE:
        assert "msprobe is not installed" in done.stderr
    assert "tier_benchmark.py" in (tmp_path / "out" / "tier.md").read_text()


def test_step_profile_quick_profiles_every_level(tmp_path):
    run("step_profile.py", "--quick", "--rounds", 1, "--seconds", 0.2, "--out", tmp_path / "out", cwd=tmp_path)
    result = json.loads((tmp_path / "out" / "step_profile.json").read_text())
    assert result["rounds"] == 1 and result["by_threads"]
    for models in result["by_threads"].values():
        assert len(models) == 2
        for model in models:
            assert set(model["levels"]) == {"L0", "L1", "L2"} and model["no_monitor_ms"] > 0, model
    assert (tmp_path / "out" / "step_profile.md").read_text().strip()


@pytest.mark.parametrize("script, folder", [
    ("load_test.py", "--output"), ("compare_benchmark.py", "--out"), ("anomaly_rates.py", "--out"),
    ("api_check_benchmark.py", "--out"), ("first_step.py", "--out"), ("monitor_benchmark.py", "--out"),
    ("live_benchmark.py", "--out"), ("tier_benchmark.py", "--out"), ("step_profile.py", "--out")])
def test_a_quick_run_without_its_folder_is_refused_before_writing_results(tmp_path, script, folder):
    """The default folder is benchmarks/results/, the published measurements: a dry run must not land there."""
    done = subprocess.run([sys.executable, str(BENCHMARKS / script), "--quick"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 2, done.stderr[-3000:]
    assert f"--quick needs {folder}: a dry run never writes into benchmarks/results/" in done.stderr
