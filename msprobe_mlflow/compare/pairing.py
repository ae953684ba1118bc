"""Which parameter of run A is which of run B, including across frameworks (MindSpore against PyTorch).

Pairs are found in this order, each stage among the parameters no earlier stage paired:

1. ``map``: the user's name map (``--name-map FILE``, ``name_map=``), name in A -> name in B.
2. ``name``: equal names.
3. ``wrapper``: names equal once the components wrappers add (``module.``, ``_orig_mod.``...) are removed.
4. ``framework``: names equal once each side's common leading components (MindSpore's ``network.`` or
   ``_backbone.``, a wrapper class of the user's) are removed and the frameworks' names of the standard layers'
   parameters agree (:data:`FRAMEWORK_SYNONYMS`: MindSpore's ``gamma``/``beta`` are torch's ``weight``/``bias``),
   with equal shapes.
5. ``order``: what is left on both sides, in model order, aligned by the longest common subsequence of (parameter
   kind, shape): a numbered ``SequentialCell`` child (``layers.0.weight``) against a named torch module
   (``layers.fc1.weight``). Models built the same way register their parameters in the same order.

Stages 2-5 need the name (or the key) to be unique on each side; a name only one side can pair is left out and
reported as only in A or only in B.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from msprobe_mlflow.parameter_names import strip_wrapper_components

# MindSpore's names of its standard layers' parameters -> torch's (LayerNorm, BatchNorm, GroupNorm, Embedding)
FRAMEWORK_SYNONYMS = {"gamma": "weight", "beta": "bias", "moving_mean": "running_mean",
                      "moving_variance": "running_var", "embedding_table": "weight"}
HOW = ("map", "name", "wrapper", "framework", "order")  # how a pair was found, in the order of the stages
PAIRED_BY = {"map": "by the name map", "name": "by name", "wrapper": "once wrapper prefixes were removed",
             "framework": "by the frameworks' layer names (MindSpore gamma/beta = torch weight/bias)",
             "order": "by model order and shape"}


@dataclass(frozen=True)
class Pair:
    """Parameter ``a`` of run A is ``b`` of run B, found by ``how`` (one of :data:`HOW`)."""

    a: str
    b: str
    how: str


def _kind(name: str) -> str:
    """A parameter's last name component in torch's words (``ln.gamma`` -> ``weight``)."""
    leaf = name.rsplit(".", 1)[-1]
    return FRAMEWORK_SYNONYMS.get(leaf, leaf)


def _without_common_prefix(names: list[str]) -> dict[str, str]:
    """name -> name without the leading components every name of the side shares (all but the last)."""
    parts = [name.split(".") for name in names]
    common = 0
    if len(parts) > 1:  # one parameter alone: its module path says nothing to strip against
        while all(len(p) > common + 1 and p[common] == parts[0][common] for p in parts):
            common += 1
    return {name: ".".join(p[common:]) for name, p in zip(names, parts)}


def _framework_key(name: str, stripped: str) -> str:
    components = strip_wrapper_components(stripped).split(".")
    return ".".join([*components[:-1], _kind(name)])


def _unique_keys(names: list[str], key) -> dict[str, str]:
    """key -> name for the keys exactly one name has."""
    found: dict[str, list[str]] = {}
    for name in names:
        found.setdefault(key(name), []).append(name)
    return {k: v[0] for k, v in found.items() if len(v) == 1}


def _aligned(a: list[tuple[str, str]], b: list[tuple[str, str]]) -> list[tuple[int, int]]:
    """Index pairs of the longest common subsequence of two lists of (kind, shape) keys."""
    if a == b:  # the usual case, in linear time: the same model, every name spelt otherwise
        return [(i, i) for i in range(len(a))]
    rows, cols = len(a), len(b)
    length = [[0] * (cols + 1) for _ in range(rows + 1)]
    for i in range(rows - 1, -1, -1):
        for j in range(cols - 1, -1, -1):
            length[i][j] = length[i + 1][j + 1] + 1 if a[i] == b[j] else max(length[i + 1][j], length[i][j + 1])
    pairs, i, j = [], 0, 0
    while i < rows and j < cols:
        if a[i] == b[j]:
            pairs.append((i, j))
            i, j = i + 1, j + 1
        elif length[i + 1][j] >= length[i][j + 1]:
            i += 1
        else:
            j += 1
    return pairs


def pair_parameters(shapes_a: dict[str, tuple], shapes_b: dict[str, tuple],
                    name_map: dict[str, str] | None = None) -> list[Pair]:
    """The pairs of A's and B's parameters (``shapes_*``: name -> shape, in model order), in A's order (see the
    module docstring). Shapes are not checked for the ``map``, ``name`` and ``wrapper`` stages: a pair whose shapes
    differ there is the caller's to report."""
    pairs: dict[str, Pair] = {}
    taken_b: set[str] = set()

    def add(a: str, b: str, how: str) -> None:
        pairs[a] = Pair(a, b, how)
        taken_b.add(b)

    for a, b in (name_map or {}).items():
        if a in shapes_a and b in shapes_b and b not in taken_b:
            add(a, b, "map")
    for a in shapes_a:
        if a not in pairs and a in shapes_b and a not in taken_b:
            add(a, a, "name")

    def left(shapes, taken) -> list[str]:
        return [name for name in shapes if name not in taken]

    by_key_b = _unique_keys(left(shapes_b, taken_b), strip_wrapper_components)
    for key, a in _unique_keys(left(shapes_a, pairs), strip_wrapper_components).items():
        if key in by_key_b:
            add(a, by_key_b[key], "wrapper")

    stripped_a, stripped_b = _without_common_prefix(list(shapes_a)), _without_common_prefix(list(shapes_b))
    by_key_b = _unique_keys(left(shapes_b, taken_b), lambda n: _framework_key(n, stripped_b[n]))
    for key, a in _unique_keys(left(shapes_a, pairs), lambda n: _framework_key(n, stripped_a[n])).items():
        b = by_key_b.get(key)
        if b is not None and tuple(shapes_a[a]) == tuple(shapes_b[b]):
            add(a, b, "framework")

    rest_a, rest_b = left(shapes_a, pairs), left(shapes_b, taken_b)
    keys_a = [(_kind(n), tuple(shapes_a[n])) for n in rest_a]
    keys_b = [(_kind(n), tuple(shapes_b[n])) for n in rest_b]
    for i, j in _aligned(keys_a, keys_b):
        add(rest_a[i], rest_b[j], "order")
    return [pairs[a] for a in shapes_a if a in pairs]


