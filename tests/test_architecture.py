"""The package's import layering, read from the source with ast (imports inside functions and under TYPE_CHECKING
count): every import goes to its own layer or to one the layer stands on, and no module imports itself back."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "msprobe_mlflow"
# The intended layers, bottom first, as (layer, its parts, the layers it stands on). A part is a sub-package or a
# top-level module; ``__init__`` is the package's face, which Python loads before any module of the package, so it
# is at the bottom (it exports the layers above by name, lazily). A module imports its own layer and the layers its
# layer stands on, and theirs, down to the bottom: never a layer above, nor one beside it (MindSpore's monitor does
# not import PyTorch's, the API checker does not import the sinks).
LAYERS = [
    ("bottom", {"__init__", "vocabulary", "formats", "levels", "statistics_table", "layout", "config", "compat",
                "notices", "safe_paths", "parameter_names", "progress"}, []),
    ("records", {"records", "directions", "exponents", "exponent_pictures", "dump", "dump_process", "anomaly_rule",
                 "background", "metrics", "trace"},
     ["bottom"]),
    ("torch_kernels", {"torch_kernels"}, ["records"]),
    ("compare", {"compare"}, ["records"]),
    ("localization", {"localization"}, ["records"]),
    ("session", {"session"}, ["records"]),
    ("tracking", {"tracking"}, ["compare", "session", "localization", "torch_kernels"]),
    ("sinks", {"sinks"}, ["tracking"]),
    ("monitoring", {"monitoring"}, ["sinks"]),
    ("pytorch", {"pytorch"}, ["monitoring", "torch_kernels"]),
    ("mindspore", {"mindspore"}, ["monitoring"]),
    ("integrations", {"integrations"}, ["pytorch", "mindspore"]),
    ("api_check", {"api_check"}, ["tracking"]),
    ("commands", {"commands", "__main__"}, ["api_check", "tracking"]),
]


def module_imports() -> dict[str, set[str]]:
    """Module -> the package modules it imports, anywhere in its file."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in modules.items():
        imported = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("msprobe_mlflow"):
                for alias in node.names:  # "from pkg import module" imports the module
                    child = f"{node.module}.{alias.name}"
                    imported.add(child if child in modules else node.module)
            elif isinstance(node, ast.Import):
                imported.update(a.name for a in node.names if a.name in modules)
        graph[name] = {module for module in imported if module in modules and module != name}
    return graph


def part(module: str) -> str:
    """A module's part of the layering: its sub-package, else itself (``__init__`` for the package's face)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def reachable_layers() -> dict[str, set[str]]:
    """Layer -> the layers its modules may import: itself and those it stands on, transitively."""
    reachable: dict[str, set[str]] = {}
    for layer, _, stands_on in LAYERS:  # bottom first: the layers below are complete when a layer is reached
        reachable[layer] = {layer}.union(*(reachable[below] for below in stands_on))
    return reachable


def layering_violations(graph: dict[str, set[str]]) -> list[str]:
    """Every ``importer -> imported`` of ``graph`` to a layer the importer's layer does not stand on."""
    layer_of = {name: layer for layer, parts, _ in LAYERS for name in parts}
    reachable = reachable_layers()
    return sorted(f"{module} -> {imported}" for module, imports in graph.items() for imported in imports
                  if layer_of[part(imported)] not in reachable[layer_of[part(module)]])


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path, None without one (depth-first search)."""
    state: dict[str, str] = {}

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = "open"
        for child in sorted(graph.get(node, ())):
            if state.get(child) == "open":
                return path[path.index(child):] + [child]
            if child not in state and (found := visit(child, path + [child])):
                return found
        state[node] = "done"
        return None

    return next((found for node in sorted(graph) if node not in state and (found := visit(node, [node]))), None)


def test_the_cycle_search_finds_a_cycle_and_no_false_one():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_no_module_imports_itself_back():
    graph = module_imports()
    assert graph["msprobe_mlflow.sinks"] and graph["msprobe_mlflow.sinks.mlflow"]  # the walk found imports
    assert cycle(graph) is None


def test_each_layer_stands_on_layers_listed_before_it():
    names = [layer for layer, _, _ in LAYERS]
    assert [(layer, below) for layer, _, stands_on in LAYERS for below in stands_on
            if below not in names[:names.index(layer)]] == []


def test_every_part_of_the_package_is_in_exactly_one_layer():
    placed = [name for _, parts, _ in LAYERS for name in parts]
    assert len(placed) == len(set(placed))
    assert {part(module) for module in module_imports()} == set(placed)


def test_every_import_goes_to_its_own_layer_or_one_it_stands_on():
    assert layering_violations(module_imports()) == []


@pytest.mark.parametrize("importer, imported", [
    ("msprobe_mlflow.mindspore.monitor", "msprobe_mlflow.pytorch.monitor"),  # beside it
    ("msprobe_mlflow.api_check", "msprobe_mlflow.sinks"),  # below it, but not one it stands on
    ("msprobe_mlflow.torch_kernels.statistics", "msprobe_mlflow.monitoring.options"),  # above it
    ("msprobe_mlflow.session", "msprobe_mlflow.tracking.runs"),  # the core stays free of MLflow's layer
])
def test_the_layer_check_refuses_an_import_outside_the_layers(importer, imported):
    graph = module_imports()
    graph[importer].add(imported)
    assert layering_violations(graph) == [f"{importer} -> {imported}"]


def test_mlflow_is_imported_in_tracking_only():
    """What talks to MLflow is in ``tracking/``; the rest calls its functions. One exception: ``compat.py``, the one
    place for every library's private names, reads MLflow's one private function there (called from tracking/)."""
    outside = []
    for path in PACKAGE.rglob("*.py"):
        if path.relative_to(PACKAGE).parts[0] == "tracking":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            outside += [f"{path.relative_to(PACKAGE)}: {n}" for n in names if n.split(".")[0] == "mlflow"
                        and not (path.name == "compat.py" and n == "mlflow.tracking")]
    assert outside == []
