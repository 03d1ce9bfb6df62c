"""A local pool's direct lane: steps and resets written straight to the envs' own pipes.

A pool that started its own worker asks it to *lend* idle envs: the worker passes the
pool its ends of each env's stdin and stdout (``SCM_RIGHTS`` over their socketpair)
and stops watching that stdout. The pool then writes step and reset lines itself and
reads the replies with the worker's own parser (:class:`~boltzlabs_gym.wire.envpipe.EnvPipe`:
the same line and payload limits, the same untrusted-data rules). That takes the worker
hop, two wake-ups and a second parse of every reply, off each policy step; on a 2-vCPU
VM the hop was most of a small batch's cost.

Everything else stays with the worker: the env processes, their stderr, every other
op, and what happens to an env that fails. When an env misses its deadline, closes
its pipe or breaks the protocol here, the lane closes its copies of the pipes and
the pool hands the env back in its next request: the worker kills it, reports the
failure (exit status, OOM, stderr tail) in that env's result slot, and respawns it,
exactly as if the call had gone through the worker. An env the worker is asked to do
anything else with is taken back by that request and lent again once idle.
"""

from __future__ import annotations

import heapq
import os
import select
import time
from collections.abc import Sequence

from ..wire.call_rules import (
    STRAY_OUTPUT,
    OpTimeouts,
    call_timeout,
    is_straggler_op,
    leftover_is_stray,
    missed_deadline,
)
from ..wire.envpipe import EnvFault, EnvPipe
from ..wire.protocol import CALL_MEMORY_LIMIT

__all__ = ["DirectLane", "DIRECT_OPS", "goes_direct"]

#: Ops the lane sends itself; anything else goes through the worker.
DIRECT_OPS = frozenset(("step", "reset"))


def goes_direct(op: dict) -> bool:
    """Whether the lane may send ``op`` itself: one of :data:`DIRECT_OPS` that asks the worker for
    nothing (a call's memory limit, :data:`~boltzlabs_gym.wire.protocol.CALL_MEMORY_LIMIT`, is the
    worker's to set and put back)."""
    return op.get("op") in DIRECT_OPS and CALL_MEMORY_LIMIT not in op


#: Gathering replies in rounds (see DirectLane._nap): only with more calls than this in flight, in
#: about this many rounds, for naps of this length. With 16 envs of 40-500 us steps on 2 vCPUs,
#: waking for each reply cost the trainer a quarter of its CPU and the envs their cores (16 envs
#: in flight, HalfCheetah: 12.2k -> 13.5k env-steps/s with naps, Pong 3.2k -> 3.4k); a batch of
#: 8 or fewer is never napped on, so the latency of small batches is what it was.
NAP_MIN_IN_FLIGHT = 8
NAP_ROUNDS = 4
MIN_NAP_S, MAX_NAP_S = 50e-6, 0.05


class _Lent(EnvPipe):
    """One lent env: its pipes, and the call in flight on them."""

    def __init__(self, index: int, stdin_w: int, stdout_r: int):
        super().__init__(stdin_w, stdout_r)
        self.index = index
        self.pos = -1  # the in-flight call's position in the batch; -1: idle
        self.op = ""
        self.timeout = 0.0
        self.sent_at = 0.0
        self.deadline = 0.0


