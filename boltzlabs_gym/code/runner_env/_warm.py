"""What a warm zygote does once, before its first program: start pytest as a program's would.

``python -m pytest`` imports pytest and every plugin the programs' Python has installed (the
``pytest11`` entry points), and runs their ``pytest_configure``, on every run: 0.2-0.5 s in a
Python with a few plugins, 0.6 s and more in the code runtime's with SandboxFusion's package list
(pytest-cov, pytest-qt with its Qt, faker, anyio, nameko...). An env's zygote forks a warm zygote
for pytest at the env's first pytest program (``_zygote.Zygote.fork_warm``); it runs
:func:`start_pytest` once, and each pytest program is then a child of it that runs ``python -m
pytest ...`` through ``runpy`` and pays for its own session only.

Python programs fork from the env's lean zygote, never from this one: what pytest imports would
cost every fork and exit (page tables of a bigger heap: 1.3-1.5 ms more CPU per trivial Python
program, measured), and a library that changes course on ``"pytest" in sys.modules`` would behave
unlike under ``python main.py``.

Standard library only; runs inside the sandbox.
"""

from __future__ import annotations

import importlib.util
import io
import os
import sys
from collections.abc import Mapping


def start_pytest(environment: Mapping[str, str]) -> str | None:
    """Start pytest here as a program's ``pytest --help`` would, under ``environment``, from ``/``
    (no ini file, conftest or module of any request's) and with nothing writable on the import
    path: pytest and every installed plugin imported through pytest's assertion-rewriting hook,
    each plugin's ``pytest_configure`` and ``pytest_unconfigure`` run. Why it could not (pytest
    missing, failing), or None. What it changed (the environment, the working directory, the
    import path, the std streams) is put back."""
    if importlib.util.find_spec("pytest") is None:
        return f"pytest is not installed in {sys.executable}"
    saved = (dict(os.environ), os.getcwd(), list(sys.path), sys.stdout, sys.stderr)
    os.environ.clear()
    os.environ.update(environment)
    os.chdir("/")
    sys.path[:] = [p for p in sys.path if p not in ("", ".")]  # ('': the working directory)
    sys.stdout = sys.stderr = io.StringIO()
    try:
        import pytest

        code = pytest.main(["--help", "-p", "no:cacheprovider"])
        return None if code == 0 else f"pytest --help exited with {code}"
    except BaseException as exc:  # (a plugin's SystemExit included)
        return f"starting pytest failed: {type(exc).__name__}: {exc}"
    finally:
        environ, cwd, path, sys.stdout, sys.stderr = saved
        os.environ.clear()
        os.environ.update(environ)
        os.chdir(cwd)
        sys.path[:] = path
