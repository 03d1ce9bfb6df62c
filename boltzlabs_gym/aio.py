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

How it works: an await puts its call in a queue and returns to the event loop; the calls queued
in one loop tick go out together, one message per worker, through the pool's send/recv
(:mod:`boltzlabs_gym.client.async_steps`). There is no thread: the event loop itself sends them
(a send never waits on an env: a message to a worker, a few bytes to each lent env's pipe) and
watches the pool's descriptors (:meth:`AsyncSteps.watched_fds
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
import os
import sys
import time
import warnings
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

from typing_extensions import Unpack

from .client.async_steps import Finished
from .client.options import PoolOptions, PoolSettings
from .client.pool import RLPool
from .client.results import read_reset, read_step
from .client.sources import WorkerSource
from .errors import AsyncStateError, PoolClosedError, WorkerTimeout

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
        future = pool._queue(self.env_id, {"op": "step", "action": action}, payload_of=action)
        try:  # awaited here, not in a coroutine of the pool's: a frame less on every step
            finished = await future
        except asyncio.CancelledError:
            pool._cancelled(self.env_id, future)
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
        self._vec: Any = None  # a BoltzLabsVecEnv, whose spaces decode observations
        self._owns = False
        exists = isinstance(source, RLPool) or (hasattr(source, "pool") and hasattr(source, "single_observation_space"))
        given = [name for name, value in (("n", n), ("workers", workers), ("options", options)) if value is not None]
        if exists and (given or settings):
            raise TypeError(
                f"AsyncPool(pool) drives a pool as it was built: pass {given + sorted(settings)} with an env "
                "directory instead"
            )
        if isinstance(source, RLPool):
            pool = source
        elif hasattr(source, "pool") and hasattr(source, "single_observation_space"):
            self._vec, pool = source, source.pool
        else:
            if n is None:
                raise ValueError("AsyncPool(env_dir, n=...) needs n, the number of envs")
            pool_options = PoolOptions.fold(options, settings)
            pool, self._owns = RLPool(source, n, workers=workers, options=pool_options), True
        self.pool = pool
        self.acquire_timeout = acquire_timeout
        self.hold_warning = hold_warning
        self._steps = pool.async_steps
        self._free: asyncio.Queue[int] | None = None
        self._held: dict[int, AsyncEnv] = {}
        self._queued: list[tuple[int, dict, Sequence[bytes]]] = []
        self._futures: dict[int, asyncio.Future] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        # The loop waits on the pool's descriptors itself (see _watch).
        self._watched: set[int] = set()  # descriptors with a reader on the loop
        self._wakeup: asyncio.TimerHandle | None = None  # the timer for the soonest deadline or heartbeat
        self._wakeup_at = 0.0  # its time.monotonic()
        self._take_due = False  # a _take_results is scheduled with call_soon and has not run
        self._hold_timer: asyncio.TimerHandle | None = None
        self._closed = False
        self._io_error: BaseException | None = None  # what broke the pool's I/O: every later call raises it
        self._releasing: set[asyncio.Future] = set()  # envs being reset before they go back
        self._waiting = 0  # coroutines waiting in env() for a free env
        # Several envs per sandbox: a sandbox takes one call at a time, so a call to an env whose
        # sandbox has one in flight waits here for its turn (see _hold_for_busy_sandboxes).
        self._k = pool.envs_per_sandbox
        self._sandbox_calls: dict[int, int] = {}  # sandbox -> its envs in flight (sent, not delivered)
        self._turns: dict[int, list[tuple[int, dict, Sequence[bytes]]]] = {}  # sandbox -> calls waiting

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
        self._loop = asyncio.get_running_loop()
        self._free = asyncio.Queue()
        for i in range(self.pool.n):
            self._free.put_nowait(i)
        self._hold_timer = self._loop.call_later(self._hold_period(), self._check_holds)

    async def aclose(self) -> None:
        """Let released envs finish their resets, stop watching the pool, collect what is still in
        flight (so that a pool passed in is left idle); close the pool if this face started it.
        Envs still held warn."""
        if self._closed:
            return
        if self._releasing:
            await asyncio.wait(set(self._releasing), timeout=self.pool.step_timeout + self.pool.reset_timeout)
        self._closed = True
        if self._loop is not None:
            self._unwatch()
            if self._hold_timer is not None:
                self._hold_timer.cancel()
            # Nothing on the loop touches the pool now: a thread may wait for the rest.
            await asyncio.to_thread(self._drop_unreceived)
        for future in self._futures.values():
            if not future.done():
                future.set_exception(PoolClosedError("the AsyncPool closed while this step was in flight"))
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
        pending = self._futures.get(env_id)
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
    async def _call(self, env_id: int, op: dict, payload_of: Any = None) -> Finished:
        future = self._queue(env_id, op, payload_of)
        try:
            return await future  # _deliver/_fail take it out of _futures before they set it
        except asyncio.CancelledError:
            self._cancelled(env_id, future)
            raise

    def _queue(self, env_id: int, op: dict, payload_of: Any = None) -> asyncio.Future:
        """Queue ``op`` for ``env_id`` (it goes out with this tick's flush); the future its
        result will be set on."""
        if self._closed:
            raise PoolClosedError("this AsyncPool is closed")
        if self._io_error is not None:
            raise self._io_error
        loop = self._loop
        assert loop is not None
        if self._vec is not None and op["op"] == "step":
            obj, payloads = self._vec._encode_action(env_id, payload_of)
            op, frames = {"op": "step", "action": obj}, payloads
        else:
            frames = ()
        future = loop.create_future()
        if not self._queued:
            loop.call_soon(self._flush)  # everything queued in this tick goes out together
        self._queued.append((env_id, op, frames))
        self._futures[env_id] = future
        return future

    def _cancelled(self, env_id: int, future: asyncio.Future) -> None:
        """The coroutine awaiting ``future`` (``env_id``'s call) was cancelled."""
        if self._futures.get(env_id) is not future:
            return  # _deliver/_fail took it out of _futures: the call is over
        if self._k > 1 and self._drop_waiting_call(env_id):
            del self._futures[env_id]  # it never went out: the env is as it was
        else:
            # The step goes on in its env: its result goes to a future that _release waits on
            # (no asyncio.shield per call, which costs a second future and a loop tick).
            self._futures[env_id] = self._loop.create_future()  # type: ignore[union-attr]

    def _flush(self) -> None:
        """Send this tick's calls (a send returns once they went out, waiting on no env), then
        watch for their results."""
        queued, self._queued = self._queued, []
        if self._k > 1:
            queued = self._hold_for_busy_sandboxes(queued)
        if not queued:
            return
        failure = self._io_error
        if failure is None and self._closed:
            failure = PoolClosedError("the AsyncPool closed before this call went out")
        if failure is None:
            try:
                self._steps.send(queued)
            except Exception as exc:  # noqa: BLE001 - each of those coroutines gets the error
                failure = exc
        if failure is not None:
            self._fail([env_id for env_id, _, _ in queued], failure)
        if self._io_error is None and not self._closed:
            self._after_io()  # (after a refused send too: one to several workers may have gone out in part)

    def _hold_for_busy_sandboxes(self, queued: list) -> list:
        """The calls that may go out now; the others (an env whose sandbox has a call in flight:
        :meth:`AsyncSteps.send <boltzlabs_gym.client.async_steps.AsyncSteps.send>` refuses
        those) wait for that call to finish, then go out together (:meth:`_sandboxes_done`).
        Calls to one idle sandbox in one tick go out together, as one call."""
        k, busy, going = self._k, self._sandbox_calls, []
        for item in queued:
            sandbox = item[0] // k
            if sandbox in busy:
                self._turns.setdefault(sandbox, []).append(item)
            else:
                going.append(item)
        for item in going:
            sandbox = item[0] // k
            busy[sandbox] = busy.get(sandbox, 0) + 1
        return going

    def _sandboxes_done(self, env_ids: Sequence[int]) -> None:
        """``env_ids``' calls are over (delivered or failed): a sandbox with none left in flight
        takes the calls that waited for it, in the next flush (with that tick's other calls)."""
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
                if not self._queued:
                    self._loop.call_soon(self._flush)  # type: ignore[union-attr]
                self._queued.extend(waiting)

    def _drop_waiting_call(self, env_id: int) -> bool:
        """Take ``env_id``'s call out of its sandbox's line (its coroutine was cancelled before
        the call went out); whether it was there."""
        waiting = self._turns.get(env_id // self._k)
        if waiting:
            for pos, item in enumerate(waiting):
                if item[0] == env_id:
                    del waiting[pos]
                    return True
        return False

    # ------------------------------------------------------------------ results, on the loop
    def _take_results(self) -> None:
        """Take in what finished, never waiting (a watched descriptor is readable, a deadline or
        heartbeat is due, or a reply waits unsignalled), and hand it to the coroutines."""
        self._take_due = False
        if self._closed or self._io_error is not None:
            return
        try:
            self._steps.take_ready(time.monotonic())
        except Exception as exc:  # noqa: BLE001 - reported to every waiting coroutine
            self._break(exc)
            return
        if self._steps.finished:
            self._deliver()
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
        self._io_error = exc
        self._unwatch()
        self._fail(None, exc)

    def _deliver(self) -> None:
        """Hand every finished call to its coroutine's future."""
        finished = list(self._steps.finished)
        self._steps.finished.clear()
        for f in finished:
            future = self._futures.pop(f.result.index, None)
            if future is not None and not future.done():
                future.set_result(f)
        if self._k > 1:
            # After the results: the coroutines they wake make their next calls before the
            # flush that sends the waiting ones, and go out with them.
            self._sandboxes_done([f.result.index for f in finished])

    def _fail(self, env_ids: list[int] | None, exc: BaseException) -> None:
        """Raise ``exc`` in the coroutines waiting on ``env_ids`` (``None``: every one)."""
        if env_ids is None:
            self._turns.clear()  # the pool's I/O is broken: nothing more goes out
            self._sandbox_calls.clear()
        for env_id in list(self._futures) if env_ids is None else env_ids:
            future = self._futures.pop(env_id, None)
            if future is not None and not future.done():
                future.set_exception(exc)
        if env_ids is not None and self._k > 1:
            self._sandboxes_done(env_ids)

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
        if self._vec is not None:
            return self._vec._read_reset(f.result, self.pool.reset_timeout)
        return read_reset(f.result, self.pool.reset_timeout)

    def _read_step(self, f: Finished):
        if self._vec is not None:
            t = self._vec._read_step(f.result, self.pool.step_timeout)
        else:
            t = read_step(f.result, self.pool.step_timeout)
        return t.obs, t.reward, t.terminated, t.truncated, t.info
