"""The ``cancel`` op: a client cancels calls of its session that are queued or in flight.

See "Cancelling calls" in :mod:`boltzlabs_gym.wire.protocol`. The request usually comes on a
connection of its own (the pool's own connection is busy waiting for the batch it cancels), so
it must not become the session's reply address: lending, start-up progress and start failures
keep going where they went. With ``"lent": true`` it also kills named envs lent to the session's
local pool (their calls are the pool's own, on the envs' pipes, with no tag the worker sees).
"""

from __future__ import annotations

from typing import Any, Protocol

from ..wire.protocol import CANCEL, CANCEL_LENT
from .direct_lane import DirectLane
from .envproc import LENT
from .scheduler import Scheduler
from .session import LOCAL_CLIENT, Session

__all__ = ["op_cancel"]

#: The most calls one cancel request may name.
MAX_CANCELLED_CALLS = 4096


class _Worker(Protocol):
    """What the handler uses of the worker (a part of :class:`~boltzlabs_gym.worker.ops.WorkerView`)."""

    sessions: dict[str, Session]
    scheduler: Scheduler
    lane: DirectLane

    def session_for(self, client: bytes, header: dict[str, Any]) -> Session: ...


def op_cancel(worker: _Worker, client: bytes, header: dict[str, Any], payloads: list[bytes]) -> dict[str, Any]:
    """Cancel ``header["calls"]``: ``[[index, tag], ...]``; answers which envs' calls were found."""
    sid = header.get("session")
    known = worker.sessions.get(sid) if isinstance(sid, str) else None
    reply_to = known.client if known is not None else None
    session = worker.session_for(client, header)  # checks the token and the key
    if reply_to is not None:
        session.client = reply_to
    calls = _checked_calls(header.get("calls"), len(session.envs))
    lent = header.get(CANCEL_LENT) is True and session.client == LOCAL_CLIENT
    cancelled = []
    for index, tag in calls:
        env = session.envs[index]
        if lent and env.state is LENT:  # the pool's own call on the env's pipes: the pool vouches for it
            worker.lane.take_back(env)
            worker.scheduler.kill_cancelled(session, env, tag)
        elif not worker.scheduler.cancel(session, env, tag):
            continue
        cancelled.append(index)
    return {"ok": True, "cancelled": cancelled}


def _checked_calls(calls: object, n_envs: int) -> list[tuple[int, str | int]]:
    if not isinstance(calls, list) or len(calls) > MAX_CANCELLED_CALLS:
        raise ValueError(f"{CANCEL} needs 'calls': a list of at most {MAX_CANCELLED_CALLS} [index, tag] pairs")
    out = []
    for call in calls:
        if (
            type(call) is not list
            or len(call) != 2
            or type(call[0]) is not int
            or not 0 <= call[0] < n_envs
            or type(call[1]) not in (str, int)
        ):
            raise ValueError(f"{CANCEL}: a call must be [index in 0..{n_envs - 1}, tag (str or int)], got {call!r:.80}")
        out.append((call[0], call[1]))
    return out
