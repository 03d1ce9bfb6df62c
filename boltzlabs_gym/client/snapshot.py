"""Snapshots of live envs, on the trainer's side: :class:`Snapshot`, a handle on one env's state.

A snapshot is taken by :meth:`RLPool.snapshot <boltzlabs_gym.client.pool.RLPool.snapshot>` (or the
vector env's), restored into other slots by ``restore`` and used by ``fork``, all of them the work of
the pool's :class:`~boltzlabs_gym.client.snapshot_keeper.SnapshotKeeper`, which the handle asks to
save and release it. Its state is
either a held process on its worker (``kind="memory"``: a fork of the env, copied again for each
restore; see :mod:`boltzlabs_gym.envside.memory_snapshot`), or a blob the env wrote about itself inside
its sandbox (``kind="portable"``, see :mod:`boltzlabs_gym.envside.state`), which the worker, the
trainer and a saved file only carry: the blob is unpickled nowhere but inside a sandbox, so
loading a snapshot file runs no code in the trainer.

>>> snap = Snapshot.from_blob(b"BLZSTATE1\\n...", env="e3b0c442", source=2)   # what Snapshot.load gives
>>> snap.kind, snap.source, snap.saveable, snap.nbytes
('portable', 2, True, 13)
"""

from __future__ import annotations

import json
import os
import time
import weakref
from typing import Any

from ..errors import SnapshotError
from ..wire.protocol import PORTABLE

# The keeper of the pool that holds a snapshot is typed Any here: it imports this module, not the reverse.
SnapshotKeeper = Any

__all__ = ["Snapshot", "SNAPSHOT_FILE_MAGIC"]

#: The first line of a saved snapshot file; a JSON header line and the blob follow.
SNAPSHOT_FILE_MAGIC = b"BOLTZLABS-SNAPSHOT 1\n"
#: The most bytes of JSON header :meth:`Snapshot.load` reads.
_MAX_HEADER = 1 << 20
#: The kinds that can leave the worker that took them (saved, moved to another worker).
SAVEABLE_KINDS = frozenset({PORTABLE})


