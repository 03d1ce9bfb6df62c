"""Calls on a pool's envs from many threads (and coroutines) at once, each waiting only for its own env.

:class:`EnvCalls` owns a pool's send/recv (:mod:`~boltzlabs_gym.client.async_steps`) on a thread of
its own. :meth:`EnvCalls.submit` queues one call on one env and returns a
:class:`concurrent.futures.Future` of its :class:`~boltzlabs_gym.client.async_steps.Finished`; the
thread sends what was queued (everything queued meanwhile together, one message per worker), waits
on every env in flight at once and resolves each future as its env finishes. A slow env holds up
its own callers only; a coroutine awaits a call with ``asyncio.wrap_future``.

Calls on one env run one after another, in the order they were submitted (a call on an env that
is busy waits for it, not for the others); calls on different envs overlap. A future's callbacks
run on the calls' thread, and may submit again (the env of a resolved call is free then).

While an :class:`EnvCalls` runs, the pool's envs are its: the pool's lockstep calls (``step``,
``reset``, ``batch_async``) are refused while any of its calls is in flight. Close it before the
pool.
"""

from __future__ import annotations

import collections
import concurrent.futures
import os
import select
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..errors import PoolClosedError
from ..wire.protocol import encode_header
from .async_steps import Finished

if TYPE_CHECKING:
    from .pool import RLPool

__all__ = ["EnvCalls", "drain"]

Item = tuple[int, dict, Sequence[bytes]]
_Call = tuple[Item, concurrent.futures.Future]


class EnvCalls:
    """Calls on the envs of ``pool`` from any thread, each answered as its env finishes (see the
    module doc). ``name`` names the thread. A context manager; :meth:`close` stops it."""

    def __init__(self, pool: RLPool, *, name: str = "boltzlabs-env-calls"):
        self.pool = pool
        self._steps = pool.async_steps
        self._lock = threading.Lock()
        self._outbox: list[_Call] = []  # calls to send: each the first of its env's line
        self._lines: dict[int, collections.deque[_Call]] = {}  # env -> its calls not finished, in order
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
        calls = []
        for index, op, payloads in items:
            if type(index) is not int or not 0 <= index < self.pool.n:
                raise IndexError(f"env id {index!r} out of range for a pool of {self.pool.n} envs")
            # Refused here, in its caller, not in a send that carries other callers' calls too.
            encode_header({"items": [[index, op, len(payloads)]]})
            future: concurrent.futures.Future = concurrent.futures.Future()
            future.set_running_or_notify_cancel()
            calls.append(((index, op, payloads), future))
        with self._lock:
            self._check_usable()
            for call in calls:
                line = self._lines.setdefault(call[0][0], collections.deque())
                line.append(call)
                if len(line) == 1:  # the env is free: its call goes out now; else after the one before
                    self._outbox.append(call)
        self._wake()
        return [future for _, future in calls]

    @property
    def in_flight(self) -> int:
        """Calls submitted and not finished (sent, or waiting for their env)."""
        with self._lock:
            return sum(len(line) for line in self._lines.values())

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
        """Send what was queued, wait for results (or a wake-up), resolve each call as it finishes."""
        steps = self._steps
        try:
            while True:
                with self._lock:
                    if self._closed:
                        return
                    outbox, self._outbox = self._outbox, []
                if outbox:
                    self._send(outbox)
                if steps.in_flight:
                    steps.pump(time.monotonic() + 1.0, wake=self._wake_r)
                else:
                    select.select([self._wake_r], [], [], 1.0)
                drain(self._wake_r)
                while steps.finished:
                    self._resolve(steps.finished.popleft())
        except BaseException as exc:  # noqa: BLE001 - the pool failed: every waiting call gets it
            with self._lock:
                self._error = exc
            self._fail_all(exc)

    def _send(self, calls: list[_Call]) -> None:
        try:
            self._steps.send([item for item, _ in calls])
        except Exception as exc:  # noqa: BLE001 - the pool refused (closed, lost): these calls fail
            for (index, _, _), _future in calls:
                self._finish(index, exc)

    def _resolve(self, finished: Finished) -> None:
        self._finish(finished.result.index, finished)

    def _finish(self, index: int, outcome: Finished | BaseException) -> None:
        """Resolve env ``index``'s call in flight; its next call (if one waits) goes out next."""
        with self._lock:
            line = self._lines.get(index)
            if not line:
                return  # not ours (nothing waits on it)
            _, future = line.popleft()
            if line:
                self._outbox.append(line[0])
            else:
                del self._lines[index]
        if line:
            self._wake()
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            calls = [call for line in self._lines.values() for call in line]
            self._lines.clear()
            self._outbox = []
        for _, future in calls:
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
        self._fail_all(PoolClosedError("the pool's calls were closed before this call finished"))
        if not self._thread.is_alive():
            with self._lock:
                os.close(self._wake_r)
                os.close(self._wake_w)
                self._wake_r = self._wake_w = -1

    def __enter__(self) -> EnvCalls:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def drain(fd: int) -> None:
    """Read a non-blocking wake-up pipe empty."""
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass
