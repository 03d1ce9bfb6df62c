"""One pool env per rollout: leased when a rollout starts, given back (killed and wiped) when it ends.

The framework envs here (TRL's ``environment_factory`` class, SkyRL's ``BaseTextEnv``, verl's
``BaseTool``) each hold one env of an :class:`EnvLeases` pool for their rollout or trajectory. The
env is the code runner's (``boltzlabs_gym/code/runner_env``): each :meth:`EnvLeases.run` is one
program in that env's sandbox, and the files it writes stay in the workspace for the rollout's next
program. Giving the env back hard-resets it: its process tree is killed, its workspace wiped, a fresh
env forked, so the next rollout sees nothing of this one.

Calls of all leases go through one pool, one at a time (a lock): a lease's program runs while the
others wait. Size ``n`` for the rollouts that run at once; :meth:`EnvLeases.acquire` waits (up to
``timeout``) for a free env.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from ..client.pool import RLPool
from ..client.results import read_step
from ..code import RunRequest, RunResult
from ..code.runner import RUNNER_ENV_DIR

__all__ = ["EnvLeases", "NoFreeEnv", "describe_run"]


class NoFreeEnv(RuntimeError):
    """Every env of the leases' pool is leased; give one back or make the pool larger."""


class EnvLeases:
    """A pool of ``n`` code-runner envs, leased one per rollout. Thread-safe; a context manager.

    ``max_output_bytes``: stdout/stderr kept per program. ``pool_options`` go to
    :class:`~boltzlabs_gym.RLPool` (``workers=``, ``isolation=``, ``limits=``; ``mode`` is ``"boltz"``).
    """

    def __init__(
        self, n: int = 8, *, max_output_bytes: int = 1 << 16, max_run_timeout: float = 60.0, **pool_options: Any
    ):
        pool_options.setdefault("step_timeout", max_run_timeout + 15.0)
        self.pool = RLPool(RUNNER_ENV_DIR, n, mode="boltz", **pool_options)
        self.pool.reset()
        self.max_output_bytes = max_output_bytes
        self.max_run_timeout = max_run_timeout
        self._lock = threading.Lock()
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

    def run(
        self, index: int, code: str, *, language: str = "python", run_timeout: float = 10.0, **fields: Any
    ) -> RunResult:
        """Run one program in leased env ``index``'s sandbox (its workspace is the rollout's); its result.
        A failed env (crash, lost worker, closed pool) is a ``SandboxError`` result, never an exception."""
        request = RunRequest(code=code, language=language, run_timeout=min(run_timeout, self.max_run_timeout), **fields)
        # No wipe after the program (the runner's default): the rollout's files stay for its next
        # program; release() hard-resets the env when the rollout ends.
        action = {**request.to_action(self.max_output_bytes), "wipe": False}
        try:
            with self._lock:
                self.pool.batch_async([(index, {"op": "step", "action": action}, ())])
                [r] = self.pool.batch_wait()
            t = read_step(r, self.pool.step_timeout)
        except Exception as exc:  # noqa: BLE001 - the pool itself failed: the program's sandbox error
            return RunResult.sandbox_error(f"the pool failed: {type(exc).__name__}: {exc}", "")
        if t.failure is not None:
            return RunResult.sandbox_error(f"the sandbox failed: {t.failure.reason}", "")
        return RunResult.from_observation(t.obs or {}, "")

    def release(self, index: int) -> None:
        """Give env ``index`` back: kill its process tree, wipe its workspace, fork it afresh."""
        try:
            with self._lock:
                if not self.pool.closed:
                    mask = np.zeros(self.pool.n, dtype=bool)
                    mask[index] = True
                    self.pool.reset(where=mask, hard=True)
        finally:
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
        """Close the pool (every env, leased or not, is killed)."""
        with self._lock:
            self.pool.close()
        with self._free_changed:
            self._free_changed.notify_all()

    def __enter__(self) -> EnvLeases:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def describe_run(result: RunResult) -> str:
    """A run as a tool's answer to the model: its status (the command's too), stdout and stderr."""
    run = result.run_result
    status = f"{result.status} ({run.status}, exit {run.return_code})" if run is not None else result.status
    return f"{status}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
