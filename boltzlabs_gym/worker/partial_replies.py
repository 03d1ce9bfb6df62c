"""Batches answered in parts: the worker's half of envs that don't wait for each other.

A ``batch`` request with ``"partial": true`` (:data:`~boltzlabs_gym.wire.protocol.PARTIAL`) is
collected by a :class:`PartialBatch`: each env's result is kept as it comes, and once per turn of
the worker's loop :meth:`PartialReplies.flush` sends every such batch's new results as one reply
part (``"more": true`` on all but the last). Results that arrive in the same turn (a policy step's
cheap envs, all answering within microseconds) still go out in one message; a slow env's result
goes out when it comes, without holding back the others. The pool side is
:mod:`boltzlabs_gym.client.async_steps`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from ..wire.protocol import MORE
from .direct_lane import DirectLane
from .session import Batch, pack_results

__all__ = ["PartialBatch", "PartialReplies"]


class PartialBatch(Batch):
    """A batch whose results leave in parts (see the module doc); made by :meth:`PartialReplies.batch`."""

    def __init__(self, client: bytes, seq, size: int, replies: PartialReplies):
        super().__init__(client, seq, size, on_complete=replies.queue)
        self._replies = replies
        #: Results in since the last part was sent: ``(index, status, reply, payloads)``.
        self.ready: list = []

    def done(self, pos: int, index: int, status: str, reply: bytes, payloads: list) -> None:
        if self.results[pos] is not None:
            return
        result = self.results[pos] = (index, status, reply, payloads)
        self.remaining -= 1
        self.ready.append(result)
        self._replies.queue(self)


class PartialReplies:
    """The partial batches with results to send; ``send(client, header, frames)`` is the worker's
    reply, ``lane`` lends a local pool's idle envs with a part (as with a whole batch's reply)."""

    def __init__(self, send: Callable[[bytes, dict, Sequence], None], lane: DirectLane):
        self._send = send
        self._lane = lane
        self._queued: dict[int, PartialBatch] = {}

    def batch(self, client: bytes, seq, size: int) -> PartialBatch:
        """A batch of ``size`` items for the request tagged ``seq`` from ``client``."""
        return PartialBatch(client, seq, size, self)

    def queue(self, batch: Batch) -> None:
        """``batch`` has results to send with the next :meth:`flush`."""
        if isinstance(batch, PartialBatch):
            self._queued[id(batch)] = batch

    @property
    def pending(self) -> bool:
        """Whether a part waits to be sent (the loop then must not sleep before :meth:`flush`)."""
        return bool(self._queued)

    def flush(self) -> None:
        """Send each queued batch's new results as one reply part."""
        queued, self._queued = self._queued, {}
        for batch in queued.values():
            self._send_part(batch)

    def _send_part(self, batch: PartialBatch) -> None:
        ready, batch.ready = batch.ready, []
        results, data = pack_results(ready)
        worker_s = time.perf_counter() - batch.t0
        more = batch.remaining > 0
        header = {"seq": batch.seq, "ok": True, "worker_ms": worker_s * 1e3, "results": results, MORE: more}
        if not more and batch.stats is not None and batch.envs:
            batch.stats.batch_done(worker_s, batch.envs)
        frames = [data]
        if batch.lend_from is not None:
            self._lane.send_lending(batch.lend_from, header, frames)
        else:
            self._send(batch.client, header, frames)
