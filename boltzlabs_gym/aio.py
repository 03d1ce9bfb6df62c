"""asyncio: each coroutine owns one env at a time and awaits its own steps.

>>> import asyncio                                                      # doctest: +SKIP
>>> from boltzlabs_gym.aio import AsyncPool                            # doctest: +SKIP
>>> async def rollout(pool, seed):
...     async with pool.env() as env:            # waits while every env is taken
...         obs, info = await env.reset(seed=seed)
...         obs, reward, terminated, truncated, info = await env.step(1)
...         return reward
>>> async def main():
...     async with AsyncPool("./envs/counter", n=64) as pool:
...         return await asyncio.gather(*(rollout(pool, s) for s in range(1000)))
>>> asyncio.run(main())                                                 # doctest: +SKIP

How it works: an await puts its call in a queue (a :class:`~boltzlabs_gym.client.call_queue.CallQueue`,
the engine :class:`~boltzlabs_gym.client.env_calls.EnvCalls` runs on a thread) and returns to the
event loop; the calls queued in one loop tick go out together, one message per worker, through the
pool's send/recv (:mod:`boltzlabs_gym.client.async_steps`). There is no thread: the event loop
itself sends them (a send never waits on an env: a message to a worker, a few bytes to each lent
env's pipe) and watches the pool's descriptors (:meth:`AsyncSteps.watched_fds
<boltzlabs_gym.client.async_steps.AsyncSteps.watched_fds>`) with ``add_reader``, plus a timer for
the soonest deadline or heartbeat. When one is readable it takes in what finished, without
waiting, and hands each result to its coroutine's future, so a slow env holds up only the
coroutine that owns it. An :class:`AsyncPool` belongs to the event loop it was first used in.

* With ``envs_per_sandbox`` K > 1 a sandbox takes one call at a time: a call to an env whose
  sandbox neighbour has one in flight waits its turn (never an error) and goes out when that
  call finished, together with the sandbox's other waiting calls and that tick's calls. A
  coroutine cancelled while its call waits drops the call: it never runs.
* Taking an env (:meth:`AsyncPool.env`) waits, up to ``acquire_timeout``, while all ``n`` are in
  use: thousands of coroutines share a pool of ``n`` envs.
* A straggler or a crash is **reported**, not raised, and only to its own coroutine: its step
  returns ``truncated=True`` with ``info["boltzlabs_straggler"]`` or ``info["boltzlabs_error"]``
  (the env is respawned; reset it before stepping again), as :meth:`RLPool.step
  <boltzlabs_gym.client.pool.RLPool.step>` reports it in that env's slot.
* A coroutine cancelled mid-step leaves its env to finish that step, then to be reset, then back
  in the pool. Every owner resets its env before stepping it (a step before that is refused),
  so an env released mid-episode goes back as it is.
* An env held longer than ``hold_warning`` seconds warns (``ResourceWarning``) naming it: a
  coroutine that never releases its env shrinks the pool for everyone.

``AsyncPool(vec_env)`` runs over a :class:`~boltzlabs_gym.BoltzLabsVecEnv` (from
:func:`boltzlabs_gym.make_vec`): observations and infos then come decoded into its spaces, and
the vector env stays owned by its caller.
"""

from __future__ import annotations

import asyncio
import functools
import os
import sys
import time
import warnings
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from typing_extensions import Unpack

from .client.async_steps import Finished
from .client.call_queue import CallQueue
from .client.options import PoolOptions, PoolSettings
from .client.pool import RLPool
from .client.results import read_reset, read_step
from .client.sources import WorkerSource
from .errors import AsyncStateError, PoolClosedError, WorkerTimeout

if TYPE_CHECKING:
    from .vector.step_batch import StepBatch

__all__ = ["AsyncEnv", "AsyncPool"]


