"""Collection rules for the whole run (tests/ and the package's doctests, pyproject: --doctest-modules).

* A package module that imports a package one of the pyproject extras declares, where that package
  is not installed, is skipped with the extra to install, not a collection error: any optional
  module, today's or a future one, the same way. Any other import error (a core module, a typo,
  a broken dependency of an installed extra) still fails collection.
* ``--sample-each-module`` keeps one test of every test module and every doctest module (the first
  that is not marked ``slow``): the whole suite is collected and every module's imports and one test
  body run, in a few minutes. ``.ci/run`` runs the README's test command so on a fresh venv.

The code runner's env directory is a program a worker runs (importing it starts serving): never
collected.
"""

from __future__ import annotations

import functools
import importlib.metadata
import re
from collections.abc import Iterator

import pytest
from _pytest.doctest import DoctestModule

collect_ignore_glob = ["boltzlabs_gym/code/runner_env/*"]

DISTRIBUTION = "boltzlabs-gym"


@functools.cache
def extra_of_module() -> dict[str, str]:
    """Top-level import name -> the pyproject extra that installs it, from the installed metadata.

    An import name is the distribution's name normalised (``skyrl-gym`` -> ``skyrl_gym``,
    ``ray[default]`` -> ``ray``), as it is for every extra this project declares.
    """
    found: dict[str, str] = {}
    try:
        requirements = importlib.metadata.requires(DISTRIBUTION) or []
    except importlib.metadata.PackageNotFoundError:
        raise pytest.UsageError(f"{DISTRIBUTION} is not installed: run pip install -e '.[test]' first") from None
    for requirement in requirements:
        extra = re.search(r"""extra\s*==\s*["']([^"']+)["']""", requirement)
        if extra is None or extra.group(1) in ("test", "lint", "docs", "bench"):
            continue
        name = re.match(r"[A-Za-z0-9._-]+", requirement)
        if name is not None:
            found.setdefault(re.sub(r"[-.]", "_", name.group(0)).lower(), extra.group(1))
    return found


def missing_extra(error: BaseException) -> tuple[str, str] | None:
    """(missing module, extra) when ``error`` (or what caused it) is a missing extra's package."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, ModuleNotFoundError) and seen.name:
            top = seen.name.split(".")[0]
            extra = extra_of_module().get(top.lower())
            if extra is not None:
                return top, extra
        seen = seen.__cause__
    return None


class OptionalDoctestModule(DoctestModule):
    """A package module's doctests, skipped when the module needs an extra that is not installed."""

    def collect(self) -> Iterator:
        try:
            yield from super().collect()
        except Exception as error:  # pytest 8+ wraps the ImportError in a CollectError (raised from it)
            found = missing_extra(error)
            if found is None:
                raise
            module, extra = found
            where = self.path.relative_to(self.config.rootpath)
            pytest.skip(f"{where} needs {module}, which is not installed: pip install 'boltzlabs-gym[{extra}]'")


@pytest.hookimpl(wrapper=True)
def pytest_collect_file(file_path, parent):
    collectors = yield
    return [
        OptionalDoctestModule.from_parent(parent, path=file_path) if type(c) is DoctestModule else c for c in collectors
    ]


def pytest_addoption(parser):
    parser.addoption(
        "--sample-each-module",
        action="store_true",
        help="run one test of every test module and doctest module (the first not marked slow)",
    )


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--sample-each-module"):
        return
    chosen: dict[str, pytest.Item] = {}
    for item in items:
        module = str(item.path)
        held = chosen.get(module)
        if held is None or (held.get_closest_marker("slow") and not item.get_closest_marker("slow")):
            chosen[module] = item
    keep = set(map(id, chosen.values()))
    config.hook.pytest_deselected(items=[item for item in items if id(item) not in keep])
    items[:] = [item for item in items if id(item) in keep]
