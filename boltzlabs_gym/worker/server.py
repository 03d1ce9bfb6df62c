"""The worker: a ZeroMQ ROUTER loop that fans batched requests out to resident envs.

One thread, one event loop (epoll over every env pipe plus the ROUTER socket's
notification fd). A ``batch`` request from a client becomes one :class:`Call` per
env; the reply goes back when every call has a result: the env's own reply, or a
straggler/error result the worker wrote after killing the env. Per-env deadlines
live in a heap, so a wedged env costs its slot the deadline and nothing more.

The worker never dies from one bad env, request or client: every handler is
wrapped, and everything that comes from an env or a client is validated.
"""

from __future__ import annotations

import collections
import itertools
import logging
import math
import os
import select
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import time

import zmq

from ..archive import ArchiveLimits, is_archive_hash
from ..channel import ChannelClosed, ChannelError, WorkerChannel
from ..errors import ArchiveError
from ..protocol import (
    DEFAULT_BUSY_POLL_US,
    LENT_FAULT,
    ERROR,
    OK,
    STRAGGLER,
    ProtocolError,
    decode_header,
    encode_header,
    env_request,
    error_reply,
)
from . import memory
from .deadlines import Deadlines
from ..envpipe import EnvFault
from .envproc import Call, EnvProcess, describe_exit, json_error
from .host import drain_fd, sweep_stale_workers, wipe_tree
from .sandbox import LaunchSpec, SandboxUnavailable, select_backend
from .session import Batch, Session, SessionConfig, SessionExpired
from .uploads import Uploads

log = logging.getLogger("boltzlabs_gym.worker")

#: The client identity of the pool on the local channel (ROUTER identities never start with 0).
LOCAL_CLIENT = b"\x00local"
MAX_FAULT_REASON = 2000

#: How many envs may be starting (interpreter boot + first reset) at once per worker.
DEFAULT_MAX_STARTING = max(4, 4 * (os.cpu_count() or 1))

#: Run the env directory's env.py as __main__ with the env dir importable.
ENV_BOOTSTRAP = (
    "import os,runpy,sys\n"
    "d=os.environ['BOLTZLABS_ENV_DIR']\n"
    "sys.path.insert(0,d)\n"
    "sys.argv=[os.path.join(d,'env.py')]\n"
    "runpy.run_path(sys.argv[0],run_name='__main__')\n"
)


def _runtime_packages() -> dict[str, str]:
    """The library's own packages, which every env imports its helper from."""
    import boltzlabs
    import boltzlabs_gym

    return {
        "boltzlabs_gym": os.path.dirname(os.path.abspath(boltzlabs_gym.__file__)),
        "boltzlabs": os.path.dirname(os.path.abspath(boltzlabs.__file__)),
    }


