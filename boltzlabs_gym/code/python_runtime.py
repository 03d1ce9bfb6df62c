"""The Python runtime programs run under for ``pytest``: a venv of its own, separate from the
project's interpreter, made from the system's Python under ``/usr`` (which every sandbox shows).

:data:`PACKAGES` is what it gets; ``boltzlabs-gym code-runtime install`` makes it.
"""

from __future__ import annotations

import logging
import os
import shutil

__all__ = ["PACKAGES", "install_python"]

log = logging.getLogger(__name__)

#: What programs import beyond the standard library (pytest for the ``pytest`` language).
PACKAGES = ("pytest",)


def _base_python() -> str:
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.path.exists(candidate):
            return candidate
    found = shutil.which("python3", path="/usr/local/bin:/usr/bin")
    if found is None:
        from .code_runtime import RuntimeInstallError

        raise RuntimeInstallError(
            "no python3 under /usr (Debian: python3 python3-venv): the runtime venv needs one the sandbox shows"
        )
    return found


def install_python(runtime: str) -> str:
    """Make ``<runtime>/python`` (a venv of the system's Python) and install :data:`PACKAGES`; its path."""
    from .code_runtime import _run

    where = os.path.join(runtime, "python")
    if not os.path.exists(os.path.join(where, "bin", "python")):
        _run([_base_python(), "-m", "venv", where], "python -m venv")
    _run([os.path.join(where, "bin", "python"), "-m", "pip", "install", "--quiet", *PACKAGES], "pip install")
    return where
