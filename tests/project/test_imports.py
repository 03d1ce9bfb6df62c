"""The package's import graph: no circle anywhere, and an env side that depends on nothing else.

The graph is read from the source with :mod:`ast` (nothing is imported), counting every
import statement wherever it is: at module level, inside functions (lazy imports) and under
``if TYPE_CHECKING``, and every ``importlib.import_module("...")`` of a literal name. An edge
goes to the deepest package module an import names (``from . import env`` names
``boltzlabs_gym.env``; ``from .codec import encode`` names ``boltzlabs_gym.wire.codec``). The package
``__init__`` modules a dotted import passes through are not edges: ``boltzlabs_gym/__init__.py``
only loads its lazy exports on first use.
"""

from __future__ import annotations

import ast
import functools
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("boltzlabs_gym", "boltzlabs")

#: The layout's rules, by module prefix (a prefix names a subpackage and everything below it).
#: What runs inside a sandbox imports the standard library, itself, the exception tree and the
#: limits it applies to itself, nothing else: an env process may run under an interpreter with
#: nothing else installed, and no worker or trainer code belongs in it.
ENV_SIDE_ALLOWED = ("boltzlabs_gym.envside", "boltzlabs_gym.errors", "boltzlabs_gym.wire.limits")
#: The env-side modules that run Gymnasium envs (and the rows of their sandbox replies) also use
#: what a Gymnasium env needs and the wire formats its values cross in.
GYMNASIUM_ENV_SIDE = {
    "boltzlabs_gym.envside.gym_host",
    "boltzlabs_gym.envside.gym_loops",
    "boltzlabs_gym.envside.gym_start",
    "boltzlabs_gym.envside.factories",
    "boltzlabs_gym.envside.sandbox_rows",
    "boltzlabs_gym.envside.info_columns",
}
GYMNASIUM_ENV_SIDE_ALLOWED = ENV_SIDE_ALLOWED + ("boltzlabs_gym.wire",)
#: Public faces of the env side: ``serve()`` and the hosted service's name for it.
ENV_FACES = {"boltzlabs_gym.env", "boltzlabs.env"}
#: Modules both ends of a hop share that must stay standard-library only too.
STDLIB_ONLY = {
    "boltzlabs_gym.errors",
    "boltzlabs_gym.wire.protocol",
    "boltzlabs_gym.wire.limits",
    "boltzlabs_gym.wire.counters",
    "boltzlabs_gym.wire.call_rules",
}
#: prefix -> prefixes it must never import.
FORBIDDEN = {
    "boltzlabs_gym.wire": (
        "boltzlabs_gym.integrations",
        "boltzlabs_gym.client",
        "boltzlabs_gym.worker",
        "boltzlabs_gym.envside",
        "boltzlabs_gym.cli",
    ),
    "boltzlabs_gym.client": (
        "boltzlabs_gym.integrations",
        "boltzlabs_gym.worker",
        "boltzlabs_gym.cli",
        "boltzlabs_gym.vector",
        "boltzlabs_gym.sb3",
        "boltzlabs_gym.ray",
    ),
    "boltzlabs_gym.worker": (
        "boltzlabs_gym.integrations",
        "boltzlabs_gym.client",
        "boltzlabs_gym.cli",
        "boltzlabs_gym.vector",
        "boltzlabs_gym.sb3",
        "boltzlabs_gym.ray",
    ),
}
#: The framework integrations sit on top of the client (and the code runner): never the worker or the env side.
FORBIDDEN["boltzlabs_gym.integrations"] = ("boltzlabs_gym.worker", "boltzlabs_gym.envside", "boltzlabs_gym.cli")
FORBIDDEN["boltzlabs_gym.envside"] = ("boltzlabs_gym.integrations",)
#: The Gymnasium adapter sits on top of the client: it never reaches into the worker, and no other
#: face (the SB3 adapter, the asyncio pool, Ray, the integrations, the CLI) is below it.
FORBIDDEN["boltzlabs_gym.vector"] = (
    "boltzlabs_gym.worker",
    "boltzlabs_gym.cli",
    "boltzlabs_gym.integrations",
    "boltzlabs_gym.sb3",
    "boltzlabs_gym.aio",
    "boltzlabs_gym.ray",
)
#: The code runner and asyncio faces sit on the client, the HTTP server on the code runner: none of
#: them reaches into the worker, and none but the runner's sandbox side (runner_env) into the env side.
FORBIDDEN["boltzlabs_gym.aio"] = ("boltzlabs_gym.worker", "boltzlabs_gym.envside", "boltzlabs_gym.integrations")
FORBIDDEN["boltzlabs_gym.code.runner"] = ("boltzlabs_gym.worker", "boltzlabs_gym.envside", "boltzlabs_gym.code.server")
FORBIDDEN["boltzlabs_gym.code.runs"] = FORBIDDEN["boltzlabs_gym.code.runner"]
FORBIDDEN["boltzlabs_gym.code.judges"] = FORBIDDEN["boltzlabs_gym.code.runner"]
FORBIDDEN["boltzlabs_gym.code.server"] = ("boltzlabs_gym.worker", "boltzlabs_gym.envside", "boltzlabs_gym.integrations")
#: What runs inside the runner's sandbox imports the env side only, like any env directory.
FORBIDDEN["boltzlabs_gym.code.runner_env"] = (
    "boltzlabs_gym.client",
    "boltzlabs_gym.worker",
    "boltzlabs_gym.code.runner",
    "boltzlabs_gym.code.server",
    "boltzlabs_gym.integrations",
)
#: The sandbox layer imports no feature of the worker above it.
SANDBOX = "boltzlabs_gym.worker.sandbox"


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


