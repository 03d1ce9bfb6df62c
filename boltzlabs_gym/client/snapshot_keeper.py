"""A pool's snapshots, on the trainer's side: taking them, restoring and forking them into envs,
moving them between workers, and releasing what the workers hold.

:class:`SnapshotKeeper` is the one implementation of snapshot, restore and fork: ``RLPool``'s
:meth:`~boltzlabs_gym.client.pool.RLPool.snapshot`, ``restore`` and ``fork`` delegate to it, and
so does the vector env (which decodes the restored envs' observations itself, from the per-env
results :meth:`SnapshotKeeper.restore` returns). The :class:`~boltzlabs_gym.client.snapshot.Snapshot`
handles it makes save and release themselves through it (:meth:`SnapshotKeeper.export`,
:meth:`SnapshotKeeper.release`).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from ..errors import AsyncStateError, SnapshotError, WorkerError
from ..wire.protocol import MEMORY, OK, SNAPSHOT_KINDS
from .arguments import check_mask
from .batch_calls import BatchCalls
from .link import WorkerLink, link_holding
from .results import EnvResult
from .snapshot import Snapshot

__all__ = ["SnapshotKeeper"]

log = logging.getLogger("boltzlabs_gym.client.pool")


def _reason(r: EnvResult) -> str:
    """Why an env's snapshot call gave no snapshot: the worker's or the env's own words."""
    reply = r.reply if isinstance(r.reply, dict) else {}
    message = reply.get("message") or reply.get("error") or f"unexpected reply {str(reply)[:200]}"
    return f"{r.status}: {message}"


