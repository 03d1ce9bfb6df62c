"""Where a :class:`~boltzlabs_gym.code.CodeRunner`'s lanes run when its workers are remote: each lane
on one worker (:func:`lanes_on_workers`), so that a lost worker takes its own lanes only, and lanes
put back on the worker that replaces a lost one (:class:`LaneKeeper`).

A lane whose pool spans several workers is lost with any of them (the runner retires lanes, not
envs); pinned to one worker each, the lanes of the other workers serve on. Used by
``boltzlabs-gym code-server --workers ...`` and ``--ray`` (:mod:`boltzlabs_gym.ray.code_lanes`).

>>> [list(w) for w in lanes_on_workers(["tcp://a:5555", "tcp://b:5555"], 2)]
[['tcp://a:5555'], ['tcp://b:5555'], ['tcp://a:5555'], ['tcp://b:5555']]
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from ..client.sources import WorkerSource, is_worker_source
from ..wire.keys import ClientKeys

if TYPE_CHECKING:
    from .runner import CodeRunner

log = logging.getLogger("boltzlabs_gym.code")

__all__ = ["LaneKeeper", "PinnedWorker", "ReplaceableWorkers", "lanes_on_workers", "lanes_per_worker_for"]


@dataclass(frozen=True)
class PinnedWorker:
    """One worker of a :class:`~boltzlabs_gym.client.sources.WorkerSource`, as a source of its own:
    a lane's pool given it runs on that worker alone. ``where`` says where it runs (its node, for
    a Ray worker); ``sandboxed_only`` as its source's (a Ray worker's pools default to
    ``isolation="strict"``)."""

    address: str
    keys: ClientKeys | None = None
    where: str = ""
    sandboxed_only: bool = False

    @property
    def addresses(self) -> list[str]:
        """The one worker's address."""
        return [self.address]

    def client_keys(self, address: str) -> ClientKeys | None:
        """The keys to reach the worker (``None``: it runs without keys)."""
        if address != self.address:
            raise KeyError(f"{address} is not this pinned worker ({self.address})")
        return self.keys

    @classmethod
    def of(cls, source: WorkerSource, position: int, where: str = "") -> PinnedWorker:
        """Worker ``position`` of ``source``, with the keys the source brings for it."""
        address = source.addresses[position]
        sandboxed = bool(getattr(source, "sandboxed_only", False))
        return cls(address, source.client_keys(address), where or address, sandboxed)


