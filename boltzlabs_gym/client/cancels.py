"""Cancelling a pool's calls in flight, from any thread, while the pool waits for them.

A pool's own connection to a worker belongs to the thread that waits for the batch (ZeroMQ
sockets are not thread-safe), so :class:`CallCanceller` opens a connection of its own to each
worker (the local worker's ``ipc://`` endpoint, or the remote worker's address with the pool's
CURVE keys) and sends the worker's ``cancel`` op on it (see "Cancelling calls" in
:mod:`boltzlabs_gym.wire.protocol`): a call whose op carries a tag
(:data:`~boltzlabs_gym.wire.protocol.CALL_TAG`) is dropped if still queued; in flight, its env's
whole sandbox is killed and respawned. The batch waiting for it gets that env's result at once,
an error result whose reply says ``"cancelled": true``.

A local pool's direct lane (``RLPool(direct=True)``, the default) steps lent envs on their own
pipes, and the worker does not see those calls: ``lent=True`` has it kill a named env that is lent
whatever it runs, so the caller must know that the named call is still the one on that env (the
code runner holds a lock that keeps its lane from starting the env's next call meanwhile).

>>> pool = RLPool(env_dir, n=4, mode="boltz", direct=False)            # doctest: +SKIP
>>> pool.batch_async([(0, {"op": "step", "action": a, "tag": "job-7"}, ())])  # doctest: +SKIP
>>> pool.cancels.cancel([(0, "job-7")])   # from another thread        # doctest: +SKIP
[0]
"""

from __future__ import annotations

import itertools
import threading
import time
import weakref
from collections.abc import Iterable, Sequence

import zmq

from ..errors import WorkerError, WorkerTimeout
from ..wire.protocol import CANCEL, CANCEL_LENT, decode_header, encode_header
from .link import WorkerLink, dealer_socket, link_holding

__all__ = ["CallCanceller"]


class CallCanceller:
    """Cancels tagged calls on the envs of ``links`` (a pool's), from any thread; ``timeout``:
    seconds to wait for a worker's answer."""

    def __init__(self, links: Sequence[WorkerLink], timeout: float = 10.0):
        self._links = links
        self.timeout = float(timeout)
        self._lock = threading.Lock()
        self._ctx = zmq.Context()
        self._socks: dict[str, zmq.Socket] = {}
        self._seq = itertools.count(1)
        self._closed = False
        self._finalizer = weakref.finalize(self, _destroy, self._ctx)

    def cancel(self, calls: Iterable[tuple[int, str | int]], *, lent: bool = False) -> list[int]:
        """Cancel each ``(env index, tag)``; the indices whose call was found (queued or in
        flight) and cancelled. A call that already finished is left alone, but with ``lent`` a
        named env lent to the pool is killed whatever it runs (see the module doc)."""
        by_link: dict[WorkerLink, list[list]] = {}
        for index, tag in calls:
            link = link_holding(self._links, int(index))
            if link is None:
                raise IndexError(f"env index {index} is not one of this pool's")
            by_link.setdefault(link, []).append([int(index) - link.start, tag])
        cancelled: list[int] = []
        with self._lock:
            if self._closed:
                raise RuntimeError("this CallCanceller is closed (its pool closed)")
            for link, items in by_link.items():
                reply = self._call(link, {"op": CANCEL, "calls": items, CANCEL_LENT: lent})
                cancelled += [link.start + int(i) for i in reply.get("cancelled") or ()]
        return cancelled

    def _call(self, link: WorkerLink, header: dict) -> dict:
        sock = self._socket(link)
        seq = next(self._seq)
        header = dict(header, seq=seq, session=link.session, token=link.token)
        try:
            sock.send_multipart([encode_header(header)])
        except zmq.Again:
            raise WorkerError(f"worker {link.address} is unreachable: cannot send a cancel", link.address) from None
        deadline = time.monotonic() + self.timeout
        while (left := deadline - time.monotonic()) > 0:
            if not sock.poll(int(left * 1000) + 1, zmq.POLLIN):
                break
            reply = decode_header(sock.recv_multipart()[0])
            if reply.get("seq") != seq:
                continue  # the answer to a cancel that timed out earlier
            if not reply.get("ok"):
                error = reply.get("error") or {}
                raise WorkerError(f"worker {link.address} refused a cancel: {error.get('message')}", link.address)
            return reply
        raise WorkerTimeout(f"worker {link.address} did not answer a cancel within {self.timeout:g} s", link.address)

    def _socket(self, link: WorkerLink) -> zmq.Socket:
        sock = self._socks.get(link.address)
        if sock is None:
            sock = dealer_socket(self._ctx, link.keys, self.timeout)
            sock.connect(link.address)
            self._socks[link.address] = sock
        return sock

    def close(self) -> None:
        """Close the connections (the pool's ``close()`` does)."""
        with self._lock:
            self._closed = True
            for sock in self._socks.values():
                sock.close(linger=0)
            self._socks.clear()
        self._finalizer()


def _destroy(ctx: zmq.Context) -> None:
    ctx.destroy(linger=0)