def is_local_endpoint(endpoint: str) -> bool:
    """ipc://, inproc:// and tcp on a loopback address are reachable from this host only."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return True
    if endpoint.startswith("tcp://"):
        host = endpoint[len("tcp://") :].rsplit(":", 1)[0].strip("[]")
        return host in ("127.0.0.1", "localhost", "::1") or host.startswith("127.")
    return False


#: Call kinds the scheduler treats apart; any other op is "other".
_CALL_KINDS = frozenset(("step", "reset", "hard_reset"))


class Worker:
    """The ROUTER server. ``Worker(["ipc:///tmp/w.sock"]).serve_forever()``."""

    def __init__(
        self,
        endpoints: list[str],
        *,
        capacity: int = 4096,
        workdir: str | None = None,
        parent_pid: int | None = None,
        max_starting: int = DEFAULT_MAX_STARTING,
        archive_limits: ArchiveLimits = ArchiveLimits(),
        keys=None,
        insecure: bool = False,
        local_channel: socket.socket | None = None,
        local_spin_s: float = DEFAULT_BUSY_POLL_US * 1e-6,
    ):
        for ep in endpoints:
            if keys is None and not insecure and not is_local_endpoint(ep):
                raise ValueError(
                    f"refusing to bind {ep} without authentication: pass CURVE keys (boltzlabs-gym keygen DIR; "
                    "worker --keys DIR) or, on a trusted network only, --insecure"
                )
        self.capacity = capacity
        self.parent_pid = parent_pid
        self.max_starting = max_starting
        self.archive_limits = archive_limits
        sweep_stale_workers(workdir)
        self.root = tempfile.mkdtemp(prefix="boltzlabs-worker-", dir=workdir)
        with open(os.path.join(self.root, "owner.pid"), "w") as f:
            f.write(str(os.getpid()))
        self.archives: dict[str, str] = {}
        self.uploads = Uploads(archive_limits)
        self.sessions: dict[str, Session] = {}
        self._sid_counter = itertools.count(1)
        self._tokens = itertools.count(1)
        self._deadlines = Deadlines(self._in_flight)
        self._fd_owner: dict[int, tuple[EnvProcess, str]] = {}
        self._to_reap: set[int] = set()
        #: exit statuses of live envs' processes that the orphan sweep reaped before their fault was handled
        self._exit_status: dict[int, int] = {}
        self._start_queue: collections.deque = collections.deque()
        self._starting = 0
        self._gate_busy = False
        self._gate_waiters: collections.deque = collections.deque()
        self._running = True
        self._wake_r = -1
        self._next_housekeeping = 0.0
        self.local_spin_s = local_spin_s
        self._spin_until = 0.0  # busy-poll until then (perf_counter), 0: sleep in epoll
        self._local_replied_at = 0.0
        self._local_gap = math.inf  # between our last batch reply and the pool's next request
        self._in_start_more = False
        self.runtime = _runtime_packages()
        self._expired: dict[str, float] = {}
        self.keys = keys
        self.ctx = zmq.Context()
        self._authenticator = None
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        if keys is not None:
            self._start_authenticator(keys)
        self.endpoints = []
        for ep in endpoints:
            self.sock.bind(ep)
            self.endpoints.append(self.sock.getsockopt(zmq.LAST_ENDPOINT).decode())
        self.epoll = select.epoll()
        # ZeroMQ's FD is edge-like: it fires when the socket's events may have changed, and a
        # send can consume that signal. So the socket is checked after it fired or after a
        # send, not on every loop turn (a getsockopt per env reply, for nothing, on a busy
        # local pool).
        self._zmq_check = True
        self._zmq_fd = self.sock.getsockopt(zmq.FD)
        self.epoll.register(self._zmq_fd, select.EPOLLIN)
        # The pool that started this worker talks over a socketpair (see boltzlabs_gym.channel).
        self._local: WorkerChannel | None = None
        self._local_fd = -1
        self._local_mask_out = False
        if local_channel is not None:
            self._local = WorkerChannel(local_channel)
            self._local_fd = self._local.fileno()
            self.epoll.register(self._local_fd, select.EPOLLIN)
        self.epoll.register(self.uploads.fileno(), select.EPOLLIN)

    def _start_authenticator(self, keys) -> None:
        """CURVE with a ZAP allow-list, set up before binding (without ZAP any key gets in)."""
        from zmq.auth.thread import ThreadAuthenticator

        allowed = set(keys.allowed_clients)

        class _AllowList:
            def callback(self, domain, key):  # called by the ZAP thread
                return key in allowed

        self._authenticator = ThreadAuthenticator(self.ctx, log=log)
        self._authenticator.start()
        self._authenticator.configure_curve_callback(domain="*", credentials_provider=_AllowList())
        self.sock.curve_secretkey = keys.secret
        self.sock.curve_publickey = keys.public
        self.sock.curve_server = True

    # ================================================================== main loop
    def serve_forever(self) -> None:
        try:
            while self._running:
                if self._zmq_check:
                    self._drain_socket()
                timeout = self._next_timeout()
                try:
                    events = self._poll_spinning(timeout) if self._spin_until else self.epoll.poll(timeout)
                except InterruptedError:
                    continue
                for fd, ev in events:
                    if fd == self._zmq_fd:
                        self._zmq_check = True
                        continue
                    if fd == self._local_fd:
                        self._on_local_event(ev)
                        continue
                    if fd == self._wake_r:
                        drain_fd(fd)
                        continue
                    if fd == self.uploads.fileno():
                        self._answer_uploads()
                        continue
                    owner = self._fd_owner.get(fd)
                    if owner is not None:
                        self._on_env_event(owner[0], owner[1], ev)
                self._expire_deadlines()
                now = time.monotonic()
                if now >= self._next_housekeeping or self._to_reap:
                    # Reaping, the parent check and leases need no per-reply precision:
                    # at most every 50 ms, not once per env reply.
                    self._next_housekeeping = now + 0.05
                    self._reap()
                    self._check_parent()
                    self._expire_leases()
        finally:
            self.shutdown()

    def _poll_spinning(self, timeout: float) -> list:
        """Poll without sleeping until :attr:`_spin_until`, then block for the rest of ``timeout``."""
        start = time.perf_counter()
        end = min(self._spin_until, start + timeout)
        self._spin_until = 0.0
        while True:
            events = self.epoll.poll(0)
            now = time.perf_counter()
            if events or now >= end:
                break
        return events or self.epoll.poll(max(0.0, timeout - (now - start)))

    def _local_request_arrived(self) -> None:
        if self._local_replied_at:
            self._local_gap = time.perf_counter() - self._local_replied_at
            self._local_replied_at = 0.0

    def _local_replied(self) -> None:
        """Busy-poll a while for the local pool's next request, if it came that fast last time.

        A process woken from sleep on an idle core pays a wake-up (an IPI and, in a VM, an
        exit to the hypervisor: 30-60 us measured on a 2-vCPU guest), and a small batch pays
        it on each hop. A trainer that steps again as soon as it has its results (a fast
        policy, a benchmark) finds the worker already awake; one that sends its next
        request later than ``local_spin_s`` (a big model, a slow learner) never makes it
        spin, because the gap it left last time is what decides.
        """
        now = time.perf_counter()
        self._local_replied_at = now
        if self.local_spin_s > 0 and self._local_gap <= self.local_spin_s:
            self._spin_until = now + self.local_spin_s

    def stop(self, *_args) -> None:
        self._running = False

    def install_signal_handlers(self) -> None:
        """SIGTERM/SIGINT stop the loop at once (a wake-up pipe interrupts the poll)."""
        r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._wake_r = r
        signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        self.epoll.register(r, select.EPOLLIN)
        signal.signal(signal.SIGTERM, self.stop)
        signal.signal(signal.SIGINT, self.stop)

    def _next_timeout(self) -> float:
        timeout = 1.0
        now = time.monotonic()
        self._deadlines.seal(now)
        deadline = self._deadlines.next_deadline()
        if deadline is not None:
            timeout = min(timeout, max(0.0, deadline - now))
        if self._to_reap:
            timeout = min(timeout, 0.05)
        return timeout

    def _check_parent(self) -> None:
        if self.parent_pid is not None and os.getppid() != self.parent_pid:
            log.warning("parent process %s is gone; shutting down", self.parent_pid)
            self._running = False

    def _drain_socket(self) -> None:
        while self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return  # checked again next turn
            if len(frames) < 2:
                continue  # nothing to answer: not even a header
            user = None
            if self.keys is not None:
                try:
                    user = frames[1].get("User-Id")
                except (zmq.ZMQError, AttributeError):
                    user = None
            self._current_user = user
            client = frames[0].bytes
            self._handle_request(client, frames[1].bytes, [f.bytes for f in frames[2:]])
        self._zmq_check = False  # the last thing done on the socket was reading its events

    def _on_local_event(self, ev: int) -> None:
        """The local pool's channel: write what is queued, answer every whole request."""
        try:
            if ev & select.EPOLLOUT:
                self._local.flush()
                self._watch_local_writes()
            if ev & (select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR):
                self._local_request_arrived()
                self._current_user = None
                for frames in self._local.read_messages():
                    if len(frames) >= 1:
                        self._handle_request(LOCAL_CLIENT, frames[0], frames[1:])
        except (ChannelClosed, ChannelError) as exc:
            self._local_gone(exc)

    def _local_gone(self, exc: Exception) -> None:
        # Only the pool that started us holds the other end: it is gone, and so are we.
        (log.info if isinstance(exc, ChannelClosed) else log.warning)("local pool channel: %s; shutting down", exc)
        self._drop_local()
        self._running = False

    def _watch_local_writes(self) -> None:
        """Watch for EPOLLOUT only while writes are queued (re-registered only on a change)."""
        if self._local is not None and self._local_mask_out != self._local.wants_write:
            self._local_mask_out = self._local.wants_write
            self.epoll.modify(self._local_fd, select.EPOLLIN | (select.EPOLLOUT if self._local_mask_out else 0))

    def _drop_local(self) -> None:
        if self._local is not None:
            try:
                self.epoll.unregister(self._local_fd)
            except (OSError, ValueError):
                pass
            self._local.close()
            self._local, self._local_fd = None, -1

    def _drain_clients(self) -> None:
        """Answer whatever every client has sent (during long start-ups)."""
        self._drain_socket()
        if self._local is not None:
            self._on_local_event(select.EPOLLIN)

    def _expire_leases(self) -> None:
        now = time.monotonic()
        for session in list(self.sessions.values()):
            lent = any(env.state == "lent" for env in session.envs)  # in use without a request
            if session.create_seq is None and not lent and now - session.last_seen > session.cfg.lease_s:
                log.warning(
                    "session %s: no request for %.0f s (lease %.0f s); reclaiming its %d envs",
                    session.sid, now - session.last_seen, session.cfg.lease_s, len(session.envs),
                )
                self._expired[session.sid] = session.cfg.lease_s
                self._close_session(session)

    # ================================================================== requests
    def _handle_request(self, client: bytes, header_frame: bytes, payloads: list) -> None:
        seq = None
        try:
            header = decode_header(header_frame)
            seq = header.get("seq")
            op = header.get("op")
            handler = self._HANDLERS.get(op)
            if handler is None:
                raise ProtocolError(f"unknown op {op!r}")
            reply = handler(self, client, header, payloads)
        except ProtocolError as exc:
            reply = error_reply(seq, "protocol", str(exc))
        except ArchiveError as exc:  # a ValueError too: must come first
            reply = error_reply(seq, "archive", str(exc))
        except (ValueError, TypeError, KeyError) as exc:
            reply = error_reply(seq, "bad_request", f"{type(exc).__name__}: {exc}")
        except SandboxUnavailable as exc:
            reply = error_reply(seq, "sandbox", str(exc))
        except SessionExpired as exc:
            reply = error_reply(seq, "expired", str(exc))
        except Exception as exc:  # noqa: BLE001 - one bad request must not kill the worker
            log.exception("error handling a request")
            reply = error_reply(seq, "internal", f"{type(exc).__name__}: {exc}")
        if reply is not None:
            reply.setdefault("seq", seq)
            self._send(client, reply)

    def _send(self, client: bytes, header: dict, frames: list = (), fds: list = ()) -> None:
        """Send a reply; ``fds`` (the local client only) may raise OSError or ValueError, sending nothing."""
        if client == LOCAL_CLIENT:
            if self._local is None:
                return
            try:
                self._local.send_multipart([encode_header(header), *frames], fds)
                self._watch_local_writes()
            except ChannelClosed as exc:
                self._local_gone(exc)
            return
        self._zmq_check = True
        try:
            self.sock.send_multipart([client, encode_header(header), *frames], copy=False)
        except zmq.ZMQError as exc:
            log.warning("could not reply to a client: %s", exc)

    def _session_for(self, client: bytes, header: dict) -> Session:
        sid = header.get("session")
        session = self.sessions.get(sid) if isinstance(sid, str) else None
        if (
            session is None
            or session.closed
            or not secrets.compare_digest(str(header.get("token", "")), session.token)
            or session.owner_key != getattr(self, "_current_user", None)
        ):
            if isinstance(sid, str) and sid in self._expired:
                raise SessionExpired(
                    f"session {sid} was reclaimed after {self._expired[sid]:.0f} s without a request (its lease)"
                )
            raise ValueError(f"no open session {sid!r} for this client")
        session.last_seen = time.monotonic()
        session.client = client
        return session

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
            return {"ok": True}
        if not is_archive_hash(digest):
            # It names a directory: checked here, before the thread checks the content.
            raise ArchiveError(
                f"upload 'hash' {digest[:80]!r} is not a SHA-256 hex digest (boltzlabs_gym.archive.archive_hash)"
            )
        dest = os.path.join(self.root, "archives", digest)
        self.uploads.submit(digest, payloads[0], dest, waiter=(client, header.get("seq")))
        return None

    def _answer_uploads(self) -> None:
        for done in self.uploads.finished():
            if done.error is None:
                self.archives[done.digest] = done.dest
                reply = {"ok": True}
            elif isinstance(done.error, ArchiveError):
                reply = error_reply(None, "archive", str(done.error))
            else:
                log.error("unpacking archive %s failed", done.digest[:12], exc_info=done.error)
                reply = error_reply(None, "internal", f"{type(done.error).__name__}: {done.error}")
            for client, seq in done.waiters:
                self._send(client, dict(reply, seq=seq))

    def _op_create(self, client, header, payloads):
        digest = header.get("hash")
        if digest not in self.archives:
            raise ValueError(f"archive {digest!r} was not uploaded to this worker")
        cfg = SessionConfig.from_header(header)
        in_use = sum(len(s.envs) for s in self.sessions.values())
        if in_use + cfg.n > self.capacity:
            return error_reply(
                header.get("seq"),
                "capacity",
                f"worker has {self.capacity - in_use} free env slots of {self.capacity}; asked for {cfg.n}",
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
        session.lend = header.get("lend") is True and self._may_lend(client, session)
        self.sessions[sid] = session
        for env in session.envs:
            os.makedirs(env.workspace)
            self._queue_start(session, env, None)
        return None  # the reply goes out when every env answered its first reset

    def _op_batch(self, client, header, payloads):
        session = self._session_for(client, header)
        # What the pool reports about envs it held is acted on first, even if an item below is
        # refused: the pool has let go of those envs, and they must not stay lent.
        self._apply_lent_reports(client, session, header)
        items = header.get("items")
        if not isinstance(items, list) or not (items or header.get("faults") or header.get("adopt")):
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
        lend = header.get("lend") is True and session.lend and self._may_lend(client, session)
        batch = Batch(self, client, header.get("seq"), len(calls))
        batch.lend_from = session if lend else None
        for pos, (index, op, frames) in enumerate(calls):
            env = session.envs[index]
            if op["op"] != LENT_FAULT:
                self._take_back(env)
            self._submit(session, env, op, frames, batch, pos)
        self._deadlines.seal(time.monotonic())
        if not calls:
            self.send_batch_reply(batch)  # only faults or adoptions: nothing to wait for
        return None

    def _op_memory(self, client, header, payloads):
        session = self._session_for(client, header)
        pss = [memory.tree_pss(env.pid) if env.pid else 0 for env in session.envs]
        template_pss = getattr(session.backend, "pss", lambda: 0)()
        return {
            "ok": True,
            "pss": pss,
            "template_pss": template_pss,
            "worker_pss": memory.tree_pss(os.getpid(), children=False),
        }

    def _op_close(self, client, header, payloads):
        sid = header.get("session")
        session = self.sessions.get(sid) if isinstance(sid, str) else None
        if session is not None:
            # Whoever holds the session's token (and CURVE key) may close it, as for every other
            # op; the ROUTER identity is only where the last reply went, not who owns the session.
            self._session_for(client, header)
            self._close_session(session)
        return {"ok": True}

    def _op_status(self, client, header, payloads):
        sessions = []
        for s in self.sessions.values():
            pss = sum(memory.tree_pss(env.pid) for env in s.envs if env.pid)
            template_pss = getattr(s.backend, "pss", lambda: 0)()
            sessions.append(
                {
                    "session": s.sid,
                    "envs": len(s.envs),
                    "mode": s.cfg.mode,
                    "pss_bytes": pss,
                    "template_pss_bytes": template_pss,
                    "envs_per_gib": len(s.envs) / ((pss + template_pss) / 2**30) if pss else None,
                    "isolation": s.backend.report().to_json(),
                    "idle_s": round(time.monotonic() - s.last_seen, 1),
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
            "worker_pss_bytes": memory.tree_pss(os.getpid(), children=False),
            "sessions": sessions,
        }

    _HANDLERS = {
        "ping": _op_ping,
        "has_archive": _op_has_archive,
        "upload": _op_upload,
        "create": _op_create,
        "batch": _op_batch,
        "memory": _op_memory,
        "close": _op_close,
        "status": _op_status,
    }

    # ================================================================== env scheduling
    def _submit(self, session: Session, env: EnvProcess, op: dict, frames: list, batch: Batch, pos: int) -> None:
        name = op["op"]
        if name == LENT_FAULT:
            self._submit_lent_fault(session, env, op, batch, pos)
            return
        cfg = session.cfg
        timeout = cfg.step_timeout if name == "step" else cfg.reset_timeout
        kind = name if name in _CALL_KINDS else "other"
        env.queue.append(Call(op, frames, timeout, kind=kind, batch=batch, pos=pos, index=env.index))
        if env.state == "dead":
            self._queue_start(session, env, None)
        self._pump(session, env)

    def _pump(self, session: Session, env: EnvProcess) -> None:
        """Send the env its next queued call if it is free to take one."""
        if env.state != "idle" or not env.queue or session.closed:
            return
        call = env.queue[0]
        if call.kind == "hard_reset":
            env.queue.popleft()
            self._kill_env(session, env)
            self._wipe(env.workspace)
            reset_op = {"op": "reset", "seed": call.op.get("seed"), "options": call.op.get("options")}
            self._queue_start(session, env, call, reset_op)
            return
        if call.kind == "step" and session.cfg.serialize_measurement:
            if self._gate_busy:
                if not any(e is env for _, e in self._gate_waiters):
                    self._gate_waiters.append((session, env))
                return
            self._gate_busy = True
            call.op = dict(call.op)
            call.gated = True
        env.queue.popleft()
        self._send_call(session, env, call)

    def _send_call(self, session: Session, env: EnvProcess, call: Call) -> None:
        call.token = next(self._tokens)
        env.current = call
        env.state = "busy"
        env.sent_at = time.perf_counter()
        if call.timeout is not None:
            self._deadlines.add(call.timeout, (session.sid, env.index, call.token))
        try:
            done = env.write(env_request(call.op, call.payloads))
        except EnvFault as exc:
            self._fault(session, env, exc.reason)
            return
        if not done:
            self.epoll.register(env.stdin_w, select.EPOLLOUT)
            self._fd_owner[env.stdin_w] = (env, "in")

    def _release_gate(self, call: Call) -> None:
        if not call.gated:
            return
        call.gated = False
        self._gate_busy = False
        while self._gate_waiters and not self._gate_busy:
            session, env = self._gate_waiters.popleft()
            self._pump(session, env)

    # ================================================================== pipes lent to the local pool
    # A local pool may step its idle envs itself, on their own pipes, while this worker keeps
    # everything else: their processes, stderr, deadlines' consequences, respawns (see
    # boltzlabs_gym.lane). A lent env is "lent": its stdout is not watched here, and any
    # request naming it takes it back first; the pool never uses it again until re-lent.
    def _may_lend(self, client: bytes, session: Session) -> bool:
        return client == LOCAL_CLIENT and self._local is not None and not session.cfg.serialize_measurement

    def _apply_lent_reports(self, client: bytes, session: Session, header: dict) -> None:
        """A request's ``faults`` and ``adopt``: lent envs the pool let go of (see below)."""
        if header.get("faults") is None and header.get("adopt") is None:
            return
        if client != LOCAL_CLIENT:
            raise ValueError("faults and adopt are for a local pool's lent envs")
        faults = self._lent_faults(session, header.get("faults"))
        adopted = self._lent_adopted(session, header.get("adopt"))
        for env, reason in faults:
            self._take_back(env)
            self._fault(session, env, reason)
        for env, name, left in adopted:
            self._adopt(session, env, name, left)

    def _lendable(self, env: EnvProcess) -> bool:
        return (env.state == "idle" and env.current is None and not env.queue and env.stdout_r >= 0
                and not env.mid_transfer)

    def _lend_idle(self, session: Session) -> tuple[list[int], list[int]]:
        """Lend every idle env of ``session``: (their indices, their stdin and stdout fds, in pairs)."""
        indices, fds = [], []
        if session.closed:
            return indices, fds
        for env in session.envs:
            if self._lendable(env):
                self._unregister(env.stdout_r)
                env.state = "lent"
                indices.append(env.index)
                fds += (env.stdin_w, env.stdout_r)
        return indices, fds

    def _send_lending(self, session: Session, header: dict, frames: list) -> None:
        """Send a reply to the local pool lending it ``session``'s idle envs; without them if
        their descriptors cannot go (out of descriptors here)."""
        header["lent"], fds = self._lend_idle(session)
        try:
            self._send(session.client, header, frames, fds)
        except (OSError, ValueError) as exc:
            log.warning("could not lend %d envs to the local pool: %s", len(header["lent"]), exc)
            for index in header["lent"]:
                self._take_back(session.envs[index])
            header["lent"] = []
            self._send(session.client, header, frames)

    def _take_back(self, env: EnvProcess) -> None:
        """The pool named a lent env in a request: its pipes are ours again."""
        if env.state != "lent":
            return
        env.state = "idle"
        self.epoll.register(env.stdout_r, select.EPOLLIN)
        self._fd_owner[env.stdout_r] = (env, "out")

    def _lent_faults(self, session: Session, faults) -> list[tuple[EnvProcess, str]]:
        """Validate a request's ``faults``: ``[[index, reason], ...]`` the pool saw on lent,
        idle envs (output nobody asked for, a closed pipe)."""
        if faults is None:
            return []
        if not isinstance(faults, list) or not all(
            type(f) is list and len(f) == 2 and type(f[0]) is int and 0 <= f[0] < len(session.envs)
            and type(f[1]) is str for f in faults
        ):
            raise ValueError("faults must be a list of [env index, reason] pairs")
        # An env that is no longer lent was already killed here (it wrote a second reply, say)
        # and is being respawned: the pool saw the same fault from its side.
        return [(session.envs[i], reason[:MAX_FAULT_REASON]) for i, reason in faults if session.envs[i].state == "lent"]

    def _lent_adopted(self, session: Session, adopt) -> list[tuple[EnvProcess, str, float]]:
        """Validate a request's ``adopt``: ``[[index, op, seconds left], ...]``, calls the pool
        sent to lent envs and stopped waiting for (its wait timed out)."""
        if adopt is None:
            return []
        if not isinstance(adopt, list) or not all(
            type(a) is list and len(a) == 3 and type(a[0]) is int and 0 <= a[0] < len(session.envs)
            and type(a[1]) is str and isinstance(a[2], (int, float)) and 0 < a[2] <= 86400 for a in adopt
        ):
            raise ValueError("adopt must be a list of [env index, op, seconds left] triples")
        return [(session.envs[i], name, float(left)) for i, name, left in adopt if session.envs[i].state == "lent"]

    def _adopt(self, session: Session, env: EnvProcess, name: str, left: float) -> None:
        """Take back a lent env with a call in flight that nobody waits for any more: its reply
        is dropped when it comes, its deadline still holds, calls queued behind it wait."""
        self._take_back(env)
        timeout = session.cfg.step_timeout if name == "step" else session.cfg.reset_timeout
        call = Call({"op": name[:40]}, (), timeout, kind="step" if name == "step" else "other", index=env.index)
        call.token = next(self._tokens)
        env.current = call
        env.state = "busy"
        env.sent_at = time.perf_counter() - max(0.0, timeout - left)
        self._deadlines.add(left, (session.sid, env.index, call.token))

    def _submit_lent_fault(self, session: Session, env: EnvProcess, op: dict, batch: Batch, pos: int) -> None:
        """The pool's call to a lent env failed (deadline, crash, bad reply): kill and report it
        as if the call had been ours, and respawn it."""
        call = Call(op, (), None, kind="step" if op.get("straggler") is True else "other",
                    batch=batch, pos=pos, index=env.index)
        reason = op["reason"][:MAX_FAULT_REASON]  # a string: checked with the request
        if env.state != "lent":
            # Not the pool's to hand back: killed here while lent (output nobody asked for, say)
            # and being respawned, or never lent at all. Either way it is not killed again.
            call.finish(ERROR, json_error(f"{reason} (env {env.global_index} is not lent to this pool: "
                                          "the worker restarted it, or never lent it)", index=env.global_index), [])
            return
        self._take_back(env)
        env.current = call
        env.state = "busy"
        self._fault(session, env, reason, straggler=op.get("straggler") is True)

    # ================================================================== env events
    def _on_env_event(self, env: EnvProcess, kind: str, ev: int) -> None:
        session = self._session_of(env)
        if session is None:
            return
        try:
            if kind == "err":
                env.drain_stderr()
                if ev & (select.EPOLLHUP | select.EPOLLERR) and not ev & select.EPOLLIN:
                    self._unregister(env.stderr_r)
            elif kind == "in":
                if env.flush():
                    self._unregister(env.stdin_w)
            else:
                replies = env.read_replies()
                # Bytes left over after a reply, or arriving with no call in flight, were never
                # asked for; left alone they would be taken as the start of the next call's reply.
                stray = env.partial_output and (bool(replies) or env.current is None)
                for reply, payloads in replies:
                    self._on_reply(session, env, reply, payloads)
                if stray:
                    raise EnvFault("the env wrote output nobody asked for")
        except EnvFault as exc:
            self._fault(session, env, exc.reason)

    def _on_reply(self, session: Session, env: EnvProcess, reply: bytes, payloads: list) -> None:
        call = env.current
        if call is None:
            raise EnvFault("the env wrote output nobody asked for")
        env.current = None
        env.state = "idle"
        self._release_gate(call)
        if call.kind == "start":
            self._start_finished(session, env, call, reply, payloads)
        else:
            call.finish(OK, reply, payloads)
        if env.queue:
            self._pump(session, env)

    def _fault(self, session: Session, env: EnvProcess, reason: str, *, straggler: bool = False) -> None:
        """Kill a misbehaving env, report its current call, respawn it in the background."""
        call = env.current
        env.current = None
        # An env whose pipe closed is usually exiting: let it finish (bounded, without reaping, so
        # its pid cannot be reused before the kill) so that its own exit status is reported, not
        # our SIGKILL, even on a loaded host. Read the OOM flag before the cgroup goes away.
        exited = not straggler and ("closed its stdout" in reason or "closed its stdin" in reason)
        oom = not straggler and _oom_killed(env)
        natural = exited and self._await_exit(env.pid, EXIT_GRACE_S)
        pid = self._kill_env(session, env)
        status = self._reap_now(pid)
        if oom:
            limit = session.cfg.limits.memory_bytes
            reason = "the env exceeded its memory limit" + (f" of {limit >> 20} MiB" if limit else "") + (
                f" and was killed by the kernel's OOM killer ({describe_exit(status)})"
            )
        elif natural and status is not None:
            reason = f"the env {describe_exit(status)}"
        elif exited:
            reason = f"{reason.split(' (')[0]} but did not exit within {EXIT_GRACE_S:g} s; killed"
        detail = json_error(
            reason,
            index=env.global_index,
            stderr=env.stderr_tail(),
            straggler=straggler,
        )
        if call is not None:
            self._release_gate(call)
            if call.kind == "start":
                self._start_failed(session, env, call, reason)
                return
            call.finish(STRAGGLER if straggler else ERROR, detail, [])
        if not session.closed:
            self._wipe(env.workspace)
            self._queue_start(session, env, None)

    def _in_flight(self, key: tuple) -> bool:
        """Whether the call a deadline names, ``(sid, index, token)``, is still unanswered."""
        session = self.sessions.get(key[0])
        if session is None:
            return False
        current = session.envs[key[1]].current
        return current is not None and current.token == key[2]

    def _expire_deadlines(self) -> None:
        for sid, index, _token in self._deadlines.pop_expired(time.monotonic()):
            session = self.sessions[sid]
            env = session.envs[index]
            waited = time.perf_counter() - env.sent_at
            what = "its first reset" if env.current.kind == "start" else f"'{env.current.op.get('op')}'"
            self._fault(
                session,
                env,
                f"missed the {env.current.timeout:g} s deadline for {what} (waited {waited:.2f} s); killed",
                straggler=env.current.kind == "step",
            )

    # ================================================================== starting envs
    def _queue_start(self, session: Session, env: EnvProcess, call: Call | None, reset_op: dict | None = None) -> None:
        """Spawn ``env`` when a start slot is free; ``call`` gets the first reset's result."""
        env.state = "queued"
        env.pending_start = (call, reset_op or {"op": "reset", "seed": None})
        self._start_queue.append((session, env))
        self._start_more()

    def _start_more(self) -> None:
        # Iterative and not re-entrant: a launch that fails calls back into here
        # (through _start_failed), which must not recurse once per queued env.
        if self._in_start_more:
            return
        self._in_start_more = True
        try:
            answered = time.monotonic()
            while self._start_queue and self._starting < self.max_starting:
                session, env = self._start_queue.popleft()
                if session.closed or env.state != "queued":
                    continue
                self._spawn(session, env)
                if time.monotonic() - answered > 0.2:
                    # Long start-ups (hundreds of envs, a template importing the env) must
                    # not starve other clients' requests and heartbeats.
                    self._drain_clients()
                    answered = time.monotonic()
        finally:
            self._in_start_more = False

    def _spawn(self, session: Session, env: EnvProcess) -> None:
        user_call, reset_op = env.pending_start
        start_call = Call(op=reset_op, timeout=session.cfg.start_timeout, kind="start", user_call=user_call)
        try:
            env.spawn(session.backend, lambda e, i, o, r: self._launch_spec(session, e, i, o, r))
        except Exception as exc:  # noqa: BLE001 - a failed launch is that env's failure
            env.state = "dead"
            self._start_failed(session, env, start_call, f"could not launch: {type(exc).__name__}: {exc}")
            return
        self._starting += 1
        env.starting = True
        self._register_env(env)
        env.restarts += 1
        self._send_call(session, env, start_call)
        self._deadlines.seal(time.monotonic())  # a long start-up must not delay its deadline

    def _launch_spec(self, session: Session, env: EnvProcess, stdin_fd: int, stdout_fd: int, stderr_fd: int):
        python_bin = os.path.dirname(sys.executable)
        return LaunchSpec(
            argv=[sys.executable, "-B", "-s", "-c", ENV_BOOTSTRAP],
            env_dir=session.env_dir,
            workspace=env.workspace,
            stdin_fd=stdin_fd,
            stdout_fd=stdout_fd,
            stderr_fd=stderr_fd,
            env={
                "PATH": f"{python_bin}:/usr/local/bin:/usr/bin:/bin",
                "LANG": "C.UTF-8",
                "PYTHONDONTWRITEBYTECODE": "1",
                "PYTHONUNBUFFERED": "1",
                "OPENBLAS_NUM_THREADS": "1",
                "OMP_NUM_THREADS": "1",
                "MKL_NUM_THREADS": "1",
                "BOLTZLABS_ENV_INDEX": str(env.global_index),
                # Host paths; a namespace backend replaces them with /env, /workspace, /opt/boltzlabs.
                "BOLTZLABS_ENV_DIR": session.env_dir,
                "BOLTZLABS_WORKSPACE": env.workspace,
                "HOME": env.workspace,
                "PYTHONPATH": os.path.dirname(self.runtime["boltzlabs_gym"]),
                **session.cfg.env_vars,
            },
            limits=session.cfg.limits,
            ro_binds={},
            index=env.global_index,
            aslr=session.cfg.env_aslr,
            **({"runtime": self.runtime} if "runtime" in LaunchSpec.__dataclass_fields__ else {}),
        )

    def _start_finished(self, session: Session, env: EnvProcess, call: Call, reply: bytes, payloads: list) -> None:
        env.starting = False
        self._starting -= 1
        self._start_more()
        user_call = call.user_call
        if user_call is not None:
            user_call.finish(OK, reply, payloads)
        if session.create_seq is not None:
            session.started += 1
            now = time.monotonic()
            if session.started < len(session.envs) and now - session.progress_sent >= 0.2:
                # Interim reply under the create's tag: the pool shows start-up progress.
                session.progress_sent = now
                self._send(session.client, {"seq": session.create_seq, "progress": session.started, "n": len(session.envs)})
            if session.started == len(session.envs):
                seq, session.create_seq = session.create_seq, None
                reply = {
                    "seq": seq,
                    "ok": True,
                    "session": session.sid,
                    "token": session.token,
                    "n": len(session.envs),
                    "isolation": session.backend.report().to_json(),
                }
                if session.lend:
                    self._send_lending(session, reply, [])
                else:
                    self._send(session.client, reply)

    def _start_failed(self, session: Session, env: EnvProcess, call: Call, reason: str) -> None:
        self._start_more()
        env.state = "dead"
        tail = env.stderr_tail()
        if session.create_seq is not None:
            # A pool is all or nothing: tear the whole session down and say which env failed.
            seq, session.create_seq = session.create_seq, None
            self._close_session(session)
            self._send(
                session.client,
                error_reply(
                    seq,
                    "env_start",
                    f"env {env.global_index} failed to start: {reason}",
                    index=env.global_index,
                    stderr=tail,
                ),
            )
            return
        detail = json_error(f"env failed to restart: {reason}", index=env.global_index, stderr=tail)
        if call.user_call is not None:
            call.user_call.finish(ERROR, detail, [])
        while env.queue:
            env.queue.popleft().finish(ERROR, detail, [])

    # ================================================================== process plumbing
    def _register_env(self, env: EnvProcess) -> None:
        self.epoll.register(env.stdout_r, select.EPOLLIN)
        self.epoll.register(env.stderr_r, select.EPOLLIN)
        self._fd_owner[env.stdout_r] = (env, "out")
        self._fd_owner[env.stderr_r] = (env, "err")

    def _unregister(self, fd: int) -> None:
        if self._fd_owner.pop(fd, None) is not None:
            try:
                self.epoll.unregister(fd)
            except (OSError, ValueError):
                pass

    def _kill_env(self, session: Session, env: EnvProcess) -> int | None:
        for fd in (env.stdin_w, env.stdout_r, env.stderr_r):
            if fd >= 0:
                self._unregister(fd)
        if env.starting:
            env.starting = False
            self._starting -= 1
        pid = env.kill()
        if pid:
            self._to_reap.add(pid)
        env.state = "dead"
        env.current = None
        self._cleanup_launch(env)
        return pid

    def _cleanup_launch(self, env: EnvProcess) -> None:
        try:
            env.cleanup()
        except Exception:  # noqa: BLE001
            log.exception("cleanup of env %s failed", env.global_index)

    def _reap_now(self, pid: int | None) -> int | None:
        if not pid:
            return None
        if pid in self._exit_status:
            self._to_reap.discard(pid)
            return self._exit_status.pop(pid)
        for _ in range(20):
            try:
                got, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                self._to_reap.discard(pid)
                return None
            if got:
                self._to_reap.discard(pid)
                return status
            time.sleep(0.001)
        return None

    def _reap(self) -> None:
        for pid in list(self._to_reap):
            try:
                got, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                got = pid
            if got:
                self._to_reap.discard(pid)
        # Orphans re-parented to us (we are a subreaper): reap whatever is left.
        while True:
            try:
                got, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if not got:
                break
            self._to_reap.discard(got)
            if any(env.pid == got for s in self.sessions.values() for env in s.envs):
                # A live env died and its pipe's EOF is not handled yet: keep its status for _fault.
                # (A lent env's EOF reaches the pool, which hands it back with a call in flight
                # or with its next request; the worker cannot tell which, so it waits for that.)
                self._exit_status[got] = status

    def _await_exit(self, pid: int | None, timeout: float) -> bool:
        """Whether our child ``pid`` exits within ``timeout``; it is left unreaped (WNOWAIT)."""
        if not pid:
            return False
        deadline = time.monotonic() + timeout
        while pid not in self._exit_status:
            try:
                if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                    return True
            except ChildProcessError:
                return False
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.002)
        return True

    def _wipe(self, path: str) -> None:
        try:
            from .sandbox.base import wipe_workspace
        except ImportError:
            wipe_workspace = wipe_tree
        try:
            wipe_workspace(path)
        except Exception:  # noqa: BLE001
            log.exception("could not wipe workspace %s", path)

    @staticmethod
    def _session_of(env: EnvProcess) -> Session | None:
        session = getattr(env, "session", None)
        return None if session is None or session.closed else session

    def send_batch_reply(self, batch: Batch) -> None:
        # One data frame for the whole batch: a frame costs ZeroMQ (and the client) several
        # microseconds, which at two or more frames per env was most of a cheap env's reply cost.
        results = []
        parts = []
        for index, status, reply, payloads in batch.results:
            sizes = [len(reply)]
            parts.append(reply)
            for payload in payloads:
                sizes.append(len(payload))
                parts.append(payload)
            results.append([index, status, sizes])
        worker_ms = (time.perf_counter() - batch.t0) * 1e3
        header = {"seq": batch.seq, "ok": True, "worker_ms": worker_ms, "results": results}
        if batch.lend_from is not None:
            self._send_lending(batch.lend_from, header, [b"".join(parts)])
        else:
            self._send(batch.client, header, [b"".join(parts)])
        if batch.client == LOCAL_CLIENT:
            self._local_replied()

    # ================================================================== shutdown
    def _close_session(self, session: Session) -> None:
        session.closed = True
        for env in session.envs:
            pid = self._kill_env(session, env)
            self._reap_now(pid)
            env.state = "closed"
            for call in env.queue:
                call.finish(ERROR, json_error("session closed"), [])
            env.queue.clear()
        close_launcher = getattr(session.backend, "close", None)
        if close_launcher is not None:
            try:
                close_launcher()
            except Exception:  # noqa: BLE001
                log.exception("closing the env launcher of session %s", session.sid)
        shutil.rmtree(session.root, ignore_errors=True)
        if os.path.exists(session.root):
            wipe_tree(session.root)
        self.sessions.pop(session.sid, None)

    def shutdown(self) -> None:
        for session in list(self.sessions.values()):
            try:
                self._close_session(session)
            except Exception:  # noqa: BLE001
                log.exception("closing session %s", session.sid)
        self._reap()
        self.uploads.close()
        shutil.rmtree(self.root, ignore_errors=True)
        try:
            self.epoll.close()
        except OSError:
            pass
        self._drop_local()
        self.sock.close(linger=0)
        if self._authenticator is not None:
            self._authenticator.stop()
        self.ctx.term()
        for ep in self.endpoints:
            if ep.startswith("ipc://"):
                try:
                    os.unlink(ep[len("ipc://") :])
                except OSError:
                    pass


#: How long the worker waits for an env whose pipe closed to exit by itself.
EXIT_GRACE_S = 0.5


def _oom_killed(env: EnvProcess) -> bool:
    try:
        return env.launched is not None and bool(env.launched.oom_killed())
    except Exception:  # noqa: BLE001 - a missing cgroup file is not a verdict
        return False