@functools.cache
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
    assert "boltzlabs_gym.envside.seccomp" in graph["boltzlabs_gym.envside.forkserver"]  # in a function
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _third_party(deps: set[str]) -> set[str]:
    return {d for d in deps if d.split(".")[0] not in PACKAGES and d.split(".")[0] not in sys.stdlib_module_names}


def _package_deps(deps: set[str]) -> set[str]:
    return {d for d in deps if d.split(".")[0] in PACKAGES}


ENV_SIDE_MODULES = sorted(m for m in import_graph() if _under(m, "boltzlabs_gym.envside"))


@pytest.mark.parametrize("module", ENV_SIDE_MODULES)
def test_env_side_imports_the_standard_library_and_itself(module):
    deps = import_graph()[module]
    gym = module in GYMNASIUM_ENV_SIDE
    allowed = GYMNASIUM_ENV_SIDE_ALLOWED if gym else ENV_SIDE_ALLOWED
    inside = {d for d in _package_deps(deps) if d not in PACKAGES and not any(_under(d, p) for p in allowed)}
    assert not inside, f"{module} imports {sorted(inside)}"
    outside = {d.split(".")[0] for d in _third_party(deps)}
    outside -= {"numpy", "gymnasium"} if gym else set()
    assert not outside, f"{module} imports {sorted(outside)}"


@pytest.mark.parametrize("module", sorted(ENV_FACES | STDLIB_ONLY))
def test_faces_of_the_env_side_and_shared_formats_import_the_standard_library_only(module):
    deps = import_graph()[module]
    assert not _third_party(deps), f"{module} imports {sorted(_third_party(deps))}"
    allowed = ENV_SIDE_ALLOWED + ("boltzlabs_gym.env",)
    inside = {d for d in _package_deps(deps) if d not in PACKAGES and not any(_under(d, p) for p in allowed)}
    assert not inside, f"{module} imports {sorted(inside)}"


@pytest.mark.parametrize("prefix", sorted(FORBIDDEN))
def test_subpackages_import_only_downwards(prefix):
    graph = import_graph()
    wrong = {
        (m, d)
        for m, deps in graph.items()
        if _under(m, prefix)
        for d in deps
        if any(_under(d, f) for f in FORBIDDEN[prefix])
    }
    assert not wrong, f"{prefix} imports {sorted(wrong)}"


def test_the_sandbox_layer_imports_no_worker_feature_above_it():
    graph = import_graph()
    wrong = {
        (m, d)
        for m, deps in graph.items()
        if _under(m, SANDBOX)
        for d in deps
        if _under(d, "boltzlabs_gym.worker") and not _under(d, SANDBOX)
    }
    assert not wrong, f"the sandbox layer imports {sorted(wrong)}"


def test_the_env_side_reaches_no_worker_or_client_code():
    graph = _package_edges(import_graph())
    for module in (*ENV_SIDE_MODULES, *ENV_FACES):
        reached, todo = set(), [module]
        while todo:
            for dep in graph.get(todo.pop(), ()):
                if dep not in reached:
                    reached.add(dep)
                    todo.append(dep)
        wrong = {m for m in reached if any(_under(m, p) for p in ("boltzlabs_gym.worker", "boltzlabs_gym.client"))}
        assert not wrong, f"{module} reaches {sorted(wrong)}"


if __name__ == "__main__":  # python tests/project/test_imports.py: print the circles
    for cycle in find_cycles(_package_edges(import_graph())):
        print(" <-> ".join(cycle))


def test_ray_is_imported_by_boltzlabs_gym_ray_only():
    # The pool takes RayWorkers through the WorkerSource protocol (sources.py), never by importing it.
    graph = import_graph()
    users = {m for m, deps in graph.items() if "ray" in deps}
    assert users and all(m == "boltzlabs_gym.ray" or m.startswith("boltzlabs_gym.ray.") for m in users), users


def test_each_framework_is_imported_by_its_integration_module_only():
    graph = import_graph()
    for framework, module in (("trl", "trl"), ("skyrl_gym", "skyrl"), ("verl", "verl")):
        users = {m for m, deps in graph.items() if any(d == framework or d.startswith(framework + ".") for d in deps)}
        assert users <= {f"boltzlabs_gym.integrations.{module}"}, (framework, users)
