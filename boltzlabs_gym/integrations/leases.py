"""One pool env per rollout: leased when a rollout starts, given back (killed and wiped) when it ends.

The framework envs here (TRL's ``environment_factory`` class, SkyRL's ``BaseTextEnv``, verl's
``BaseTool``) each hold one env of an :class:`EnvLeases` pool for their rollout or trajectory. The
env is the code runner's (``boltzlabs_gym/code/runner_env``): each :meth:`EnvLeases.run` is one
program in that env's sandbox, and the files it writes stay in the workspace for the rollout's next
program. Giving the env back hard-resets it: its process tree is killed, its workspace wiped, a fresh
env forked, so the next rollout sees nothing of this one.

Calls on different leases run at the same time, from any number of threads (:meth:`EnvLeases.run`)
or coroutines (:meth:`EnvLeases.run_async`): each waits for its own env only (the pool's send/recv,
through :class:`~boltzlabs_gym.client.env_calls.EnvCalls`). Calls on one lease run one after
another, in the order they were made, and a release waits for the calls before it. Size ``n`` for
the rollouts that run at once; :meth:`EnvLeases.acquire` waits (up to ``timeout``) for a free env.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Sequence
from typing import Any

from typing_extensions import Unpack

from ..client.env_calls import EnvCalls
from ..client.options import PoolOptions, PoolSettings
from ..client.pool import RLPool
from ..client.results import read_reset, read_step
from ..client.sources import WorkerSource
from ..code import RunRequest, RunResult
from ..code.runner import RUNNER_ENV_DIR

__all__ = ["EnvLeases", "NoFreeEnv", "describe_run"]

log = logging.getLogger("boltzlabs_gym.integrations")


class NoFreeEnv(RuntimeError):
    """Every env of the leases' pool is leased; give one back or make the pool larger."""


