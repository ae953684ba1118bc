"""The package's import layering, read from the source with ast (imports inside functions and under TYPE_CHECKING
count): no module imports itself back, no package imports a package that imports it back, and the core (the
top-level modules the packages build on) imports no package."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "msprobe_mlflow"
# The only top-level modules above the packages: the package's face (``__init__``, lazy exports) and
# ``python -m msprobe_mlflow``; every other top-level module is the core, at the bottom, and imports no package.
ABOVE_THE_PACKAGES = {"msprobe_mlflow", "msprobe_mlflow.__main__"}


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


def unit(module: str) -> str:
    """A module's unit of the layering: its sub-package, itself when above the packages, else ``(core)``."""
    parts = module.split(".")
    if module in ABOVE_THE_PACKAGES:
        return module
    return parts[1] if (PACKAGE / parts[1]).is_dir() else "(core)"


def package_imports(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    units: dict[str, set[str]] = {}
    for module, imported in graph.items():
        units.setdefault(unit(module), set()).update(unit(m) for m in imported if unit(m) != unit(module))
    return units


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


def test_no_package_imports_a_package_that_imports_it_back():
    units = package_imports(module_imports())
    assert {"tracking", "sinks", "pytorch", "monitoring", "commands", "(core)"} <= set(units)  # the units found
    assert cycle(units) is None
    assert units["(core)"] <= {"(core)"}, "the core imports no package"


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
