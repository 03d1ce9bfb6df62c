"""The package's import graph: no circle anywhere, and an env side that depends on nothing else.

The graph is read from the source with :mod:`ast` (nothing is imported), counting every
import statement wherever it is: at module level, inside functions (lazy imports) and under
``if TYPE_CHECKING``, and every ``importlib.import_module("...")`` of a literal name. An edge
goes to the deepest package module an import names (``from . import env`` names
``boltzlabs_gym.env``; ``from .codec import encode`` names ``boltzlabs_gym.codec``). The package
``__init__`` modules a dotted import passes through are not edges: ``boltzlabs_gym/__init__.py``
only loads its lazy exports on first use.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("boltzlabs_gym", "boltzlabs")

#: What runs in every env process, possibly under an interpreter with nothing else installed:
#: the standard library only, plus these package modules.
ENV_SIDE = {
    "boltzlabs_gym.errors": set(),
    "boltzlabs_gym.envside": {"boltzlabs_gym.errors"},
    "boltzlabs_gym.envstate": set(),
    "boltzlabs_gym.env": {"boltzlabs_gym.envside", "boltzlabs_gym.envstate", "boltzlabs_gym.errors"},
    "boltzlabs.env": {"boltzlabs_gym.env"},
}
#: Modules both ends of a hop share, which must stay standard-library only too.
STDLIB_ONLY = {"boltzlabs_gym.protocol": {"boltzlabs_gym.errors"}}


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _is_import_module_call(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call) or not node.args or not isinstance(node.args[0], ast.Constant):
        return False
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    return name in ("import_module", "__import__") and isinstance(node.args[0].value, str)


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Every module ``name`` imports, inside the package (resolved to a known module) or not (top name)."""
    is_package = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            # ``from pkg import mod`` imports a module; ``from mod import name`` imports mod.
            targets = [f"{stem}.{alias.name}" if f"{stem}.{alias.name}" in known else stem for alias in node.names]
        elif _is_import_module_call(node):
            targets = [node.args[0].value]  # importlib.import_module("a.b"): an import all the same
        else:
            continue
        for target in targets:
            while target not in known and "." in target and target.split(".")[0] in PACKAGES:
                target = target.rsplit(".", 1)[0]
            out.add(target)
    out.discard(name)
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules it imports (package modules by full name, others by top-level name)."""
    modules = _modules()
    known = set(modules)
    return {name: _imports(name, path, known) for name, path in modules.items()}


def _package_edges(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    # A package __init__ is a module too, but an edge into one is only the way to its submodule.
    inits = set(PACKAGES) | {m for m in graph if (ROOT / m.replace(".", "/") / "__init__.py").exists()}
    return {m: {t for t in deps if t in graph and t not in inits} for m, deps in graph.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (or a module importing itself)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph[v]:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_the_package_has_no_import_circle():
    assert find_cycles(_package_edges(import_graph())) == []


def test_the_graph_sees_lazy_and_dynamic_imports():
    graph = import_graph()
    assert "boltzlabs_gym.worker.sandbox.seccomp" in graph["boltzlabs_gym.worker.forkserver"]  # in a function
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.parametrize("module, allowed", sorted({**ENV_SIDE, **STDLIB_ONLY}.items()))
def test_env_side_imports_only_the_standard_library(module, allowed):
    graph = import_graph()
    outside = {
        dep
        for dep in graph[module]
        if dep not in allowed and dep not in PACKAGES and dep.split(".")[0] not in sys.stdlib_module_names
    }
    assert not outside, f"{module} imports {sorted(outside)}"


def test_the_env_side_imports_no_worker_or_client_code():
    graph = _package_edges(import_graph())
    for module in ("boltzlabs_gym.gym_server", *ENV_SIDE):
        reached, todo = set(), [module]
        while todo:
            for dep in graph[todo.pop()]:
                if dep not in reached:
                    reached.add(dep)
                    todo.append(dep)
        worker_or_client = {
            m
            for m in reached
            if m.startswith("boltzlabs_gym.worker")
            or m in ("boltzlabs_gym.pool", "boltzlabs_gym.lane", "boltzlabs_gym.vector", "boltzlabs_gym.channel")
        }
        assert not worker_or_client, f"{module} reaches {sorted(worker_or_client)}"


if __name__ == "__main__":  # python tests/test_imports.py: print the circles
    for cycle in find_cycles(_package_edges(import_graph())):
        print(" <-> ".join(cycle))


def test_ray_is_imported_by_boltzlabs_gym_ray_only():
    # The pool takes RayWorkers through the WorkerSource protocol (sources.py), never by importing it.
    graph = import_graph()
    users = {m for m, deps in graph.items() if "ray" in deps}
    assert users and all(m == "boltzlabs_gym.ray" or m.startswith("boltzlabs_gym.ray.") for m in users), users
