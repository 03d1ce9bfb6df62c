"""The snapshots a worker holds for its sessions: opaque blobs within one byte budget.

A blob is what an env wrote about its own state (:mod:`boltzlabs_gym.envside.state`): untrusted
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
from typing import Any

from ..wire.protocol import DEFAULT_SNAPSHOT_BUDGET

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
    #: a memory snapshot's held process (:class:`~boltzlabs_gym.worker.memory_snapshots.holders.Holder`);
    #: None for a blob
    holder: Any = None
    #: what it counts against the budget: the blob's length, or a holder's memory and workspace copy
    nbytes: int = 0

    def describe(self) -> dict:
        return {"id": self.id, "kind": self.kind, "bytes": self.nbytes}


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
        #: released memory snapshots whose holders still wait for their copies: ``(session, holder)``
        self._lingering: list[tuple[str, Any]] = []

    def hold(
        self, session: str, source: int, kind: str, blob: bytes, *, holder: Any = None, nbytes: int | None = None
    ) -> HeldSnapshot:
        """Keep ``blob`` (or a memory snapshot's ``holder``, counted as ``nbytes``) for ``session``;
        :class:`SnapshotBudgetExceeded` when it does not fit (a refused holder is released)."""
        size = len(blob) if nbytes is None else nbytes
        if size > self.room():
            if holder is not None:
                holder.nbytes = size  # (it lingers until its copies and the continued source end)
                holder.release()
                self._lingering.append((session, holder))
            raise SnapshotBudgetExceeded(self.over_budget_message(size))
        snap_id = f"z{next(self._counter)}-{secrets.token_hex(6)}"
        snap = HeldSnapshot(snap_id, session, source, kind, bytes(blob), holder=holder, nbytes=size)
        if holder is not None:
            holder.nbytes = size
        self._held[snap.id] = snap
        self.held_bytes += size
        return snap

    def room(self) -> int:
        """Bytes the budget has left (released holders that still wait for their copies count)."""
        self._prune_lingering()
        return max(0, self.budget - self.held_bytes - self._lingering_bytes())

    def over_budget_message(self, size: int) -> str:
        return (
            f"the worker's snapshot budget is {self.budget} bytes and {self.budget - self.room()} are held "
            f"({len(self._held)} snapshots, every client's); this one needs {size} more: release "
            "snapshots (snap.release()) or raise the budget (RLPool(snapshot_budget=...) for a local pool, "
            "`boltzlabs-gym worker --snapshot-budget` for a remote worker)"
        )

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
        self.held_bytes -= snap.nbytes
        if snap.holder is not None:
            # the holder is PID 1 of the namespace its copies (and the continued source) live under:
            # it exits after the last of them, and counts until then
            snap.holder.release()
            self._lingering.append((session, snap.holder))
        return True

    def kill_session_holders(self, session: str) -> None:
        """Kill every holder of ``session`` now, held or released (the session is closing)."""
        for snap in self.of_session(session):
            if snap.holder is not None:
                snap.holder.kill()
        for owner, holder in self._lingering:
            if owner == session:
                holder.kill()

    def _prune_lingering(self) -> None:
        self._lingering = [(s, h) for s, h in self._lingering if h.alive()]

    def _lingering_bytes(self, session: str | None = None) -> int:
        """Released holders still alive, as they were counted when taken (not measured again: reading
        a process's PSS walks its page tables)."""
        return sum(h.nbytes for s, h in self._lingering if session is None or s == session)

    def release_session(self, session: str) -> int:
        """Forget every blob of ``session`` (it closed) and kill its holders; how many there were."""
        self.kill_session_holders(session)
        ids = [sid for sid, snap in self._held.items() if snap.session == session]
        for snapshot_id in ids:
            self.release(session, snapshot_id)
        self._lingering = [(s, h) for s, h in self._lingering if s != session]
        return len(ids)

    def of_session(self, session: str) -> list[HeldSnapshot]:
        return [snap for snap in self._held.values() if snap.session == session]

    def session_bytes(self, session: str) -> int:
        """What ``session``'s snapshots hold: blobs, held processes and released holders that still
        wait for their copies (processes measured now)."""
        self._prune_lingering()
        held = sum(
            snap.holder.pss() if snap.holder is not None else len(snap.blob) for snap in self.of_session(session)
        )
        return held + sum(h.pss() for s, h in self._lingering if s == session)

    def listing(self, session: str) -> list[dict]:
        """What ``status`` shows of a session's blobs."""
        now = time.time()
        return [
            {**snap.describe(), "source": snap.source, "age_s": round(now - snap.created, 1)}
            for snap in self.of_session(session)
        ]

    def __len__(self) -> int:
        return len(self._held)
