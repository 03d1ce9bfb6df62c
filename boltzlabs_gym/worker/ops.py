"""The worker's request handlers, one per op, and the table that dispatches to them.

A part of :class:`~boltzlabs_gym.worker.server.Worker`. A handler takes ``(client,
header, payloads)`` and returns the reply header, or ``None`` when the reply comes later
(an upload unpacked on a thread, a ``create`` whose envs are starting, a ``batch`` whose
calls are in flight). Errors it raises become error replies (``Worker._handle_request``).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import ClassVar

from ..errors import ArchiveError
from ..wire.archive import is_archive_hash
from ..wire.protocol import (
    ADOPT,
    AUTO,
    ERROR,
    FAULTS,
    GROUP_SLOTS,
    LEND,
    LENT_FAULT,
    MAX_ENV_PAYLOAD_BYTES,
    MEMORY,
    OK,
    PORTABLE,
    RESTORE,
    SNAPSHOT,
    SNAPSHOT_ID,
    SNAPSHOT_KINDS,
    error_reply,
    parse_json,
)
from . import pss as memory
from .envproc import json_error
from .memory_snapshots.holders import copy_workspace
from .parts import WorkerParts
from .sandbox import select_backend
from .session import LOCAL_CLIENT, Batch, Session, SessionConfig, SessionExpired
from .snapshot_store import SnapshotBudgetExceeded
from .stats import envs_by_state, read_lane_report

log = logging.getLogger(__name__)


#: The most bytes one snapshot blob may have: one env reply's payload limit, which is also what an
#: env reads with one request (envstate.MAX_BLOB_BYTES keeps under it).
MAX_SNAPSHOT_BYTES = MAX_ENV_PAYLOAD_BYTES


class _SnapshotCatcher:
    """Stands in for a batch as a snapshot call's destination: keeps the env's blob in the worker's
    store and passes the batch the blob's id instead of its bytes. For a memory snapshot
    (``swap``: the launcher, the env, the worker's end of the continued source's socket and the
    workspace copy) it finishes the role swap: the env's slot gets the continued source, the
    store the holder (see :mod:`boltzlabs_gym.envside.memory_snapshot`)."""

    __slots__ = ("batch", "store", "session", "source", "swap", "memory_why")

    def __init__(self, batch: Batch, store, session: Session, source: int):
        self.batch, self.store, self.session, self.source = batch, store, session, source
        self.swap: tuple | None = None
        self.memory_why: str | None = None  # "auto" fell back to portable here: why (said if that fails too)

    def done(self, pos: int, index: int, status: str, reply: bytes, payloads: list) -> None:
        if self.swap is not None:
            status, reply, payloads = self._end_swap(status, reply, payloads)
        elif status == OK:
            status, reply, payloads = self._hold(reply, payloads)
        self.batch.done(pos, index, status, reply, payloads)

    def _end_swap(self, status: str, reply: bytes, payloads: list) -> tuple[str, bytes, list]:
        assert self.swap is not None
        launcher, env, sock, workspace_copy, workspace_bytes = self.swap
        self.swap = None
        info = None
        if status == OK:
            try:
                answer = parse_json(reply)
                info = answer.get("snapshot") if isinstance(answer, dict) else None
            except ValueError:
                pass
        swapped = isinstance(info, dict) and info.get("kind") == MEMORY and not payloads
        launched = env.launched
        try:
            result = launcher.end_swap(launched, sock, swapped, workspace_copy) if launched is not None else None
        except Exception as exc:  # noqa: BLE001 - the env swapped but cannot be tracked: end it
            log.warning("memory snapshot of env %s: %s", self.source, exc)
            shutil.rmtree(workspace_copy, ignore_errors=True)
            if launched is not None:
                launched.kill()
            return ERROR, json_error(f"memory snapshot of env {self.source} failed: {exc}; the env was ended"), []
        if result is None:
            shutil.rmtree(workspace_copy, ignore_errors=True)
            return self._hold(reply, payloads) if status == OK else (status, reply, payloads)
        env.launched, holder = result
        env.workspace_pinned = True  # (the holder keeps it mounted: the slot's next process gets another)
        nbytes = holder.pss() + workspace_bytes
        try:
            held = self.store.hold(self.session.sid, self.source, MEMORY, b"", holder=holder, nbytes=nbytes)
        except SnapshotBudgetExceeded as exc:
            return ERROR, json_error(f"snapshot of env {self.source} refused: {exc}", refused="budget"), []
        return OK, json.dumps({"snapshot": held.describe()}).encode(), []

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
            held = self.store.hold(self.session.sid, self.source, kind, payloads[0])
        except SnapshotBudgetExceeded as exc:
            return ERROR, json_error(f"snapshot of env {self.source} refused: {exc}", refused="budget"), []
        return OK, json.dumps({"snapshot": held.describe()}).encode(), []


class OpHandlers(WorkerParts):
    """``_op_<name>`` for each op of :data:`~boltzlabs_gym.wire.protocol.WORKER_OPS`; :attr:`HANDLERS` maps
    names to them."""

    def _op_ping(self, client, header, payloads):
        if header.get("session") is not None:
            try:
                self._session_for(client, header)  # a heartbeat renews the session's lease
            except (ValueError, SessionExpired):
                pass
        return {"ok": True, "pid": os.getpid(), "endpoints": self.endpoints}

    def _op_has_archive(self, client, header, payloads):
        digest = header.get("hash")
        return {"ok": True, "have": isinstance(digest, str) and digest in self.archives}

    def _op_upload(self, client, header, payloads):
        """Start unpacking an archive on a thread; the reply comes when it is done (see
        :mod:`~boltzlabs_gym.worker.uploads`), so other sessions are served meanwhile."""
        digest = header.get("hash")
        if not isinstance(digest, str) or len(payloads) != 1:
            raise ValueError("upload needs a 'hash' and exactly one archive frame")
        if digest in self.archives:
            self.stats.upload("cached")
            return {"ok": True}
        self.stats.upload_bytes += len(payloads[0])
        if not is_archive_hash(digest):
            # It names a directory: checked here, before the thread checks the content.
            raise ArchiveError(
                f"upload 'hash' {digest[:80]!r} is not a SHA-256 hex digest (boltzlabs_gym.wire.archive.archive_hash)"
            )
        dest = os.path.join(self.root, "archives", digest)
        self.uploads.submit(digest, payloads[0], dest, waiter=(client, header.get("seq")))
        return None

    def _op_create(self, client, header, payloads):
        digest = header.get("hash")
        if digest not in self.archives:
            raise ValueError(f"archive {digest!r} was not uploaded to this worker")
        cfg = SessionConfig.from_header(header)
        # Capacity counts processes: a sandbox of K envs takes one slot.
        in_use = sum(len(s.envs) for s in self.sessions.values())
        if in_use + cfg.sandboxes > self.capacity:
            return error_reply(
                header.get("seq"),
                "capacity",
                f"worker has {self.capacity - in_use} free sandbox slots of {self.capacity}; asked for "
                f"{cfg.sandboxes} ({cfg.n} envs, {cfg.envs_per_sandbox} per sandbox)",
                free=self.capacity - in_use,
            )
        backend = select_backend(cfg.isolation)
        sid = f"s{next(self._sid_counter)}"
        root = os.path.join(self.root, "sessions", sid)
        os.makedirs(os.path.join(root, "ws"))
        if cfg.mode == "boltz":
            # Envs are forked from a warm template that imported the env once; the
            # template launcher has the same launch()/report() shape as a backend.
            from .template import TemplateLauncher

            backend = TemplateLauncher(backend, env_dir=self.archives[digest], root=root, runtime=self.runtime)
        session = Session(sid, client, self.archives[digest], root, cfg, backend)
        session.owner_key = getattr(self, "_current_user", None)
        session.create_seq = header.get("seq")
        session.lend = header.get(LEND) is True and self._may_lend(client, session)
        self.sessions[sid] = session
        self.stats.open(sid, cfg.n, cfg.envs_per_sandbox, cfg.mode)
        for env in session.envs:
            os.makedirs(env.workspace)
            self._queue_start(session, env, None)
        return None  # the reply goes out when every env answered its first request

    def _op_batch(self, client, header, payloads):
        session = self._session_for(client, header)
        # What the pool reports about envs it held is acted on first, even if an item below is
        # refused: the pool has let go of those envs, and they must not stay lent.
        self._apply_lent_reports(client, session, header)
        items = header.get("items")
        if not isinstance(items, list) or not (items or header.get(FAULTS) or header.get(ADOPT)):
            raise ValueError("batch needs a non-empty 'items' list")
        calls = []
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
        copies: list = []  # memory-snapshot restores: forked together, after the loop
        lend = header.get(LEND) is True and session.lend and self._may_lend(client, session)
        batch = Batch(client, header.get("seq"), len(calls), self._reply_batch)
        batch.lend_from = session if lend else None
        batch.stats = self.stats.sessions.get(session.sid)
        if session.cfg.envs_per_sandbox > 1:  # one item per sandbox: count its envs (per sandbox, not per env)
            batch.envs = sum(len(op.get(GROUP_SLOTS) or (0,)) for _, op, _ in calls)
        for pos, (index, op, frames) in enumerate(calls):
            env = session.envs[index]
            target: Batch | _SnapshotCatcher = batch
            if op["op"] != LENT_FAULT:
                self._take_back(env)  # even for a refused item: the pool let go of it when it sent one
            if op["op"] in (SNAPSHOT, RESTORE):
                prepared = self._prepare_snapshot_item(session, env, op, frames, batch, pos)
                if prepared is None:
                    continue  # refused: already answered, nothing sent to the env
                op, frames, target = prepared
                if "_holder" in op:
                    copies.append((env, op, target, pos))
                    continue
            self._submit(session, env, op, frames, target, pos)
        if copies:
            self._restore_copies(session, copies)
        self._deadlines.seal(time.monotonic())
        if not calls:
            self._reply_batch(batch)  # only faults or adoptions: nothing to wait for
        return None

    def _prepare_snapshot_item(self, session: Session, env, op: dict, frames, batch: Batch, pos: int):
        """A snapshot or restore item as the env gets it, and where its result goes; ``None`` when
        refused here (the item's result is then already in ``batch``)."""
        index = env.global_index
        if session.cfg.envs_per_sandbox > 1:
            message = f"env {index}: snapshots need envs_per_sandbox=1"
            batch.done(pos, env.index, ERROR, json_error(message, refused="envs_per_sandbox"), [])
            return None
        if op["op"] == SNAPSHOT:
            return self._prepare_snapshot(session, env, op, batch, pos)
        held = self.snapshots.get(session.sid, op.get(SNAPSHOT_ID))
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

    def _restore_copies(self, session: Session, copies: list) -> None:
        """Fork the batch's memory-snapshot copies (``(env, op, batch, pos)``), per holder, then
        send each its restore request."""
        by_holder: dict = {}
        for item in copies:
            by_holder.setdefault(id(item[1]["_holder"]), []).append(item)
        for items in by_holder.values():
            holder = items[0][1]["_holder"]
            failed = self._replace_with_copies(session, [env for env, _op, _b, _p in items], holder)
            for env, op, batch, pos in items:
                op.pop("_holder")
                if env.index in failed:
                    message = f"env {env.global_index}: restore failed: {failed[env.index]}"
                    log.warning("session %s %s", session.sid, message)
                    batch.done(pos, env.index, ERROR, json_error(message), [])
                else:
                    self._submit(session, env, op, (), batch, pos)

    def _prepare_snapshot(self, session: Session, env, op: dict, batch: Batch, pos: int):
        """A snapshot item: a memory snapshot where the env can take one (``kind`` "auto" or
        "memory"), else a portable one; ``None`` when refused here."""
        index = env.global_index
        want = op.get("kind") or AUTO
        if want not in SNAPSHOT_KINDS:
            batch.done(pos, env.index, ERROR, json_error(f"env {index}: unknown snapshot kind {str(want)[:20]!r}"), [])
            return None
        catcher = _SnapshotCatcher(batch, self.snapshots, session, index)
        if want == PORTABLE:
            return {"op": SNAPSHOT}, (), catcher
        why = (
            session.backend.memory_snapshots_unavailable(env.launched)
            if hasattr(session.backend, "memory_snapshots_unavailable")
            else "memory snapshots need the namespaces backend (a sandbox that can nest one per copy)"
        )
        if why is None:
            # Nothing of the env runs now (the worker checked: one thread, blocked reading its next
            # request, no other process), so its workspace holds still while the worker copies it.
            room = self.snapshots.room()
            copy = tempfile.mkdtemp(prefix="snap-", dir=os.path.dirname(env.workspace))
            try:
                nbytes = copy_workspace(env.workspace, copy, max_bytes=room)
                # the budget before the env is asked (a refusal after the swap would leave it changed):
                # the workspace copy and, for the holder, half the env's memory (shared with the source)
                needed = nbytes + memory.pid_pss(env.pid or 0) // 2
                if needed > room:
                    raise SnapshotBudgetExceeded(self.snapshots.over_budget_message(needed))
                nonce = secrets.token_hex(8)
                sock = session.backend.begin_swap(env.launched, nonce)
            except SnapshotBudgetExceeded as exc:
                shutil.rmtree(copy, ignore_errors=True)
                if want == MEMORY:
                    message = f"snapshot of env {index} refused: {exc}"
                    batch.done(pos, env.index, ERROR, json_error(message, refused="budget"), [])
                    return None
                why = f"it would not fit: {exc}"  # "auto": a portable snapshot, a blob, may still fit
            except Exception as exc:  # noqa: BLE001 - the env was not asked: nothing changed
                shutil.rmtree(copy, ignore_errors=True)
                why = f"could not prepare it: {type(exc).__name__}: {exc}"
            else:
                catcher.swap = (session.backend, env, sock, copy, nbytes)
                return {"op": SNAPSHOT, "kind": want, "swap": nonce}, (), catcher
        if want == MEMORY:
            message = f"env {index}: cannot take a memory snapshot: {why}; take kind='portable' instead"
            batch.done(pos, env.index, ERROR, json_error(message, refused="memory"), [])
            return None
        catcher.memory_why = why
        return {"op": SNAPSHOT}, (), catcher

    def _op_snapshots(self, client, header, payloads):
        """Release, export or import a session's snapshot blobs (see "Snapshots" in the protocol)."""
        session = self._session_for(client, header)
        store = self.snapshots
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
            self._send(client, {"seq": header.get("seq"), "ok": True, **held.describe()}, [held.blob])
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

    def _op_memory(self, client, header, payloads):
        session = self._session_for(client, header)
        pss = memory.trees_pss([env.pid or 0 for env in session.envs])
        template_pss = getattr(session.backend, "pss", lambda: 0)()
        return {
            "ok": True,
            "pss": pss,
            "template_pss": template_pss,
            "worker_pss": memory.pid_pss(os.getpid()),
            "snapshot_bytes": self.snapshots.session_bytes(session.sid),
        }

    def _op_close(self, client, header, payloads):
        sid = header.get("session")
        session = self.sessions.get(sid) if isinstance(sid, str) else None
        if session is not None:
            # Whoever holds the session's token (and CURVE key) may close it, as for every other
            # op; the ROUTER identity is only where the last reply went, not who owns the session.
            try:
                self._session_for(client, header)
            except SessionExpired:
                return {"ok": True}  # its lease ran out just now: reclaimed, as closing would have
            self._close_session(session)
        return {"ok": True}

    def _op_status(self, client, header, payloads):
        sessions = []
        for s in self.sessions.values():
            pss = sum(memory.trees_pss([env.pid or 0 for env in s.envs]))
            template_pss = getattr(s.backend, "pss", lambda: 0)()
            sessions.append(
                {
                    "session": s.sid,
                    "envs": s.cfg.n,
                    "sandboxes": len(s.envs),
                    "envs_per_sandbox": s.cfg.envs_per_sandbox,
                    "mode": s.cfg.mode,
                    "pss_bytes": pss,
                    "template_pss_bytes": template_pss,
                    "envs_per_gib": s.cfg.n / ((pss + template_pss) / 2**30) if pss else None,
                    "isolation": s.backend.report().for_envs_per_sandbox(s.cfg.envs_per_sandbox).to_json(),
                    "idle_s": round(time.monotonic() - s.last_seen, 1),
                    "envs_by_state": envs_by_state(s.envs),
                    "snapshots": self.snapshots.listing(s.sid),
                    **({"live": self.stats.sessions[s.sid].live()} if s.sid in self.stats.sessions else {}),
                }
            )
        in_use = sum(len(s.envs) for s in self.sessions.values())
        return {
            "ok": True,
            "pid": os.getpid(),
            "endpoints": self.endpoints,
            "authenticated": self.keys is not None,
            "capacity": self.capacity,
            "in_use": in_use,
            "free": self.capacity - in_use,
            "worker_pss_bytes": memory.pid_pss(os.getpid()),
            "sessions": sessions,
            "metrics": self.metrics_url,
            "uploads": dict(self.stats.uploads),
            "auth_failures": self.stats.auth_failures,
            "snapshot_budget": self.snapshots.budget,
            "snapshot_bytes": self.snapshots.held_bytes,
        }

    def _op_report(self, client, header, payloads):
        """A local pool's count of what it stepped on its direct lane (the worker never sees those
        steps): ``{"lane": {"calls": n, "batch_s": [seconds, ...]}}``. Answered only when asked
        (``ack``): the pool sends one a second and does not wait for it."""
        if client != LOCAL_CLIENT:
            raise ValueError("report is for a local pool's direct lane")
        session = self._session_for(client, header)
        calls, batch_seconds = read_lane_report(header.get("lane"))
        stats = self.stats.sessions.get(session.sid)
        if stats is not None:
            stats.lane_report(calls, batch_seconds)
        return {"ok": True} if header.get("ack") is True else None

    #: Looked up with whatever JSON value a request's ``op`` holds (a miss is an unknown op).
    HANDLERS: ClassVar[dict[object, Callable[..., dict | None]]] = {
        "ping": _op_ping,
        "has_archive": _op_has_archive,
        "upload": _op_upload,
        "create": _op_create,
        "batch": _op_batch,
        "memory": _op_memory,
        "close": _op_close,
        "status": _op_status,
        "report": _op_report,
        "snapshots": _op_snapshots,
    }
