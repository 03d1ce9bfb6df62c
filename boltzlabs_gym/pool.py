"""RLPool: the trainer-side client of one or more workers.

>>> from boltzlabs_gym import RLPool                              # doctest: +SKIP
>>> with RLPool("./envs/counter", n=64) as pool:                  # doctest: +SKIP
...     obs = pool.reset(seed=0)
...     obs, rewards, dones, infos = pool.step([1] * 64)
...     if dones.any():
...         obs = pool.reset(where=dones)
...     print(pool.timing, pool.envs_per_gb())

One request per worker carries all of that worker's actions; replies are spliced
back into index order. Without ``workers=`` the pool starts its own worker as a
child process on an ``ipc://`` socket, the same code path a remote worker uses.
"""

from __future__ import annotations

import enum
import itertools
import logging
import math
import os
import resource
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import zmq

from .archive import pack_dir
from .channel import Channel, ChannelClosed, ChannelError
from .errors import (
    AsyncStateError,
    CapacityError,
    EnvStartError,
    PoolClosedError,
    SandboxUnavailable,
    WorkerError,
    WorkerTimeout,
)
from .lane import DIRECT_OPS, Lane
from .protocol import (
    DEFAULT_BUSY_POLL_US, ERROR, LENT_FAULT, OK, STRAGGLER, check_poll_us, decode_header, encode_header,
    env_request, jsonable,
)
from .results import EnvResult, parse_result, read_reset, read_step
from .timing import Timing
from .worker.sandbox.base import IsolationReport, Limits

log = logging.getLogger("boltzlabs_gym.pool")

MODES = ("default", "boltz")


class _State(enum.Enum):
    IDLE = "idle"
    WAITING_STEP = "waiting for step_wait()"
    WAITING_RESET = "waiting for a reset reply"


class _Link:
    """One worker: its DEALER socket (or, for the pool's own worker, a :class:`Channel`),
    the envs it hosts, its session."""

    def __init__(self, ctx: zmq.Context, address: str, start: int, count: int, process=None, keys=None,
                 send_timeout: float = 10.0, channel: Channel | None = None):
        self.address = address
        self.start = start
        self.count = count
        self.process = process
        self.session: str | None = None
        self.token: str | None = None
        self.uploaded = False
        self.monitor = None
        self.last_heard = time.monotonic()
        self.last_ping = 0.0
        #: The envs this (local) worker lent us, stepped on their own pipes; None: no lane.
        self.lane: Lane | None = None
        if channel is not None:
            self.sock = channel  # same send_multipart/poll/recv_multipart/close as a DEALER
            return
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        # A DEALER with no live peer blocks on send: bound it, so an unreachable or
        # key-rejecting worker becomes an error instead of a hang.
        self.sock.setsockopt(zmq.SNDTIMEO, int(send_timeout * 1000))
        if keys is not None:
            self.sock.curve_secretkey = keys.secret
            self.sock.curve_publickey = keys.public
            self.sock.curve_serverkey = keys.server_public
            # A rejected key is silent on the data socket: watch the handshake events.
            self.monitor = self.sock.get_monitor_socket(
                zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
            )
        self.sock.connect(address)

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
        if self.lane is not None:
            self.lane.close()
            self.lane = None
        if self.monitor is not None:
            try:
                self.sock.disable_monitor()
            except zmq.ZMQError:
                pass
            self.monitor.close(linger=0)
        self.sock.close(linger=0)


#: The time the worker gets to kill, report and respawn envs that failed on the lane.
LENT_FAULT_TIMEOUT_S = 30.0


@dataclass
class _LanePending:
    """A batch sent partly on the lane: the worker request's tag (None: nothing sent to
    it), the batch positions of its items, the batch size, calls that failed at once,
    when the call started and when its lane part was written (None: no lane part)."""

    seq: int | None
    via: list[int]
    size: int
    failed: list
    t0: float
    t_send: float | None


def _close_lent(header: dict) -> None:
    for fd in header.pop("_fds", ()):
        try:
            os.close(fd)
        except OSError:
            pass


def _sigpipe_ignored() -> bool:
    """Whether writing to a dead env's pipe raises EPIPE here rather than killing the process
    (Python ignores SIGPIPE unless the program restored it)."""
    if signal.getsignal(signal.SIGPIPE) == signal.SIG_IGN:
        return True
    log.info("direct lane off: SIGPIPE is not ignored in this process")
    return False


