"""One worker link: the pool's connection to one worker, and the start of a local worker.

A :class:`WorkerLink` is a ZeroMQ DEALER socket (a remote worker) or a :class:`Channel`
over a socketpair (the pool's own worker), plus what the pool knows of that worker: the
envs it hosts, the session, the lent envs (its lane). It sends tagged requests, waits for
the reply with that tag while pinging the worker, and turns error replies, silence,
rejected keys and a dead local worker into the library's exceptions.
"""

from __future__ import annotations

import itertools
import math
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Container, Iterable, Iterator, Sequence
from typing import Any

import zmq

from ..errors import CapacityError, SandboxUnavailable, WorkerError, WorkerLost, WorkerTimeout
from ..wire.channel import Channel, ChannelClosed, ChannelError
from ..wire.protocol import LENT, LENT_FDS, REGION_FDS, REGION_FDS_TAKEN, decode_header, encode_header
from ..wire.start_failure import EXC_TYPES
from .direct_lane import DirectLane
from .obs_regions import ObsRegions
from .start_errors import start_error

__all__ = ["WorkerLink", "start_local_worker"]


class WorkerLink:
    """One worker: its DEALER socket (or, for the pool's own worker, a :class:`Channel`),
    the envs it hosts, its session."""

    def __init__(
        self,
        ctx: zmq.Context | None,
        address: str,
        start: int,
        count: int,
        *,
        heartbeat_interval: float,
        heartbeat_timeout: float,
        seq: Iterator[int] | None = None,
        process: subprocess.Popen | None = None,
        keys=None,
        send_timeout: float = 10.0,
        channel: Channel | None = None,
        tmpdir: str | None = None,
    ):
        self.address = address
        self.start = start
        self.count = count
        #: The local worker's process and the directory of its socket (None: a remote worker).
        self.process = process
        self.tmpdir = tmpdir
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_timeout = heartbeat_timeout
        self._seq = seq if seq is not None else itertools.count(1)
        self.session: str | None = None
        self.token: str | None = None
        self.uploaded = False
        self.monitor: zmq.Socket | None = None
        self.last_heard = time.monotonic()
        self.last_ping = 0.0
        self.last_sent = 0.0  # when the last request went out (time.monotonic)
        #: Envs started so far, from the worker's interim replies to ``create``.
        self.started = 0
        #: Called after each interim start-up count (see :attr:`started`).
        self.on_progress: Callable[[], None] | None = None
        #: The envs this (local) worker lent us, stepped on their own pipes; None: no lane.
        self.lane: DirectLane | None = None
        #: The CURVE keys this link authenticates with (None: none), for other connections to the worker.
        self.keys = keys
        #: The (local) worker's env processes' shared observation regions; None: observations as bytes.
        self.regions: ObsRegions | None = None
        #: A ZeroMQ DEALER or a Channel: the same send_multipart/poll/recv_multipart/close.
        self.sock: Any = channel
        if channel is None:
            assert ctx is not None
            self.sock = self._connect(ctx, keys, send_timeout)
        self._fd: int | None = None  # fileno(), once asked

    def holds(self, index: int) -> bool:
        """Whether env (or sandbox) ``index`` of the pool lives on this worker."""
        return self.start <= index < self.start + self.count

    def _connect(self, ctx: zmq.Context, keys, send_timeout: float) -> zmq.Socket:
        sock = dealer_socket(ctx, keys, send_timeout)
        if keys is not None:
            # A rejected key is silent on the data socket: watch the handshake events.
            self.monitor = sock.get_monitor_socket(
                zmq.EVENT_HANDSHAKE_FAILED_AUTH
                | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
            )
        sock.connect(self.address)
        return sock

    def handshake_failure(self) -> str | None:
        """A message naming the handshake failure seen since the last look, if any."""
        if self.monitor is None:
            return None
        from zmq.utils.monitor import recv_monitor_message

        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)["event"]
            if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                return "the worker rejected this client's key (is client.key in the worker's --keys directory?)"
            if event in (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL):
                return "the CURVE handshake failed (wrong worker.key, or the worker runs without --keys?)"
        return None

    def close(self) -> None:
        """Close the socket, the lent pipes and the mapped regions; stop a local worker and remove its directory."""
        if self.lane is not None:
            self.lane.close()
            self.lane = None
        if self.regions is not None:
            self.regions.close()
        if self.monitor is not None:
            try:
                self.sock.disable_monitor()
            except zmq.ZMQError:
                pass
            self.monitor.close(linger=0)
        self.sock.close(linger=0)
        if self.process is not None:
            stop_process(self.process)
        if self.tmpdir:
            shutil.rmtree(self.tmpdir, ignore_errors=True)

    # ------------------------------------------------------------------ requests and replies
    def send(self, header: dict, frames: Sequence[bytes] = ()) -> int:
        """Send one request (with this link's session); the tag its reply will carry."""
        seq = next(self._seq)
        header = dict(header, seq=seq)
        if self.session is not None and "session" not in header:
            header["session"] = self.session
            header["token"] = self.token
        try:
            self.sock.send_multipart([encode_header(header), *frames])
            self.last_sent = time.monotonic()
        except zmq.Again:
            hint = self.handshake_failure() or "it is down, unreachable, or refused the connection"
            raise WorkerLost(f"worker {self.address} is unreachable: cannot send ({hint})", self.address) from None
        except ChannelClosed:
            self._raise_worker_gone()
        return seq

    def recv(self, seq: int, timeout: float) -> tuple[dict, list]:
        """Wait for the reply tagged ``seq``, pinging the worker while waiting.

        Stale replies of abandoned calls are dropped. A worker that answers nothing,
        not even a ping, for ``heartbeat_timeout`` seconds is declared dead or
        unreachable: a clear error naming it, never a hang.
        """
        started = time.monotonic()
        deadline = started + timeout
        # Silence counts from when this request went out (or the last word since): a pool that waits
        # on several workers in turn finds every lost one within one heartbeat timeout, not one each.
        self.last_heard = heard_before = max(self.last_heard, self.last_sent)
        while True:
            now = time.monotonic()
            left = deadline - now
            if left <= 0:
                if self.last_heard == heard_before:
                    hint = self.handshake_failure() or "it died, hangs, or the network is down"
                    raise WorkerTimeout(
                        f"worker {self.address} is unreachable: nothing heard within {timeout:.1f} s: {hint}",
                        self.address,
                    )
                raise WorkerTimeout(f"worker {self.address} did not answer within {timeout:.1f} s", self.address)
            # (a reply that came while the pool waited on another worker is no silence: read it first)
            if now - self.last_heard > self.heartbeat_timeout and not self._message_waiting():
                hint = self.handshake_failure() or "it died, hangs, or the network is down"
                raise WorkerLost(
                    f"worker {self.address} is unreachable: nothing heard for {now - self.last_heard:.1f} s "
                    f"(heartbeat timeout {self.heartbeat_timeout:g} s): {hint}",
                    self.address,
                )
            if now - max(self.last_ping, self.last_heard) >= self.heartbeat_interval:
                self._ping(now)
            try:
                ready = self.sock.poll(min(left, self.heartbeat_interval / 2) * 1000, zmq.POLLIN)
            except ChannelClosed:
                self._raise_worker_gone()
            except ChannelError as exc:
                raise WorkerError(f"the channel to local worker {self.address} broke: {exc}", self.address) from None
            if ready:
                # Copying receive: zero-copy Frames run cleanup code in __dealloc__, where a
                # Ctrl-C is "ignored" by the interpreter, and the trainer then never stops.
                frames = self.sock.recv_multipart()
                self.last_heard = time.monotonic()
                header = decode_header(frames[0])
                self._claim_fds(header)
                if header.get("seq") != seq:
                    close_lent(header)  # those envs are taken back when next named
                    continue  # a heartbeat, or a reply to a call that timed out earlier
                if "progress" in header and "ok" not in header:
                    self._note_progress(header)
                    continue
                return header, frames[1:]
            failure = self.handshake_failure()
            if failure:
                raise WorkerError(f"worker {self.address}: {failure}", self.address)
            self._check_alive()

    def read_ready(self, wanted: Container[int]) -> list[tuple[dict, list]]:
        """Every reply already here whose tag is in ``wanted``, without waiting (replies to calls
        nobody waits for are dropped, as :meth:`recv` drops them). For callers that keep several
        requests in flight on this link and wait on many links at once
        (:mod:`~boltzlabs_gym.client.async_steps`)."""
        out = []
        while self._message_waiting():
            frames = self.sock.recv_multipart()
            self.last_heard = time.monotonic()
            header = decode_header(frames[0])
            self._claim_fds(header)
            if header.get("seq") not in wanted:
                close_lent(header)
                continue
            out.append((header, frames[1:]))
        return out

    def keep_alive(self, now: float) -> None:
        """While waiting without :meth:`recv`: ping a quiet worker, and raise
        :class:`~boltzlabs_gym.errors.WorkerLost` (or a dead local worker's error) for one silent
        past the heartbeat timeout."""
        heard = max(self.last_heard, self.last_sent)
        if now - heard > self.heartbeat_timeout and not self._message_waiting():
            self._check_alive()
            hint = self.handshake_failure() or "it died, hangs, or the network is down"
            raise WorkerLost(
                f"worker {self.address} is unreachable: nothing heard for {now - heard:.1f} s "
                f"(heartbeat timeout {self.heartbeat_timeout:g} s): {hint}",
                self.address,
            )
        if now - max(self.last_ping, heard) >= self.heartbeat_interval:
            self._ping(now)

    def fileno(self) -> int:
        """The descriptor to wait on for replies, for an event loop that reads them with
        :meth:`read_ready`: the channel's socket, or the ZeroMQ socket's ``FD``. ZeroMQ's only
        signals a change, and a send or receive on the socket may take in the change that a reply
        came: after any, ask :meth:`reply_waiting` before waiting on it again."""
        if self._fd is None:
            self._fd = self.sock.fileno() if isinstance(self.sock, Channel) else self.sock.getsockopt(zmq.FD)
        return self._fd

    def reply_waiting(self) -> bool:
        """Whether a message waits to be read that :meth:`fileno` may not signal (see there)."""
        if isinstance(self.sock, Channel):
            return self.sock.has_message()  # beyond those, its socket is readable while bytes wait
        try:
            return bool(self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN)
        except zmq.ZMQError:
            return False  # closed: the next read says so with its own message

    def _message_waiting(self) -> bool:
        try:
            return bool(self.sock.poll(0, zmq.POLLIN))
        except (ChannelClosed, ChannelError):
            return False  # the next poll raises it with its own message

    def call(self, header: dict, frames: Sequence[bytes] = (), timeout: float = 30.0) -> dict:
        """Send a request and return its reply's header; an error reply raises."""
        header, _ = self.recv(self.send(header, frames), timeout)
        self.raise_for_error(header)
        return header

    def raise_for_error(self, header: dict) -> None:
        """Raise the library exception an error reply stands for (nothing if it is ``ok``)."""
        if header.get("ok"):
            return
        err = header.get("error") or {}
        kind, message = err.get("kind"), err.get("message", "unknown error")
        if kind == "env_start":
            stderr = err.get("stderr", "")
            types = err.get(EXC_TYPES)
            raise start_error(
                message + _tail_text(stderr),
                err.get("index"),
                stderr,
                self.address,
                types=types if isinstance(types, list) else None,
            )
        if kind == "capacity":
            raise CapacityError(f"worker {self.address}: {message}")
        if kind == "sandbox":
            raise SandboxUnavailable(message)
        if kind == "expired":
            raise WorkerError(f"worker {self.address}: {message}; create a new pool", self.address)
        raise WorkerError(f"worker {self.address} refused the request ({kind}): {message}", self.address)

    def _ping(self, now: float) -> None:
        ping = {"op": "ping", "seq": -1}
        if self.session is not None:
            ping.update(session=self.session, token=self.token)
        try:
            self.sock.send_multipart([encode_header(ping)], zmq.NOBLOCK)
        except zmq.Again:
            pass  # no live connection: silence will tell
        except ChannelClosed:
            self._raise_worker_gone()
        self.last_ping = now

    def _note_progress(self, header: dict) -> None:
        """An interim start-up count from the worker: keep it, and tell whoever watches."""
        try:
            self.started = min(int(header["progress"]), self.count)
        except (KeyError, TypeError, ValueError):
            return
        if self.on_progress is not None:
            self.on_progress()

    def _raise_worker_gone(self) -> None:
        """The local worker closed its channel: say how it ended."""
        if self.process is not None:
            try:
                self.process.wait(2.0)
            except subprocess.TimeoutExpired:
                pass
        self._check_alive()
        raise WorkerError(f"local worker {self.address} closed its channel", self.address)

    def _check_alive(self) -> None:
        if self.process is not None and self.process.poll() is not None:
            raise WorkerError(f"local worker {self.address} exited with code {self.process.returncode}", self.address)

    # ------------------------------------------------------------------ lent envs
    def _claim_fds(self, header: dict) -> None:
        """Attach to ``header`` (as ``_fds``) the descriptors its ``lent`` envs came with, and (as
        ``_region_fds``) the observation regions that follow them."""
        lent = header.get(LENT)
        regions = header.get(REGION_FDS)
        if regions and (type(regions) is not int or self.regions is None or not 0 < regions <= self.count):
            raise WorkerError(f"worker {self.address} sent regions this pool did not ask for", self.address)
        if not lent:
            if regions:
                header[REGION_FDS_TAKEN] = self._take_fds(regions)
            return
        valid = isinstance(lent, list) and all(type(i) is int and 0 <= i < self.count for i in lent)
        if self.lane is None or not valid:
            raise WorkerError(
                f"worker {self.address} lent envs this pool did not ask for: {str(lent)[:80]}", self.address
            )
        header[LENT_FDS] = self._take_fds(2 * len(lent))
        if regions:
            header[REGION_FDS_TAKEN] = self._take_fds(regions)

    def _take_fds(self, count: int) -> list[int]:
        try:
            return self.sock.take_fds(count)
        except ChannelError as exc:
            raise WorkerError(f"worker {self.address}: {exc}", self.address) from None

    def take_lent(self, header: dict) -> None:
        """Add the envs a reply lent (``lent``, with their claimed descriptors) to the lane."""
        if header.get(LENT_FDS) and self.lane is not None:  # _claim_fds took none without a lane
            self.lane.add(header[LENT], header.pop(LENT_FDS))


