"""Isolation backends for env processes, best first: ``namespaces``, ``bwrap``, ``process``.

``select_backend("auto")`` picks the best one this host allows and logs a warning
when it has to fall back; ``"strict"`` refuses anything without real isolation.
"""

from __future__ import annotations

import logging

from .base import (
    SANDBOX_ENV_DIR,
    SANDBOX_RUNTIME,
    SANDBOX_WORKSPACE,
    Backend,
    IsolationReport,
    Launched,
    LaunchSpec,
    Limits,
    ListenerGate,
    SandboxUnavailable,
)
from .process import ProcessBackend

__all__ = [
    "SANDBOX_ENV_DIR",
    "SANDBOX_RUNTIME",
    "SANDBOX_WORKSPACE",
    "IsolationReport",
    "Launched",
    "LaunchSpec",
    "Limits",
    "ListenerGate",
    "SandboxUnavailable",
    "select_backend",
    "BACKENDS",
]

log = logging.getLogger("boltzlabs_gym.sandbox")


def _backends(gate: ListenerGate | None = None) -> dict[str, Backend]:
    found: dict[str, Backend] = {}
    try:
        from .namespaces import NamespaceBackend

        found["namespaces"] = NamespaceBackend(gate=gate)
    except ImportError:  # pragma: no cover - the module ships with the package
        pass
    try:
        from .bwrap import BwrapBackend

        found["bwrap"] = BwrapBackend()
    except ImportError:  # pragma: no cover
        pass
    found["process"] = ProcessBackend()
    return found


BACKENDS = ("namespaces", "bwrap", "process")
ISOLATION_CHOICES = ("auto", "strict") + BACKENDS


def select_backend(isolation: str = "auto", *, gate: ListenerGate | None = None) -> Backend:
    """Return the backend object for ``isolation`` or raise :class:`SandboxUnavailable`.

    ``gate`` answers what the envs' seccomp filters hand to the worker (the namespaces backend as
    root: see :class:`~.base.ListenerGate`); without one they get the plain filter.
    """
    if isolation not in ISOLATION_CHOICES:
        raise ValueError(f"isolation={isolation!r} is not one of {ISOLATION_CHOICES}")
    backends = _backends(gate)
    if isolation in BACKENDS:
        backend = backends.get(isolation)
        ok, why = backend.available() if backend else (False, "backend not shipped")
        if backend is None or not ok:
            raise SandboxUnavailable(f"isolation={isolation!r} is not available on this host: {why}")
        return backend
    reasons: list[str] = []
    for name in BACKENDS:
        backend = backends.get(name)
        if backend is None:
            continue
        ok, why = backend.available()
        if ok and not (isolation == "strict" and name == "process"):
            if reasons:
                log.warning("isolation falls back to %r: %s", name, "; ".join(reasons))
            return backend
        reasons.append(f"{name}: {why}")
    raise SandboxUnavailable(
        "isolation='strict' needs a real sandbox and none is available here ("
        + "; ".join(reasons)
        + "). Run as root, allow unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1,"
        " or on Ubuntu 24.04 install bubblewrap: apt-get install bubblewrap), or pass isolation='process'"
        " to run without one."
    )
