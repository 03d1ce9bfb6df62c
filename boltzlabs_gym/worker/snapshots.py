"""The snapshots a worker holds for its sessions: opaque blobs within one byte budget.

A blob is what an env wrote about its own state (:mod:`boltzlabs_gym.envstate`): untrusted
bytes that the worker only stores, counts and hands to another env of the same session (or
to its client, on export). It never looks inside. The budget bounds the worker's memory
for all sessions together; a snapshot over it is refused, and nothing is evicted behind a
client's back: blobs go when released, or with their session.
"""

from __future__ import annotations

import itertools
import secrets
import time
from dataclasses import dataclass, field

from ..protocol import DEFAULT_SNAPSHOT_BUDGET

__all__ = ["HeldSnapshot", "SnapshotBudgetExceeded", "SnapshotStore"]


class SnapshotBudgetExceeded(Exception):
    """Holding a blob would exceed the worker's snapshot budget."""


@dataclass(slots=True)
class HeldSnapshot:
    """One blob and where it came from."""

    id: str
    session: str
    source: int  # the pool-wide index of the env it was taken from; -1: imported
    kind: str
    blob: bytes
    created: float = field(default_factory=time.time)

    def describe(self) -> dict:
        return {"id": self.id, "kind": self.kind, "bytes": len(self.blob)}


class SnapshotStore:
    """Blobs by id, each owned by one session; ``budget`` bytes in all."""

    def __init__(self, budget: int = DEFAULT_SNAPSHOT_BUDGET):
        if budget < 0:
            raise ValueError(f"snapshot budget must be >= 0 bytes, got {budget}")
        self.budget = budget
        self.held_bytes = 0
        self._held: dict[str, HeldSnapshot] = {}
        # Unguessable ids: a client names only its own session's blobs, but an id leaked in a log
        # should not name another session's blob by luck either (ids are also checked per session).
        self._counter = itertools.count(1)

    def hold(self, session: str, source: int, kind: str, blob: bytes) -> HeldSnapshot:
        """Keep ``blob`` for ``session``; :class:`SnapshotBudgetExceeded` when it does not fit."""
        if self.held_bytes + len(blob) > self.budget:
            raise SnapshotBudgetExceeded(
                f"the worker's snapshot budget is {self.budget} bytes and {self.held_bytes} are held "
                f"({len(self._held)} snapshots, every client's); this one needs {len(blob)} more: release "
                "snapshots (snap.release()) or raise the budget (RLPool(snapshot_budget=...) for a local pool, "
                "`boltzlabs-gym worker --snapshot-budget` for a remote worker)"
            )
        snap = HeldSnapshot(f"z{next(self._counter)}-{secrets.token_hex(6)}", session, source, kind, bytes(blob))
        self._held[snap.id] = snap
        self.held_bytes += len(snap.blob)
        return snap

    def get(self, session: str, snapshot_id: object) -> HeldSnapshot | None:
        """The blob ``snapshot_id`` if ``session`` holds it (``None``: unknown, released or another's)."""
        snap = self._held.get(snapshot_id) if isinstance(snapshot_id, str) else None
        return snap if snap is not None and snap.session == session else None

    def release(self, session: str, snapshot_id: object) -> bool:
        """Forget one of ``session``'s blobs; whether it was held."""
        snap = self.get(session, snapshot_id)
        if snap is None:
            return False
        del self._held[snap.id]
        self.held_bytes -= len(snap.blob)
        return True

    def release_session(self, session: str) -> int:
        """Forget every blob of ``session`` (it closed); how many there were."""
        ids = [sid for sid, snap in self._held.items() if snap.session == session]
        for snapshot_id in ids:
            self.release(session, snapshot_id)
        return len(ids)

    def of_session(self, session: str) -> list[HeldSnapshot]:
        return [snap for snap in self._held.values() if snap.session == session]

    def session_bytes(self, session: str) -> int:
        return sum(len(snap.blob) for snap in self._held.values() if snap.session == session)

    def listing(self, session: str) -> list[dict]:
        """What ``status`` shows of a session's blobs."""
        now = time.time()
        return [
            {**snap.describe(), "source": snap.source, "age_s": round(now - snap.created, 1)}
            for snap in self.of_session(session)
        ]

    def __len__(self) -> int:
        return len(self._held)
