"""Installing the code runtime: what programs expect beyond the toolchains, as SandboxFusion's image
provides it (its ``runtime/``): Node.js packages (tsx for TypeScript, jest with babel for ``jest``,
and the libraries its node runtime lists) and a Python venv for ``pytest``.

``boltzlabs-gym code-runtime install`` runs :func:`install`. The runtime goes under ``/usr``
(:data:`~boltzlabs_gym.code.languages.DEFAULT_RUNTIME`), which every sandbox shows read-only; a
runtime elsewhere would be invisible to the programs, so :func:`install` refuses one.

>>> from boltzlabs_gym.code.code_runtime import NODE_PACKAGES
>>> any(p.startswith("tsx@") for p in NODE_PACKAGES)
True
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Sequence

from .install_step import RuntimeInstallError, run_step
from .languages import runtime_dir

__all__ = ["NODE_PACKAGES", "RuntimeInstallError", "install", "install_node"]

#: SandboxFusion's node runtime (``runtime/node/package.json``) and TypeScript tools (its image's
#: ``npm install -g typescript tsx``), at the same major versions; puppeteer is left out: it
#: downloads a browser at install time, which no registry serves.
NODE_PACKAGES = (
    "tsx@4",
    "typescript@5",
    "jest@29",
    "babel-jest@29",
    "@jest/globals@29",
    "@babel/core@7",
    "@babel/preset-env@7",
    "@babel/preset-typescript@7",
    "@testing-library/dom@10",
    "@testing-library/jest-dom@6",
    "jsdom@24",
    "commander@12",
    "js-md5@0.7",
    "lodash@4",
    "random-seed@0.3",
    "seedrandom@3",
)


def _check_visible(runtime: str) -> None:
    real = os.path.realpath(runtime)
    if not real.startswith("/usr/"):
        raise RuntimeInstallError(
            f"code runtime {runtime!r} is not under /usr: sandboxes show only /usr and the top-level bin/lib "
            "directories of the host, so programs would not see it; pick a directory under /usr/local"
        )


def install_node(runtime: str) -> str:
    """Install :data:`NODE_PACKAGES` into ``<runtime>/node``; the directory."""
    npm = shutil.which("npm")
    if npm is None:
        raise RuntimeInstallError("npm is not installed (Debian: nodejs npm); TypeScript and jest need it")
    where = os.path.join(runtime, "node")
    os.makedirs(where, exist_ok=True)
    package = os.path.join(where, "package.json")
    if not os.path.exists(package):
        with open(package, "w") as f:
            json.dump({"name": "boltzlabs-code-runtime", "private": True, "version": "1.0.0"}, f)
    quiet = ("--no-audit", "--no-fund", "--loglevel=error")
    run_step([npm, "install", "--prefix", where, *quiet, *NODE_PACKAGES], "npm install")
    return where


def install(
    runtime: str | None = None,
    *,
    node: bool = True,
    python: bool = True,
    python_packages: Sequence[str] | None = None,
    jvm: bool = True,
    cpp: bool = True,
) -> dict[str, str]:
    """Install the code runtime (default :func:`~boltzlabs_gym.code.languages.runtime_dir`); what
    was installed where. ``python_packages``: what the Python venv gets (default
    :data:`~boltzlabs_gym.code.python_runtime.PACKAGES`, SandboxFusion's list). ``jvm``: dump the
    JVM toolchains' class-data-sharing archives (:mod:`~boltzlabs_gym.code.jvm_archives`; those
    whose toolchain is installed). ``cpp``: precompile the C++ standard headers programs include first
    (:mod:`~boltzlabs_gym.code.cpp_headers`; where g++ is installed). Raises
    :class:`RuntimeInstallError` naming what failed."""
    runtime = runtime or runtime_dir()
    _check_visible(runtime)
    done = {}
    if jvm:
        from .jvm_archives import build

        for name, made in build(runtime).items():
            done[f"jvm {name}"] = made
    if cpp:
        from .cpp_headers import build as build_headers

        for header, made in build_headers(runtime).items():
            done[f"cpp <{header}>"] = made
    if node:
        done["node"] = install_node(runtime)
    if python:
        from .python_runtime import PACKAGES, install_python

        done["python"] = install_python(runtime, PACKAGES if python_packages is None else python_packages)
    return done


if __name__ == "__main__":  # pragma: no cover
    print(install(sys.argv[1] if len(sys.argv) > 1 else None))
