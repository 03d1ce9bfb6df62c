"""The worker's deadlines for calls in flight: one heap entry per group of calls sent together.

A batch writes its n requests in one turn of the event loop with one timeout, so its n
calls share one heap entry (n times fewer heap operations on the hot path). Entries of
calls that answered in time are not searched out of the heap when they answer; they are
dropped when popped, or when the heap has grown to twice what is still live (then it is
compacted in one pass), so a busy pool with a long timeout holds about as many entries as
it has calls in flight, not its step rate times the timeout.

>>> d = Deadlines(is_live=lambda key: True)
>>> d.add(0.5, ("s1", 0, 7)); d.add(0.5, ("s1", 1, 8))
>>> d.seal(now=100.0)
>>> d.next_deadline()
100.5
>>> list(d.pop_expired(now=100.6))
[('s1', 0, 7), ('s1', 1, 8)]
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Hashable, Iterator
from typing import Any

#: The heap is compacted only past this many entries: small heaps are cheap as they are.
_COMPACT_MIN = 256


class Deadlines:
    """Keys (any hashable naming one call) due at a deadline; ``is_live(key)`` says whether
    the call is still in flight (a key whose call answered is stale and skipped)."""

    def __init__(self, is_live: Callable[[Any], bool]):
        self._is_live = is_live
        self._heap: list = []  # (deadline, tiebreak, [keys])
        self._open: dict[float, list] = {}  # timeout -> keys added since the last seal
        self._order = itertools.count()
        self._compact_at = _COMPACT_MIN

    def add(self, timeout: float, key: Hashable) -> None:
        """A call was just sent with ``timeout`` seconds to answer; it is due once sealed."""
        group = self._open.get(timeout)
        if group is None:
            self._open[timeout] = [key]
        else:
            group.append(key)

    def seal(self, now: float) -> None:
        """Give the calls added since the last seal their deadline, counted from ``now``.

        Called once per turn of the event loop, after the turn's sends, so a call's
        deadline starts no earlier than its request was written: the deadline never
        shortens an env's time, and lengthens it by at most one loop turn.
        """
        if not self._open:
            return
        for timeout, keys in self._open.items():
            heapq.heappush(self._heap, (now + timeout, next(self._order), keys))
        self._open.clear()
        if len(self._heap) > self._compact_at:
            self._compact()

    def next_deadline(self) -> float | None:
        """The earliest sealed deadline (possibly of stale calls only), or ``None``."""
        return self._heap[0][0] if self._heap else None

    def pop_expired(self, now: float) -> Iterator[Any]:
        """Yield the live keys whose deadline is at or before ``now``, removing their entries."""
        # self._heap, not a local: handling a key may send calls, seal, and compact the heap.
        while self._heap and self._heap[0][0] <= now:
            for key in heapq.heappop(self._heap)[2]:
                if self._is_live(key):
                    yield key

    def __len__(self) -> int:
        """Heap entries (groups), live or stale; for tests and diagnostics."""
        return len(self._heap)

    def _compact(self) -> None:
        live = []
        for deadline, order, keys in self._heap:
            keys = [k for k in keys if self._is_live(k)]
            if keys:
                live.append((deadline, order, keys))
        heapq.heapify(live)
        self._heap = live
        self._compact_at = max(_COMPACT_MIN, 2 * len(live))
