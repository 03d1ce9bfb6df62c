"""pytest kept warm: imported once in the template, run per program in a child of the warm interpreter.

``python -m pytest`` imports pytest and every plugin the programs' Python has installed (the
``pytest11`` entry points) on every run: 0.2 s in a venv with pytest alone, 0.6 s in the code
runtime's with SandboxFusion's package list (pytest-cov, pytest-qt, faker, anyio, nameko...). The
template imports them once (:func:`preload_pytest`, before any env exists, so before any request),
every env and its zygote inherit them, and a ``pytest`` program is a child forked from that warm
interpreter which runs ``python -m pytest ...`` as the interpreter would (``runpy``), paying only
for its own session.

Python programs must not see what this imports: a library that changes course on ``"pytest" in
sys.modules`` would behave unlike under ``python main.py``. So the modules the preload adds, except
the standard library's (which a program cannot tell from ones the interpreter had loaded), are
taken out of ``sys.modules`` and kept here (alive, so that no fork frees them) until a pytest
program puts them back (:func:`expose`).

Standard library only; runs inside the sandbox.
"""

from __future__ import annotations

import atexit
import importlib.util
import io
import os
import sys
from collections.abc import Callable, Mapping
from types import ModuleType

#: the modules the preload added, outside ``sys.modules`` until a pytest program runs
_hidden: dict[str, ModuleType] = {}
#: what the preload registered with ``atexit`` (PyQt's clean-ups, say), registered in pytest programs only
_at_exit: list[tuple[Callable, tuple, dict]] = []
#: why pytest is not preloaded (then pytest programs start the interpreter), or None
not_preloaded: str | None = "preload_pytest() was not called"


def preload_pytest(environment: Mapping[str, str]) -> str | None:
    """Start pytest once here as a program's ``pytest --help`` would, under the programs'
    ``environment`` and in ``/`` (no ini file of anyone's): pytest and every installed plugin
    imported through pytest's assertion-rewriting hook, each plugin's ``pytest_configure`` run (which
    imports what it needs: pytest-qt its Qt). Then hide what that added from ``sys.modules`` and
    ``atexit``. Why it could not (pytest missing, failing), or None."""
    global not_preloaded
    if importlib.util.find_spec("pytest") is None:
        not_preloaded = f"pytest is not installed in {sys.executable}"
        return not_preloaded
    before = set(sys.modules)
    saved = (dict(os.environ), os.getcwd(), sys.stdout, sys.stderr, atexit.register)
    os.environ.clear()
    os.environ.update(environment)
    os.chdir("/")
    sys.stdout = sys.stderr = io.StringIO()
    atexit.register = _defer_at_exit  # type: ignore[assignment]
    try:
        import pytest

        code = pytest.main(["--help", "-p", "no:cacheprovider"])
        not_preloaded = None if code == 0 else f"pytest --help exited with {code}"
    except BaseException as exc:  # (a plugin's SystemExit included)
        not_preloaded = f"starting pytest failed: {type(exc).__name__}: {exc}"
    finally:
        environ, cwd, sys.stdout, sys.stderr, atexit.register = saved  # type: ignore[assignment]
        os.environ.clear()
        os.environ.update(environ)
        os.chdir(cwd)
    for name in set(sys.modules) - before:
        if name.partition(".")[0] not in sys.stdlib_module_names:
            _hidden[name] = sys.modules.pop(name)
    return not_preloaded


def _defer_at_exit(func: Callable, *args, **kwargs) -> Callable:
    _at_exit.append((func, args, kwargs))
    return func


def expose() -> None:
    """In a pytest program's child: the preloaded modules back in ``sys.modules``, and their
    ``atexit`` functions registered, as a fresh ``python -m pytest`` would have them."""
    for name, module in _hidden.items():
        sys.modules.setdefault(name, module)
    for func, args, kwargs in _at_exit:
        atexit.register(func, *args, **kwargs)
