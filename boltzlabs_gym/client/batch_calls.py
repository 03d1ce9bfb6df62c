"""A pool's batched calls: one in flight at a time, sent on the pool's route, collected in the
items' order, timed and counted.

:class:`~boltzlabs_gym.client.pool.RLPool`'s ``batch_async``/``batch_wait`` and everything built
on them (``step``, ``reset``, snapshots) go through the pool's :class:`BatchCalls`. The vector
env also uses its two block-wise calls, :meth:`BatchCalls.send_steps` and
:meth:`BatchCalls.wait_sandboxes`, which hand a sandbox of several envs over as one block.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

import numpy as np

from ..errors import AsyncStateError, PoolClosedError
from ..wire.protocol import ERROR, OK, STRAGGLER
from .results import EnvResult
from .routes import Items, Route
from .sandbox_replies import SandboxResult
from .sandbox_route import SandboxRoute, step_items
from .stats import PoolRecorder
from .timing import Timing

if TYPE_CHECKING:
    from .link import WorkerLink

__all__ = ["BatchCalls"]


class BatchCalls:
    """The batched calls of a pool of ``n`` envs; ``default_timeout``: how long a wait without one may take."""

    def __init__(self, n: int, default_timeout: float):
        #: How batches reach the envs (a :class:`SandboxRoute` for several envs per sandbox), set by
        #: the pool once its workers are connected.
        self.route: Route
        self.n = n
        self.default_timeout = default_timeout
        #: Set by the pool's ``close()``: every call is refused after.
        self.closed = False
        #: A batch was sent and not collected yet.
        self.in_flight = False
        #: Where the time of the last call went, and running counts (``pool.timing``).
        self.timing = Timing()
        #: The books behind ``pool.stats()``: one entry per batch waited for.
        self.recorder = PoolRecorder()
        self._sent_at = 0.0  # when the batch in flight started going out (time.perf_counter)
        #: Envs with calls in flight outside the lockstep batch (:mod:`~boltzlabs_gym.client.async_steps`):
        #: a batched call starts only when there are none.
        self.async_envs: Collection[int] = ()
        #: The pool's worker links (its own list: a replaced link takes the lost one's place).
        self.links: Sequence[WorkerLink] = ()

    def check_open(self) -> None:
        """Raise :class:`~boltzlabs_gym.errors.PoolClosedError` once the pool is closed."""
        if self.closed:
            raise PoolClosedError("this pool is closed; create a new RLPool")

    def lending_obs_views(self) -> _LendingViews:
        """Within the block, observations from shared regions come as read-only views of their
        slots, not copies (:meth:`~boltzlabs_gym.client.obs_regions.ObsRegions.lending_views`):
        for a caller that copies each into its own batch and keeps no result past the block."""
        return _LendingViews([link.regions for link in self.links if link.regions is not None])

    def _check_idle(self) -> None:
        self.check_open()
        if self.in_flight:
            raise AsyncStateError("a call is already in flight (waiting for step_wait()); wait for it first")
        if self.async_envs:
            ids = sorted(self.async_envs)
            raise AsyncStateError(
                f"{len(ids)} envs have send() calls in flight (env {ids[0]} first): recv() them before a lockstep call"
            )

    def send(self, items: Items) -> None:
        """Send one request per worker carrying ``items``: ``(index, op, payload_frames)``."""
        self._check_idle()
        self._sent_at = self.route.send(items)
        self.in_flight = True

    def send_steps(self, actions: list[int], resets: np.ndarray, autoreset: bool) -> None:
        """:meth:`send` of a Discrete step batch: env ``i`` steps with ``actions[i]``, or resets (seed
        ``None``) where ``resets[i]``; ``autoreset`` marks every step for a reset in its own reply.
        With several envs per sandbox, packed per sandbox without per-env work."""
        if not isinstance(self.route, SandboxRoute):
            self.send(step_items(actions, resets, autoreset))
            return
        self._check_idle()
        self._sent_at = self.route.send_steps(actions, resets, autoreset)
        self.in_flight = True

    def send_action_rows(self, actions: np.ndarray, resets: np.ndarray, autoreset: bool) -> bool:
        """:meth:`send` of a step batch of array actions (``actions``: ``(n, ...)``, C-contiguous), each
        sandbox's rows as one payload; ``False``, sending nothing, where that cannot be (one env
        per sandbox, or envs to be told of a restart): the caller sends per-env items then."""
        if not isinstance(self.route, SandboxRoute):
            return False
        self._check_idle()
        sent_at = self.route.send_action_rows(actions, resets, autoreset)
        if sent_at is None:
            return False
        self._sent_at = sent_at
        self.in_flight = True
        return True

    def wait(self, timeout: float | None, raw: bool) -> list[EnvResult]:
        """The results of the batch in flight, in the order of its items (reply lines unparsed if ``raw``)."""
        return self._collect(timeout, raw, blocks=False)[1]

    def wait_sandboxes(self, timeout: float | None, raw: bool) -> tuple[list[SandboxResult], list[EnvResult]]:
        """The results of the batch in flight as blocks: one :class:`SandboxResult` per sandbox of
        several envs, and per-env results for the rest (every env, with one env per sandbox;
        unparsed if ``raw``), in no particular order."""
        return self._collect(timeout, raw, blocks=True)

    def _collect(self, timeout: float | None, raw: bool, blocks: bool) -> tuple[list[SandboxResult], list[EnvResult]]:
        self.check_open()
        if not self.in_flight:
            raise AsyncStateError("batch_wait()/step_wait() called without a call in flight; call step_async() first")
        timeout = self.default_timeout if timeout is None else timeout
        route = self.route
        sandboxes: list[SandboxResult] = []
        try:
            if blocks and isinstance(route, SandboxRoute):
                sandboxes, results, per_worker_ms = route.wait_sandboxes(timeout)
            else:
                results, per_worker_ms = route.wait(timeout, raw)
        finally:
            # Whatever happened, this call is over: a late reply will be dropped by its tag.
            self.in_flight = False
        self._record(sandboxes, results, per_worker_ms)
        return sandboxes, results

    def _record(self, sandboxes: list[SandboxResult], results: list[EnvResult], per_worker_ms: dict) -> None:
        failed = results
        calls = len(results)
        for sandbox in sandboxes:
            calls += len(sandbox.plan.indices)
            if sandbox.result.status != OK:
                failed = failed + sandbox.failures()
        stragglers: tuple[int, ...] = ()
        errors: tuple[int, ...] = ()
        if failed:
            stragglers = tuple(r.index for r in failed if r.status == STRAGGLER)
            errors = tuple(r.index for r in failed if r.status == ERROR)
        seconds = time.perf_counter() - self._sent_at
        self.recorder.batch(calls, seconds, len(stragglers), len(errors))
        self.timing = self.timing.after_batch(per_worker_ms, seconds * 1e3, stragglers, errors, calls)


class _LendingViews:
    """:meth:`BatchCalls.lending_obs_views`'s block: each region lends views inside it (a plain
    class, not a generator's context: it is entered once per step)."""

    __slots__ = ("regions",)

    def __init__(self, regions: list):
        self.regions = regions

    def __enter__(self) -> None:
        for regions in self.regions:
            regions.views = True

    def __exit__(self, *exc: object) -> None:
        for regions in self.regions:
            regions.views = False