def close_lent(header: dict) -> None:
    """Close the descriptors of envs lent (and regions passed) with a reply nobody waits for any more."""
    for fd in [*header.pop(LENT_FDS, ()), *header.pop(REGION_FDS_TAKEN, ())]:
        try:
            os.close(fd)
        except OSError:
            pass


# ---------------------------------------------------------------------- the local worker
def start_local_worker(
    n: int,
    worker_args: Sequence[str] = (),
    *,
    heartbeat_interval: float,
    heartbeat_timeout: float,
    seq: Iterator[int] | None = None,
) -> WorkerLink:
    """Start the pool's own worker as a child process and return its link (hosting all ``n`` envs);
    ``worker_args``: the flags the pool's settings give it (``--busy-poll-us``, ``--metrics-port``:
    :meth:`PoolOptions.worker_config <boltzlabs_gym.client.options.PoolOptions.worker_config>`).

    The worker binds an ``ipc://`` socket in a fresh directory (removed when the link
    closes) but is reached over a socketpair: no ZeroMQ I/O-thread hand-offs.
    """
    tmpdir = tempfile.mkdtemp(prefix="boltzlabs-pool-")
    endpoint = f"ipc://{tmpdir}/worker.sock"
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    argv = [sys.executable, "-m", "boltzlabs_gym.worker", "--bind", endpoint, "--parent-pid", str(os.getpid())]
    argv += ["--remove-on-exit", tmpdir, "--local-fd", str(theirs.fileno())]
    argv += list(worker_args)
    try:
        process = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            start_new_session=True,
            pass_fds=(theirs.fileno(),),
        )
    except BaseException:
        ours.close()
        shutil.rmtree(tmpdir, ignore_errors=True)
        raise
    finally:
        theirs.close()
    link = WorkerLink(
        None,
        endpoint,
        0,
        n,
        process=process,
        channel=Channel(ours),
        tmpdir=tmpdir,
        seq=seq,
        heartbeat_interval=heartbeat_interval,
        heartbeat_timeout=heartbeat_timeout,
    )
    try:
        line = _read_line(process.stdout, timeout=30.0)
        if not line.startswith("READY "):
            process.kill()
            link.sock.close()
            if line.startswith("ERROR "):  # the worker's own words (a --metrics-port in use, say)
                raise WorkerError(f"local worker failed to start: {line[len('ERROR ') :]}", endpoint)
            raise WorkerError(f"local worker failed to start (exit code {process.poll()}): {line!r}", endpoint)
    except BaseException:
        link.close()
        raise
    return link


