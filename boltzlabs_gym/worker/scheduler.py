"""Env calls: queueing them, sending them, reading replies, deadlines and faults.

:class:`Scheduler` is the part of the worker that runs env calls. Each env runs one call at a
time; more wait in its queue. A reply finishes the call in flight; a missed deadline, a
closed pipe or a reply that breaks the protocol is a fault: the env is killed, the call
answered with the reason, and the env respawned. An env's first request after a start (a
``describe``, or a hard reset's seeded reset) is a call too (kind ``start``), and its
answer completes a ``create``.
"""

from __future__ import annotations

import collections
import logging
import select
import time
from collections.abc import Callable, Iterator, Sequence
from random import random

from ..wire.call_rules import STEP, STRAY_OUTPUT, call_timeout, leftover_is_stray, missed_deadline
from ..wire.envpipe import EnvFault
from ..wire.protocol import (
    CALL_MEMORY_LIMIT,
    CALL_TAG,
    ERROR,
    OK,
    SANDBOX_OPS,
    SANDBOX_SLOTS,
    STRAGGLER,
    env_request,
    env_request_line,
    error_reply,
)
from ..wire.start_failure import error_fields as start_failure_fields
from ..wire.start_failure import parse_start_failure
from .call_memory import lower_for_call, restore_after_call
from .deadlines import Deadlines
from .envproc import BUSY, DEAD, IDLE, Call, EnvProcess, json_error, read_progress
from .poller import Poller
from .session import Results, Session
from .spawner import Spawner
from .stats import ENV_SAMPLE_EVERY, WorkerStats, classify_fault

#: The share of env calls whose latency is bucketed (one in ENV_SAMPLE_EVERY, on average).
SAMPLE_FRACTION = 1.0 / ENV_SAMPLE_EVERY

log = logging.getLogger("boltzlabs_gym.worker")

#: Call kinds the scheduler treats apart; any other op is "other".
_CALL_KINDS = frozenset(("step", "reset", "hard_reset"))


#: A request whose payloads are this large goes to the pipe as parts, not joined into one copy.
_PARTS_MIN = 1 << 20


def in_flight(sessions: dict[str, Session], key: tuple) -> bool:
    """Whether the call a deadline names, ``(sid, index, token)``, is still unanswered."""
    session = sessions.get(key[0])
    if session is None:
        return False
    current = session.envs[key[1]].current
    return current is not None and current.token == key[2]