def lanes_per_worker_for(lanes: int, workers: int) -> int:
    """Lanes on each of ``workers`` workers so that there are at least ``lanes`` in all (one each at least).

    >>> lanes_per_worker_for(4, 2), lanes_per_worker_for(4, 3), lanes_per_worker_for(2, 8)
    (2, 2, 1)
    """
    if workers < 1:
        raise ValueError(f"lanes need at least one worker, got {workers}")
    return max(1, -(-lanes // workers))


def lanes_on_workers(
    workers: Sequence[str] | WorkerSource, lanes_per_worker: int, where: Callable[[int], str] | None = None
) -> list[Sequence[str] | WorkerSource]:
    """``CodeRunner(lane_workers=...)`` for ``lanes_per_worker`` lanes on each worker: lane ``i`` on
    worker ``i % W`` (so the first lanes already spread over the workers). An address list's
    lanes get ``[address]`` (the pool's ``keys=`` reach them); a source's get a
    :class:`PinnedWorker` (``where(position)`` names its place)."""
    if type(lanes_per_worker) is not int or lanes_per_worker < 1:
        raise ValueError(f"lanes_per_worker must be a positive int, got {lanes_per_worker!r}")
    if is_worker_source(workers):
        source = workers
        assert isinstance(source, WorkerSource)
        count = len(source.addresses)
        one: list[Sequence[str] | WorkerSource] = [
            PinnedWorker.of(source, i, where(i) if where else "") for i in range(count)
        ]
    else:
        addresses = list(workers)  # type: ignore[arg-type]
        count, one = len(addresses), [[a] for a in addresses]
    if count < 1:
        raise ValueError("lanes_on_workers needs at least one worker")
    return [one[i % count] for i in range(count * lanes_per_worker)]


class ReplaceableWorkers(WorkerSource, Protocol):
    """Workers that can say which of them are gone and start new ones in their places
    (:class:`boltzlabs_gym.ray.RayWorkers`)."""

    def dead(self, timeout: float = 5.0) -> list[int]:
        """Positions of the workers that are gone."""
        ...

    def replace_dead(self, timeout: float = 5.0) -> list[str]:
        """Start a worker in place of each dead one (same position); the new addresses."""
        ...


class LaneKeeper:
    """Keeps a runner's lanes on the workers of ``workers``: lanes of a worker found dead are retired
    at once (before a request goes there), the dead worker is replaced (``workers.replace_dead()``),
    and as many lanes as were lost are started on the worker in its place. A lane lost while its
    worker lives (its pool failed) is started again on that worker.

    Args:
        runner: the runner whose lanes these are.
        workers: the workers (:class:`ReplaceableWorkers`: ``RayWorkers``).
        positions: lane number -> the position of its worker in ``workers`` (the runner's lanes as
            :func:`lanes_on_workers` placed them: lane ``i`` on worker ``i % W``).
        where: names a position's place in lane reports (its node).
        poll_s: how often the workers are asked whether they live.
        retry_s: how long after a failed replacement (no room for it: Ray's
            :class:`~boltzlabs_gym.errors.PlacementTimeout`) it is tried again; the server serves
            with fewer lanes meanwhile.

    :meth:`start` runs it on a thread of its own; :meth:`close` stops it (before the runner closes).
    """

    def __init__(
        self,
        runner: CodeRunner,
        workers: ReplaceableWorkers,
        positions: dict[int, int],
        *,
        where: Callable[[int], str] | None = None,
        poll_s: float = 1.0,
        retry_s: float = 30.0,
        dead_timeout: float = 5.0,
    ):
        self.runner = runner
        self.workers = workers
        self.where = where
        self.poll_s = float(poll_s)
        self.retry_s = float(retry_s)
        self.dead_timeout = float(dead_timeout)
        #: Lanes put back on a replacement so far.
        self.lanes_replaced = 0
        #: Why the last replacement failed (``""``: none did).
        self.last_failure = ""
        self._positions = dict(positions)  # lane number -> worker position, for the lanes that serve
        self._lost: dict[int, int] = {}  # worker position -> lanes lost there and not put back yet
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._retry_at = 0.0
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ running
    def start(self) -> LaneKeeper:
        """Watch the workers on a thread of its own (and hear of lanes the runner finds lost)."""
        self.runner.on_lane_lost = self._lane_lost
        self._thread = threading.Thread(target=self._watch, name="code-lane-keeper", daemon=True)
        self._thread.start()
        return self

    def close(self, timeout: float = 30.0) -> None:
        """Stop watching (a replacement under way is waited for up to ``timeout``)."""
        self._stop.set()
        self._wake.set()
        if self.runner.on_lane_lost == self._lane_lost:
            self.runner.on_lane_lost = None
        if self._thread is not None:
            self._thread.join(timeout)

    def _lane_lost(self, number: int, reason: str) -> None:
        """The runner found lane ``number`` lost (on the thread that found it): count it, wake up."""
        with self._lock:
            position = self._positions.pop(number, None)
            if position is not None:
                self._lost[position] = self._lost.get(position, 0) + 1
        self._wake.set()

    def _watch(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.poll_s)
            self._wake.clear()
            if self._stop.is_set():
                break
            try:
                self.check()
            except Exception:  # noqa: BLE001 - the keeper must outlive a bad round; the next one tries again
                log.exception("code lane keeper: a round of checks failed")

    # ------------------------------------------------------------------ one round
    def check(self, now: float | None = None) -> None:
        """One round: retire the lanes of dead workers, replace the dead workers when due, put lanes
        back on the workers that took their places (and on live workers whose lanes were lost)."""
        now = time.monotonic() if now is None else now
        dead = self.workers.dead(self.dead_timeout)
        self._retire_lanes_on(dead)
        with self._lock:
            waiting = dict(self._lost)
        if dead and now >= self._retry_at:
            dead = self._replace(dead, now)
        for position, count in waiting.items():
            if position not in dead:
                self._put_back(position, count)

    def _retire_lanes_on(self, dead: list[int]) -> None:
        """Retire the serving lanes of the ``dead`` workers (their losses come back through
        :meth:`_lane_lost`)."""
        with self._lock:
            doomed = [(number, position) for number, position in self._positions.items() if position in dead]
        for number, position in doomed:
            self.runner.retire_lane(number, f"worker {self._where(position)} died")

    def _replace(self, dead: list[int], now: float) -> list[int]:
        """Replace the dead workers; the positions still dead (all of them, if that failed)."""
        try:
            self.workers.replace_dead(self.dead_timeout)
        except Exception as exc:  # noqa: BLE001 - no room for a replacement: serve with fewer lanes, try later
            self.last_failure = f"{type(exc).__name__}: {exc}"
            self._retry_at = now + self.retry_s
            log.warning(
                "code lane keeper: could not replace the worker(s) at %s; their lanes stay retired, "
                "trying again in %g s: %s",
                dead,
                self.retry_s,
                self.last_failure,
            )
            return dead
        return []

    def _put_back(self, position: int, count: int) -> None:
        """Start ``count`` lanes on the worker now at ``position``."""
        for _ in range(count):
            pinned = PinnedWorker.of(self.workers, position, self._where(position))
            try:
                number = self.runner.add_lane(pinned)
            except Exception as exc:  # noqa: BLE001 - tried again next round
                self.last_failure = f"{type(exc).__name__}: {exc}"
                log.warning("code lane keeper: could not start a lane on %s: %s", pinned.where, self.last_failure)
                return
            with self._lock:
                self._positions[number] = position
                self._lost[position] -= 1
                if not self._lost[position]:
                    del self._lost[position]
            self.lanes_replaced += 1
            log.info("code lane keeper: lane %d put back on %s", number, pinned.where)

    def _where(self, position: int) -> str:
        if self.where is not None:
            return self.where(position)
        addresses = self.workers.addresses
        return addresses[position] if position < len(addresses) else f"worker {position}"