def _fd_room(need: int) -> bool:
    """Whether this process may open ``need`` more descriptors, raising its soft limit if it must."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        used = len(os.listdir("/proc/self/fd"))
    except OSError:
        used = 256
    want = used + need
    if soft == resource.RLIM_INFINITY or want <= soft:
        return True
    if hard != resource.RLIM_INFINITY and want > hard:
        log.info("direct lane off: %d more descriptors needed, the hard limit is %d", need, hard)
        return False
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (ValueError, OSError):
        return False
    return True


def _cap_counts(counts: list[int], caps: Sequence[int]) -> list[int]:
    """Move envs from workers over their free capacity to workers with room left."""
    counts = list(counts)
    extra = sum(max(0, c - cap) for c, cap in zip(counts, caps))
    counts = [min(c, cap) for c, cap in zip(counts, caps)]
    for i, cap in enumerate(caps):
        take = min(extra, cap - counts[i])
        counts[i] += take
        extra -= take
    return counts


def _split_counts(n: int, weights: Sequence[int]) -> list[int]:
    total = sum(weights)
    counts = [n * w // total for w in weights]
    for i in range(n - sum(counts)):
        counts[i % len(counts)] += 1
    return counts


class RLPool:
    """A pool of ``n`` resident, sandboxed env processes behind one batched call.

    Args:
        env_dir: an env directory whose ``env.py`` calls :func:`boltzlabs_gym.env.serve`.
        n: number of envs.
        workers: worker addresses (``tcp://host:port``); default: start a local worker.
            Envs are split across workers by their free capacity, or by ``split``.
        keys: CURVE key directory (``boltzlabs-gym keygen``) for authenticated workers.
        split: explicit number of envs per worker (same order as ``workers``).
        heartbeat_timeout: seconds of silence after which a worker counts as dead or
            unreachable (the pool pings it every ``heartbeat_interval`` while waiting).
        lease: seconds a remote worker keeps this pool's envs without hearing from it.
        isolation: ``"auto"`` (best available, warns on fallback), ``"strict"`` (refuse to
            run without a real sandbox), or a backend name (``"namespaces"``, ``"bwrap"``,
            ``"process"``).
        mode: ``"default"``: one fresh interpreter per env; ``"boltz"``: every env is
            forked from a warm template process that imported the env once (denser
            pools, faster hard resets). No fallback between the two.
        step_timeout: per-step deadline in seconds; an env that misses it is killed and
            reported as a straggler (``info["boltzlabs_straggler"]``).
        reset_timeout: deadline for resets and other calls.
        start_timeout: deadline for an env's interpreter start plus first reset.
        limits: per-env :class:`~boltzlabs_gym.Limits` (memory, processes, files, ...).
        serialize_measurement: run one env step at a time per worker host (for rewards
            that are timings); resets stay concurrent.
        env_vars: extra environment variables for every env process.
        busy_poll_us: microseconds a local pool's worker keeps polling, awake, for the next
            request after answering one, when the previous one came at least that fast (it
            saves a wake-up per batch: 30-60 us in a VM); 0 always sleeps. Remote workers
            always sleep.
        env_aslr: give every env interpreter a randomized address-space layout. Off by
            default: envs then share one layout, as forked envs (boltz mode,
            AsyncVectorEnv, SubprocVecEnv) always do, and the CPU's branch predictors
            and caches carry over from env to env (about 30% less CPU per CartPole step
            with 64 fresh interpreters on a 2-vCPU VM). Inside a sandbox that runs
            untrusted code anyway the randomization guards nothing outside it; the
            worker and the trainer keep theirs. In boltz mode it applies to the template,
            whose layout every forked env shares.
        direct: let a local pool step idle envs on their own pipes (lent by its worker,
            see :mod:`boltzlabs_gym.lane`) instead of through the worker: one process hop
            less per step, same limits, deadlines and failure reports. ``False`` sends
            everything through the worker, as remote pools always do.
    """

    def __init__(
        self,
        env_dir: str | os.PathLike,
        n: int,
        *,
        workers: Sequence[str] | None = None,
        isolation: str = "auto",
        mode: str = "default",
        step_timeout: float = 30.0,
        reset_timeout: float = 60.0,
        start_timeout: float = 120.0,
        limits: Limits | None = None,
        serialize_measurement: bool = False,
        env_vars: dict[str, str] | None = None,
        keys: str | os.PathLike | None = None,
        split: Sequence[int] | None = None,
        heartbeat_interval: float = 1.0,
        heartbeat_timeout: float = 10.0,
        lease: float = 600.0,
        busy_poll_us: float = DEFAULT_BUSY_POLL_US,
        env_aslr: bool = False,
        direct: bool = True,
    ):
        if type(n) is not int or n < 1:
            raise ValueError(f"n must be a positive int, got {n!r}")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        for name, value in (("step_timeout", step_timeout), ("reset_timeout", reset_timeout), ("start_timeout", start_timeout)):
            if not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        busy_poll_us = check_poll_us("busy_poll_us", busy_poll_us)
        if not isinstance(env_aslr, bool):
            raise ValueError(f"env_aslr must be True or False, got {env_aslr!r}")
        if not isinstance(direct, bool):
            raise ValueError(f"direct must be True or False, got {direct!r}")
        self.direct = direct
        if heartbeat_interval <= 0 or heartbeat_timeout <= heartbeat_interval:
            raise ValueError("heartbeat_timeout must be greater than heartbeat_interval > 0")
        if split is not None and (not workers or len(split) != len(workers) or sum(split) != n or min(split) < 0):
            raise ValueError(f"split must give one count per worker and sum to n={n}, got {split!r}")
        self.n = n
        self.heartbeat_interval = float(heartbeat_interval)
        self.busy_poll_us = float(busy_poll_us)
        self.heartbeat_timeout = float(heartbeat_timeout)
        self._keys = None
        if keys is not None:
            from .keys import load_client_keys

            self._keys = load_client_keys(os.fspath(keys))
        self.env_dir = os.fspath(env_dir)
        self.mode = mode
        self.env_aslr = env_aslr
        self.step_timeout = float(step_timeout)
        self.reset_timeout = float(reset_timeout)
        self.start_timeout = float(start_timeout)
        self.limits = limits or Limits()
        self.timing = Timing()
        self.isolation: IsolationReport | None = None
        self.reset_infos: list[dict] = [{} for _ in range(n)]
        #: PSS in bytes of the boltz-mode templates, as of the last :meth:`memory` call.
        self.template_pss = 0
        #: (envs started, n) while the pool starts; a bar shows it on a terminal.
        self.start_progress = (0, n)
        self._progress_stream = None
        self._closed = False
        self._state = _State.IDLE
        self._seq = itertools.count(1)
        self._tmpdir: str | None = None
        self._links: list[_Link] = []
        self._pending: list | None = None
        self._last_obs: list = [None] * n
        self._ctx = zmq.Context()
        self._finalizer = weakref.finalize(self, RLPool._finalize, self._ctx, self._links, [None])
        try:
            archive, digest = pack_dir(self.env_dir)
            self._start_links(workers, split)
            self._create_sessions(
                archive,
                digest,
                {
                    "isolation": isolation,
                    "mode": mode,
                    "limits": self.limits.to_json(),
                    "step_timeout": self.step_timeout,
                    "reset_timeout": self.reset_timeout,
                    "start_timeout": self.start_timeout,
                    "serialize_measurement": bool(serialize_measurement),
                    "env_vars": dict(env_vars or {}),
                    "env_aslr": env_aslr,
                    # A local worker dies with this process; only remote ones need a lease.
                    "lease_s": float(lease) if workers else 86400.0,
                },
            )
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ start-up
    def _start_links(self, workers: Sequence[str] | None, split: Sequence[int] | None) -> None:
        if workers:
            probes = [_Link(self._ctx, address, 0, 0, keys=self._keys, send_timeout=self.heartbeat_timeout) for address in workers]
            self._links.extend(probes)  # closed by the finalizer whatever happens next
            free = [int(self._call(link, {"op": "status"}, timeout=self.heartbeat_timeout)["free"]) for link in probes]
            if split is None:
                if sum(free) < self.n:
                    raise CapacityError(
                        f"asked for {self.n} envs but the workers have {sum(free)} free slots: "
                        + ", ".join(f"{w} {f}" for w, f in zip(workers, free))
                    )
                counts = _split_counts(self.n, free) if sum(free) else [0] * len(free)
                counts = _cap_counts(counts, free)
            else:
                counts = list(split)
                short = [f"{w} has {f} free, asked {c}" for w, f, c in zip(workers, free, counts) if c > f]
                if short:
                    raise CapacityError("not enough free env slots: " + "; ".join(short))
            start = 0
            self._links.clear()
            for link, count in zip(probes, counts):
                if count:
                    link.start, link.count = start, count
                    self._links.append(link)
                else:
                    link.close()
                start += count
            return
        self._tmpdir = tempfile.mkdtemp(prefix="boltzlabs-pool-")
        endpoint = f"ipc://{self._tmpdir}/worker.sock"
        # Our own worker is reached over a socketpair, not ZeroMQ: no I/O-thread hand-offs.
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            process = subprocess.Popen(
                [
                    sys.executable, "-m", "boltzlabs_gym.worker", "--bind", endpoint,
                    "--parent-pid", str(os.getpid()), "--remove-on-exit", self._tmpdir,
                    "--local-fd", str(theirs.fileno()), "--local-spin-us", repr(self.busy_poll_us),
                ],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                start_new_session=True,
                pass_fds=(theirs.fileno(),),
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        channel = Channel(ours)
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, RLPool._finalize, self._ctx, self._links, [process, self._tmpdir])
        line = _read_line(process.stdout, timeout=30.0)
        if not line.startswith("READY "):
            process.kill()
            channel.close()
            raise WorkerError(f"local worker failed to start (exit code {process.poll()}): {line!r}", endpoint)
        link = _Link(self._ctx, endpoint, 0, self.n, process=process, channel=channel)
        self._links.append(link)
        if self.direct and _sigpipe_ignored() and _fd_room(2 * self.n + 64):
            link.lane = Lane(self.step_timeout, self.reset_timeout)

    def _create_sessions(self, archive: bytes, digest: str, config: dict) -> None:
        for link in self._links:
            have = self._call(link, {"op": "has_archive", "hash": digest}, timeout=30.0)
            if not have.get("have"):
                self._call(link, {"op": "upload", "hash": digest}, [archive], timeout=120.0)
                link.uploaded = True
        seqs = []
        for link in self._links:
            header = dict(config, op="create", hash=digest, n=link.count, index_offset=link.start)
            if link.lane is not None:
                header["lend"] = True
            seqs.append(self._send(link, header))
        # Every env may queue behind max_starting others: allow for the whole stagger.
        timeout = self.start_timeout * (1 + self.n / 4) + 30.0
        # A progress bar for big pools, on a terminal only (nothing in logs or CI output).
        self._progress_stream = sys.stderr if self.n >= 32 and sys.stderr.isatty() else None
        failure = None
        for link, seq in zip(self._links, seqs):
            try:
                header, _ = self._recv(link, seq, timeout)
                self._raise_for_error(link, header)
            except BaseException as exc:  # keep collecting: started sessions must be closed
                failure = failure or exc
                continue
            link.session = header["session"]
            link.token = header["token"]
            self.isolation = IsolationReport.from_json(header["isolation"])
            self._take_lent(link, header)
        if failure is None:
            self.start_progress = (self.n, self.n)
        if self._progress_stream is not None:
            if failure is None:
                self._draw_progress()
            self._progress_stream.write("\n")
            self._progress_stream = None
        if failure is not None:
            raise failure
        log.info("pool of %d envs ready: %s", self.n, self.isolation)

    # ------------------------------------------------------------------ transport
    def _send(self, link: _Link, header: dict, frames: Sequence[bytes] = ()) -> int:
        seq = next(self._seq)
        header = dict(header, seq=seq)
        if link.session is not None and "session" not in header:
            header["session"] = link.session
            header["token"] = link.token
        try:
            link.sock.send_multipart([encode_header(header), *frames])
        except zmq.Again:
            hint = link.handshake_failure() or "it is down, unreachable, or refused the connection"
            raise WorkerError(f"worker {link.address} is unreachable: cannot send ({hint})", link.address) from None
        except ChannelClosed:
            self._raise_worker_gone(link)
        return seq

    def _recv(self, link: _Link, seq: int, timeout: float) -> tuple[dict, list]:
        """Wait for the reply tagged ``seq``, pinging the worker while waiting.

        Stale replies of abandoned calls are dropped. A worker that answers nothing,
        not even a ping, for ``heartbeat_timeout`` seconds is declared dead or
        unreachable: a clear error naming it, never a hang.
        """
        started = time.monotonic()
        deadline = started + timeout
        link.last_heard = started
        while True:
            now = time.monotonic()
            left = deadline - now
            if left <= 0:
                if link.last_heard == started:
                    hint = link.handshake_failure() or "it died, hangs, or the network is down"
                    raise WorkerTimeout(
                        f"worker {link.address} is unreachable: nothing heard within {timeout:.1f} s: {hint}", link.address
                    )
                raise WorkerTimeout(f"worker {link.address} did not answer within {timeout:.1f} s", link.address)
            if now - link.last_heard > self.heartbeat_timeout:
                hint = link.handshake_failure() or "it died, hangs, or the network is down"
                raise WorkerError(
                    f"worker {link.address} is unreachable: nothing heard for {now - link.last_heard:.1f} s "
                    f"(heartbeat timeout {self.heartbeat_timeout:g} s): {hint}",
                    link.address,
                )
            if now - max(link.last_ping, link.last_heard) >= self.heartbeat_interval:
                ping = {"op": "ping", "seq": -1}
                if link.session is not None:
                    ping.update(session=link.session, token=link.token)
                try:
                    link.sock.send_multipart([encode_header(ping)], zmq.NOBLOCK)
                except zmq.Again:
                    pass  # no live connection: silence will tell
                except ChannelClosed:
                    self._raise_worker_gone(link)
                link.last_ping = now
            try:
                ready = link.sock.poll(min(left, self.heartbeat_interval / 2) * 1000, zmq.POLLIN)
            except ChannelClosed:
                self._raise_worker_gone(link)
            except ChannelError as exc:
                raise WorkerError(f"the channel to local worker {link.address} broke: {exc}", link.address) from None
            if ready:
                # Copying receive: zero-copy Frames run cleanup code in __dealloc__, where a
                # Ctrl-C is "ignored" by the interpreter, and the trainer then never stops.
                frames = link.sock.recv_multipart()
                link.last_heard = time.monotonic()
                header = decode_header(frames[0])
                self._claim_fds(link, header)
                if header.get("seq") != seq:
                    _close_lent(header)  # those envs are taken back when next named
                    continue  # a heartbeat, or a reply to a call that timed out earlier
                if "progress" in header and "ok" not in header:
                    self._on_progress(link, header)
                    continue
                return header, frames[1:]
            failure = link.handshake_failure()
            if failure:
                raise WorkerError(f"worker {link.address}: {failure}", link.address)
            self._check_worker_alive(link)

    @staticmethod
    def _claim_fds(link: _Link, header: dict) -> None:
        """Attach to ``header`` (as ``_fds``) the descriptors its ``lent`` envs came with."""
        lent = header.get("lent")
        if not lent:
            return
        valid = isinstance(lent, list) and all(type(i) is int and 0 <= i < link.count for i in lent)
        if link.lane is None or not valid:
            raise WorkerError(f"worker {link.address} lent envs this pool did not ask for: {str(lent)[:80]}",
                              link.address)
        try:
            header["_fds"] = link.sock.take_fds(2 * len(lent))
        except ChannelError as exc:
            raise WorkerError(f"worker {link.address}: {exc}", link.address) from None

    @staticmethod
    def _take_lent(link: _Link, header: dict) -> None:
        if header.get("_fds"):
            link.lane.add(header["lent"], header.pop("_fds"))

    def _on_progress(self, link: _Link, header: dict) -> None:
        """An interim start-up count from a worker: keep it, and redraw the bar on a terminal."""
        try:
            link.started = min(int(header["progress"]), link.count)
        except (KeyError, TypeError, ValueError):
            return
        self.start_progress = (sum(getattr(x, "started", 0) for x in self._links), self.n)
        if self._progress_stream is not None:
            self._draw_progress()

    def _draw_progress(self) -> None:
        done, total = self.start_progress
        width = 30
        bar = "#" * (width * done // total) + "-" * (width - width * done // total)
        self._progress_stream.write(f"\rboltzlabs: starting envs [{bar}] {done}/{total}")
        self._progress_stream.flush()

    def _raise_worker_gone(self, link: _Link) -> None:
        """The local worker closed its channel: say how it ended."""
        if link.process is not None:
            try:
                link.process.wait(2.0)
            except subprocess.TimeoutExpired:
                pass
        self._check_worker_alive(link)
        raise WorkerError(f"local worker {link.address} closed its channel", link.address)

    def _check_worker_alive(self, link: _Link) -> None:
        if link.process is not None and link.process.poll() is not None:
            raise WorkerError(
                f"local worker {link.address} exited with code {link.process.returncode}", link.address
            )

    def _call(self, link: _Link, header: dict, frames: Sequence[bytes] = (), timeout: float = 30.0) -> dict:
        header, _ = self._recv(link, self._send(link, header, frames), timeout)
        self._raise_for_error(link, header)
        return header

    @staticmethod
    def _raise_for_error(link: _Link, header: dict) -> None:
        if header.get("ok"):
            return
        err = header.get("error") or {}
        kind, message = err.get("kind"), err.get("message", "unknown error")
        if kind == "env_start":
            raise EnvStartError(message + _tail_text(err.get("stderr", "")), err.get("index"), err.get("stderr", ""), link.address)
        if kind == "capacity":
            raise CapacityError(f"worker {link.address}: {message}")
        if kind == "sandbox":
            raise SandboxUnavailable(message)
        if kind == "expired":
            raise WorkerError(f"worker {link.address}: {message}; create a new pool", link.address)
        raise WorkerError(f"worker {link.address} refused the request ({kind}): {message}", link.address)

    # ------------------------------------------------------------------ batched calls
    def _check_open(self) -> None:
        if self._closed:
            raise PoolClosedError("this pool is closed; create a new RLPool")

    def batch_async(self, items: Sequence[tuple[int, dict, Sequence[bytes]]]) -> None:
        """Send one request per worker carrying ``items``: ``(index, op, payload_frames)``.

        The low-level call that ``step``/``reset`` and the adapters are built on.
        """
        self._check_open()
        if self._state is not _State.IDLE:
            raise AsyncStateError(f"a call is already in flight ({self._state.value}); wait for it first")
        if len(self._links) == 1 and self._links[0].lane is not None:
            self._lane_async(self._links[0], items)
            return
        per_link: list[list] = [[] for _ in self._links]
        frames: list[list] = [[] for _ in self._links]
        # One worker (every local pool) answers in the items' order: nothing to reorder.
        order: list | None = [] if len(self._links) > 1 else None
        for index, op, payloads in items:
            li = self._link_of(index)
            link = self._links[li]
            per_link[li].append([index - link.start, op, len(payloads)])
            frames[li].extend(payloads)
            if order is not None:
                order.append((li, len(per_link[li]) - 1))
        t0 = time.perf_counter()
        seqs = []
        for li, link in enumerate(self._links):
            if per_link[li]:
                seqs.append((link, self._send(link, {"op": "batch", "items": per_link[li]}, frames[li])))
        self._pending = (seqs, order, t0)
        self._state = _State.WAITING_STEP

    def batch_wait(self, timeout: float | None = None, *, raw: bool = False) -> list[EnvResult]:
        """Collect the replies of :meth:`batch_async`, in the order of its items.

        ``raw=True`` leaves each reply line unparsed (``EnvResult.raw``), for a caller with
        a faster parser of its own; :func:`parse_result` parses one.
        """
        self._check_open()
        if self._state is _State.IDLE or self._pending is None:
            raise AsyncStateError("batch_wait()/step_wait() called without a call in flight; call step_async() first")
        if timeout is None:
            timeout = self.start_timeout + max(self.step_timeout, self.reset_timeout) + 30.0
        if isinstance(self._pending, _LanePending):
            return self._lane_wait(timeout, raw)
        seqs, order, t0 = self._pending
        per_link: dict[int, list[EnvResult]] = {}
        per_worker_ms = {}
        try:
            deadline = time.monotonic() + timeout
            for link, seq in seqs:
                header, frames = self._recv(link, seq, max(0.0, deadline - time.monotonic()))
                self._raise_for_error(link, header)
                per_link[id(link)] = self._parse_results(link, header, frames, raw)
                per_worker_ms[link.address] = float(header.get("worker_ms", 0.0))
        finally:
            # Whatever happened, this call is over: a late reply will be dropped by its tag.
            self._pending = None
            self._state = _State.IDLE
        if order is None:
            results = per_link[id(self._links[0])]
        else:
            results = [per_link[id(self._links[li])][pos] for li, pos in order]
        self._record_timing(results, per_worker_ms, t0)
        return results

    # ------------------------------------------------------------------ the direct lane
    def _lane_async(self, link: _Link, items: Sequence[tuple[int, dict, Sequence[bytes]]]) -> None:
        """Send what the lane holds and may send itself on the envs' pipes, the rest (and
        envs that failed on our side while idle) to the worker, in one request."""
        lane = link.lane
        lane.check_idle()
        direct, via, frames, seen = [], [], [], set()
        for pos, (index, op, payloads) in enumerate(items):
            self._link_of(index)
            if index in seen:
                raise ValueError(f"env index {index} appears twice in one batch")
            seen.add(index)
            local = index - link.start
            if lane.holds(local) and type(op) is dict and op.get("op") in DIRECT_OPS:
                # Encoded before anything is sent: an op that cannot be, fails the call untouched.
                direct.append((pos, local, op["op"], env_request(op, payloads)))
            else:
                via.append((pos, local, [local, op, len(payloads)]))
                frames.extend(payloads)
        header: dict = {"op": "batch", "items": [item for *_, item in via], "lend": True}
        if via:
            encode_header(dict(header))  # one that cannot be encoded fails here, before envs are let go
        for _pos, local, _item in via:
            lane.hand_back(local)  # the worker takes it back with this request
        if lane.idle_faults:
            header["faults"] = [[i, reason] for i, reason in lane.idle_faults.items()]
        if lane.abandoned:
            header["adopt"] = lane.abandoned
        t0 = time.perf_counter()
        seq = None
        if via or "faults" in header or "adopt" in header:
            seq = self._send(link, header, frames)
            # The worker acts on these before it looks at the items, so they are delivered.
            lane.idle_faults, lane.abandoned = {}, []
        t_send = time.perf_counter()
        failed = lane.send(direct)
        self._pending = _LanePending(seq, [pos for pos, *_ in via], len(items), failed, t0, t_send if direct else None)
        self._state = _State.WAITING_STEP

    def _lane_wait(self, timeout: float, raw: bool) -> list[EnvResult]:
        link = self._links[0]
        lane = link.lane
        pending: _LanePending = self._pending
        results: list = [None] * pending.size
        worker_ms = 0.0
        deadline = time.monotonic() + timeout
        failed: list = list(pending.failed)
        try:
            try:
                done, seen_failing = lane.wait(deadline)
            except TimeoutError:
                raise WorkerTimeout(f"the envs of local worker {link.address} did not answer within {timeout:.1f} s",
                                    link.address) from None
            failed += seen_failing
            if pending.t_send is not None:  # fan-out to the envs and back, as a worker counts it
                worker_ms = (time.perf_counter() - pending.t_send) * 1e3
            for pos, index, line, payloads in done:
                results[pos] = EnvResult(link.start + index, OK, None, payloads, line)
            if pending.seq is not None:
                worker_ms = max(worker_ms, self._collect(link, pending.seq, pending.via, results, deadline))
            if failed:
                # Our side saw the failure; the worker kills the env, says why, respawns it. Its
                # own time: a straggler is found at the step deadline, which may be the caller's.
                items = [[index, {"op": LENT_FAULT, "reason": reason, "straggler": straggler}, 0]
                         for _pos, index, reason, straggler in failed]
                seq = self._send(link, {"op": "batch", "items": items, "lend": True})
                failed_positions, failed = [pos for pos, *_ in failed], []
                worker_ms += self._collect(link, seq, failed_positions, results,
                                           max(deadline, time.monotonic() + LENT_FAULT_TIMEOUT_S))
        except BaseException:
            lane.abandon(failed)  # with the next request: no env stays lent to nobody
            raise
        finally:
            self._pending = None
            self._state = _State.IDLE
        if not raw:
            results = [parse_result(r) for r in results]
        self._record_timing(results, {link.address: worker_ms}, pending.t0)
        return results

    def _collect(self, link: _Link, seq: int, positions: list[int], results: list, deadline: float) -> float:
        """Receive a batch reply into ``results`` at ``positions``; take the envs it lends; its worker_ms."""
        header, frames = self._recv(link, seq, max(0.0, deadline - time.monotonic()))
        self._raise_for_error(link, header)
        self._take_lent(link, header)
        for pos, result in zip(positions, self._parse_results(link, header, frames, raw=True)):
            results[pos] = result
        return float(header.get("worker_ms", 0.0))

    def _parse_results(self, link: _Link, header: dict, frames: list, raw: bool = False) -> list[EnvResult]:
        """Split a batch reply's one data frame into per-env results (replies and payload views)."""
        entries = header.get("results")
        if not isinstance(entries, list) or len(frames) != 1:
            raise WorkerError(f"worker {link.address} sent a malformed batch reply (results or data frame missing)", link.address)
        data = memoryview(frames[0])
        out = []
        pos = 0
        for entry in entries:
            try:
                local, status, sizes = entry
                end = pos + sum(sizes)
                if not sizes or min(sizes) < 0 or end > len(data):
                    raise ValueError
            except (TypeError, ValueError):
                raise WorkerError(f"worker {link.address} sent a malformed batch result {str(entry)[:80]}", link.address) from None
            reply_end = pos + sizes[0]
            payloads = []
            start = reply_end
            for size in sizes[1:]:
                payloads.append(data[start : start + size])
                start += size
            result = EnvResult(link.start + local, status, None, payloads, bytes(data[pos:reply_end]))
            out.append(result if raw else parse_result(result))
            pos = end
        return out

    def _record_timing(self, results: list[EnvResult], per_worker_ms: dict, t0: float) -> None:
        stragglers = tuple(r.index for r in results if r.status == STRAGGLER)
        errors = tuple(r.index for r in results if r.status == ERROR)
        t = self.timing
        self.timing = Timing(
            worker_ms=max(per_worker_ms.values(), default=0.0),
            roundtrip_ms=(time.perf_counter() - t0) * 1e3,
            per_worker_ms=per_worker_ms,
            stragglers=stragglers,
            errors=errors,
            calls=t.calls + 1,
            env_steps=t.env_steps + len(results),
            total_stragglers=t.total_stragglers + len(stragglers),
            total_errors=t.total_errors + len(errors),
        )

    def _link_of(self, index: int) -> int:
        if type(index) is not int and not isinstance(index, np.integer):
            raise TypeError(f"env index must be an int, got {type(index).__name__}")
        if not 0 <= index < self.n:
            raise IndexError(f"env index {index} out of range for a pool of {self.n}")
        for li, link in enumerate(self._links):
            if link.start <= index < link.start + link.count:
                return li
        raise IndexError(index)  # pragma: no cover

    def call_envs(self, op: dict, indices: Sequence[int] | None = None, timeout: float | None = None) -> list[EnvResult]:
        """Send the same op to several envs (e.g. ``{"op": "describe"}``) and wait."""
        indices = range(self.n) if indices is None else indices
        self.batch_async([(int(i), op, ()) for i in indices])
        return self.batch_wait(timeout)

    # ------------------------------------------------------------------ the JSON pool API
    def step_async(self, actions: Sequence[Any]) -> None:
        """Send one step to every env; collect with :meth:`step_wait`."""
        self._check_open()
        actions = self._validate_actions(actions)
        self.batch_async([(i, {"op": "step", "action": a}, ()) for i, a in enumerate(actions)])

    def step_wait(self, timeout: float | None = None):
        """Return ``(obs, rewards, dones, infos)`` for the step sent by :meth:`step_async`.

        ``obs`` and ``infos`` are lists in index order, ``rewards`` ``np.float32[n]``,
        ``dones`` ``np.bool_[n]``. A straggler's or crashed env's slot holds obs
        ``None``, reward 0, done True (its episode is truncated) and
        ``info["boltzlabs_straggler"]`` or ``info["boltzlabs_error"]``, as described in
        :mod:`boltzlabs_gym.results`.
        """
        results = self.batch_wait(timeout)
        obs = [None] * self.n
        rewards = np.zeros(self.n, dtype=np.float32)
        dones = np.ones(self.n, dtype=np.bool_)
        infos: list[dict] = [{} for _ in range(self.n)]
        for r in results:
            t = read_step(r, self.step_timeout)
            obs[r.index], rewards[r.index], dones[r.index], infos[r.index] = (
                t.obs, t.reward, t.terminated or t.truncated, t.info)
        self._last_obs = obs
        return obs, rewards, dones, infos

    def step(self, actions: Sequence[Any]):
        """Step every env with its action; see :meth:`step_wait` for what comes back."""
        self.step_async(actions)
        return self.step_wait()

    def reset(
        self,
        seed: int | Sequence[int | None] | None = None,
        where: Sequence[bool] | np.ndarray | None = None,
        hard: bool = False,
        options: dict | None = None,
    ) -> list:
        """Reset the envs selected by ``where`` (all by default) and return all ``n`` observations.

        ``seed``: an int gives env ``i`` the seed ``seed + i``; a list gives one seed
        per env. ``hard=True`` kills each selected env's process tree, wipes its
        workspace and starts it afresh (byte-identical start). Unselected envs keep
        their last observation in their slot. Per-env reset infos land in
        :attr:`reset_infos`.
        """
        self._check_open()
        mask = self._validate_mask(where)
        seeds = self._validate_seeds(seed)
        op_name = "hard_reset" if hard else "reset"
        items = []
        for i in np.flatnonzero(mask):
            op = {"op": op_name, "seed": seeds[i]}
            if options:
                op["options"] = jsonable(options)
            items.append((int(i), op, ()))
        if not items:
            return list(self._last_obs)
        self.batch_async(items)
        results = self.batch_wait()
        obs = list(self._last_obs)
        deadline_s = self.start_timeout if hard else self.reset_timeout
        for r in results:
            obs[r.index], self.reset_infos[r.index], _ = read_reset(r, deadline_s)
        self._last_obs = obs
        return obs

    # ------------------------------------------------------------------ validation
    def _validate_actions(self, actions: Sequence[Any]) -> list:
        if isinstance(actions, (str, bytes, dict)) or not hasattr(actions, "__len__"):
            raise ValueError(f"actions must be a sequence of {self.n} actions, got {type(actions).__name__}")
        if len(actions) != self.n:
            raise ValueError(f"expected exactly {self.n} actions (one per env), got {len(actions)}")
        out = []
        for i, a in enumerate(actions):
            try:
                out.append(jsonable(a))
            except TypeError as exc:
                raise ValueError(f"action for env {i} is not JSON-serialisable: {exc}") from None
        return out

    def _validate_mask(self, where) -> np.ndarray:
        if where is None:
            return np.ones(self.n, dtype=bool)
        mask = np.asarray(where)
        if mask.shape != (self.n,) or mask.dtype != np.bool_:
            raise ValueError(f"where must be a boolean mask of shape ({self.n},), got dtype {mask.dtype} shape {mask.shape}")
        return mask

    def _validate_seeds(self, seed) -> list:
        if seed is None:
            return [None] * self.n
        if isinstance(seed, (int, np.integer)) and not isinstance(seed, bool):
            return [int(seed) + i for i in range(self.n)]
        if isinstance(seed, (list, tuple, np.ndarray)):
            if len(seed) != self.n:
                raise ValueError(f"expected {self.n} seeds (one per env), got {len(seed)}")
            out = []
            for i, s in enumerate(seed):
                if s is not None and not (isinstance(s, (int, np.integer)) and not isinstance(s, bool)):
                    raise ValueError(f"seed for env {i} must be an int or None, got {s!r}")
                out.append(None if s is None else int(s))
            return out
        raise ValueError(f"seed must be an int, a list of {self.n} ints, or None; got {type(seed).__name__}")

    # ------------------------------------------------------------------ introspection
    def memory(self) -> list[int]:
        """PSS in bytes of each env's whole process tree, in index order.

        In ``mode="boltz"`` the pages envs share with their template are split between
        them by PSS; the template's own share is :attr:`template_pss` after this call.
        """
        self._check_open()
        out = [0] * self.n
        template = 0
        for link in self._links:
            header = self._call(link, {"op": "memory"}, timeout=60.0)
            for local, pss in enumerate(header["pss"]):
                out[link.start + local] = int(pss)
            template += int(header.get("template_pss", 0))
        self.template_pss = template
        return out

    def envs_per_gb(self) -> float:
        """How many envs fit in one GiB: their PSS, plus the boltz templates' (shared pages split honestly)."""
        total = sum(self.memory()) + self.template_pss
        return self.n / (total / 2**30) if total else float("inf")

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def workers(self) -> list[str]:
        """The worker addresses, in the order their envs appear in the batch."""
        return [link.address for link in self._links]

    @property
    def uploads(self) -> dict[str, bool]:
        """Per worker: whether this pool had to upload the env archive (False: cached by hash)."""
        return {link.address: link.uploaded for link in self._links}

    # ------------------------------------------------------------------ shutdown
    def close(self) -> None:
        """Stop every env and (for a local pool) the worker; idempotent and bounded."""
        if self._closed:
            return
        self._closed = True
        for link in self._links:
            if link.session is not None and link.process is None:
                try:
                    self._call(link, {"op": "close"}, timeout=5.0)
                except Exception:  # noqa: BLE001 - closing is best effort towards remote workers
                    pass
        self._finalizer()

    @staticmethod
    def _finalize(ctx: zmq.Context, links: list, local: list) -> None:
        for link in links:
            link.close()
        process = local[0]
        if process is not None:
            _stop_process(process)
        if len(local) > 1 and local[1]:
            shutil.rmtree(local[1], ignore_errors=True)
        ctx.term()

    def __enter__(self) -> "RLPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._links)} worker(s)"
        return f"RLPool({self.env_dir!r}, n={self.n}, {state})"


def _tail_text(stderr: str) -> str:
    return f"\n--- stderr tail ---\n{stderr.rstrip()}" if stderr.strip() else " (no stderr output)"


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


def _stop_process(process: subprocess.Popen, grace: float = 5.0) -> None:
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
