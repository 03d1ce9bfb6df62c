"""One step of installing the code runtime (a command that must succeed), and the error that says
which failed; shared by the Node.js and Python halves (:mod:`~boltzlabs_gym.code.code_runtime`,
:mod:`~boltzlabs_gym.code.python_runtime`)."""

from __future__ import annotations

import logging
import subprocess

__all__ = ["RuntimeInstallError", "run_step"]

log = logging.getLogger(__name__)


class RuntimeInstallError(RuntimeError):
    """The code runtime could not be installed (what failed, and its output)."""


def run_step(cmd: list[str], what: str) -> None:
    """Run ``cmd``; a :class:`RuntimeInstallError` naming ``what`` and the end of its stderr if it fails."""
    log.info("code runtime: %s: %s", what, " ".join(cmd))
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeInstallError(f"{what} failed ({' '.join(cmd[:3])} ...): {done.stderr.strip()[-2000:]}")
