"""The worker: a ZeroMQ ROUTER loop that fans batched requests out to resident envs.

One thread, one event loop (epoll over every env pipe plus the ROUTER socket's
notification fd). A ``batch`` request from a client becomes one :class:`Call` per
env; the reply goes back when every call has a result: the env's own reply, or a
straggler/error result the worker wrote after killing the env. Per-env deadlines
live in a heap, so a wedged env costs its slot the deadline and nothing more.

The worker never dies from one bad env, request or client: every handler is
wrapped, and everything that comes from an env or a client is validated.

:class:`Worker` is this module's event loop and transport (the ROUTER socket, the local
pool's channel, authentication, busy polling, dispatch by op name, sessions' leases and
shutdown). It owns one object per job, each made here with what it needs passed in:

* :class:`~.poller.Poller`: the epoll, and which env pipe each watched descriptor is;
* :class:`~.spawner.Spawner`: starting, killing and reaping env processes, and why one died;
* :class:`~.scheduler.Scheduler`: env calls: queue, send, reply, deadlines, faults, first requests;
* :class:`~.direct_lane.DirectLane`: lending idle envs to the local pool, taking them back, its reports;
* :class:`~.memory_snapshots.snapshotter.Snapshotter`: memory snapshots, taken and restored;
* :class:`~.partial_replies.PartialReplies`: batches answered in parts, as their envs finish;
* :class:`~.snapshot_store.SnapshotStore`, :class:`~.stats.WorkerStats`, :class:`~.uploads.Uploads`.

The request handlers, one per op, are :mod:`.ops` (its table, :data:`~.ops.HANDLERS`, is the
dispatch). Batches (:mod:`.session`) reply through a callback; no part imports this module.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import os
import secrets
import select
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import zmq

from ..errors import ArchiveError
from ..wire.archive import ArchiveLimits
from ..wire.channel import ChannelClosed, ChannelError, WorkerChannel
from ..wire.keys import WorkerKeys
from ..wire.protocol import (
    DEFAULT_BUSY_POLL_US,
    DEFAULT_SNAPSHOT_BUDGET,
    ERROR,
    REGION_FDS,
    ProtocolError,
    check_poll_us,
    decode_header,
    encode_header,
    error_reply,
)
from .deadlines import Deadlines
from .direct_lane import DirectLane
from .envproc import CLOSED, LENT, json_error
from .host import drain_fd, sweep_stale_workers, wipe_tree
from .memory_snapshots.gate import shared_gate
from .memory_snapshots.snapshotter import Snapshotter
from .ops import HANDLERS
from .partial_replies import PartialReplies
from .poller import Poller
from .sandbox import SandboxUnavailable
from .scheduler import Scheduler, in_flight
from .session import LOCAL_CLIENT, Batch, Session, SessionExpired, pack_results
from .snapshot_store import SnapshotStore
from .spawner import DEFAULT_MAX_STARTING, Spawner
from .stats import WorkerStats
from .uploads import Uploads

if TYPE_CHECKING:
    from zmq.auth.thread import ThreadAuthenticator

__all__ = ["Worker", "LOCAL_CLIENT", "DEFAULT_MAX_STARTING", "is_local_endpoint"]

log = logging.getLogger("boltzlabs_gym.worker")


def is_local_endpoint(endpoint: str) -> bool:
    """ipc://, inproc:// and tcp on a loopback address are reachable from this host only."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return True
    if endpoint.startswith("tcp://"):
        host = endpoint[len("tcp://") :].rsplit(":", 1)[0].strip("[]")
        return host in ("127.0.0.1", "localhost", "::1") or host.startswith("127.")
    return False


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
        keys: WorkerKeys | None = None,
        insecure: bool = False,
        local_channel: socket.socket | None = None,
        busy_poll_us: float = DEFAULT_BUSY_POLL_US,
        snapshot_budget: int = DEFAULT_SNAPSHOT_BUDGET,
    ) -> None:
        """Bind ``endpoints``; ``local_channel`` is the starting pool's socketpair end, and
        ``busy_poll_us`` how long to busy-poll for that pool's next request (see
        :meth:`_local_replied`; the pool's knob of the same name, validated the same way)."""
        busy_poll_us = check_poll_us("busy_poll_us", busy_poll_us)
        for ep in endpoints:
            if keys is None and not insecure and not is_local_endpoint(ep):
                raise ValueError(
                    f"refusing to bind {ep} without authentication: pass CURVE keys (boltzlabs-gym keygen DIR; "
                    "worker --keys DIR) or, on a trusted network only, --insecure"
                )
        self.capacity = capacity
        self.parent_pid = parent_pid
        sweep_stale_workers(workdir)
        self.root = tempfile.mkdtemp(prefix="boltzlabs-worker-", dir=workdir)
        with open(os.path.join(self.root, "owner.pid"), "w") as f:
            f.write(str(os.getpid()))
        self.archives: dict[str, str] = {}
        self.uploads = Uploads(archive_limits)
        self.sessions: dict[str, Session] = {}
        #: Snapshot blobs the sessions hold (see :mod:`.snapshots`), within one byte budget.
        self.snapshots = SnapshotStore(snapshot_budget)
        #: What happened to the envs, for ``status`` and ``/metrics`` (see :mod:`.stats`).
        self.stats = WorkerStats()
        #: Where ``/metrics`` is served (``--metrics-port``), for ``status``; ``None``: not served.
        self.metrics_url: str | None = None
        #: The HTTP server behind it (``prometheus_client``'s), stopped by :meth:`shutdown`.
        self.metrics_server: Any = None
        self._sid_counter = itertools.count(1)
        self._running = True
        self._wake_r = -1
        self._next_housekeeping = 0.0
        self.busy_poll_us = busy_poll_us
        self._spin_until = 0.0  # busy-poll until then (perf_counter), 0: sleep in epoll
        self._local_replied_at = 0.0
        self._local_gap = math.inf  # between our last batch reply and the pool's next request
        self._expired: dict[str, float] = {}
        self.current_user: str | None = None  # the CURVE key of the request being handled
        self.keys = keys
        self.ctx = zmq.Context()
        self._authenticator: ThreadAuthenticator | None = None
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        if keys is not None:
            self._start_authenticator(keys)
        self.endpoints: list[str] = []
        for ep in endpoints:
            self.sock.bind(ep)
            self.endpoints.append(self.sock.getsockopt_string(zmq.LAST_ENDPOINT))
        self.poller = Poller()
        # ZeroMQ's FD is edge-like: it fires when the socket's events may have changed, and a
        # send can consume that signal. So the socket is checked after it fired or after a
        # send, not on every loop turn (a getsockopt per env reply, for nothing, on a busy
        # local pool).
        self._zmq_check = True
        self._zmq_fd = cast(int, self.sock.getsockopt(zmq.FD))  # an int option (pyzmq types every option int | bytes)
        self.poller.watch(self._zmq_fd)
        # The pool that started this worker talks over a socketpair (see boltzlabs_gym.wire.channel).
        self._local: WorkerChannel | None = None
        self._local_fd = -1
        self._local_mask_out = False
        if local_channel is not None:
            self._local = WorkerChannel(local_channel)
            self._local_fd = self._local.fileno()
            self.poller.watch(self._local_fd)
        self.poller.watch(self.uploads.fileno())
        self._make_parts(max_starting)

    def _make_parts(self, max_starting: int) -> None:
        """The worker's parts, each given what it uses (see the module doc)."""
        self._deadlines = Deadlines(functools.partial(in_flight, self.sessions))
        tokens = itertools.count(1)  # numbers env calls, the lane's adopted ones too
        # The scheduler starts envs through the spawner, which sends each started env's first
        # request (an env call) back through the scheduler: the spawner is made first.
        self.spawner = Spawner(
            self.poller,
            self._deadlines,
            self.stats,
            self.sessions,
            send_call=lambda session, env, call: self.scheduler.send_call(session, env, call),
            start_failed=lambda session, env, call, reason: self.scheduler.start_failed(session, env, call, reason),
            drain_clients=self._drain_clients,
            max_starting=max_starting,
        )
        self.scheduler = Scheduler(
            self.sessions,
            self.stats,
            self.poller,
            self._deadlines,
            tokens,
            self.spawner,
            send=self.send,
            send_created=self._send_created,
            close_session=self.close_session,
            name=self.endpoints[0] if self.endpoints else "?",
        )
        self.lane = DirectLane(
            self.poller,
            self._deadlines,
            tokens,
            send=self.send,
            fault=self.scheduler.fault,
            has_local_pool=lambda: self._local is not None,
        )
        self.snapshotter = Snapshotter(shared_gate(), self.snapshots, self.spawner, self.poller)
        self.partial_replies = PartialReplies(self.send, self.lane)

    def new_session_id(self) -> str:
        return f"s{next(self._sid_counter)}"

    def _start_authenticator(self, keys: WorkerKeys) -> None:
        """CURVE with a ZAP allow-list, set up before binding (without ZAP any key gets in)."""
        from zmq.auth.thread import ThreadAuthenticator

        allowed = set(keys.allowed_clients)
        stats = self.stats

        class _AllowList:
            def callback(self, domain: str, key: bytes) -> bool:  # called by the ZAP thread
                if key in allowed:
                    return True
                stats.auth_failures += 1  # only this thread writes it
                return False

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
                if self.partial_replies.pending:  # (refusals answered while requests were read)
                    self.partial_replies.flush()
                timeout = self._next_timeout()
                try:
                    events = self._poll_spinning(timeout) if self._spin_until else self.poller.poll(timeout)
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
                    owner = self.poller.owner(fd)
                    if owner is not None:
                        self.scheduler.on_env_event(owner[0], owner[1], ev)
                self.scheduler.expire_deadlines()
                if self.partial_replies.pending:  # what came in this turn, one part per request
                    self.partial_replies.flush()
                now = time.monotonic()
                if now >= self._next_housekeeping or self.spawner.reaping:
                    # Reaping, the parent check and leases need no per-reply precision:
                    # at most every 50 ms, not once per env reply.
                    self._next_housekeeping = now + 0.05
                    self.spawner.reap()
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
            events = self.poller.poll(0)
            now = time.perf_counter()
            if events or now >= end:
                break
        return events or self.poller.poll(max(0.0, timeout - (now - start)))

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
        request later than ``busy_poll_us`` (a big model, a slow learner) never makes it
        spin, because the gap it left last time is what decides.
        """
        now = time.perf_counter()
        self._local_replied_at = now
        window = self.busy_poll_us * 1e-6
        if window > 0 and self._local_gap <= window:
            self._spin_until = now + window

    def stop(self, *_args: object) -> None:
        self._running = False

    def install_signal_handlers(self) -> None:
        """SIGTERM/SIGINT stop the loop at once (a wake-up pipe interrupts the poll)."""
        r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._wake_r = r
        signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        self.poller.watch(r)
        signal.signal(signal.SIGTERM, self.stop)
        signal.signal(signal.SIGINT, self.stop)

    def _next_timeout(self) -> float:
        timeout = 1.0
        now = time.monotonic()
        self._deadlines.seal(now)
        deadline = self._deadlines.next_deadline()
        if deadline is not None:
            timeout = min(timeout, max(0.0, deadline - now))
        if self.spawner.reaping:
            timeout = min(timeout, 0.05)
        return timeout

    def _check_parent(self) -> None:
        if self.parent_pid is not None and os.getppid() != self.parent_pid:
            log.warning("parent process %s is gone; shutting down", self.parent_pid)
            self._running = False

    # ================================================================== clients
    def _drain_socket(self) -> None:
        # EVENTS is an int option (pyzmq types every option int | bytes); no cast() call per turn here.
        while self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:  # type: ignore[arg-type,operator]
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return  # checked again next turn
            if len(frames) < 2:
                continue  # nothing to answer: not even a header
            user: str | None = None
            if self.keys is not None:
                try:
                    # a ZAP metadata property: always a str (pyzmq types a str-named property int | str)
                    user = frames[1].get("User-Id")  # type: ignore[assignment]
                except (zmq.ZMQError, AttributeError):
                    user = None
            self.current_user = user
            client = frames[0].bytes
            self._handle_request(client, frames[1].bytes, [f.bytes for f in frames[2:]])
        self._zmq_check = False  # the last thing done on the socket was reading its events

    def _on_local_event(self, ev: int) -> None:
        """The local pool's channel: write what is queued, answer every whole request."""
        local = self._local
        if local is None:  # dropped: its fd is unregistered, so only a stale caller gets here
            return
        try:
            if ev & select.EPOLLOUT:
                local.flush()
                self._watch_local_writes()
            if ev & (select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR):
                self._local_request_arrived()
                self.current_user = None
                for frames in local.read_messages():
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
            self.poller.modify(self._local_fd, select.EPOLLIN | (select.EPOLLOUT if self._local_mask_out else 0))

    def _drop_local(self) -> None:
        if self._local is not None:
            self.poller.unwatch(self._local_fd)
            self._local.close()
            self._local, self._local_fd = None, -1

    def _drain_clients(self) -> None:
        """Answer whatever every client has sent (during long start-ups)."""
        self._drain_socket()
        if self._local is not None:
            self._on_local_event(select.EPOLLIN)

    def _handle_request(self, client: bytes, header_frame: bytes, payloads: list[bytes]) -> None:
        seq = None
        try:
            header = decode_header(header_frame)
            seq = header.get("seq")
            op = header.get("op")
            handler = HANDLERS.get(op)
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
            self.send(client, reply)

    def send(self, client: bytes, header: dict, frames: Sequence = (), fds: Sequence[int] = ()) -> None:
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

    def reply_batch(self, batch: Batch) -> None:
        """Send a complete batch's results (each :class:`Batch` calls this when its last call is done)."""
        results, data = pack_results(batch.results)
        worker_s = time.perf_counter() - batch.t0
        header = {"seq": batch.seq, "ok": True, "worker_ms": worker_s * 1e3, "results": results}
        if batch.stats is not None and batch.envs:  # not a request of only faults or adoptions
            batch.stats.batch_done(worker_s, batch.envs)
        region_fds = batch.region_fds
        if region_fds:
            header[REGION_FDS] = len(region_fds)
        try:
            if batch.lend_from is not None:
                self.lane.send_lending(batch.lend_from, header, [data], region_fds)
            elif region_fds:
                self._send_with_regions(batch.client, header, [data], region_fds)
            else:
                self.send(batch.client, header, [data])
        finally:
            for fd in region_fds:  # the pool has its own copies now (or none: it then keeps bytes)
                os.close(fd)
        if batch.client == LOCAL_CLIENT:
            self._local_replied()

    def _send_with_regions(self, client: bytes, header: dict, frames: list, region_fds: list[int]) -> None:
        """Send a reply with observation-region descriptors; without them if they cannot go."""
        try:
            self.send(client, header, frames, region_fds)
        except (OSError, ValueError) as exc:
            log.warning("could not pass %d observation regions to the local pool: %s", len(region_fds), exc)
            header.pop(REGION_FDS, None)
            self.send(client, header, frames)

    def _send_created(self, session: Session, header: dict) -> None:
        """Answer a session's ``create`` (its envs all started), lending them if its pool asked."""
        if session.lend:
            self.lane.send_lending(session, header, [])
        else:
            self.send(session.client, header)

    def _answer_uploads(self) -> None:
        for done in self.uploads.finished():
            if done.error is None:
                self.archives[done.digest] = done.dest
                reply = {"ok": True}
                self.stats.upload("unpacked")
            elif isinstance(done.error, ArchiveError):
                reply = error_reply(None, "archive", str(done.error))
                self.stats.upload("refused")
            else:
                self.stats.upload("error")
                log.error("unpacking archive %s failed", done.digest[:12], exc_info=done.error)
                reply = error_reply(None, "internal", f"{type(done.error).__name__}: {done.error}")
            for client, seq in done.waiters:
                self.send(client, dict(reply, seq=seq))

    def session_for(self, client: bytes, header: dict) -> Session:
        """The open session a request names, checked against its token and the client's key (and
        its lease renewed); ``ValueError``, or :class:`SessionExpired` for a reclaimed one."""
        sid = header.get("session")
        session = self.sessions.get(sid) if isinstance(sid, str) else None
        if (
            session is None
            or session.closed
            or not secrets.compare_digest(str(header.get("token", "")), session.token)
            or session.owner_key != self.current_user
        ):
            if isinstance(sid, str) and sid in self._expired:
                raise self._expired_error(sid)
            raise ValueError(f"no open session {sid!r} for this client")
        now = time.monotonic()
        if self._lease_passed(session, now):  # (housekeeping had not got to it yet: the lease decides)
            self._reclaim(session, now)
            raise self._expired_error(session.sid)
        session.last_seen = now
        session.client = client
        return session

    # ================================================================== sessions' end, shutdown
    def _expire_leases(self) -> None:
        now = time.monotonic()
        for session in list(self.sessions.values()):
            if self._lease_passed(session, now):
                self._reclaim(session, now)

    def _expired_error(self, sid: str) -> SessionExpired:
        return SessionExpired(
            f"session {sid} was reclaimed after {self._expired[sid]:.0f} s without a request (its lease)"
        )

    @staticmethod
    def _lease_passed(session: Session, now: float) -> bool:
        """Whether ``session`` went longer than its lease without a request (and nothing is lent).
        Every request asks, so the scan of its envs comes last, only once the time has run out."""
        if session.create_seq is not None or now - session.last_seen <= session.cfg.lease_s:
            return False
        return not any(env.state is LENT for env in session.envs)  # lent: in use without a request

    def _reclaim(self, session: Session, now: float) -> None:
        log.warning(
            "session %s: no request for %.0f s (lease %.0f s); reclaiming its %d envs",
            session.sid,
            now - session.last_seen,
            session.cfg.lease_s,
            len(session.envs),
        )
        self._expired[session.sid] = session.cfg.lease_s
        self.close_session(session)

    def close_session(self, session: Session) -> None:
        session.closed = True
        self.stats.close(session.sid)
        self.snapshots.release_session(session.sid)
        # Every env is signalled first, then each is cleaned up and reaped: closing takes the slowest
        # env's exit (namespace teardown, cgroup removal), not the sum of them all.
        for env in session.envs:
            if env.launched is not None:
                env.launched.kill()
        for env in session.envs:
            pid = self.spawner.kill_env(session, env)
            self.spawner.reap_now(pid)
            env.state = CLOSED
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
        if self.metrics_server is not None:
            self.metrics_server.shutdown()
            self.metrics_server.server_close()
            self.metrics_server = None
        for session in list(self.sessions.values()):
            try:
                self.close_session(session)
            except Exception:  # noqa: BLE001
                log.exception("closing session %s", session.sid)
        self.spawner.reap()
        self.uploads.close()
        shutil.rmtree(self.root, ignore_errors=True)
        self.poller.close()
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