class Scheduler:
    """The worker's env calls: submit, pump, send, reply, fault, deadlines, start results.

    ``send(client, header)`` replies to a client and ``send_created(session, header)`` answers a
    session's ``create`` (lending its envs if asked); ``close_session`` ends a session whose env
    could not start (the worker's, all three). ``tokens`` numbers the calls sent (shared with the
    direct lane's adopted calls); ``name`` is the worker's, for logs.
    """

    def __init__(
        self,
        sessions: dict[str, Session],
        stats: WorkerStats,
        poller: Poller,
        deadlines: Deadlines,
        tokens: Iterator[int],
        spawner: Spawner,
        *,
        send: Callable[[bytes, dict], None],
        send_created: Callable[[Session, dict], None],
        close_session: Callable[[Session], None],
        name: str,
    ) -> None:
        self.sessions = sessions
        self.stats = stats
        self.poller = poller
        self.deadlines = deadlines
        self.tokens = tokens
        self.spawner = spawner
        self._send = send
        self._send_created = send_created
        self._close_session = close_session
        self.name = name
        #: the measurement gate (``serialize_measurement``): one step in flight at a time, the others wait
        self._gate_busy = False
        self._gate_waiters: collections.deque[tuple[Session, EnvProcess]] = collections.deque()

    # ================================================================== sending calls
    def submit(
        self, session: Session, env: EnvProcess, op: dict, frames: Sequence[bytes], batch: Results, pos: int
    ) -> None:
        name = op["op"]
        kind = name if name in _CALL_KINDS else "other"
        timeout = call_timeout(session.timeouts, op)
        env.queue.append(Call(op, frames, timeout, kind=kind, batch=batch, pos=pos, index=env.index))
        if env.state is DEAD:
            self.spawner.queue_start(session, env, None)
        self._pump(session, env)

    def seal_deadlines(self) -> None:
        """Close this turn's deadline entries: the calls sent since share one per timeout (:mod:`.deadlines`)."""
        self.deadlines.seal(time.monotonic())

    def _pump(self, session: Session, env: EnvProcess) -> None:
        """Send the env its next queued call if it is free to take one."""
        if env.state is not IDLE or not env.queue or session.closed:
            return
        call = env.queue[0]
        if call.kind == "hard_reset":
            env.queue.popleft()
            self._count_hard_reset(session, env)
            self.spawner.kill_env(session, env)
            self.spawner.wipe(env.workspace)
            if SANDBOX_SLOTS in call.op:  # a multi-env sandbox: its envs' resets, as one request
                reset_op = {"op": "reset", SANDBOX_SLOTS: call.op[SANDBOX_SLOTS], SANDBOX_OPS: call.op.get(SANDBOX_OPS)}
            else:
                reset_op = {"op": "reset", "seed": call.op.get("seed"), "options": call.op.get("options")}
            self.spawner.queue_start(session, env, call, reset_op)
            return
        if call.kind == STEP and session.cfg.serialize_measurement:
            if self._gate_busy:
                if not any(e is env for _, e in self._gate_waiters):
                    self._gate_waiters.append((session, env))
                return
            self._gate_busy = True
            call.op = dict(call.op)
            call.gated = True
        env.queue.popleft()
        self.send_call(session, env, call)

    def send_call(self, session: Session, env: EnvProcess, call: Call) -> None:
        call.token = next(self.tokens)
        # At random, when sent: by arrival, fast envs would claim the samples; by a fixed stride,
        # the same envs of every batch would (a batch of a multiple of the stride).
        call.sampled = random() < SAMPLE_FRACTION
        env.current = call
        env.state = BUSY
        env.sent_at = time.perf_counter()
        if call.timeout is not None:
            self.deadlines.add(call.timeout, (session.sid, env.index, call.token))
        if CALL_MEMORY_LIMIT in call.op:
            call.memory_lowered = lower_for_call(session, env, call.op)
        try:
            if call.payloads and sum(len(p) for p in call.payloads) >= _PARTS_MIN:
                done = env.write_parts([env_request_line(call.op, call.payloads), *call.payloads])
            else:
                done = env.write(env_request(call.op, call.payloads))
        except EnvFault as exc:
            self.fault(session, env, exc.reason)
            return
        if not done:
            self.poller.watch_pipe(env, env.stdin_w, "in", select.EPOLLOUT)

    def _release_gate(self, call: Call) -> None:
        if not call.gated:
            return
        call.gated = False
        self._gate_busy = False
        while self._gate_waiters and not self._gate_busy:
            session, env = self._gate_waiters.popleft()
            self._pump(session, env)

    # ================================================================== env events
    def on_env_event(self, env: EnvProcess, kind: str, ev: int) -> None:
        session = self._session_of(env)
        if session is None:
            return
        try:
            if kind == "err":
                env.drain_stderr()
                if ev & (select.EPOLLHUP | select.EPOLLERR) and not ev & select.EPOLLIN:
                    self.poller.drop_pipe(env.stderr_r)
            elif kind == "in":
                if env.flush():
                    self.poller.drop_pipe(env.stdin_w)
            else:
                replies = env.read_replies()
                stray = env.partial_output and leftover_is_stray(bool(replies), env.current is None)
                for reply, payloads in replies:
                    self._on_reply(session, env, reply, payloads)
                if stray:
                    raise EnvFault(STRAY_OUTPUT)
        except EnvFault as exc:
            self.fault(session, env, exc.reason)

    def _on_reply(self, session: Session, env: EnvProcess, reply: bytes, payloads: list) -> None:
        call = env.current
        if call is None:
            raise EnvFault(STRAY_OUTPUT)
        if call.kind == "start":
            env.start_failure = parse_start_failure(reply)
            if env.start_failure is not None:  # its factory raised: a failed start (see start_failed)
                raise EnvFault(env.start_failure.reason)
        env.current = None
        env.state = IDLE
        self._release_gate(call)
        if call.memory_lowered:
            restore_after_call(session, env)
        if call.sampled:  # one call in ENV_SAMPLE_EVERY, chosen when sent: see worker.stats
            self._sample_latency(session, env, call)
        if call.kind == "start":
            self._start_finished(session, env, call, reply, payloads)
        else:
            call.finish(OK, reply, payloads)
        if env.queue:
            self._pump(session, env)

    def fault(self, session: Session, env: EnvProcess, reason: str, *, straggler: bool = False) -> None:
        """Kill a misbehaving env, report its current call, respawn it in the background."""
        call = env.current
        env.current = None
        # Which of a multi-env sandbox's envs was running, before the kill and the wipe lose it.
        slot = read_progress(env.workspace) if env.count > 1 or session.cfg.envs_per_sandbox > 1 else None
        reason = self.spawner.kill_and_explain(session, env, reason, straggler)
        kind = self._count_fault(session, env, reason, straggler)
        detail = json_error(
            reason,
            index=env.global_index,
            stderr=env.stderr_tail(),
            straggler=straggler,
            **({} if slot is None else {"slot": slot}),
            envs=env.count,
        )
        if call is not None:
            self._release_gate(call)
            if call.kind == "start":
                self.start_failed(session, env, call, reason)
                return
            call.finish(STRAGGLER if straggler else ERROR, detail, [])
        if not session.closed:
            self.spawner.wipe(env.workspace)
            self.spawner.queue_start(session, env, None)
            stats = self.stats.sessions.get(session.sid)
            if stats is not None:
                stats.respawned(kind)

    def cancel(self, session: Session, env: EnvProcess, tag: object) -> bool:
        """Cancel ``env``'s call tagged ``tag`` (:data:`~boltzlabs_gym.wire.protocol.CALL_TAG`):
        still queued, it is dropped; in flight, the env's whole sandbox is killed and respawned.
        Either way the call is answered as an error that says so. ``False``: no such call (it
        finished first). A cancellation is the client's wish, not the env's fault: it is logged,
        not counted among faults."""
        for call in env.queue:
            if call.op.get(CALL_TAG) == tag:
                env.queue.remove(call)
                call.finish(ERROR, _cancelled(env, "before it was sent to the env"), [])
                return True
        current = env.current
        if current is None or current.kind == "start" or current.op.get(CALL_TAG) != tag:
            return False
        env.current = None
        self._release_gate(current)
        self.kill_cancelled(session, env, tag)
        current.finish(ERROR, _cancelled(env, "in flight: the env was killed and is being respawned"), [])
        return True

    def kill_cancelled(self, session: Session, env: EnvProcess, tag: object) -> None:
        """Kill ``env``'s sandbox, whose call ``tag`` was cancelled (a lent env's: the pool's own
        call), wipe its workspace and respawn it; logged, not counted as a fault."""
        self.spawner.reap_now(self.spawner.kill_env(session, env))
        log.info("worker %s session %s env %d: call %r cancelled", self.name, session.sid, env.global_index, tag)
        if not session.closed:
            self.spawner.wipe(env.workspace)
            self.spawner.queue_start(session, env, None)

    # ================================================================== the books (worker.stats)
    def _sample_latency(self, session: Session, env: EnvProcess, call: Call) -> None:
        """Bucket this reply's latency (a step's) or its start-up time (a start's)."""
        stats = self.stats.sessions.get(session.sid)
        if stats is not None and call.kind == STEP:
            stats.env_step_sampled(time.perf_counter() - env.sent_at)

    def _count_fault(self, session: Session, env: EnvProcess, reason: str, straggler: bool) -> str:
        """Count a fault, logged with the env and worker it happened on; its label (worker.stats)."""
        kind = classify_fault(reason, straggler)
        stats = self.stats.sessions.get(session.sid)
        if stats is not None:
            stats.fault(kind, reason, env.count)
        log.warning(
            "worker %s session %s env %d%s: %s (%s)",
            self.name,
            session.sid,
            env.global_index,
            f"..{env.global_index + env.count - 1}" if env.count > 1 else "",
            kind,
            reason,
        )
        return kind

    def _count_hard_reset(self, session: Session, env: EnvProcess) -> None:
        stats = self.stats.sessions.get(session.sid)
        if stats is not None:
            stats.hard_resets += env.count

    def expire_deadlines(self) -> None:
        for sid, index, _token in self.deadlines.pop_expired(time.monotonic()):
            session = self.sessions[sid]
            env = session.envs[index]
            call = env.current
            if call is None:  # a live key's env has a call in flight: for the type checker
                continue
            waited = time.perf_counter() - env.sent_at
            op = None if call.kind == "start" else call.op.get("op")
            self.fault(session, env, missed_deadline(call.timeout, op, waited), straggler=call.kind == STEP)

    # ================================================================== first requests
    def _start_finished(self, session: Session, env: EnvProcess, call: Call, reply: bytes, payloads: list) -> None:
        stats = self.stats.sessions.get(session.sid)
        if stats is not None:  # interpreter start and first answer, as start_timeout counts it
            stats.started(time.perf_counter() - env.sent_at)
        self.spawner.started(env)
        user_call = call.user_call
        if user_call is not None:
            user_call.finish(OK, reply, payloads)
        if session.create_seq is not None:
            session.started += 1
            now = time.monotonic()
            if session.started < len(session.envs) and now - session.progress_sent >= 0.2:
                # Interim reply under the create's tag: the pool shows start-up progress.
                session.progress_sent = now
                progress = {"seq": session.create_seq, "progress": session.started, "n": len(session.envs)}
                self._send(session.client, progress)
            if session.started == len(session.envs):
                seq, session.create_seq = session.create_seq, None
                reply = {
                    "seq": seq,
                    "ok": True,
                    "session": session.sid,
                    "token": session.token,
                    "n": len(session.envs),
                    "isolation": session.backend.report().for_envs_per_sandbox(session.cfg.envs_per_sandbox).to_json(),
                }
                self._send_created(session, reply)

    def start_failed(self, session: Session, env: EnvProcess, call: Call, reason: str) -> None:
        self.spawner.start_more()
        env.state = DEAD
        tail = env.stderr_tail()
        failure, env.start_failure = env.start_failure, None
        if session.create_seq is not None:
            # A pool is all or nothing: tear the whole session down and say which env failed.
            seq, session.create_seq = session.create_seq, None
            self._close_session(session)
            self._send(
                session.client,
                error_reply(
                    seq,
                    "env_start",
                    f"env {env.global_index} failed to start: {reason}",
                    index=env.global_index,
                    stderr=tail,
                    **start_failure_fields(failure),
                ),
            )
            return
        detail = json_error(
            f"env failed to restart: {reason}",
            index=env.global_index,
            stderr=tail,
            **start_failure_fields(failure),
        )
        if call.user_call is not None:
            call.user_call.finish(ERROR, detail, [])
        while env.queue:
            env.queue.popleft().finish(ERROR, detail, [])

    @staticmethod
    def _session_of(env: EnvProcess) -> Session | None:
        session = getattr(env, "session", None)
        return None if session is None or session.closed else session


def _cancelled(env: EnvProcess, where: str) -> bytes:
    return json_error(f"the call was cancelled by the client {where}", index=env.global_index, cancelled=True)
