"""``pool.stats()``: one frozen snapshot of what a pool's envs are doing, from the trainer's side.

The same figures ``boltzlabs-gym top`` shows per worker (:mod:`boltzlabs_gym.cli.top`), for
one pool, computed from the pool's own calls: every batch it waited for, whichever route
it took (a worker, or a local pool's direct lane), so nothing is missing here that the
worker could not see. The books cost one entry per batch, nothing per env.

>>> r = PoolRecorder()
>>> r.batch(calls=8, seconds=0.002, stragglers=1, errors=0)
>>> r.batch(calls=8, seconds=0.004, stragglers=0, errors=0)
>>> r.calls, r.batches, r.stragglers, r.p(50)
(16, 2, 1, 2.0)
"""

from __future__ import annotations

import collections
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from ..wire.counters import RATE_WINDOW_S, RECENT_LATENCIES, RecentCounts, percentile
from .link import WorkerLink
from .sandbox_replies import SandboxLayout

__all__ = ["PoolRecorder", "PoolStats", "PssReport", "measure_pss"]


@dataclass(frozen=True)
class PoolStats:
    """What a pool's envs have been doing; :meth:`RLPool.stats() <boltzlabs_gym.RLPool.stats>`.

    ``calls`` counts env calls answered (steps and resets, one per env per batch, as
    ``pool.timing.env_steps`` does); ``calls_per_s`` over the last ten seconds. Batch latencies
    are the trainer's wall clock around each batched call (``pool.timing.roundtrip_ms``),
    over the last 1024 calls. ``stragglers`` and ``errors`` count envs (a sandbox of K envs
    that failed counts K), in total and in the last minute. ``pss_bytes`` is the PSS of every
    env's sandbox plus the boltz templates' (``None`` when not measured).

    >>> PoolStats(n=4, envs_per_sandbox=1, workers=("ipc://w",), isolation="namespaces").calls
    0
    """

    n: int
    envs_per_sandbox: int
    workers: tuple[str, ...]
    isolation: str | None
    calls: int = 0
    batches: int = 0
    calls_per_s: float = 0.0
    batch_p50_ms: float | None = None
    batch_p99_ms: float | None = None
    stragglers: int = 0
    errors: int = 0
    stragglers_1m: int = 0
    errors_1m: int = 0
    pss_bytes: int | None = None
    envs_per_gib: float | None = None
    metrics_url: str | None = None


class PoolRecorder:
    """The pool's books: one :meth:`batch` per batched call it waited for."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.calls = self.batches = self.stragglers = self.errors = 0
        self._latency_ms: collections.deque[float] = collections.deque(maxlen=RECENT_LATENCIES)
        self._recent_calls = RecentCounts()
        self._recent_stragglers = RecentCounts()
        self._recent_errors = RecentCounts()

    def batch(self, calls: int, seconds: float, stragglers: int, errors: int) -> None:
        self.calls += calls
        self.batches += 1
        self._latency_ms.append(seconds * 1e3)
        self._recent_calls.add(calls)
        if stragglers:
            self.stragglers += stragglers
            self._recent_stragglers.add(stragglers)
        if errors:
            self.errors += errors
            self._recent_errors.add(errors)

    def p(self, q: float) -> float | None:
        """The ``q``-th percentile of recent batch latencies, in ms."""
        return percentile(list(self._latency_ms), q)

    def snapshot(self, **pool: object) -> PoolStats:
        return PoolStats(
            calls=self.calls,
            batches=self.batches,
            calls_per_s=self._recent_calls.rate(RATE_WINDOW_S, self.started),
            batch_p50_ms=self.p(50),
            batch_p99_ms=self.p(99),
            stragglers=self.stragglers,
            errors=self.errors,
            stragglers_1m=self._recent_stragglers.total(60),
            errors_1m=self._recent_errors.total(60),
            **pool,  # type: ignore[arg-type]  # the pool's own fields, by name
        )


@dataclass(frozen=True)
class PssReport:
    """What ``pool.memory()`` measured: PSS in bytes per env (index order), of the boltz-mode
    templates, and of the snapshots the workers hold for the pool."""

    per_env: list[int]
    template_bytes: int
    snapshot_bytes: int


def measure_pss(links: Sequence[WorkerLink], layout: SandboxLayout, lost: Collection[str]) -> PssReport:
    """Ask every worker of ``links`` but the ``lost`` for its envs' PSS (one request each); a sandbox
    of several envs has its PSS split evenly between them, and the envs of a lost worker have none."""
    out = [0] * layout.n
    template = 0
    snapshots = 0
    for link in links:
        if link.address in lost:
            continue  # its envs are gone: 0 bytes
        header = link.call({"op": "memory"}, timeout=60.0)
        for local, pss in enumerate(header["pss"]):
            envs = layout.envs(link.start + local)
            share, rest = divmod(int(pss), len(envs))
            for i in envs:
                out[i] = share + (1 if i - envs.start < rest else 0)
        template += int(header.get("template_pss", 0))
        snapshots += int(header.get("snapshot_bytes", 0))
    return PssReport(out, template, snapshots)
