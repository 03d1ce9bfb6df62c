"""The worker's half of the direct lane: lending idle envs' pipes to the local pool, taking them
back, and what the pool reports.

:class:`DirectLane` is a part of the worker. A local pool may step its idle
envs itself, on their own pipes, while this worker keeps everything else: their
processes, stderr, deadlines' consequences, respawns (see :mod:`boltzlabs_gym.client.direct_lane`;
the wire words are documented in :mod:`boltzlabs_gym.wire.protocol`, "Lending"). A lent env is
``LENT``: its stdout is not watched here, and any request naming it takes it back first;
the pool never uses it again until re-lent.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

from ..wire.call_rules import STEP
from ..wire.protocol import ADOPT, ERROR, FAULTS, LENT, REGION_FDS
from .deadlines import Deadlines
from .envproc import BUSY, IDLE, Call, EnvProcess, json_error
from .envproc import LENT as LENT_STATE  # the env state; LENT is the reply's wire word
from .poller import Poller
from .session import LOCAL_CLIENT, Batch, Session

log = logging.getLogger("boltzlabs_gym.worker")

#: The longest fault reason a pool's report may carry (longer ones are cut).
MAX_FAULT_REASON = 2000


class Fault(Protocol):
    """Kill a misbehaving env, report its current call, respawn it (the scheduler's ``fault``)."""

    def __call__(self, session: Session, env: EnvProcess, reason: str, *, straggler: bool = False) -> None: ...


class DirectLane:
    """The worker's side of lending (``lend``, ``lent``, ``faults``, ``adopt``, ``lent_fault``).

    ``send(client, header, frames, fds)`` sends a reply with descriptors (the local channel's),
    ``fault(session, env, reason, straggler=...)`` kills and respawns an env (the scheduler's), and
    ``has_local_pool()`` says whether the pool that started the worker is still connected.
    ``tokens`` numbers calls (the scheduler's numbering: an adopted call is one of its calls).
    """

    def __init__(
        self,
        poller: Poller,
        deadlines: Deadlines,
        tokens: Iterator[int],
        *,
        send: Callable[[bytes, dict, Sequence, Sequence[int]], None],
        fault: Fault,
        has_local_pool: Callable[[], bool],
    ) -> None:
        self.poller = poller
        self.deadlines = deadlines
        self.tokens = tokens
        self._send = send
        self._fault = fault
        self._has_local_pool = has_local_pool

    def may_lend(self, client: bytes, session: Session) -> bool:
        return client == LOCAL_CLIENT and self._has_local_pool() and not session.cfg.serialize_measurement

    def apply_lent_reports(self, client: bytes, session: Session, header: dict) -> None:
        """A request's ``faults`` and ``adopt``: lent envs the pool let go of (see below)."""
        if header.get(FAULTS) is None and header.get(ADOPT) is None:
            return
        if client != LOCAL_CLIENT:
            raise ValueError(f"{FAULTS} and {ADOPT} are for a local pool's lent envs")
        faults = self._lent_faults(session, header.get(FAULTS))
        adopted = self._lent_adopted(session, header.get(ADOPT))
        for env, reason in faults:
            self.take_back(env)
            self._fault(session, env, reason)
        for env, name, left in adopted:
            self._adopt(session, env, name, left)

    def _lendable(self, env: EnvProcess) -> bool:
        return (
            env.state is IDLE and env.current is None and not env.queue and env.stdout_r >= 0 and not env.mid_transfer
        )

    def _lend_idle(self, session: Session) -> tuple[list[int], list[int]]:
        """Lend every idle env of ``session``: (their indices, their stdin and stdout fds, in pairs)."""
        indices: list[int] = []
        fds: list[int] = []
        if session.closed:
            return indices, fds
        for env in session.envs:
            if self._lendable(env):
                self.poller.drop_pipe(env.stdout_r)
                env.state = LENT_STATE
                indices.append(env.index)
                fds += (env.stdin_w, env.stdout_r)
        return indices, fds

    def send_lending(self, session: Session, header: dict, frames: list, region_fds: Sequence[int] = ()) -> None:
        """Send a reply to the local pool lending it ``session``'s idle envs, with the observation
        regions ``region_fds`` after their descriptors; without either if the descriptors cannot
        go (out of descriptors here)."""
        header[LENT], fds = self._lend_idle(session)
        try:
            self._send(session.client, header, frames, [*fds, *region_fds])
        except (OSError, ValueError) as exc:
            log.warning("could not lend %d envs to the local pool: %s", len(header[LENT]), exc)
            for index in header[LENT]:
                self.take_back(session.envs[index])
            header[LENT] = []
            header.pop(REGION_FDS, None)
            self._send(session.client, header, frames, ())

    def take_back(self, env: EnvProcess) -> None:
        """The pool named a lent env in a request: its pipes are ours again."""
        if env.state is not LENT_STATE:
            return
        env.state = IDLE
        self.poller.watch_pipe(env, env.stdout_r, "out")

    def _lent_faults(self, session: Session, faults: object) -> list[tuple[EnvProcess, str]]:
        """Validate a request's ``faults``: ``[[index, reason], ...]`` the pool saw on lent,
        idle envs (output nobody asked for, a closed pipe)."""
        if faults is None:
            return []
        if not isinstance(faults, list) or not all(
            type(f) is list
            and len(f) == 2
            and type(f[0]) is int
            and 0 <= f[0] < len(session.envs)
            and type(f[1]) is str
            for f in faults
        ):
            raise ValueError(f"{FAULTS} must be a list of [env index, reason] pairs")
        # An env that is no longer lent was already killed here (it wrote a second reply, say)
        # and is being respawned: the pool saw the same fault from its side.
        envs = session.envs
        return [(envs[i], reason[:MAX_FAULT_REASON]) for i, reason in faults if envs[i].state is LENT_STATE]

    def _lent_adopted(self, session: Session, adopt: object) -> list[tuple[EnvProcess, str, float]]:
        """Validate a request's ``adopt``: ``[[index, op, seconds left], ...]``, calls the pool
        sent to lent envs and stopped waiting for (its wait timed out)."""
        if adopt is None:
            return []
        if not isinstance(adopt, list) or not all(
            type(a) is list
            and len(a) == 3
            and type(a[0]) is int
            and 0 <= a[0] < len(session.envs)
            and type(a[1]) is str
            and isinstance(a[2], (int, float))
            and 0 < a[2] <= 86400
            for a in adopt
        ):
            raise ValueError(f"{ADOPT} must be a list of [env index, op, seconds left] triples")
        envs = session.envs
        return [(envs[i], name, float(left)) for i, name, left in adopt if envs[i].state is LENT_STATE]

    def _adopt(self, session: Session, env: EnvProcess, name: str, left: float) -> None:
        """Take back a lent env with a call in flight that nobody waits for any more: its reply
        is dropped when it comes, its deadline still holds, calls queued behind it wait."""
        self.take_back(env)
        timeout = session.timeouts[name]
        call = Call({"op": name[:40]}, (), timeout, kind=STEP if name == STEP else "other", index=env.index)
        call.token = next(self.tokens)
        env.current = call
        env.state = BUSY
        env.sent_at = time.perf_counter() - max(0.0, timeout - left)
        self.deadlines.add(left, (session.sid, env.index, call.token))

    def submit_lent_fault(self, session: Session, env: EnvProcess, op: dict, batch: Batch, pos: int) -> None:
        """The pool's call to a lent env failed (deadline, crash, bad reply): kill and report it
        as if the call had been ours, and respawn it."""
        call = Call(
            op, (), None, kind=STEP if op.get("straggler") is True else "other", batch=batch, pos=pos, index=env.index
        )
        reason = op["reason"][:MAX_FAULT_REASON]  # a string: checked with the request
        if env.state is not LENT_STATE:
            # Not the pool's to hand back: killed here while lent (output nobody asked for, say)
            # and being respawned, or never lent at all. Either way it is not killed again.
            call.finish(
                ERROR,
                json_error(
                    f"{reason} (env {env.global_index} is not lent to this pool: "
                    "the worker restarted it, or never lent it)",
                    index=env.global_index,
                ),
                [],
            )
            return
        self.take_back(env)
        env.current = call
        env.state = BUSY
        self._fault(session, env, reason, straggler=op.get("straggler") is True)