class EnvLeases:
    """A pool of ``n`` code-runner envs, leased one per rollout. Thread-safe; a context manager.

    ``max_output_bytes``: stdout/stderr kept per program. ``workers``, ``options`` and the keyword
    settings go to the :class:`~boltzlabs_gym.RLPool` (``isolation=``, ``limits=``, ...): its
    ``mode`` is ``"boltz"`` (a ``mode`` keyword raises ``TypeError``) and its ``step_timeout``
    ``max_run_timeout`` + 15 s unless the keyword says otherwise.
    """

    def __init__(
        self,
        n: int = 8,
        *,
        max_output_bytes: int = 1 << 16,
        max_run_timeout: float = 60.0,
        workers: Sequence[str] | WorkerSource | None = None,
        options: PoolOptions | None = None,
        **settings: Unpack[PoolSettings],
    ):
        if "mode" in settings:
            raise TypeError("EnvLeases sets mode itself: its envs are forked from the runner's template (mode='boltz')")
        settings.setdefault("step_timeout", max_run_timeout + 15.0)
        pool_options = PoolOptions.fold(options, dict(settings, mode="boltz"))
        self.pool = RLPool(RUNNER_ENV_DIR, n, workers=workers, options=pool_options)
        try:
            self.pool.reset()
            self._calls = EnvCalls(self.pool, name="boltzlabs-env-leases")
        except BaseException:
            self.pool.close()
            raise
        self.max_output_bytes = max_output_bytes
        self.max_run_timeout = max_run_timeout
        self._free_changed = threading.Condition()
        self._free = list(range(n))

    def acquire(self, timeout: float | None = 60.0) -> int:
        """Lease a free env: its index. :class:`NoFreeEnv` if none is free within ``timeout`` s."""
        with self._free_changed:
            if not self._free_changed.wait_for(lambda: self._free or self.pool.closed, timeout):
                raise NoFreeEnv(f"all {self.pool.n} envs are leased (waited {timeout} s)")
            if self.pool.closed:
                raise RuntimeError("these EnvLeases are closed")
            return self._free.pop(0)

    # ------------------------------------------------------------------ programs
    def run(
        self, index: int, code: str, *, language: str = "python", run_timeout: float = 10.0, **fields: Any
    ) -> RunResult:
        """Run one program in leased env ``index``'s sandbox (its workspace is the rollout's); its result.
        Waits for this env only. A failed env (crash, lost worker, closed pool) is a ``SandboxError``
        result, never an exception."""
        try:
            finished = self._start(index, code, language, run_timeout, fields).result()
        except Exception as exc:  # noqa: BLE001 - the pool itself failed: the program's sandbox error
            return _pool_failed(exc)
        return self._read_run(finished)

    async def run_async(
        self, index: int, code: str, *, language: str = "python", run_timeout: float = 10.0, **fields: Any
    ) -> RunResult:
        """:meth:`run` for asyncio: awaits the env's answer without blocking the event loop (or a
        thread). Cancelling the awaiting task leaves the program to finish in its env."""
        try:
            finished = await asyncio.wrap_future(self._start(index, code, language, run_timeout, fields))
        except Exception as exc:  # noqa: BLE001
            return _pool_failed(exc)
        return self._read_run(finished)

    def _start(
        self, index: int, code: str, language: str, run_timeout: float, fields: dict
    ) -> concurrent.futures.Future:
        request = RunRequest(code=code, language=language, run_timeout=min(run_timeout, self.max_run_timeout), **fields)
        # No wipe after the program (the runner's default): the rollout's files stay for its next
        # program; release() hard-resets the env when the rollout ends.
        action = {**request.to_action(self.max_output_bytes), "wipe": False}
        return self._calls.submit(int(index), {"op": "step", "action": action})

    def _read_run(self, finished: Any) -> RunResult:
        t = read_step(finished.result, self.pool.step_timeout)
        if t.failure is not None:
            return RunResult.sandbox_error(f"the sandbox failed: {t.failure.reason}", "")
        return RunResult.from_observation(t.obs or {}, "")

    # ------------------------------------------------------------------ giving back
    def release(self, index: int) -> None:
        """Give env ``index`` back: kill its process tree, wipe its workspace, fork it afresh (after
        the calls made on it before); then it is free for the next lease."""
        try:
            self._check_restarted(index, self._hard_reset(index).result())
        except Exception as exc:  # noqa: BLE001 - closed or failed: the env goes back all the same
            log.debug("env %d given back without a hard reset: %s", index, exc)
        finally:
            self._give_back(index)

    async def release_async(self, index: int) -> None:
        """:meth:`release` for asyncio."""
        try:
            self._check_restarted(index, await asyncio.wrap_future(self._hard_reset(index)))
        except Exception as exc:  # noqa: BLE001
            log.debug("env %d given back without a hard reset: %s", index, exc)
        finally:
            self._give_back(index)

    def _check_restarted(self, index: int, finished: Any) -> None:
        _, _, failure = read_reset(finished.result, self.pool.start_timeout)
        if failure is not None:  # its next program reports a SandboxError; the lease after it restarts it
            log.warning("env %d did not restart when given back: %s", index, failure.reason)

    def _hard_reset(self, index: int) -> concurrent.futures.Future:
        return self._calls.submit(int(index), {"op": "hard_reset", "seed": None})

    def _give_back(self, index: int) -> None:
        with self._free_changed:
            if index not in self._free:
                self._free.append(index)
            self._free_changed.notify()

    @property
    def leased(self) -> int:
        """How many envs are leased now."""
        with self._free_changed:
            return self.pool.n - len(self._free)

    def close(self) -> None:
        """Close the pool (every env, leased or not, is killed; calls not finished get a ``SandboxError``)."""
        self._calls.close()
        self.pool.close()
        with self._free_changed:
            self._free_changed.notify_all()

    def __enter__(self) -> EnvLeases:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _pool_failed(exc: Exception) -> RunResult:
    return RunResult.sandbox_error(f"the pool failed: {type(exc).__name__}: {exc}", "")


def describe_run(result: RunResult) -> str:
    """A run as a tool's answer to the model: its status (the command's too), stdout and stderr."""
    run = result.run_result
    status = f"{result.status} ({run.status}, exit {run.return_code})" if run is not None else result.status
    return f"{status}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
