"""Calls on a pool's envs from many threads (and coroutines) at once, each waiting only for its own env.

:class:`EnvCalls` owns a pool's send/recv (:mod:`~boltzlabs_gym.client.async_steps`) on a thread of
its own. :meth:`EnvCalls.submit` queues one call on one env and returns a
:class:`concurrent.futures.Future` of its :class:`~boltzlabs_gym.client.async_steps.Finished`; the
thread sends what was queued (everything queued meanwhile together, one message per worker), waits
on every env in flight at once and resolves each future as its env finishes. A slow env holds up
its own callers only; a coroutine awaits a call with ``asyncio.wrap_future``.

Calls on one env run one after another, in the order they were submitted (a call on an env that
is busy waits for it, not for the others); calls on different envs overlap. With
``envs_per_sandbox`` K > 1 a sandbox takes one call at a time: a call to an env whose sandbox
neighbour has one in flight waits for it (never an error), then goes out together with the
sandbox's other waiting calls. A future's callbacks run on the calls' thread, and may submit
again (the env of a resolved call is free then).

While an :class:`EnvCalls` runs, the pool's envs are its: the pool's lockstep calls (``step``,
``reset``, ``batch_async``) are refused while any of its calls is in flight. Close it before the
pool.

The lines of calls, the sandbox turns and the resolving are the
:class:`~boltzlabs_gym.client.call_queue.CallQueue`'s, which :mod:`boltzlabs_gym.aio` runs on an
event loop; here the thread runs it: submitted calls reach it through an inbox and a wake-up
pipe, and it waits with :meth:`AsyncSteps.pump <boltzlabs_gym.client.async_steps.AsyncSteps.pump>`.
"""

from __future__ import annotations

import concurrent.futures
import os
import select
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..errors import PoolClosedError
from ..wire.protocol import encode_header
from .call_queue import CallQueue

if TYPE_CHECKING:
    from .pool import RLPool

__all__ = ["EnvCalls", "drain"]

Item = tuple[int, dict, Sequence[bytes]]
_Call = tuple[concurrent.futures.Future, Item]


class EnvCalls:
    """Calls on the envs of ``pool`` from any thread, each answered as its env finishes (see the
    module doc). ``name`` names the thread. A context manager; :meth:`close` stops it."""

    def __init__(self, pool: RLPool, *, name: str = "boltzlabs-env-calls"):
        self.pool = pool
        self._steps = pool.async_steps
        # Driven by the thread alone; its flush comes each turn of the thread's loop.
        self._calls: CallQueue[concurrent.futures.Future] = CallQueue(
            self._steps, pool.envs_per_sandbox, wake=_nothing, new_future=concurrent.futures.Future
        )
        self._lock = threading.Lock()
        self._inbox: list[_Call] = []  # calls submitted, not yet taken by the thread
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._closed = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ asking
    def submit(self, index: int, op: dict, payloads: Sequence[bytes] = ()) -> concurrent.futures.Future:
        """Queue ``op`` on env ``index``; a future of its :class:`Finished` (an exception if the pool
        failed or closed first). The call cannot be cancelled: its env runs it whatever happens."""
        return self.submit_many([(index, op, payloads)])[0]

    def submit_many(self, items: Sequence[Item]) -> list[concurrent.futures.Future]:
        """:meth:`submit` for several ``(index, op, payloads)`` items, queued together (one message
        per worker where their envs are free). An env id out of range (``IndexError``) or an op that
        cannot be encoded is refused here, nothing queued."""
        calls: list[_Call] = []
        for index, op, payloads in items:
            if type(index) is not int or not 0 <= index < self.pool.n:
                raise IndexError(f"env id {index!r} out of range for a pool of {self.pool.n} envs")
            # Refused here, in its caller, not in a send that carries other callers' calls too.
            encode_header({"items": [[index, op, len(payloads)]]})
            future: concurrent.futures.Future = concurrent.futures.Future()
            future.set_running_or_notify_cancel()
            calls.append((future, (index, op, payloads)))
        with self._lock:
            self._check_usable()
            self._inbox.extend(calls)
        self._wake()
        return [future for future, _ in calls]

    @property
    def in_flight(self) -> int:
        """Calls submitted and not finished (sent, or waiting for their env)."""
        with self._lock:
            return len(self._inbox) + len(self._calls)

    def _check_usable(self) -> None:
        if self._error is not None:
            raise PoolClosedError(f"the pool's calls stopped: {type(self._error).__name__}: {self._error}")
        if self._closed:
            raise PoolClosedError("these EnvCalls are closed")

    def _wake(self) -> None:
        with self._lock:
            if self._wake_w < 0:
                return  # closed: the thread has stopped
            try:
                os.write(self._wake_w, b"x")
            except BlockingIOError:
                pass  # full: the thread wakes anyway

    # ------------------------------------------------------------------ the thread
    def _serve(self) -> None:
        """Take what was submitted, send what may go, wait for results (or a wake-up), resolve
        each call as it finishes."""
        steps, calls = self._steps, self._calls
        try:
            while True:
                with self._lock:  # (in_flight counts a call in the inbox or the queue, never both)
                    if self._closed:
                        break
                    inbox, self._inbox = self._inbox, []
                    for future, (index, op, payloads) in inbox:
                        calls.queue(future, index, op, payloads)
                calls.flush()
                if steps.in_flight:
                    steps.pump(time.monotonic() + 1.0, wake=self._wake_r)
                else:
                    select.select([self._wake_r], [], [], 1.0)
                drain(self._wake_r)
                calls.deliver()
        except BaseException as exc:  # noqa: BLE001 - the pool failed: every waiting call gets it
            with self._lock:
                self._error = exc
            self._fail_all(exc)
            return
        self._fail_all(_closed_error())

    def _fail_all(self, exc: BaseException) -> None:
        """Every call not finished fails with ``exc`` (on the thread, or once it stopped)."""
        with self._lock:
            inbox, self._inbox = self._inbox, []
        self._calls.fail_all(exc)
        for future, _ in inbox:
            if not future.done():
                future.set_exception(exc)

    # ------------------------------------------------------------------ closing
    def close(self, timeout: float = 10.0) -> None:
        """Stop the thread; calls not finished fail with :class:`~boltzlabs_gym.errors.PoolClosedError`
        (calls in flight stay with the pool, whose ``close`` drops them)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._wake()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)
        if self._thread is threading.current_thread() or not self._thread.is_alive():
            self._fail_all(_closed_error())  # (the thread does it too as it stops; a call fails once)
        if not self._thread.is_alive():
            with self._lock:
                os.close(self._wake_r)
                os.close(self._wake_w)
                self._wake_r = self._wake_w = -1

    def __enter__(self) -> EnvCalls:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _closed_error() -> PoolClosedError:
    return PoolClosedError("the pool's calls were closed before this call finished")


def _nothing() -> None:
    """The queue's wake-up: nothing to do, the thread flushes on each turn of its loop."""


def drain(fd: int) -> None:
    """Read a non-blocking wake-up pipe empty."""
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass
