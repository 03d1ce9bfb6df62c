"""The engine under the per-env call faces (:mod:`boltzlabs_gym.aio`, :mod:`~boltzlabs_gym.client.env_calls`):
calls on a pool's envs, each resolved on its own future as its env finishes.

A :class:`CallQueue` owns:

* **the lines**: calls on one env run one after another, in the order they were queued; the first
  goes out, the others wait for it (a second call on a busy env is never refused);
* **the sandbox turns**: with ``envs_per_sandbox`` K > 1 a sandbox takes one call at a time, so a
  call to an env whose sandbox neighbour has one in flight waits for it, then goes out together
  with the sandbox's other waiting calls (one call to the sandbox);
* **the outbox**: what may go out now, sent by :meth:`CallQueue.flush` as one
  :meth:`AsyncSteps.send <boltzlabs_gym.client.async_steps.AsyncSteps.send>` (one message per
  worker);
* **resolution**: :meth:`CallQueue.deliver` hands each finished call to its future and lets the
  next calls of its env and its sandbox go out; a call the pool refused fails alone;
  :meth:`CallQueue.fail_all` fails every waiting call (the pool's I/O broke, the face closed);
* **cancellation**: :meth:`CallQueue.cancelled` drops a call that has not gone out (it never
  runs); one that has goes on in its env, its result going to a future of its own
  (:meth:`CallQueue.pending`).

It does no I/O of its own and holds no lock: a face drives it from one thread, and wakes it up in
its own way. :mod:`boltzlabs_gym.aio` runs it on the event loop (the outbox's wake-up is a
``call_soon`` of a flush; results are taken in when the pool's descriptors are readable, with
``add_reader`` and a timer); :class:`~boltzlabs_gym.client.env_calls.EnvCalls` runs it on a thread
of its own, which takes calls submitted from other threads through a wake-up pipe and waits with
:meth:`AsyncSteps.pump <boltzlabs_gym.client.async_steps.AsyncSteps.pump>`. The futures are the
face's: anything with ``set_result``, ``set_exception`` and ``done`` (:class:`asyncio.Future`,
:class:`concurrent.futures.Future`).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from typing import Any, Generic, Protocol, TypeVar

from .async_steps import AsyncSteps

__all__ = ["CallQueue", "ResultFuture"]

Item = tuple[int, dict, Sequence[bytes]]


class ResultFuture(Protocol):
    """What the queue needs of a future: :class:`asyncio.Future` and
    :class:`concurrent.futures.Future` both are one."""

    def set_result(self, result: Any, /) -> None: ...
    def set_exception(self, exception: BaseException, /) -> None: ...
    def done(self) -> bool: ...


F = TypeVar("F", bound=ResultFuture)


class CallQueue(Generic[F]):
    """Calls on the envs of ``steps`` (a pool's :class:`~boltzlabs_gym.client.async_steps.AsyncSteps`),
    K = ``envs_per_sandbox`` envs per sandbox (see the module doc).

    ``wake`` is called when the outbox, empty, receives a call: the face arranges a
    :meth:`flush`. ``new_future`` makes the future that takes the result of a call whose caller
    was cancelled after it went out (:meth:`cancelled`).
    """

    def __init__(
        self,
        steps: AsyncSteps,
        envs_per_sandbox: int,
        *,
        wake: Callable[[], object],
        new_future: Callable[[], F],
    ):
        self.steps = steps
        self.wake = wake
        self.new_future = new_future
        #: Set: :meth:`queue` raises it (the face closed, or the pool's I/O broke).
        self.refusal: BaseException | None = None
        self._k = envs_per_sandbox
        self._heads: dict[int, F] = {}  # env -> the future of its first call not finished (out, or to go)
        self._lines: dict[int, collections.deque[tuple[Item, F]]] = {}  # env -> its calls behind that one
        self._outbox: list[Item] = []  # the calls that go out with the next flush
        self._sandbox_calls: dict[int, int] = {}  # sandbox -> its envs in flight (K > 1)
        self._turns: dict[int, list[Item]] = {}  # sandbox -> calls waiting for it to be free (K > 1)

    # ------------------------------------------------------------------ asking
    def queue(self, future: F, env_id: int, op: dict, frames: Sequence[bytes] = ()) -> None:
        """Queue ``op`` (with its payload ``frames``) on ``env_id``, to resolve ``future`` with its
        :class:`~boltzlabs_gym.client.async_steps.Finished`: it goes out with the next flush,
        unless its env or its sandbox is busy (then when they are free). Raises :attr:`refusal`."""
        if self.refusal is not None:
            raise self.refusal
        if self._heads.setdefault(env_id, future) is not future:  # the env is busy: wait in its line
            self._lines.setdefault(env_id, collections.deque()).append(((env_id, op, frames), future))
            return
        if not self._outbox:
            self.wake()
        self._outbox.append((env_id, op, frames))

    def pending(self, env_id: int) -> F | None:
        """The future of ``env_id``'s first call not finished, if it has one."""
        return self._heads.get(env_id)

    def __len__(self) -> int:
        """Calls queued and not finished (safe to read from another thread)."""
        return len(self._heads) + sum(len(line) for line in list(self._lines.values()))

    def cancelled(self, env_id: int, future: F) -> None:
        """The caller of ``env_id``'s call resolving ``future`` was cancelled: a call that has not
        gone out is dropped (it never runs, its env is as it was); one that has goes on, its
        result going to a new future (:meth:`pending`)."""
        if self._heads.get(env_id) is not future:  # over, or waiting behind another call of its env
            line = self._lines.get(env_id)
            if line:
                for pos, (_, waiting) in enumerate(line):
                    if waiting is future:
                        del line[pos]  # (by place: an equality test would compare payloads)
                        break
                if not line:
                    del self._lines[env_id]
            return
        if self._unqueue(env_id):
            del self._heads[env_id]
            self._next_of([env_id])
        else:
            # It runs on in its env; no shield per call (a second future and a loop tick): a new
            # future takes the result.
            self._heads[env_id] = self.new_future()

    def _unqueue(self, env_id: int) -> bool:
        """Take ``env_id``'s call out of the outbox or its sandbox's turn; whether it was there."""
        waiting = self._turns.get(env_id // self._k) if self._k > 1 else None
        for calls in (self._outbox, waiting):
            if calls:
                for pos, item in enumerate(calls):
                    if item[0] == env_id:
                        del calls[pos]
                        return True
        return False

    # ------------------------------------------------------------------ sending
    def flush(self) -> bool:
        """Send the outbox (calls to a busy sandbox wait for it); whether anything was sent or
        tried (a refused send fails its calls, each alone). Returns once they went out: a send
        waits on no env."""
        outbox, self._outbox = self._outbox, []
        if self._k > 1:
            outbox = self._take_turns(outbox)
        if not outbox:
            return False
        failure = self.refusal
        if failure is None:
            try:
                self.steps.send(outbox)
                return True
            except Exception as exc:  # noqa: BLE001 - each of those callers gets the error
                failure = exc
        self._fail_calls([env_id for env_id, _, _ in outbox], failure)
        return True

    def _take_turns(self, outbox: list[Item]) -> list[Item]:
        """The calls that may go out now; the others (an env whose sandbox has a call in flight:
        ``AsyncSteps.send`` refuses those) wait for that call to finish, then go out together
        (:meth:`_sandboxes_done`). Calls to one idle sandbox in one flush go out together, as one
        call."""
        k, busy, going = self._k, self._sandbox_calls, []
        for item in outbox:
            sandbox = item[0] // k
            if sandbox in busy:
                self._turns.setdefault(sandbox, []).append(item)
            else:
                going.append(item)
        for item in going:
            sandbox = item[0] // k
            busy[sandbox] = busy.get(sandbox, 0) + 1
        return going

    # ------------------------------------------------------------------ resolving
    def deliver(self) -> None:
        """Hand every finished call (the pool's ``finished``) to its future; the calls that waited
        for those envs and sandboxes go out with the next flush. A result nobody waits for
        (a call that is not this queue's) is dropped."""
        steps_finished = self.steps.finished
        finished = list(steps_finished)
        steps_finished.clear()
        heads = self._heads
        for f in finished:
            future = heads.pop(f.result.index, None)
            if future is not None and not future.done():
                future.set_result(f)
        # After the results: an event loop's callers they wake make their next calls before the
        # flush that sends the waiting ones, and go out with them.
        if self._lines:
            self._next_of([f.result.index for f in finished])
        if self._k > 1:
            self._sandboxes_done([f.result.index for f in finished])

    def _fail_calls(self, env_ids: list[int], exc: BaseException) -> None:
        """The calls of ``env_ids`` that were to go out fail with ``exc``; their envs' next calls
        and their sandboxes' turns go on."""
        for env_id in env_ids:
            future = self._heads.pop(env_id, None)
            if future is not None and not future.done():
                future.set_exception(exc)
        if self._lines:
            self._next_of(env_ids)
        if self._k > 1:
            self._sandboxes_done(env_ids)

    def _next_of(self, env_ids: Sequence[int]) -> None:
        """The next call of each of ``env_ids`` that has no call left, if one waits, goes out next."""
        lines, heads, outbox = self._lines, self._heads, self._outbox
        for env_id in env_ids:
            if env_id in heads:
                continue  # its call before is not over (a placeholder of a cancelled one, say)
            line = lines.get(env_id)
            if line is None:
                continue
            item, future = line.popleft()
            if not line:
                del lines[env_id]
            heads[env_id] = future
            if not outbox:
                self.wake()
            outbox.append(item)

    def _sandboxes_done(self, env_ids: Sequence[int]) -> None:
        """``env_ids``' calls are over (delivered or failed): a sandbox with none left in flight
        takes the calls that waited for it, with the next flush."""
        k, busy = self._k, self._sandbox_calls
        for env_id in env_ids:
            sandbox = env_id // k
            left = busy.get(sandbox, 0) - 1
            if left > 0:
                busy[sandbox] = left
                continue
            busy.pop(sandbox, None)
            waiting = self._turns.pop(sandbox, None)
            if waiting:
                if not self._outbox:
                    self.wake()
                self._outbox.extend(waiting)

    def fail_all(self, exc: BaseException) -> None:
        """Every call not finished fails with ``exc``, nothing more goes out (the pool's I/O broke,
        or the face closed); calls in flight stay with the pool."""
        futures = list(self._heads.values())
        futures.extend(future for line in self._lines.values() for _, future in line)
        self._heads.clear()
        self._lines.clear()
        self._outbox.clear()
        self._turns.clear()
        self._sandbox_calls.clear()
        for future in futures:
            if not future.done():
                future.set_exception(exc)
