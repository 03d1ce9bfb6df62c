"""The worker's request handlers, one per op, and the table that dispatches to them.

A handler takes ``(worker, client, header, payloads)`` and returns the reply header, or ``None``
when the reply comes later (an upload unpacked on a thread, a ``create`` whose envs are starting,
a ``batch`` whose calls are in flight). Errors it raises become error replies
(``Worker._handle_request``). What a handler may use of the worker is :class:`WorkerView`: the
worker's state and its parts (scheduler, spawner, direct lane, memory snapshots).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from ..errors import ArchiveError
from ..wire.archive import is_archive_hash
from ..wire.keys import WorkerKeys
from ..wire.protocol import (
    ADOPT,
    AUTO,
    ERROR,
    FAULTS,
    LEND,
    LENT_FAULT,
    MAX_ENV_PAYLOAD_BYTES,
    MEMORY,
    OBS_REGION,
    OK,
    PARTIAL,
    PORTABLE,
    RESTORE,
    SANDBOX_SLOTS,
    SNAPSHOT,
    SNAPSHOT_ID,
    SNAPSHOT_KINDS,
    error_reply,
    parse_json,
)
from . import pss
from .cancels import op_cancel
from .direct_lane import DirectLane
from .envproc import EnvProcess, json_error
from .memory_snapshots.holders import Holder
from .memory_snapshots.snapshotter import Snapshotter, Swap
from .obs_regions import RegionCatcher
from .partial_replies import PartialBatch, PartialReplies
from .sandbox import select_backend
from .scheduler import Scheduler
from .session import LOCAL_CLIENT, Batch, Session, SessionConfig, SessionExpired
from .snapshot_store import SnapshotBudgetExceeded, SnapshotStore
from .spawner import Spawner
from .stats import WorkerStats, envs_by_state, read_lane_report
from .uploads import Uploads

log = logging.getLogger(__name__)


#: The most bytes one snapshot blob may have: one env reply's payload limit, which is also what an
#: env reads with one request (envstate.MAX_BLOB_BYTES keeps under it).
MAX_SNAPSHOT_BYTES = MAX_ENV_PAYLOAD_BYTES


#: A request's header, its payload frames, and a handler's reply header (None: it comes later).
Header = dict[str, Any]
Payloads = list[bytes]
Reply = dict[str, Any] | None


class WorkerView(Protocol):
    """What an op handler may use of the worker (:class:`~boltzlabs_gym.worker.router.Worker`)."""

    root: str
    capacity: int
    endpoints: list[str]
    keys: WorkerKeys | None
    metrics_url: str | None
    #: the CURVE key of the request being handled (None: the local pool, or no authentication)
    current_user: str | None
    archives: dict[str, str]
    uploads: Uploads
    sessions: dict[str, Session]
    snapshots: SnapshotStore
    stats: WorkerStats
    spawner: Spawner
    scheduler: Scheduler
    lane: DirectLane
    snapshotter: Snapshotter
    partial_replies: PartialReplies

    def session_for(self, client: bytes, header: Header) -> Session: ...
    def new_session_id(self) -> str: ...
    def close_session(self, session: Session) -> None: ...
    def send(self, client: bytes, header: Header, frames: Sequence = (), fds: Sequence[int] = ()) -> None: ...
    def reply_batch(self, batch: Batch) -> None: ...


Handler = Callable[[WorkerView, bytes, Header, Payloads], Reply]


class _SnapshotCatcher:
    """Stands in for a batch as a snapshot call's destination: keeps the env's blob in the worker's
    store and passes the batch the blob's id instead of its bytes. For a memory snapshot (``swap``)
    it finishes the role swap: the env's slot gets the continued source, the store the holder (see
    :class:`~.memory_snapshots.snapshotter.Snapshotter`)."""

    __slots__ = ("batch", "snapshotter", "session", "source", "swap", "memory_why")

    def __init__(self, batch: Batch, snapshotter: Snapshotter, session: Session, source: int):
        self.batch, self.snapshotter, self.session, self.source = batch, snapshotter, session, source
        self.swap: Swap | None = None
        self.memory_why: str | None = None  # "auto" fell back to portable here: why (said if that fails too)

    def done(self, pos: int, index: int, status: str, reply: bytes, payloads: list) -> None:
        if self.swap is not None:
            swap, self.swap = self.swap, None
            ended = self.snapshotter.end_swap(swap, self.session, self.source, status, reply, payloads)
            if ended is not None:
                status, reply, payloads = ended
            elif status == OK:
                status, reply, payloads = self._hold(reply, payloads)
        elif status == OK:
            status, reply, payloads = self._hold(reply, payloads)
        self.batch.done(pos, index, status, reply, payloads)

    def _hold(self, reply: bytes, payloads: list) -> tuple[str, bytes, list]:
        try:
            answer = parse_json(reply)
        except ValueError:
            return OK, reply, payloads  # the client reads it as the bad reply it is
        if not isinstance(answer, dict) or "snapshot" not in answer:
            if self.memory_why and isinstance(answer, dict) and isinstance(answer.get("error"), str):
                answer["error"] += f" (and a memory snapshot: {self.memory_why})"  # neither kind: say why for both
                return OK, json.dumps(answer).encode(), payloads
            return OK, reply, payloads  # the env's own error ({"error": ...}): passed on as it is
        info = answer["snapshot"]
        kind = info.get("kind") if isinstance(info, dict) else None
        if len(payloads) != 1 or not isinstance(kind, str) or len(kind) > 32:
            return ERROR, json_error(f"env {self.source} answered a snapshot without exactly one blob"), []
        try:
            held = self.snapshotter.store.hold(self.session.sid, self.source, kind, payloads[0])
        except SnapshotBudgetExceeded as exc:
            return ERROR, json_error(f"snapshot of env {self.source} refused: {exc}", refused="budget"), []
        return OK, json.dumps({"snapshot": held.describe()}).encode(), []


#: A snapshot or restore item as the env gets it (its op and frames), and where its result goes.
Prepared = tuple[dict, Sequence[bytes], "Batch | _SnapshotCatcher"]


# ====================================================================== the handlers
def op_ping(worker: WorkerView, client: bytes, header: Header, payloads: Payloads) -> Reply:
    if header.get("session") is not None:
        try:
            worker.session_for(client, header)  # a heartbeat renews the session's lease
        except (ValueError, SessionExpired):
            pass
    return {"ok": True, "pid": os.getpid(), "endpoints": worker.endpoints}


def op_has_archive(worker: WorkerView, client: bytes, header: Header, payloads: Payloads) -> Reply:
    digest = header.get("hash")
    return {"ok": True, "have": isinstance(digest, str) and digest in worker.archives}


def op_upload(worker: WorkerView, client: bytes, header: Header, payloads: Payloads) -> Reply:
    """Start unpacking an archive on a thread; the reply comes when it is done (see
    :mod:`~boltzlabs_gym.worker.uploads`), so other sessions are served meanwhile."""
    digest = header.get("hash")
    if not isinstance(digest, str) or len(payloads) != 1:
        raise ValueError("upload needs a 'hash' and exactly one archive frame")
    if digest in worker.archives:
        worker.stats.upload("cached")
        return {"ok": True}
    worker.stats.upload_bytes += len(payloads[0])
    if not is_archive_hash(digest):
        # It names a directory: checked here, before the thread checks the content.
        raise ArchiveError(
            f"upload 'hash' {digest[:80]!r} is not a SHA-256 hex digest (boltzlabs_gym.wire.archive.archive_hash)"
        )
    dest = os.path.join(worker.root, "archives", digest)
    worker.uploads.submit(digest, payloads[0], dest, waiter=(client, header.get("seq")))
    return None


def op_create(worker: WorkerView, client: bytes, header: Header, payloads: Payloads) -> Reply:
    digest = header.get("hash")
    if digest not in worker.archives:
        raise ValueError(f"archive {digest!r} was not uploaded to this worker")
    cfg = SessionConfig.from_header(header)
    # Capacity counts processes: a sandbox of K envs takes one slot.
    in_use = sum(len(s.envs) for s in worker.sessions.values())
    if in_use + cfg.sandboxes > worker.capacity:
        return error_reply(
            header.get("seq"),
            "capacity",
            f"worker has {worker.capacity - in_use} free sandbox slots of {worker.capacity}; asked for "
            f"{cfg.sandboxes} ({cfg.n} envs, {cfg.envs_per_sandbox} per sandbox)",
            free=worker.capacity - in_use,
        )
    gate = worker.snapshotter.gate
    backend = select_backend(cfg.isolation, gate=gate)
    sid = worker.new_session_id()
    root = os.path.join(worker.root, "sessions", sid)
    os.makedirs(os.path.join(root, "ws"))
    env_dir = worker.archives[digest]
    if cfg.mode == "boltz":
        # Envs are forked from a warm template that imported the env once; the
        # template launcher has the same launch()/report() shape as a backend.
        from .template import TemplateLauncher

        launcher = TemplateLauncher(backend, env_dir=env_dir, root=root, runtime=worker.spawner.runtime, gate=gate)
        session = Session(sid, client, env_dir, root, cfg, launcher, launcher.copies)
    else:
        session = Session(sid, client, env_dir, root, cfg, backend, worker.snapshotter.copies_for(backend))
    session.owner_key = worker.current_user
    session.create_seq = header.get("seq")
    session.lend = header.get(LEND) is True and worker.lane.may_lend(client, session)
    worker.sessions[sid] = session
    worker.stats.open(sid, cfg.n, cfg.envs_per_sandbox, cfg.mode)
    for env in session.envs:
        os.makedirs(env.workspace)
        worker.spawner.queue_start(session, env, None)
    return None  # the reply goes out when every env answered its first request


def op_batch(worker: WorkerView, client: bytes, header: Header, payloads: Payloads) -> Reply:
    session = worker.session_for(client, header)
    lane = worker.lane
    # What the pool reports about envs it held is acted on first, even if an item below is
    # refused: the pool has let go of those envs, and they must not stay lent.
    lane.apply_lent_reports(client, session, header)
    items = header.get("items")
    if not isinstance(items, list) or not (items or header.get(FAULTS) or header.get(ADOPT)):
        raise ValueError("batch needs a non-empty 'items' list")
    calls: list[tuple[int, dict, Sequence[bytes]]] = []
    used = 0
    seen = set()
    n_envs, n_frames = len(session.envs), len(payloads)
    for item in items:
        if type(item) is not list or len(item) != 3:
            raise ValueError(f"batch item must be [index, op, n_frames], got {str(item)[:80]}")
        index, op, nframes = item
        if type(index) is not int or not 0 <= index < n_envs:
            raise ValueError(f"env index {index!r} out of range 0..{n_envs - 1}")
        if index in seen:
            raise ValueError(f"env index {index} appears twice in one batch")
        seen.add(index)
        if type(op) is not dict or type(op.get("op")) is not str:
            raise ValueError(f"env {index}: op must be an object with an 'op' string")
        if op["op"] == LENT_FAULT and (client != LOCAL_CLIENT or type(op.get("reason")) is not str):
            raise ValueError(f"env {index}: {LENT_FAULT} is for a local pool's lent envs, with a reason string")
        if type(nframes) is not int or nframes < 0 or used + nframes > n_frames:
            raise ValueError(f"env {index}: frame count {nframes!r} does not match the frames sent")
        calls.append((index, op, payloads[used : used + nframes] if nframes else ()))
        used += nframes
    if used != len(payloads):
        raise ValueError(f"{len(payloads) - used} frames were sent that no item claims")
    copies: list[tuple[EnvProcess, dict, Batch | _SnapshotCatcher, int]] = []  # memory-snapshot restores
    lend = header.get(LEND) is True and session.lend and lane.may_lend(client, session)
    batch: Batch
    if header.get(PARTIAL) is True and calls:  # answered in parts, as its envs finish
        batch = worker.partial_replies.batch(client, header.get("seq"), len(calls))
    else:
        batch = Batch(client, header.get("seq"), len(calls), worker.reply_batch)
    batch.lend_from = session if lend else None
    batch.stats = worker.stats.sessions.get(session.sid)
    if session.cfg.envs_per_sandbox > 1:  # one item per sandbox: count its envs (per sandbox, not per env)
        batch.envs = sum(len(op.get(SANDBOX_SLOTS) or (0,)) for _, op, _ in calls)
    # The pool's own set-up of shared observations is no call of its user's: not counted as env calls.
    batch.envs -= sum(op["op"] == OBS_REGION for _, op, _ in calls)
    for pos, (index, op, frames) in enumerate(calls):
        env = session.envs[index]
        target: Batch | _SnapshotCatcher | RegionCatcher = batch
        if op["op"] == LENT_FAULT:
            lane.submit_lent_fault(session, env, op, batch, pos)
            continue
        lane.take_back(env)  # even for a refused item: the pool let go of it when it sent one
        if op["op"] == OBS_REGION:
            if client != LOCAL_CLIENT or isinstance(batch, PartialBatch):
                message = f"env {env.global_index}: shared observation regions are for a local pool's batches"
                batch.done(pos, env.index, ERROR, json_error(message, refused="obs_region"), [])
                continue
            target = RegionCatcher(batch, env, _submitter(worker, session, env, pos))
        if op["op"] in (SNAPSHOT, RESTORE):
            prepared = _prepare_snapshot_item(worker, session, env, op, frames, batch, pos)
            if prepared is None:
                continue  # refused: already answered, nothing sent to the env
            op, frames, target = prepared
            if "_holder" in op:
                copies.append((env, op, target, pos))  # forked together, after the loop
                continue
        worker.scheduler.submit(session, env, op, frames, target, pos)
    if copies:
        _restore_copies(worker, session, copies)
    worker.scheduler.seal_deadlines()
    if not calls:
        worker.reply_batch(batch)  # only faults or adoptions: nothing to wait for
    return None


def _submitter(worker: WorkerView, session: Session, env: EnvProcess, pos: int) -> Callable[[dict, Any], None]:
    """Queue a further request to ``env`` for batch position ``pos`` (a :class:`RegionCatcher`'s)."""

    def submit(op: dict, destination: Any) -> None:
        worker.scheduler.submit(session, env, op, (), destination, pos)

    return submit


def _prepare_snapshot_item(
    worker: WorkerView, session: Session, env: EnvProcess, op: dict, frames: Sequence[bytes], batch: Batch, pos: int
) -> Prepared | None:
    """A snapshot or restore item as the env gets it, and where its result goes; ``None`` when
    refused here (the item's result is then already in ``batch``)."""
    index = env.global_index
    if session.cfg.envs_per_sandbox > 1:
        message = f"env {index}: snapshots need envs_per_sandbox=1"
        batch.done(pos, env.index, ERROR, json_error(message, refused="envs_per_sandbox"), [])
        return None
    if op["op"] == SNAPSHOT:
        return _prepare_snapshot(worker, session, env, op, batch, pos)
    held = worker.snapshots.get(session.sid, op.get(SNAPSHOT_ID))
    if held is None or frames:
        why = "restore carries no frames" if frames else f"snapshot {str(op.get(SNAPSHOT_ID))[:40]!r} is not held"
        message = f"env {index}: {why} (released, or another session's)"
        batch.done(pos, env.index, ERROR, json_error(message, refused="not_held"), [])
        return None
    reseed = op.get("reseed")
    if held.holder is None:
        return {"op": RESTORE, "reseed": reseed}, (held.blob,), batch
    # a memory snapshot: the slot's process is replaced by a copy forked from the holder (with the
    # batch's other copies of it: _restore_copies), which then answers the restore like any env
    return {"op": RESTORE, "kind": MEMORY, "reseed": reseed, "_holder": held.holder}, (), batch


def _restore_copies(
    worker: WorkerView, session: Session, copies: list[tuple[EnvProcess, dict, Batch | _SnapshotCatcher, int]]
) -> None:
    """Fork the batch's memory-snapshot copies (``(env, op, batch, pos)``), per holder, then
    send each its restore request."""
    by_holder: dict[int, list[tuple[EnvProcess, dict, Batch | _SnapshotCatcher, int]]] = {}
    for item in copies:
        by_holder.setdefault(id(item[1]["_holder"]), []).append(item)
    for items in by_holder.values():
        holder: Holder = items[0][1]["_holder"]
        failed = worker.snapshotter.replace_with_copies(session, [env for env, _op, _b, _p in items], holder)
        for env, op, batch, pos in items:
            op.pop("_holder")
            if env.index in failed:
                message = f"env {env.global_index}: restore failed: {failed[env.index]}"
                log.warning("session %s %s", session.sid, message)
                batch.done(pos, env.index, ERROR, json_error(message), [])
            else:
                worker.scheduler.submit(session, env, op, (), batch, pos)


def _prepare_snapshot(
    worker: WorkerView, session: Session, env: EnvProcess, op: dict, batch: Batch, pos: int
) -> Prepared | None:
    """A snapshot item: a memory snapshot where the env can take one (``kind`` "auto" or
    "memory"), else a portable one; ``None`` when refused here."""
    index = env.global_index
    want = op.get("kind") or AUTO
    if want not in SNAPSHOT_KINDS:
        batch.done(pos, env.index, ERROR, json_error(f"env {index}: unknown snapshot kind {str(want)[:20]!r}"), [])
        return None
    catcher = _SnapshotCatcher(batch, worker.snapshotter, session, index)
    if want == PORTABLE:
        return {"op": SNAPSHOT}, (), catcher
    try:
        swap = worker.snapshotter.begin_swap(session, env)
    except SnapshotBudgetExceeded as exc:
        if want == MEMORY:
            message = f"snapshot of env {index} refused: {exc}"
            batch.done(pos, env.index, ERROR, json_error(message, refused="budget"), [])
            return None
        swap = f"it would not fit: {exc}"  # "auto": a portable snapshot, a blob, may still fit
    if isinstance(swap, Swap):
        catcher.swap = swap
        return {"op": SNAPSHOT, "kind": want, "swap": swap.nonce}, (), catcher
    why = swap
    if want == MEMORY:
        message = f"env {index}: cannot take a memory snapshot: {why}; take kind='portable' instead"
        batch.done(pos, env.index, ERROR, json_error(message, refused="memory"), [])
        return None
    catcher.memory_why = why
    return {"op": SNAPSHOT}, (), catcher


def op_snapshots(worker: WorkerView, client: bytes, header: Header, payloads: Payloads) -> Reply:
    """Release, export or import a session's snapshot blobs (see "Snapshots" in the protocol)."""
    session = worker.session_for(client, header)
    store = worker.snapshots
    action = header.get("action")
    if action == "release":
        ids = header.get("ids")
        if not isinstance(ids, list):
            raise ValueError("snapshots release needs an 'ids' list")
        return {"ok": True, "released": sum(store.release(session.sid, i) for i in ids)}
    if action == "export":
        held = store.get(session.sid, header.get("id"))
        if held is None:
            raise ValueError(f"snapshot {str(header.get('id'))[:40]!r} is not held by this session")
        worker.send(client, {"seq": header.get("seq"), "ok": True, **held.describe()}, [held.blob])
        return None
    if action == "import":
        kind = header.get("kind")
        if len(payloads) != 1 or not isinstance(kind, str) or len(kind) > 32:
            raise ValueError("snapshots import needs a 'kind' and exactly one blob frame")
        if len(payloads[0]) > MAX_SNAPSHOT_BYTES:
            raise ValueError(f"snapshot blob of {len(payloads[0])} bytes is over {MAX_SNAPSHOT_BYTES}")
        try:
            held = store.hold(session.sid, -1, kind, payloads[0])
        except SnapshotBudgetExceeded as exc:
            return error_reply(header.get("seq"), "snapshot_budget", str(exc))
        return {"ok": True, "snapshot": held.describe()}
    raise ValueError(f"snapshots 'action' must be release, export or import, got {str(action)[:40]!r}")


def op_memory(worker: WorkerView, client: bytes, header: Header, payloads: Payloads) -> Reply:
    session = worker.session_for(client, header)
    trees = pss.trees_pss([env.pid or 0 for env in session.envs])
    template_pss = getattr(session.backend, "pss", lambda: 0)()
    return {
        "ok": True,
        "pss": trees,
        "template_pss": template_pss,
        "worker_pss": pss.pid_pss(os.getpid()),
        "snapshot_bytes": worker.snapshots.session_bytes(session.sid),
    }


def op_close(worker: WorkerView, client: bytes, header: Header, payloads: Payloads) -> Reply:
    sid = header.get("session")
    session = worker.sessions.get(sid) if isinstance(sid, str) else None
    if session is not None:
        # Whoever holds the session's token (and CURVE key) may close it, as for every other
        # op; the ROUTER identity is only where the last reply went, not who owns the session.
        try:
            worker.session_for(client, header)
        except SessionExpired:
            return {"ok": True}  # its lease ran out just now: reclaimed, as closing would have
        worker.close_session(session)
    return {"ok": True}


def op_status(worker: WorkerView, client: bytes, header: Header, payloads: Payloads) -> Reply:
    sessions = []
    for s in worker.sessions.values():
        tree_pss = sum(pss.trees_pss([env.pid or 0 for env in s.envs]))
        template_pss = getattr(s.backend, "pss", lambda: 0)()
        sessions.append(
            {
                "session": s.sid,
                "envs": s.cfg.n,
                "sandboxes": len(s.envs),
                "envs_per_sandbox": s.cfg.envs_per_sandbox,
                "mode": s.cfg.mode,
                "pss_bytes": tree_pss,
                "template_pss_bytes": template_pss,
                "envs_per_gib": s.cfg.n / ((tree_pss + template_pss) / 2**30) if tree_pss else None,
                "isolation": s.backend.report().for_envs_per_sandbox(s.cfg.envs_per_sandbox).to_json(),
                "idle_s": round(time.monotonic() - s.last_seen, 1),
                "envs_by_state": envs_by_state(s.envs),
                "snapshots": worker.snapshots.listing(s.sid),
                **({"live": worker.stats.sessions[s.sid].live()} if s.sid in worker.stats.sessions else {}),
            }
        )
    in_use = sum(len(s.envs) for s in worker.sessions.values())
    return {
        "ok": True,
        "pid": os.getpid(),
        "endpoints": worker.endpoints,
        "authenticated": worker.keys is not None,
        "capacity": worker.capacity,
        "in_use": in_use,
        "free": worker.capacity - in_use,
        "worker_pss_bytes": pss.pid_pss(os.getpid()),
        "sessions": sessions,
        "metrics": worker.metrics_url,
        "uploads": dict(worker.stats.uploads),
        "auth_failures": worker.stats.auth_failures,
        "snapshot_budget": worker.snapshots.budget,
        "snapshot_bytes": worker.snapshots.held_bytes,
    }


def op_report(worker: WorkerView, client: bytes, header: Header, payloads: Payloads) -> Reply:
    """A local pool's count of what it stepped on its direct lane (the worker never sees those
    steps): ``{"lane": {"calls": n, "batch_s": [seconds, ...]}}``. Answered only when asked
    (``ack``): the pool sends one a second and does not wait for it."""
    if client != LOCAL_CLIENT:
        raise ValueError("report is for a local pool's direct lane")
    session = worker.session_for(client, header)
    calls, batch_seconds = read_lane_report(header.get("lane"))
    stats = worker.stats.sessions.get(session.sid)
    if stats is not None:
        stats.lane_report(calls, batch_seconds)
    return {"ok": True} if header.get("ack") is True else None


#: Op name -> its handler; looked up with whatever JSON value a request's ``op`` holds (a miss is an
#: unknown op). One per op of :data:`~boltzlabs_gym.wire.protocol.WORKER_OPS`.
HANDLERS: dict[object, Handler] = {
    "ping": op_ping,
    "has_archive": op_has_archive,
    "upload": op_upload,
    "create": op_create,
    "batch": op_batch,
    "memory": op_memory,
    "close": op_close,
    "status": op_status,
    "report": op_report,
    "snapshots": op_snapshots,
    "cancel": op_cancel,
}
