"""Fair sharing of the code runner's sandboxes: round robin over one FIFO queue per client.

One client's burst must not starve the others. Each client (the code server makes one per token;
without tokens every request is the same client) has a queue of its own, first in first out, and
the queue's :meth:`~FairQueue.get` takes from the clients in turn: one item from each client that
has any waiting, then round again. A client whose queue empties leaves the round; when it queues
again it joins at the end. So a client that queues 4 programs behind another's 40 has its 4 taken
within the next 8, not after the 40.

Every item counts as one turn, whatever it costs to run: the queue shares the number of programs
started, not sandbox-seconds (a program's run time is not known when it is taken).

Bounds are checked when an item is queued: ``max_total`` items in all, ``max_per_client`` for
each client (``None``: no bound); past either :meth:`~FairQueue.put` raises
:class:`QueueFullError` and queues nothing.

A taker that took an item it cannot serve (the code runner's lane that finds its worker lost)
gives it back with :meth:`~FairQueue.put_front`: at the head of its client's line, and the client
at the head of the round, as if it had never been taken.

>>> q = FairQueue()
>>> for i in range(3):
...     q.put("a", f"a{i}")
>>> q.put("b", "b0"); q.put("b", "b1")
>>> [q.get_nowait() for _ in range(5)]
['a0', 'b0', 'a1', 'b1', 'a2']
>>> bounded = FairQueue(max_per_client=1)
>>> bounded.put("a", 1)
>>> bounded.put("a", 2)
Traceback (most recent call last):
...
boltzlabs_gym.code.fair_queue.QueueFullError: client 'a' has 1 request waiting (max_queue_per_client=1)
>>> bounded.put("b", 3)  # another client still gets in
"""

from __future__ import annotations

import collections
import queue
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["DEFAULT_CLIENT", "FairQueue", "QueueClosedError", "QueueFullError"]

#: The client every request belongs to when nobody says otherwise (a server without tokens).
DEFAULT_CLIENT = "default"

T = TypeVar("T")


class QueueFullError(RuntimeError):
    """A bound of the queue is reached; nothing was queued. Try again later.

    ``client`` is the client that asked; ``per_client`` is ``True`` when its own bound
    (``max_queue_per_client``) refused it, ``False`` when the bound on all clients together did.
    """

    def __init__(self, message: str, *, client: str = DEFAULT_CLIENT, per_client: bool = False):
        super().__init__(message)
        self.client = client
        self.per_client = per_client


class QueueClosedError(RuntimeError):
    """The queue is closed: it takes nothing more."""


class FairQueue(Generic[T]):
    """Per-client FIFO queues taken from in round robin (see the module doc); thread-safe.

    Args:
        max_total: items waiting at most, over all clients (``None``: no bound).
        max_per_client: items waiting at most for any one client (``None``: no bound).

    Both bounds are plain attributes and may be changed while the queue is in use; they apply to
    the next :meth:`put`.
    """

    def __init__(self, max_total: int | None = None, max_per_client: int | None = None):
        self.max_total = max_total
        self.max_per_client = max_per_client
        self._lines: dict[str, collections.deque[T]] = {}  # only clients with something waiting
        self._turns: collections.deque[str] = collections.deque()  # those clients, next to be served first
        self._size = 0
        self._closed = False
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)

    # ------------------------------------------------------------------ queueing
    def put(self, client: str, item: T) -> None:
        """Queue ``item`` at the end of ``client``'s line.

        Raises:
            QueueFullError: a bound is reached (nothing was queued).
            QueueClosedError: the queue was closed.
        """
        with self._lock:
            if self._closed:
                raise QueueClosedError("the queue is closed")
            line = self._lines.get(client)
            self._check_bounds(client, len(line) if line is not None else 0)
            if line is None:
                line = self._lines[client] = collections.deque()
                self._turns.append(client)  # a client that had nothing waiting joins at the end of the round
            line.append(item)
            self._size += 1
            self._ready.notify()

    def put_front(self, client: str, item: T) -> None:
        """Queue ``item`` at the head of ``client``'s line, and ``client`` at the head of the round:
        the undoing of a :meth:`get` that took it (a taker that could not serve it gives it back,
        and its client loses neither its place in line nor its turn). The bounds are not checked:
        the item was let in once.

        Raises:
            QueueClosedError: the queue was closed (the taker then answers the item itself).
        """
        with self._lock:
            if self._closed:
                raise QueueClosedError("the queue is closed")
            line = self._lines.get(client)
            if line is None:
                line = self._lines[client] = collections.deque()
            else:
                self._turns.remove(client)
            self._turns.appendleft(client)
            line.appendleft(item)
            self._size += 1
            self._ready.notify()

    def _check_bounds(self, client: str, waiting: int) -> None:
        # The client's own bound first: when both are reached, that is the one it can do something about.
        if self.max_per_client is not None and waiting >= self.max_per_client:
            raise QueueFullError(
                f"client {client!r} has {waiting} request{'s' * (waiting != 1)} waiting "
                f"(max_queue_per_client={self.max_per_client})",
                client=client,
                per_client=True,
            )
        if self.max_total is not None and self._size >= self.max_total:
            raise QueueFullError(
                f"{self._size} requests are waiting (max_queue={self.max_total})", client=client, per_client=False
            )

    # ------------------------------------------------------------------ taking
    def get(self, timeout: float | None = None) -> T | None:
        """The next item in turn, waiting for one; ``None`` once the queue is closed. With a
        ``timeout`` (seconds), raises :class:`queue.Empty` if nothing came within it (as
        :meth:`queue.Queue.get` does), so a taker can look at something else and wait again."""
        with self._lock:
            if not self._ready.wait_for(lambda: self._size or self._closed, timeout):
                raise queue.Empty
            return self._take() if self._size else None

    def get_nowait(self) -> T | None:
        """The next item in turn, or ``None`` if nothing waits (or the queue is closed)."""
        with self._lock:
            return self._take() if self._size else None

    def _take(self) -> T:
        """Pop the head of the next client's line (under the lock; something waits)."""
        client = self._turns.popleft()
        line = self._lines[client]
        item = line.popleft()
        self._size -= 1
        if line:
            self._turns.append(client)  # served: to the end of the round
        else:
            del self._lines[client]
        return item

    def remove(self, matches: Callable[[T], bool]) -> T | None:
        """Take out the first waiting item (in any client's line) for which ``matches`` is true,
        and return it; ``None`` if none does (a lane took it already, say). Looks at every waiting
        item: for a cancel, not for a hot path."""
        with self._lock:
            for client, line in self._lines.items():
                for item in line:
                    if matches(item):
                        line.remove(item)
                        self._size -= 1
                        if not line:
                            del self._lines[client]
                            self._turns.remove(client)
                        return item
        return None

    # ------------------------------------------------------------------ looking, closing
    def __len__(self) -> int:
        with self._lock:
            return self._size

    def depths(self) -> dict[str, int]:
        """Items waiting per client (clients with none left out)."""
        with self._lock:
            return {client: len(line) for client, line in self._lines.items()}

    def close(self) -> list[T]:
        """Close the queue and return what was waiting, in turn order; every :meth:`get` that waits
        returns ``None``, and :meth:`put` raises :class:`QueueClosedError` from now on."""
        with self._lock:
            self._closed = True
            left = [self._take() for _ in range(self._size)]
            self._ready.notify_all()
            return left