class AsyncEnv:
    """One env, owned by the coroutine inside ``async with pool.env() as env``."""

    def __init__(self, pool: AsyncPool, env_id: int):
        self._pool = pool
        #: The env's index in the pool.
        self.env_id = env_id
        self._taken_at = time.monotonic()
        self.needs_reset = True

    async def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[Any, dict]:
        """Reset the env: ``(obs, info)``."""
        op: dict = {"op": "reset", "seed": seed}
        if options:
            op["options"] = options
        finished = await self._pool._call(self.env_id, op)
        obs, info, failure = self._pool._read_reset(finished)
        self.needs_reset = failure is not None
        return obs, info

    async def step(self, action: Any) -> tuple[Any, float, bool, bool, dict]:
        """Step the env: ``(obs, reward, terminated, truncated, info)``; a straggler or crash is
        reported in ``info`` with ``truncated=True`` (see the module doc)."""
        if self.needs_reset:
            raise AsyncStateError(f"env {self.env_id}: reset() it before step() (its episode is over or unstarted)")
        pool = self._pool
        calls = pool._calls
        future = pool._loop.create_future()  # type: ignore[union-attr]
        # The op is not kept in a local: held while the step is out, 1000 of them would fill the
        # collector's youngest generation and run it several times as often.
        if pool._step_batch is None:
            calls.queue(future, self.env_id, {"op": "step", "action": action})
        else:
            obj, frames = pool._step_batch.encode_action(self.env_id, action)
            calls.queue(future, self.env_id, {"op": "step", "action": obj}, frames)
            del obj, frames
        try:  # awaited here, not in a coroutine of the pool's: a frame less on every step
            finished = await future
        except asyncio.CancelledError:
            calls.cancelled(self.env_id, future)
            raise
        obs, reward, terminated, truncated, info = self._pool._read_step(finished)
        self.needs_reset = terminated or truncated
        return obs, reward, terminated, truncated, info