class SnapshotKeeper:
    """The snapshots of a pool of ``n`` envs whose env directory hashes to ``archive_hash``.

    ``links``: the pool's worker links (the list itself: a replaced worker's link takes its
    predecessor's place in it); ``calls``: the pool's batched calls; ``lost``: the workers found
    lost, with why (``RLPool.lost_workers``).
    """

    def __init__(
        self,
        links: list[WorkerLink],
        calls: BatchCalls,
        *,
        n: int,
        envs_per_sandbox: int,
        archive_hash: str,
        lost: Callable[[], dict[str, str]],
    ):
        self._links = links
        self._calls = calls
        self.n = n
        self.envs_per_sandbox = envs_per_sandbox
        self.archive_hash = archive_hash
        self._lost = lost
        #: Held snapshots whose handles were garbage collected: released with the next snapshot call.
        self._forgotten: list[tuple[str, str]] = []

    @property
    def closed(self) -> bool:
        """Whether the pool is closed (its workers hold nothing for it any more)."""
        return self._calls.closed

    # ------------------------------------------------------------------ the three calls
    def take(self, index: int, kind: str = "auto", meta: dict | None = None) -> Snapshot:
        """Env ``index``'s state now, held by its worker: :meth:`RLPool.snapshot
        <boltzlabs_gym.client.pool.RLPool.snapshot>`."""
        self._check_call("snapshot")
        index = self.check_index(index, "snapshot")
        if kind not in SNAPSHOT_KINDS:
            raise SnapshotError(f"snapshot kind must be one of {', '.join(SNAPSHOT_KINDS)}, got {kind!r}", index)
        link = self._link_of(index)
        self._check_not_lost({index: link}, "snapshot")
        self._release_forgotten()
        [r] = self._run([(index, {"op": "snapshot", "kind": kind}, ())])
        reply = r.reply if r.status == OK else None
        info = reply.get("snapshot") if isinstance(reply, dict) else None
        if not isinstance(info, dict) or not isinstance(info.get("id"), str):
            raise SnapshotError(f"cannot snapshot env {index}: {_reason(r)}", index)
        snap = Snapshot(
            kind=str(info.get("kind")),
            env=self.archive_hash,
            source=index,
            nbytes=int(info.get("bytes") or 0),
            keeper=self,
            worker=link.address,
            snapshot_id=info["id"],
            meta=meta,
        )
        # Dropped unreleased: its id is queued (no I/O in a finalizer, which may run mid-call) and
        # released by the next snapshot call; release() detaches this.
        snap._finalizer = weakref.finalize(snap, self._forgotten.append, (link.address, info["id"]))
        return snap

    def restore(
        self,
        snap: Snapshot,
        where: Sequence[int] | np.ndarray,
        *,
        reseed: Sequence[int] | None = None,
        fresh: bool = False,
    ) -> list[EnvResult]:
        """Make the envs ``where`` copies of ``snap`` (:meth:`RLPool.restore
        <boltzlabs_gym.client.pool.RLPool.restore>`); each target env's result, as a reset's."""
        self._check_call("restore")
        if not isinstance(snap, Snapshot):
            raise TypeError(
                f"restore needs a Snapshot (pool.snapshot(i) or Snapshot.load(path)), got {type(snap).__name__}"
            )
        snap.check_usable()
        if snap.env != self.archive_hash:
            raise SnapshotError(
                f"this snapshot of env {snap.source} is of another env directory (hash {snap.env[:12]}), not this "
                f"pool's ({self.archive_hash[:12]}); restore it into a pool of the same env",
                snap.source,
            )
        targets = self._targets(where)
        seeds = self._check_reseed(reseed, len(targets))
        links = {i: self._link_of(i) for i in targets}
        self._check_not_lost(links, "restore")
        if snap.worker is not None and snap.worker in self._lost():
            raise SnapshotError(
                f"the snapshot of env {snap.source} was held by worker {snap.worker}, which is lost; "
                "only snapshots saved before (snap.save) outlive their worker",
                snap.source,
            )
        self._release_forgotten()
        ids, imported = self._place(snap, {link.address: link for link in links.values()}.values())
        items = []
        for i, seed in zip(targets, seeds):
            items.append((i, {"op": "restore", "snapshot": ids[links[i].address], "reseed": seed}, ()))
        try:
            if fresh and snap.kind != MEMORY:  # (a memory snapshot's copies always are new processes)
                # A new process in a new sandbox for each copy first: nothing of what the slot's last
                # occupant left (child processes, /tmp files, module state) reaches the copy.
                self._run([(i, {"op": "hard_reset", "seed": None}, ()) for i in targets])
            return self._run(items)
        finally:
            for address, snapshot_id in imported:
                self.release(address, [snapshot_id])

    def fork(
        self,
        index: int,
        into: Sequence[int] | np.ndarray,
        *,
        reseed: Sequence[int] | None = None,
        fresh: bool = False,
        kind: str = "auto",
        meta: dict | None = None,
    ) -> list[EnvResult]:
        """Branch env ``index`` into the envs ``into``: :meth:`take`, :meth:`restore`, release. Every
        argument is checked before anything is sent; each target env's result, as a reset's."""
        index = self.check_index(index, "fork")
        targets = self._targets(into)
        if index in targets:
            raise SnapshotError(f"fork of env {index} into itself: leave {index} out of 'into'", index)
        self._check_reseed(reseed, len(targets))
        with self.take(index, kind=kind, meta=meta) as snap:
            return self.restore(snap, targets, reseed=reseed, fresh=fresh)

    # ------------------------------------------------------------------ what a handle asks of its keeper
    def export(self, snap: Snapshot) -> bytes:
        """The blob of a snapshot this pool's worker holds (for :meth:`Snapshot.save` and moves)."""
        self._calls.check_open()
        if self._calls.in_flight:
            # The export's reply and the batch's share the link: waiting for one drops the other.
            raise AsyncStateError("a snapshot cannot be saved or moved while a call is in flight; collect it first")
        link = next((lk for lk in self._links if lk.address == snap.worker), None)
        if link is None or snap.held_by(self, link.address) is None:
            raise SnapshotError(f"snapshot of env {snap.source} is not held by this pool's workers", snap.source)
        header, frames = link.recv(
            link.send({"op": "snapshots", "action": "export", "id": snap.held_by(self, link.address)}), 60.0
        )
        link.raise_for_error(header)
        if len(frames) != 1:
            raise SnapshotError(f"worker {link.address} sent {len(frames)} frames for a snapshot blob, not 1")
        return bytes(frames[0])

    def release(self, address: str | None, ids: list[str]) -> None:
        """Free the snapshots ``ids`` that the worker at ``address`` holds for this pool (queued for
        the next snapshot call while a batch is in flight)."""
        link = next((lk for lk in self._links if lk.address == address), None)
        if link is None or self.closed or self._calls.in_flight:
            if not self.closed and address is not None:
                self._forgotten.extend((address, i) for i in ids)
            return
        try:
            link.call({"op": "snapshots", "action": "release", "ids": ids}, timeout=30.0)
        except WorkerError:
            log.warning("could not release %d snapshot(s) on worker %s", len(ids), address)

    # ------------------------------------------------------------------ checks
    def check_index(self, index: Any, what: str) -> int:
        """``index`` as an env index of this pool, or :class:`~boltzlabs_gym.errors.SnapshotError` naming ``what``."""
        if not isinstance(index, (int, np.integer)) or isinstance(index, bool) or not 0 <= int(index) < self.n:
            raise SnapshotError(f"{what}: env index must be an int in [0, {self.n}), got {index!r}")
        return int(index)

    def _check_call(self, what: str) -> None:
        self._calls.check_open()
        if self._calls.in_flight:
            raise AsyncStateError(f"{what}() while a call is in flight; collect it with step_wait() first")
        if self.envs_per_sandbox > 1:
            raise SnapshotError(
                f"{what}() needs envs_per_sandbox=1: the envs of a multi-env sandbox share one process and "
                "one workspace, so one of them cannot be copied alone"
            )

    def _check_not_lost(self, links: dict[int, WorkerLink], what: str) -> None:
        """Refuse at once (not after a heartbeat's wait) a snapshot call that needs a lost worker;
        ``links``: each env's link."""
        lost = self._lost()
        if not lost:
            return
        for i, link in links.items():
            address = link.address
            if address in lost:
                raise SnapshotError(
                    f"{what}: env {i} is on worker {address}, which is lost; replace it and hard-reset its envs "
                    "(RayWorkers.replace_dead(), pool.reset(hard=True)) first",
                    i,
                )

    def _targets(self, where: Any) -> list[int]:
        if isinstance(where, np.ndarray) and where.dtype == np.bool_:
            targets = [int(i) for i in np.flatnonzero(check_mask(where, self.n))]
        else:
            if isinstance(where, (str, bytes)) or not hasattr(where, "__iter__"):
                raise SnapshotError(
                    f"'where' must be env indices or a boolean mask of shape ({self.n},), got {where!r}"
                )
            targets = [self.check_index(i, "restore") for i in where]
        if not targets:
            raise SnapshotError("'where' selects no env: name at least one env to restore into")
        if len(set(targets)) != len(targets):
            raise SnapshotError(f"'where' names an env twice: {targets}")
        return targets

    @staticmethod
    def _check_reseed(reseed: Any, count: int) -> list[int | None]:
        if reseed is None:
            return [None] * count
        seeds = list(reseed)
        if len(seeds) != count:
            raise SnapshotError(f"reseed needs one seed per env restored into: {count}, got {len(seeds)}")
        for s in seeds:
            if not isinstance(s, (int, np.integer)) or isinstance(s, bool) or s < 0:
                raise SnapshotError(f"reseed values must be non-negative ints, got {s!r}")
        return [int(s) for s in seeds]

    # ------------------------------------------------------------------ the workers' side
    def _link_of(self, index: int) -> WorkerLink:
        link = link_holding(self._links, index // self.envs_per_sandbox)
        if link is not None:
            return link
        raise SnapshotError(f"env {index} is on no worker of this pool")  # unreachable: the links cover every env

    def _place(self, snap: Snapshot, links: Iterable[WorkerLink]) -> tuple[dict[str, str], list[tuple[str, str]]]:
        """The snapshot's id on each of the workers of ``links``, importing it where it is not held;
        and the ids imported (released after the restore)."""
        ids: dict[str, str] = {}
        imported: list[tuple[str, str]] = []
        try:
            for link in links:
                held = snap.held_by(self, link.address)
                if held is None:
                    blob = snap.blob()
                    try:
                        header = link.call(
                            {"op": "snapshots", "action": "import", "kind": snap.kind}, [blob], timeout=60.0
                        )
                    except WorkerError as exc:
                        raise SnapshotError(f"worker {link.address} would not take the snapshot: {exc}") from None
                    held = str(header["snapshot"]["id"])
                    imported.append((link.address, held))
                ids[link.address] = held
        except BaseException:
            for address, snapshot_id in imported:
                self.release(address, [snapshot_id])
            raise
        return ids, imported

    def _release_forgotten(self) -> None:
        forgotten, self._forgotten = self._forgotten, []
        by_worker: dict[str, list[str]] = {}
        for address, snapshot_id in forgotten:
            by_worker.setdefault(address, []).append(snapshot_id)
        for address, ids in by_worker.items():
            self.release(address, ids)

    def _run(self, items: list) -> list[EnvResult]:
        self._calls.send(items)
        return self._calls.wait(None, raw=False)
