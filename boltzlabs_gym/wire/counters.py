"""Running counts both sides keep the same way: events per second and percentiles of recent latencies.

The worker's books (:mod:`boltzlabs_gym.worker.stats`) and a pool's own (:mod:`boltzlabs_gym.client.stats`)
use them; standard library only.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Iterable

#: Recent batch latencies kept for ``top``'s p50/p99.
RECENT_LATENCIES = 1024


#: The window of ``top``'s rates (env calls per second).
RATE_WINDOW_S = 10


class RecentCounts:
    """Events per whole second for the last ``keep_s`` seconds: rates and "in the last minute"."""

    __slots__ = ("keep_s", "_seconds")

    def __init__(self, keep_s: int = 60):
        self.keep_s = keep_s
        self._seconds: collections.deque[list[int]] = collections.deque()

    def add(self, n: int, now: float | None = None) -> None:
        second = int(time.monotonic() if now is None else now)
        seconds = self._seconds
        if seconds and seconds[-1][0] == second:
            seconds[-1][1] += n
            return
        seconds.append([second, n])
        while seconds[0][0] <= second - self.keep_s:
            seconds.popleft()

    def total(self, window_s: float, now: float | None = None) -> int:
        """Events in the last ``window_s`` seconds (whole seconds, the current one included)."""
        since = int(time.monotonic() if now is None else now) - window_s
        return sum(n for second, n in list(self._seconds) if second > since)

    def rate(self, window_s: int, opened: float, now: float | None = None) -> float:
        """Events per second over the last ``window_s`` seconds: :meth:`total` divided by the time
        it covers (``window_s - 1`` whole seconds and the current one so far; less since ``opened``).

        >>> counts = RecentCounts()
        >>> counts.add(30, now=100.0)
        >>> counts.rate(10, opened=0.0, now=100.5)  # 9 whole seconds and half of this one
        3.1578947368421053
        """
        now = time.monotonic() if now is None else now
        covered = min(window_s - 1 + (now - int(now)), now - opened)
        return self.total(window_s, now) / max(covered, 1.0)


def percentile(values: Iterable[float], q: float) -> float | None:
    """The ``q``-th percentile (nearest rank) of ``values``; ``None`` when there are none.

    >>> percentile([3.0, 1.0, 2.0, 4.0], 50), percentile([], 99)
    (2.0, None)
    """
    ordered = sorted(values)
    if not ordered:
        return None
    rank = max(0, min(len(ordered) - 1, -(-len(ordered) * q // 100) - 1))
    return ordered[int(rank)]