class AsyncPool:
    """An asyncio face over a pool: ``AsyncPool(env_dir, n=...)`` starts an :class:`RLPool`
    (``workers``, ``options`` and the keyword settings as its), ``AsyncPool(pool)`` or
    ``AsyncPool(vec_env)`` uses one that exists (and takes no settings).

    ``acquire_timeout``: how long :meth:`env` waits for a free env (``TimeoutError`` after);
    ``hold_warning``: seconds after which an env still held warns.

    It is bound to the running event loop it is first used in (``async with``, :meth:`env`): its
    sends and receives run on that loop, never in a thread, and never block it; used from
    another loop it raises ``RuntimeError``.
    """

    def __init__(
        self,
        source: str | os.PathLike | RLPool | Any,
        n: int | None = None,
        *,
        acquire_timeout: float | None = 600.0,
        hold_warning: float = 600.0,
        workers: Sequence[str] | WorkerSource | None = None,
        options: PoolOptions | None = None,
        **settings: Unpack[PoolSettings],
    ):
        from .vector import BoltzLabsVecEnv

        # Over a BoltzLabsVecEnv, its step batch encodes actions and reads results in its spaces.
        self._step_batch: StepBatch | None = None
        self._owns = False
        exists = isinstance(source, (RLPool, BoltzLabsVecEnv))
        given = [name for name, value in (("n", n), ("workers", workers), ("options", options)) if value is not None]
        if exists and (given or settings):
            raise TypeError(
                f"AsyncPool(pool) drives a pool as it was built: pass {given + sorted(settings)} with an env "
                "directory instead"
            )
        if isinstance(source, RLPool):
            pool = source
        elif isinstance(source, BoltzLabsVecEnv):
            self._step_batch, pool = source._batch, source.pool
        else:
            if n is None:
                raise ValueError("AsyncPool(env_dir, n=...) needs n, the number of envs")
            pool_options = PoolOptions.fold(options, settings)
            pool, self._owns = RLPool(source, n, workers=workers, options=pool_options), True
        self.pool = pool
        self.acquire_timeout = acquire_timeout
        self.hold_warning = hold_warning
        self._steps = pool.async_steps
        # The calls, their lines and sandbox turns: woken by the loop (see _start and _watch).
        self._calls: CallQueue[asyncio.Future] = CallQueue(
            pool.async_steps, pool.envs_per_sandbox, wake=_not_started, new_future=_not_started
        )
        self._free: asyncio.Queue[int] | None = None
        self._held: dict[int, AsyncEnv] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        # The loop waits on the pool's descriptors itself (see _watch).
        self._watched: set[int] = set()  # descriptors with a reader on the loop
        self._wakeup: asyncio.TimerHandle | None = None  # the timer for the soonest deadline or heartbeat
        self._wakeup_at = 0.0  # its time.monotonic()
        self._take_due = False  # a _take_results is scheduled with call_soon and has not run
        self._hold_timer: asyncio.TimerHandle | None = None
        self._closed = False
        self._releasing: set[asyncio.Future] = set()  # envs being reset before they go back
        self._waiting = 0  # coroutines waiting in env() for a free env

    # ------------------------------------------------------------------ life
    async def __aenter__(self) -> AsyncPool:
        self._start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def _start(self) -> None:
        if self._loop is not None:
            if self._loop is not asyncio.get_running_loop():
                raise RuntimeError(
                    "this AsyncPool belongs to another event loop (the one it was first used in); "
                    "make one AsyncPool per loop, e.g. inside the coroutine that asyncio.run() runs"
                )
            return
        self._loop = loop = asyncio.get_running_loop()
        self._calls.wake = functools.partial(loop.call_soon, self._flush)  # what is queued in a tick goes out together
        self._calls.new_future = loop.create_future
        self._free = asyncio.Queue()
        for i in range(self.pool.n):
            self._free.put_nowait(i)
        self._hold_timer = self._loop.call_later(self._hold_period(), self._check_holds)

    async def aclose(self) -> None:
        """Let released envs finish their resets, stop watching the pool, collect what is still in
        flight (so that a pool passed in is left idle); close the pool if this face started it.
        Envs still held warn. After the pool's I/O broke (a worker lost) nothing more is
        collected: the pool's own close reports what it drops."""
        if self._closed:
            return
        if self._releasing:
            await asyncio.wait(set(self._releasing), timeout=self.pool.step_timeout + self.pool.reset_timeout)
        self._closed = True
        broken = self._calls.refusal is not None
        self._calls.refusal = PoolClosedError("this AsyncPool is closed")
        if self._loop is not None:
            self._unwatch()
            if self._hold_timer is not None:
                self._hold_timer.cancel()
            if not broken:
                # Nothing on the loop touches the pool now: a thread may wait for the rest.
                await asyncio.to_thread(self._drop_unreceived)
        self._calls.fail_all(PoolClosedError("the AsyncPool closed while this step was in flight"))
        if self._held:
            warnings.warn(
                f"AsyncPool closed with envs {sorted(self._held)[:8]} still held by coroutines",
                ResourceWarning,
                stacklevel=2,
            )
        if self._owns:
            self.pool.close()

    def _drop_unreceived(self) -> None:
        """Wait for the calls still in flight (cancelled or abandoned steps) and drop their results."""
        steps = self._steps
        if steps.in_flight:
            try:
                steps.recv(None, self.pool.step_timeout + self.pool.reset_timeout)
            except WorkerTimeout:
                pass  # the pool's own close reports what it drops
        steps.finished.clear()

    # ------------------------------------------------------------------ taking envs
    @asynccontextmanager
    async def env(self) -> AsyncIterator[AsyncEnv]:
        """Take a free env for the ``async with`` block (waiting up to ``acquire_timeout`` while
        all are in use); it goes back when the block ends (after a cancelled step, once that
        step finished and the env was reset). Each owner resets its env before stepping it."""
        self._start()
        assert self._free is not None
        try:
            # A free env nobody waits for is taken at once; otherwise wait in line, so that
            # waiting coroutines are served first, in order.
            if self._waiting == 0 and not self._free.empty():
                env_id = self._free.get_nowait()
            else:
                self._waiting += 1
                try:
                    env_id = await self._next_free()
                finally:
                    self._waiting -= 1
        except asyncio.TimeoutError:
            held = sorted(self._held, key=lambda i: self._held[i]._taken_at)
            raise TimeoutError(
                f"no free env within {self.acquire_timeout} s: all {self.pool.n} are held "
                f"(longest held: env {held[0] if held else '?'}); release envs sooner or use a larger pool"
            ) from None
        env = self._held[env_id] = AsyncEnv(self, env_id)
        try:
            yield env
        finally:
            del self._held[env_id]
            self._release(env)

    async def _next_free(self) -> int:
        """The next free env, waiting up to ``acquire_timeout`` (``asyncio.timeout`` where there is
        one: ``wait_for`` costs a task per call, and every take waits while coroutines outnumber envs)."""
        assert self._free is not None
        if self.acquire_timeout is None:
            return await self._free.get()
        if sys.version_info >= (3, 11):
            async with asyncio.timeout(self.acquire_timeout):
                return await self._free.get()
        return await asyncio.wait_for(self._free.get(), self.acquire_timeout)  # pragma: no cover - 3.10

    def _release(self, env: AsyncEnv) -> None:
        """Give the env back: at once, unless a step was cancelled: then once that step has
        finished and the env was reset. (Its next owner resets it before stepping anyway: an
        :class:`AsyncEnv` refuses a step before its first reset, so a reset here would only
        cost a round trip.)"""
        assert self._free is not None
        env_id = env.env_id
        pending = self._calls.pending(env_id)
        if pending is None:
            self._free.put_nowait(env_id)
            return

        async def reset_then_free() -> None:
            try:
                await asyncio.wait([pending])
                await self._call(env_id, {"op": "reset", "seed": None})
            except Exception:  # noqa: BLE001 - the env goes back anyway; its next owner resets it
                pass
            if self._free is not None:
                self._free.put_nowait(env_id)

        task = asyncio.ensure_future(reset_then_free())
        self._releasing.add(task)
        task.add_done_callback(self._releasing.discard)

    # ------------------------------------------------------------------ calls
    async def _call(self, env_id: int, op: dict) -> Finished:
        calls = self._calls
        future = self._loop.create_future()  # type: ignore[union-attr]
        calls.queue(future, env_id, op)
        try:
            return await future
        except asyncio.CancelledError:
            calls.cancelled(env_id, future)
            raise

    def _flush(self) -> None:
        """Send what was queued (a send returns once it went out, waiting on no env), then watch
        for the results (after a refused send too: one to several workers may have gone out in
        part)."""
        calls = self._calls
        if calls.flush() and calls.refusal is None:
            self._after_io()

    # ------------------------------------------------------------------ results, on the loop
    def _take_results(self) -> None:
        """Take in what finished, never waiting (a watched descriptor is readable, a deadline or
        heartbeat is due, or a reply waits unsignalled), and hand it to the coroutines."""
        self._take_due = False
        if self._calls.refusal is not None:  # closed, or broken
            return
        try:
            self._steps.take_ready(time.monotonic())
        except Exception as exc:  # noqa: BLE001 - reported to every waiting coroutine
            self._break(exc)
            return
        if self._steps.finished:
            self._calls.deliver()
        self._after_io()

    def _on_wakeup(self) -> None:
        self._wakeup = None
        self._take_results()

    def _after_io(self) -> None:
        """After a send or a take: take again soon if a reply waits that no descriptor will
        signal (ZeroMQ's descriptor signals a change only, and any send or receive on the socket
        may take that change in; pyzmq's asyncio sockets do the same), then watch what is in
        flight."""
        try:
            waiting = self._steps.reply_waiting()
        except Exception as exc:  # noqa: BLE001 - reported to every waiting coroutine
            self._break(exc)
            return
        if waiting and not self._take_due:
            self._take_due = True
            self._loop.call_soon(self._take_results)  # type: ignore[union-attr]
        self._watch()

    def _watch(self) -> None:
        """Have the loop wait on the descriptors of the calls in flight, and until the soonest
        lane deadline (a straggler is killed on time) or worker heartbeat."""
        loop, steps = self._loop, self._steps
        assert loop is not None
        fds = steps.watched_fds()
        if fds != self._watched:
            for fd in self._watched - fds:
                loop.remove_reader(fd)
            for fd in fds - self._watched:
                loop.add_reader(fd, self._take_results)
            self._watched = fds
        now = time.monotonic()
        due = steps.next_wakeup(now)
        # A timer set for later than needed is moved; one set sooner stays (it finds nothing
        # and sets the next): no new timer per tick while calls keep finishing.
        if due is not None and (self._wakeup is None or due < self._wakeup_at):
            if self._wakeup is not None:
                self._wakeup.cancel()
            self._wakeup = loop.call_later(max(0.0, due - now), self._on_wakeup)
            self._wakeup_at = due

    def _unwatch(self) -> None:
        loop = self._loop
        assert loop is not None
        for fd in self._watched:
            loop.remove_reader(fd)
        self._watched = set()
        if self._wakeup is not None:
            self._wakeup.cancel()
            self._wakeup = None

    def _break(self, exc: BaseException) -> None:
        """The pool's I/O failed (a worker lost, say): every waiting coroutine gets ``exc``, and
        every later call raises it."""
        self._calls.refusal = exc
        self._unwatch()
        self._calls.fail_all(exc)

    def _hold_period(self) -> float:
        return min(1.0, self.hold_warning / 4)

    def _check_holds(self) -> None:
        """Warn about envs held past ``hold_warning``; a timer, a few times per period (a pool may
        have thousands held)."""
        if self._closed:
            return
        # First: a warning turned into an error must not stop the checks.
        self._hold_timer = self._loop.call_later(self._hold_period(), self._check_holds)  # type: ignore[union-attr]
        now = time.monotonic()
        for env in list(self._held.values()):
            if now - env._taken_at > self.hold_warning:
                env._taken_at = now  # once per period
                warnings.warn(
                    f"env {env.env_id} has been held by one coroutine for over {self.hold_warning:g} s; "
                    "a coroutine that never leaves `async with pool.env()` keeps it from the others",
                    ResourceWarning,
                    stacklevel=1,
                )

    # ------------------------------------------------------------------ reading
    def _read_reset(self, f: Finished):
        if self._step_batch is not None:
            return self._step_batch.read_reset(f.result, self.pool.reset_timeout)
        return read_reset(f.result, self.pool.reset_timeout)

    def _read_step(self, f: Finished):
        if self._step_batch is not None:
            t = self._step_batch.read_step(f.result, self.pool.step_timeout)
        else:
            t = read_step(f.result, self.pool.step_timeout)
        return t.obs, t.reward, t.terminated, t.truncated, t.info


def _not_started() -> Any:
    raise RuntimeError("this AsyncPool is not started: use it inside `async with` or pool.env()")
