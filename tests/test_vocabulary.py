"""Every name a run carries (tags, metric keys, artifact paths) is spelled in ``vocabulary.py`` only, so that the
writers and the readers of a run cannot drift apart. Read from the package's source with ast: docstrings and
comments aside, no string elsewhere reads as a run's name."""
from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

from msprobe_mlflow import vocabulary

PACKAGE = Path(vocabulary.__file__).resolve().parent
# A string reads as a run's name when it matches whole (a message that mentions a name holds spaces, and is not one).
RUN_NAME = re.compile(r"""
      (msprobe_mlflow|mlflow)\.[\w.{}-]*                       # our tags and MLflow's (module paths are told apart)
    | (grad|verdict|anomalies)/[\w.{}/-]* | summary_similarity(/[\w.{}/-]*)?   # metric keys
    | grad_probe/[\w.{}/-]* | grad_compare(/[\w.{}/-]*)?       # artifact folders
    | ([\w.{}-]+/)*(verdict|config)\.json                      # artifact files
""", re.VERBOSE)
CONSTANTS = {name: value for name, value in vars(vocabulary).items() if name.isupper() and isinstance(value, str)}
NAMES = {value for value in CONSTANTS.values() if RUN_NAME.fullmatch(value)}  # a name, even where a module is so named
PREFIXES = {name for name in CONSTANTS if name.endswith("_PREFIX")}  # only vocabulary.py completes one


def is_module_path(text: str) -> bool:
    """``mlflow.exceptions``, ``msprobe_mlflow.tracking.upload``, ``mlflow.tracking.fluent._get_experiment_id``: a
    module (or a name in one) found on disk, as an import names it."""
    top, *parts = text.split(".")
    spec = importlib.util.find_spec(top) if all(part.isidentifier() for part in (top, *parts)) else None
    if spec is None:
        return False
    folder = Path(spec.origin).parent
    for part in parts:
        if (folder / f"{part}.py").is_file():
            return True  # what follows a module's name is a name in it
        if not (folder / part / "__init__.py").is_file():
            return False
        folder = folder / part
    return bool(parts)


def reads_as_a_name(text: str) -> bool:
    return RUN_NAME.fullmatch(text) is not None and (text in NAMES or not is_module_path(text))


def is_metric_key_call(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "metric_key"


def text_of(node: ast.expr) -> tuple[str, bool]:
    """The text ``node`` makes, as far as the source tells (a vocabulary constant's value, else ``{}``), and whether
    the source spells some of it: a literal word, or a vocabulary prefix it completes."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value, True
    if isinstance(node, ast.Name) and node.id in CONSTANTS:
        return CONSTANTS[node.id], False
    if isinstance(node, ast.JoinedStr):
        pieces = [text_of(value.value if isinstance(value, ast.FormattedValue) else value) for value in node.values]
        first = node.values[0] if node.values else None
        completes_prefix = isinstance(first, ast.FormattedValue) and isinstance(first.value, ast.Name) and \
            first.value.id in PREFIXES
        spelled = completes_prefix or any(spelt and re.search(r"\w", text) for text, spelt in pieces)
        return "".join(text for text, _ in pieces), spelled
    if is_metric_key_call(node):
        pieces = [text_of(arg) for arg in node.args]  # metric_key joins its parts with "/"
        return "/".join(text for text, _ in pieces), any(spelt for _, spelt in pieces)
    return "{}", False


def names_in(source: str) -> list[tuple[int, str]]:
    """``(line, name)`` of every string in ``source`` that reads as a run's name; docstrings are not read."""
    tree = ast.parse(source)
    skipped = {id(node.body[0].value) for node in ast.walk(tree)
               if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body
               and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    read = [node for node in ast.walk(tree) if isinstance(node, (ast.Constant, ast.JoinedStr)) or
            is_metric_key_call(node)]
    for node in read:
        if isinstance(node, ast.JoinedStr) or is_metric_key_call(node):  # their parts are read with them
            skipped.update(id(child) for child in ast.walk(node) if child is not node)
    found = []
    for node in read:
        text, spelled = text_of(node) if id(node) not in skipped else ("", False)
        if spelled and reads_as_a_name(text):
            found.append((node.lineno, text))
    return sorted(set(found))


def names_spelled_outside_vocabulary() -> list[str]:
    """``file:line: 'name'`` for every string of the package outside vocabulary.py that reads as a run's name."""
    return [f"{path.relative_to(PACKAGE.parent)}:{line}: {text!r}" for path in sorted(PACKAGE.rglob("*.py"))
            if path != PACKAGE / "vocabulary.py" for line, text in names_in(path.read_text(encoding="utf-8"))]


def test_every_run_name_is_spelled_in_vocabulary_only():
    spelled = names_spelled_outside_vocabulary()
    assert not spelled, "run names spelled outside vocabulary.py (take them from it):\n" + "\n".join(spelled)


def test_the_check_finds_tags_metric_keys_and_artifacts_spelled_by_hand():
    source = '''
tags = {"mlflow.source.name": "x", f"{TAG_PREFIX}level": level, f"{TAG_PREFIX}{key}": value}
tags[f"{COMPARE_TAG_PREFIX}rank{rank}.grade"] = grade
metrics = {f"anomalies/rank{rank}/flagged_params": 1.0, metric_key("verdict", f"rank{rank}", "suspicious"): 0.0}
client.log_artifacts(run_id, folder, "grad_compare")
path = folder / "verdict.json"
'''
    assert names_in(source) == [
        (2, "mlflow.source.name"), (2, "msprobe_mlflow.level"), (2, "msprobe_mlflow.{}"),
        (3, "msprobe_mlflow.compare.rank{}.grade"),
        (4, "anomalies/rank{}/flagged_params"), (4, "verdict/rank{}/suspicious"),
        (5, "grad_compare"), (6, "verdict.json")]


def test_the_check_leaves_module_paths_messages_docstrings_and_composed_paths():
    source = '''
"""Logs ``msprobe_mlflow.compare.verdict`` and ``grad_compare/verdict.json``."""
LAZY = {"compare_runs": "msprobe_mlflow.tracking.comparison_run", "e": "mlflow.exceptions"}
getter = "mlflow.tracking.fluent._get_experiment_id"
message = f"tag {TAG_PREFIX}level = {level!r}: an L0 run records no directions"
destination = f"{ARTIFACT_ROOT}/{relative_rank_dir(rank)}"
section = config["grad_probe"]
key = grad_key(rank, "total_norm")
'''
    assert names_in(source) == []