def example_name_map(only_in_a: list[str], only_in_b: list[str]) -> str:
    """The start of a name map for what is left unpaired, for an error message (``"a.x": "b.y", ...``)."""
    pairs = list(zip(only_in_a, only_in_b))[:2] or [("name.in.A", "name.in.B")]
    return ", ".join(f"{json.dumps(a)}: {json.dumps(b)}" for a, b in pairs)


def read_name_map(path: str | os.PathLike) -> dict[str, str]:
    """A name map file: a JSON object, name in run A -> name in run B (``{"ln.weight": "ln.gamma"}``). Raises
    ``ValueError`` naming the file and the entry that is not a pair of names."""
    path = Path(path)
    try:
        loaded = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"name map {path}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"name map {path}: not a readable JSON file ({e}); expected an object such as "
                         f'{{"ln.weight": "ln.gamma"}} (name in A -> name in B)') from None
    return check_name_map(loaded, f"name map {path}")


def name_map_from(value: "dict[str, str] | str | os.PathLike | None") -> dict[str, str] | None:
    """``name_map=`` as given: a dict, or the path of a name map file (:func:`read_name_map`); None: none."""
    if value is None:
        return None
    return read_name_map(value) if isinstance(value, (str, os.PathLike)) else check_name_map(value)


def check_name_map(name_map, where: str = "name_map") -> dict[str, str]:
    """``name_map`` as a dict of names, or ``ValueError`` naming the entry that is not a pair of names or names a
    parameter of B twice."""
    if not isinstance(name_map, dict):
        raise ValueError(f"{where}: {type(name_map).__name__} is not accepted; expected an object, name in A -> "
                         f"name in B")
    seen: dict[str, str] = {}
    for a, b in name_map.items():
        if not isinstance(a, str) or not isinstance(b, str) or not a or not b:
            raise ValueError(f"{where}: entry {a!r}: {b!r} is not accepted; expected two parameter names")
        if b in seen:
            raise ValueError(f"{where}: {b!r} is named for both {seen[b]!r} and {a!r}; a parameter of B pairs "
                             f"with one of A")
        seen[b] = a
    return dict(name_map)