class DirectLane:
    """The lent envs of one local pool, by env index.

    Its descriptors come only from a worker's lending reply, so this sketch is not a
    doctest (:class:`~boltzlabs_gym.client.routes.LaneRoute` is the real user)::

        lane = DirectLane(step_timeout=30.0, reset_timeout=60.0)
        lane.add([0, 1], [in0, out0, in1, out1])        # the pipes lent with a worker reply
        failed = lane.send([(0, 0, {"op": "step"}, line)])   # (batch pos, env index, op, request line)
        done, failed = lane.wait(deadline)              # replies, and calls to hand back to the worker
    """

    def __init__(self, step_timeout: float, reset_timeout: float, envs_per_sandbox: int = 1):
        #: Envs per lent process: a reply may carry that many envs' answers (EnvPipe.serve_envs).
        self.envs_per_sandbox = envs_per_sandbox
        self._timeouts = OpTimeouts(step_timeout, reset_timeout)  # the worker's rule (boltzlabs_gym.wire.call_rules)
        self._envs: dict[int, _Lent] = {}
        self._by_fd: dict[int, _Lent] = {}
        self._epoll = select.epoll()
        self._inflight: dict[int, _Lent] = {}
        self._deadlines: list[tuple[float, int]] = []
        self._streaming = False  # a message larger than a pipe is on the way in this wait
        #: index -> reason: lent envs that failed while idle, for the next request's ``faults``.
        self.idle_faults: dict[int, str] = {}
        #: [index, op, seconds left]: calls abandoned by a timed-out wait, for the next request's ``adopt``.
        self.abandoned: list[list] = []

    def __len__(self) -> int:
        return len(self._envs)

    def holds(self, index: int) -> bool:
        return index in self._envs

    # ------------------------------------------------------------------ lending
    def add(self, indices: Sequence[int], fds: Sequence[int]) -> None:
        """Take the lent envs ``indices`` with their ``(stdin, stdout)`` fds, in pairs."""
        for k, index in enumerate(indices):
            if index in self._envs:  # lent again without being taken back: keep the newest pipes
                self.release(index)
            env = _Lent(index, fds[2 * k], fds[2 * k + 1])
            if self.envs_per_sandbox > 1:
                env.serve_envs(self.envs_per_sandbox)
            self._envs[index] = env
            self._by_fd[env.stdout_r] = env
            self._epoll.register(env.stdout_r, select.EPOLLIN)

    def release(self, index: int) -> None:
        """Forget env ``index`` and close our copies of its pipes (the worker has its own)."""
        env = self._envs.pop(index, None)
        if env is None:
            return
        self._inflight.pop(index, None)
        for fd in (env.stdout_r, env.stdin_w):
            if self._by_fd.pop(fd, None) is not None:
                try:
                    self._epoll.unregister(fd)
                except (OSError, ValueError):
                    pass
            try:
                os.close(fd)
            except OSError:
                pass

    def close(self) -> None:
        for index in list(self._envs):
            self.release(index)
        self._epoll.close()

    def hand_back(self, index: int) -> None:
        """Let go of env ``index`` for the worker to take back with the next request; one caught
        mid-transfer (a request half written, a reply half read) is reported as a fault."""
        env = self._envs.get(index)
        if env is not None and env.mid_transfer:
            self._idle_fault(env, "the env's pipe held a partial message when the pool handed it back")
        self.release(index)

    # ------------------------------------------------------------------ calls
    def send(self, items: Sequence[tuple[int, int, dict, bytes]]) -> list[tuple[int, int, str, bool]]:
        """Write each ``(pos, index, op, request bytes)`` to its env; the calls that
        failed at once, as :meth:`wait` returns them. If this raises, every call sent so far
        is abandoned (see :meth:`abandon`)."""
        failed = []
        now, sent_at = time.monotonic(), time.perf_counter()
        self._streaming = False
        try:
            for pos, index, op, data in items:
                env = self._envs[index]
                if env.write_pending:
                    # It answered before reading all of its last request: the rest would be read as this one.
                    env.pos = pos
                    failed.append(self._fail(env, "the env answered before reading its whole request"))
                    continue
                self._write(env, pos, op, data, now, sent_at, failed)
        except BaseException:
            self.abandon(failed)
            raise
        return failed

    def _write(self, env: _Lent, pos: int, op: dict, data: bytes, now: float, sent_at: float, failed: list) -> None:
        env.pos, env.op = pos, op["op"]
        env.timeout = call_timeout(self._timeouts, op)
        env.sent_at, env.deadline = sent_at, now + env.timeout
        self._inflight[env.index] = env  # before writing: whatever happens, the call is accounted for
        self._push_deadline(env)
        try:
            done = env.write(data)
        except EnvFault as exc:
            failed.append(self._fail(env, exc.reason))
            return
        if not done:
            self._by_fd[env.stdin_w] = env
            self._epoll.register(env.stdin_w, select.EPOLLOUT)
            self._streaming = True

    def _push_deadline(self, env: _Lent) -> None:
        """Put ``env``'s deadline on the heap. Answered calls' entries stay there until their time
        passes; calls sent as others finish (send/recv) never empty the lane to clear it, so
        with many stale entries the heap is rebuilt from the calls in flight."""
        heap = self._deadlines
        if len(heap) > 4 * len(self._inflight) + 64:
            heap[:] = [(e.deadline, e.index) for e in self._inflight.values() if e is not env]
            heapq.heapify(heap)
        heapq.heappush(heap, (env.deadline, env.index))

    def wait(self, deadline: float) -> tuple[list[tuple[int, int, bytes, list]], list[tuple[int, int, str, bool]]]:
        """Collect every call in flight, or stop at ``deadline`` (``time.monotonic``).

        Returns ``(done, failed)``: ``(pos, index, reply line, payloads)`` per answered call,
        ``(pos, index, reason, straggler)`` per call whose env must be handed back to the
        worker (released here already). Calls still in flight at ``deadline`` move to
        :attr:`abandoned` and :class:`TimeoutError` is raised.
        """
        done: list = []
        failed: list = []
        try:
            self._gather(deadline, done, failed)
        except TimeoutError:
            raise
        except BaseException:  # a Ctrl-C, say: nothing may stay in flight unseen
            self.abandon(failed)
            raise
        return done, failed

    def collect(self, deadline: float) -> tuple[list[tuple[int, int, bytes, list]], list[tuple[int, int, str, bool]]]:
        """What :meth:`wait` returns, for the calls that finished by the first time any did (or by
        ``deadline``, ``time.monotonic``, when none has: then nothing); the others stay in flight.
        For calls sent at different times and collected as they finish
        (:mod:`~boltzlabs_gym.client.async_steps`)."""
        done: list = []
        failed: list = []
        try:
            self._gather(deadline, done, failed, first=True)
        except BaseException:
            self.abandon(failed)
            raise
        return done, failed

    @property
    def in_flight(self) -> int:
        """How many calls are in flight on the lane."""
        return len(self._inflight)

    def fileno(self) -> int:
        """The lane's epoll descriptor: readable while a lent env's pipe has something for
        :meth:`collect` (level-triggered), for an event loop to wait on."""
        return self._epoll.fileno()

    @property
    def next_deadline(self) -> float | None:
        """The earliest deadline (``time.monotonic``) of a call in flight, if any."""
        return self._deadlines[0][0] if self._inflight and self._deadlines else None

    def _gather(self, deadline: float, done: list, failed: list, first: bool = False) -> None:
        started = time.monotonic()
        while self._inflight:
            now = time.monotonic()
            failed += self._expire(now)
            if not self._inflight or first and (done or failed):
                break
            if now >= deadline and not first:
                self.abandon(failed)
                raise TimeoutError
            next_deadline = self._deadlines[0][0] if self._deadlines else deadline
            timeout = max(0.0, min(deadline, next_deadline) - now)
            may_nap = not first and done and len(self._inflight) > NAP_MIN_IN_FLIGHT and not self._streaming
            if may_nap and self._nap(now, started, len(done), timeout):
                timeout = 0.0  # read what came during the nap before any deadline is judged
            try:
                events = self._epoll.poll(timeout)
            except InterruptedError:
                continue
            for fd, _ev in events:
                env = self._by_fd.get(fd)
                if env is None:
                    continue
                if fd == env.stdin_w:
                    self._on_writable(env, failed)
                else:
                    self._on_readable(env, done, failed)
            if first and now >= deadline:
                return  # one look without waiting

    def _nap(self, now: float, started: float, answered: int, limit: float) -> bool:
        """Sleep through part of the expected wait for the calls still in flight (at most
        ``limit`` seconds); whether it slept.

        Woken for each reply as it comes, the pool would take a CPU from the envs a
        few hundred times per large batch, and each wake-up preempts the env that has just
        answered (measured with 256 envs on 2 vCPUs: 160 wake-ups per batch, a quarter more
        env CPU per step than when replies were gathered in rounds). Sleeping for a part of
        the time the rest should take, at the rate replies came so far, gathers them in
        rounds instead; with few calls left the lane blocks in epoll again. Not while a
        message larger than a pipe is on the way (its env waits for each pipe-full).
        """
        left = len(self._inflight)
        nap = min((now - started) / answered * left / NAP_ROUNDS, MAX_NAP_S, limit)
        if nap < MIN_NAP_S:
            return False
        time.sleep(nap)
        return True

    def check_idle(self) -> None:
        """Look for output from lent envs that nobody asked for (or a closed pipe) before a new call."""
        if not self._envs:
            return
        for fd, _ev in self._epoll.poll(0):
            env = self._by_fd.get(fd)
            if env is not None and env.pos < 0 and fd == env.stdout_r:
                self._on_readable(env, [], [])

    def _on_writable(self, env: _Lent, failed: list) -> None:
        try:
            flushed = env.flush()
        except EnvFault as exc:
            failed.append(self._fail(env, exc.reason))
            return
        if flushed:
            self._by_fd.pop(env.stdin_w, None)
            self._epoll.unregister(env.stdin_w)

    def _on_readable(self, env: _Lent, done: list, failed: list) -> None:
        """Read what ``env`` wrote, judged as the worker judges it (``Worker._on_env_event``):
        the first reply answers the call; a reply nobody asked for, or bytes left over after
        one, mean the env is handed back to be restarted, the answered call standing."""
        try:
            replies = env.read_replies()
        except EnvFault as exc:
            if env.pos < 0:
                self._idle_fault(env, exc.reason)
            else:
                failed.append(self._fail(env, exc.reason))
            return
        stray = env.partial_output and leftover_is_stray(bool(replies), env.pos < 0)
        if env.partial_output and not replies:
            self._streaming = True  # a reply larger than the pipe: keep reading as it comes
        for line, payloads in replies:
            if env.pos < 0:
                stray = True
                break
            done.append((env.pos, env.index, line, payloads))
            env.pos = -1
            del self._inflight[env.index]
        if stray:
            self._idle_fault(env, STRAY_OUTPUT)

    def _expire(self, now: float) -> list:
        failed = []
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            when, index = heapq.heappop(heap)
            env = self._inflight.get(index)
            if env is None or env.deadline != when:
                continue  # answered, or a later call's deadline
            waited = time.perf_counter() - env.sent_at
            reason = missed_deadline(env.timeout, env.op, waited)
            failed.append(self._fail(env, reason, straggler=is_straggler_op(env.op)))
        if not self._inflight:
            heap.clear()
        return failed

    def _fail(self, env: _Lent, reason: str, straggler: bool = False) -> tuple[int, int, str, bool]:
        pos = env.pos
        self.release(env.index)
        return pos, env.index, reason, straggler

    def _idle_fault(self, env: _Lent, reason: str) -> None:
        self.idle_faults[env.index] = reason
        self.release(env.index)

    def abandon(self, failed: Sequence[tuple[int, int, str, bool]] = ()) -> None:
        """Stop waiting: the calls in flight go to :attr:`abandoned`, the worker to adopt them
        with their deadlines (or, caught mid-transfer, to :attr:`idle_faults`), and ``failed``
        calls not reported yet to :attr:`idle_faults`: all with the next request."""
        for _pos, index, reason, _straggler in failed:
            self.idle_faults[index] = reason
        now = time.monotonic()
        for index, env in list(self._inflight.items()):
            if env.mid_transfer:
                self._idle_fault(env, "the pool stopped waiting with the env's request or reply half sent")
                continue
            self.abandoned.append([index, env.op, max(0.001, env.deadline - now)])
            self.release(index)
        self._deadlines.clear()