def stop_process(process: subprocess.Popen, grace: float = 5.0) -> None:
    """SIGTERM, then after ``grace`` seconds SIGKILL; close its stdout."""
    if process.poll() is None:
        try:
            process.send_signal(signal.SIGTERM)
            process.wait(grace)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5.0)
        except ProcessLookupError:
            pass
    if process.stdout is not None:
        process.stdout.close()


def _read_line(stream, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    buf = b""
    fd = stream.fileno()
    poller = select.poll()  # not select(): the fd may be above 1024 in a busy trainer
    poller.register(fd, select.POLLIN)
    while not buf.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0:
            break
        if not poller.poll(math.ceil(left * 1000)):
            break
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        buf += chunk
    return buf.decode("utf-8", "replace").strip()


def _tail_text(stderr: str) -> str:
    return f"\n--- stderr tail ---\n{stderr.rstrip()}" if stderr.strip() else " (no stderr output)"


def dealer_socket(ctx: zmq.Context, keys: Any, send_timeout: float) -> zmq.Socket:
    """A DEALER for a worker, not yet connected: no linger, sends bounded by ``send_timeout``
    seconds, and the CURVE ``keys`` (a :class:`~boltzlabs_gym.wire.keys.ClientKeys`) when given."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    # A DEALER with no live peer blocks on send: bound it, so an unreachable or
    # key-rejecting worker becomes an error instead of a hang.
    sock.setsockopt(zmq.SNDTIMEO, int(send_timeout * 1000))
    if keys is not None:
        sock.curve_secretkey = keys.secret
        sock.curve_publickey = keys.public
        sock.curve_serverkey = keys.server_public
    return sock


def link_holding(links: Iterable[WorkerLink], index: int) -> WorkerLink | None:
    """The link whose worker holds env (or sandbox) ``index``, if any."""
    for link in links:
        if link.holds(index):
            return link
    return None
