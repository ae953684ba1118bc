"""The localization benchmark's quick mode end to end (generate, evaluate, side, cost, report) in a temporary folder:
the harness runs, the report has every rule's rows, ``locate`` names the exact operator of an injected fault, and the
replay names the side it was put in."""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

BENCHMARK = Path(__file__).resolve().parent.parent / "benchmarks" / "locate_benchmark.py"
RULES = ("ours", "msprobe -da", "msprobe table")


def test_quick_benchmark_names_injected_faults_and_reports_every_rule(tmp_path):
    work, out = tmp_path / "work", tmp_path / "out"
    done = subprocess.run([sys.executable, str(BENCHMARK), "--quick", "--work", str(work), "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "generate: 4 runs and" in done.stderr  # progress lines go to stderr
    result = json.loads((out / "locate.json").read_text())
    markdown = (out / "locate.md").read_text()

    faults = [f for f in result["faults"] if f["status"] != "not injected"]
    assert len(faults) >= 5 and {f["kind"] for f in faults} >= {"scale", "bf16-matmul", "drop-bias", "eps"}
    assert all(f["truth"]["name"].startswith(f["operator"]) for f in faults)
    exact = [f for f in faults if f["status"] == "counted" and f["rules"]["ours"]["exact"]]
    assert exact, [f["rules"]["ours"]["describe"] for f in faults]
    assert all(f["rules"]["ours"]["module"] == f["truth"]["module"] for f in exact)
    assert result["benign"] and all(p["rules"]["ours"]["kind"] in ("drift", "identical") for p in result["benign"])

    for rule in RULES:
        assert rule in result["summary"]["all"] and rule in result["summary"]["benign"]
        assert f"{rule}: exact" in markdown
    assert "| exact operator named" in markdown and "| benign pairs with no operator named" in markdown

    sides = result["side"]["rows"]  # each checked fault in B, then in A: the replay names the side it was put in
    assert sides and all(row["B"] == "B" and row["A"] == "A" for row in sides), sides
    assert "| the side named right" in markdown and "## Which side is wrong" in markdown

    flagged = result["flagged"]["rows"]  # the divergence benchmark's first benign alarm, retrained and located
    assert len(flagged) == 1 and flagged[0]["kind"] in ("operator", "drift", "identical", "sequence", "argument")
    assert flagged[0]["side"] in (None, "A", "B", "neither", "not replayed")
    assert "## The verdict's alarms on benign pairs, located" in markdown

    rows = result["cost"]["rows"]
    assert {level for row in rows for level in row["ours"]} == {"L0", "L1", "mix"}
    assert all(row["untraced_ms"] > 0 and row["ours"]["mix"]["ratio"] > 0 for row in rows)
    assert all(row["untraced_with_trace_steps"]["ratio"] > 0 for row in rows)
    assert "| ... an untraced step of a monitor with trace_steps set" in markdown
    if importlib.util.find_spec("msprobe") is None:
        assert all(row["msprobe"][level] == {"error": "msprobe not installed"} for row in rows
                   for level in ("L1", "mix"))
        assert "msprobe not installed" in markdown


def test_phases_say_what_is_missing(tmp_path):
    done = subprocess.run([sys.executable, str(BENCHMARK), "report", "--work", str(tmp_path / "empty"),
                           "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "run `evaluate` first" in done.stderr
    done = subprocess.run([sys.executable, str(BENCHMARK), "generate", "--families", "tiny-gpt,resnet",
                           "--work", str(tmp_path / "w")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--families: resnet unknown" in done.stderr
