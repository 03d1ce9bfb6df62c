"""A call's own memory limit: the env's cgroup lowered for one call (``"memory_limit_bytes"``).

See "A call's memory limit" in :mod:`boltzlabs_gym.wire.protocol`. The code runner uses it to give
each program the memory its request asks for, enforced by the kernel: the limit of the env's
cgroup becomes, for the call, what the sandbox holds when the call is sent (the env, its zygote,
the request's files) plus the request's bytes, never more than the session's own limit. Only the
worker writes the limit; nothing inside the sandbox can reach the cgroup's files (no ``/sys``
there), so no program can raise it.
"""

from __future__ import annotations

from typing import Any

from ..wire.protocol import CALL_MEMORY_LIMIT
from .envproc import EnvProcess
from .session import Session

__all__ = ["lower_for_call", "restore_after_call"]


def _cgroup(env: EnvProcess) -> Any:
    launched = env.launched
    return getattr(launched, "cgroup", None) if launched is not None else None


def lower_for_call(session: Session, env: EnvProcess, op: dict) -> bool:
    """Lower ``env``'s cgroup memory limit for the call ``op`` if it asks; whether it was."""
    wanted = op.get(CALL_MEMORY_LIMIT)
    if type(wanted) is not int or wanted <= 0:
        return False
    cgroup = _cgroup(env)
    if cgroup is None:
        return False
    held = cgroup.memory_usage()
    if held is None:
        return False
    ceiling = session.cfg.limits.memory_bytes
    limit = held + wanted if not ceiling else min(ceiling, held + wanted)
    return bool(cgroup.set_memory_limit(limit))


def restore_after_call(session: Session, env: EnvProcess) -> None:
    """Put the session's limit back on ``env``'s cgroup after a call that lowered it; an OOM
    kill during the call was its program's, not the env's."""
    cgroup = _cgroup(env)
    if cgroup is not None:
        cgroup.set_memory_limit(session.cfg.limits.memory_bytes)
        cgroup.forget_oom_kills()
