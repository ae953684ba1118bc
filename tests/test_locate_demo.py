"""The README's "From a suspicious step to the operator": examples/locate_demo.py prints what the README shows (its
numbers masked: another CPU may round the last digit otherwise) and exits 3, naming the faulty GELU."""
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NUMBER = re.compile(r"\d+(\.\d+)?(e[+-]?\d+)?")


def readme_output() -> list[str]:
    section = (REPO / "README.md").read_text(encoding="utf-8").split("## From a suspicious step to the operator")[1]
    block = section.split("`python examples/locate_demo.py`")[1].split("```\n")[1]
    return block.rstrip("\n").splitlines()


def test_the_demo_prints_what_the_readme_shows_and_names_the_gelu(tmp_path):
    result = subprocess.run([sys.executable, str(REPO / "examples" / "locate_demo.py")], cwd=tmp_path,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 3, result.stderr
    printed = result.stdout.rstrip("\n").splitlines()
    assert [NUMBER.sub("N", line) for line in printed] == [NUMBER.sub("N", line) for line in readme_output()]
    assert printed[-2].startswith("Aten.gelu.default.0.forward in 2: output differs by 0.06")