class Snapshot:
    """One env's state at one moment: held by a worker, or in memory after :meth:`load`.

    * ``kind``: how the state was captured (``"memory"``: the env process, held by its worker;
      ``"portable"``: the env's own state blob, see :mod:`boltzlabs_gym.envside.state`);
      :attr:`saveable` says whether it can leave its worker (portable only).
    * ``source``: the index of the env it was taken from, in its pool; ``env``: the content hash
      of that pool's env directory (a snapshot restores only into envs of the same directory).
    * ``nbytes``: what counts against the worker's snapshot budget while held: the blob's size, or
      the held process's memory (PSS when taken) and its workspace copy.

    It outlives its source: it restores after that env was stepped, reset, killed or closed.
    :meth:`release` (or leaving a ``with`` block) frees the worker's copy; a released snapshot
    refuses to restore. Closing the pool releases what it holds.
    """

    def __init__(
        self,
        *,
        kind: str,
        env: str,
        source: int,
        nbytes: int,
        keeper: SnapshotKeeper | None = None,
        worker: str | None = None,
        snapshot_id: str | None = None,
        blob: bytes | None = None,
        meta: dict | None = None,
    ):
        self.kind = kind
        self.env = env
        self.source = source
        self.nbytes = nbytes
        self.created = time.time()
        #: Trainer-side bookkeeping that travels with it (the vector env's autoreset state, say).
        self.meta: dict = dict(meta or {})
        self._keeper = weakref.ref(keeper) if keeper is not None else None
        self._worker = worker
        self._id = snapshot_id
        self._blob = blob
        self._released = False
        #: Set by the keeper that took it: queues its release if the handle is dropped unreleased.
        self._finalizer: weakref.finalize | None = None

    @classmethod
    def from_blob(cls, blob: bytes, *, env: str, source: int = -1, kind: str = PORTABLE, meta: dict | None = None):
        """A snapshot that holds its blob in memory (what :meth:`load` returns)."""
        return cls(kind=kind, env=env, source=source, nbytes=len(blob), blob=bytes(blob), meta=meta)

    # ------------------------------------------------------------------ state
    @property
    def saveable(self) -> bool:
        """Whether the state can leave its worker: saved to a file, or restored on another worker."""
        return self.kind in SAVEABLE_KINDS

    @property
    def released(self) -> bool:
        return self._released

    @property
    def worker(self) -> str | None:
        """The address of the worker that holds it (``None``: held in memory only)."""
        return self._worker if self._id is not None else None

    def held_by(self, keeper: SnapshotKeeper, worker: str) -> str | None:
        """Its id on ``worker`` if that worker holds it for the session of ``keeper``'s pool, else ``None``."""
        if self._id is None or self._keeper is None or self._keeper() is not keeper or self._worker != worker:
            return None
        return self._id

    def check_usable(self) -> None:
        """Raise :class:`SnapshotError` if it was released."""
        if self._released:
            raise SnapshotError(
                f"snapshot of env {self.source} was released; take a new one with pool.snapshot(i)", self.source
            )

    def blob(self) -> bytes:
        """The state blob (fetched from its worker each time for a snapshot a worker holds: the
        trainer keeps no copy of it; kept in memory for one loaded from a file)."""
        self.check_usable()
        if self._blob is not None:
            return self._blob
        if not self.saveable:
            raise SnapshotError(
                f"a {self.kind!r} snapshot of env {self.source} cannot leave worker {self._worker}: "
                "restore it into envs of that worker",
                self.source,
            )
        keeper = self._keeper() if self._keeper is not None else None
        if keeper is None or keeper.closed:
            raise SnapshotError(
                f"the pool that holds this snapshot of env {self.source} is closed, and the snapshot "
                "was not saved; save snapshots you want to keep (snap.save(path)) before closing their pool",
                self.source,
            )
        return keeper.export(self)

    # ------------------------------------------------------------------ files
    def save(self, path: str | os.PathLike) -> None:
        """Write it to ``path`` (a header line of JSON, then the blob); :meth:`load` reads it back."""
        try:
            meta = json.dumps(self.meta, separators=(",", ":"))
        except (TypeError, ValueError) as exc:
            raise SnapshotError(f"snapshot meta must be JSON to be saved: {exc}", self.source) from None
        blob = self.blob()
        header = {
            "kind": self.kind,
            "env": self.env,
            "source": self.source,
            "nbytes": len(blob),
            "created": self.created,
        }
        line = json.dumps(header, separators=(",", ":"))[:-1] + f',"meta":{meta}}}\n'
        tmp = f"{os.fspath(path)}.tmp{os.getpid()}"
        try:
            with open(tmp, "wb") as f:
                f.write(SNAPSHOT_FILE_MAGIC)
                f.write(line.encode())
                f.write(blob)
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise

    @classmethod
    def load(cls, path: str | os.PathLike) -> Snapshot:
        """A snapshot saved by :meth:`save`. Nothing in the file is executed here: its blob is
        unpickled only inside the sandbox it is restored into."""
        with open(path, "rb") as f:
            if f.read(len(SNAPSHOT_FILE_MAGIC)) != SNAPSHOT_FILE_MAGIC:
                raise SnapshotError(f"{os.fspath(path)!r} is not a boltzlabs_gym snapshot file")
            line = f.readline(_MAX_HEADER)
            try:
                header = json.loads(line)
                kind, env, source, nbytes = header["kind"], header["env"], header["source"], header["nbytes"]
                meta = header.get("meta") or {}
            except (ValueError, KeyError, TypeError) as exc:
                raise SnapshotError(f"{os.fspath(path)!r}: unreadable snapshot header ({exc})") from None
            blob = f.read()
        created = header.get("created", 0.0)
        if not (
            isinstance(kind, str)
            and isinstance(env, str)
            and type(source) is int
            and type(nbytes) is int
            and isinstance(created, (int, float))
        ):
            raise SnapshotError(f"{os.fspath(path)!r}: malformed snapshot header")
        if len(blob) != nbytes:
            raise SnapshotError(f"{os.fspath(path)!r} is cut short: {len(blob)} of {nbytes} bytes of state")
        snap = cls.from_blob(blob, env=env, source=source, kind=kind, meta=meta if isinstance(meta, dict) else {})
        snap.created = float(created) or snap.created
        return snap

    # ------------------------------------------------------------------ life
    def release(self) -> None:
        """Free the worker's copy (and the in-memory one); idempotent. It restores no more after."""
        if self._released:
            return
        self._released = True
        self._blob = None
        if self._finalizer is not None:
            self._finalizer.detach()
        keeper = self._keeper() if self._keeper is not None else None
        if keeper is not None and self._id is not None and not keeper.closed:
            keeper.release(self._worker, [self._id])
        self._id = None

    def __enter__(self) -> Snapshot:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def __repr__(self) -> str:
        where = "released" if self._released else (f"on {self._worker}" if self._id else "in memory")
        return f"Snapshot(kind={self.kind!r}, source={self.source}, nbytes={self.nbytes}, {where})"
