"""One step of installing the code runtime (a command that must succeed), and the error that says
which failed; shared by the Node.js and Python halves (:mod:`~boltzlabs_gym.code.code_runtime`,
:mod:`~boltzlabs_gym.code.python_runtime`) and by what is built once from the toolchains (the JVM
archives, the precompiled C++ headers): a toolchain run as the env runs it, a file made read-only."""

from __future__ import annotations

import logging
import os
import subprocess

__all__ = ["RuntimeInstallError", "publish_read_only", "run_step", "run_toolchain"]

log = logging.getLogger(__name__)


class RuntimeInstallError(RuntimeError):
    """The code runtime could not be installed (what failed, and its output)."""


def run_step(cmd: list[str], what: str) -> None:
    """Run ``cmd``; a :class:`RuntimeInstallError` naming ``what`` and the end of its stderr if it fails."""
    log.info("code runtime: %s: %s", what, " ".join(cmd))
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeInstallError(f"{what} failed ({' '.join(cmd[:3])} ...): {done.stderr.strip()[-2000:]}")


def run_toolchain(cmd: list[str], work: str, timeout: float, failed: str) -> None:
    """Run a toolchain's ``cmd`` in ``work`` with the environment the env gives it (its ``PATH``,
    ``LANG``; ``HOME`` the work directory); a :class:`RuntimeInstallError` saying ``failed`` and the
    end of its stderr if it fails."""
    from .languages import _TABLE

    env = {"PATH": _TABLE.PATH, "LANG": "C.UTF-8", "HOME": work}  # (as the env runs it: its PROGRAM_ENV)
    done = subprocess.run(cmd, cwd=work, capture_output=True, text=True, timeout=timeout, env=env)
    if done.returncode != 0:
        raise RuntimeInstallError(f"{failed}: {done.stderr.strip()[-2000:]}")


def publish_read_only(partial: str, path: str) -> None:
    """Make the finished ``partial`` read-only (0444) and put it at ``path`` in one rename."""
    os.chmod(partial, 0o444)
    os.replace(partial, path)
