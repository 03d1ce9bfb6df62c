"""One resident env process as the worker sees it: its process, its calls, its stderr.

The protocol pipes and their untrusted-reply parser are :class:`~boltzlabs_gym.wire.envpipe.EnvPipe`;
a reply that breaks the protocol is an :class:`EnvFault`, and the worker kills and
respawns the env.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import fcntl
import json
import os
import signal
import stat
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from ..wire.envpipe import EnvPipe
from ..wire.protocol import PROGRESS_FILE
from ..wire.start_failure import StartFailure
from .sandbox import Launched, LaunchSpec

#: How much of an env's stderr the worker keeps for error reports.
STDERR_TAIL_BYTES = 8192
_READ_CHUNK = 1 << 16


class EnvState(enum.Enum):
    """Where one env is in its life, as the worker sees it.

    ``NEW`` -> ``QUEUED`` (waiting for a start slot) -> ``STARTING`` (spawned, first request in
    flight) -> ``IDLE`` <-> ``BUSY`` (a call in flight), or ``IDLE`` <-> ``LENT`` (its pipes
    lent to a local pool); ``DEAD`` after a kill until queued again; ``CLOSED`` at the end.
    """

    NEW = "new"
    QUEUED = "queued"
    STARTING = "starting"
    IDLE = "idle"
    BUSY = "busy"
    LENT = "lent"
    DEAD = "dead"
    CLOSED = "closed"


# Module-level names for the hot path: ``EnvState.IDLE`` costs an enum attribute lookup
# (about 60 ns on CPython 3.11) at every test, a global costs what a string constant did.
NEW, QUEUED, STARTING, IDLE = EnvState.NEW, EnvState.QUEUED, EnvState.STARTING, EnvState.IDLE
BUSY, LENT, DEAD, CLOSED = EnvState.BUSY, EnvState.LENT, EnvState.DEAD, EnvState.CLOSED


def _ignore_result(status: str, reply: bytes, payloads: list) -> None:
    pass


@dataclass(slots=True)
class Call:
    """One operation for one env, and where its result goes.

    :meth:`finish` is called exactly once: it fills slot ``pos`` of ``batch`` (a client
    request's results) when the call belongs to one, else calls ``on_done(status,
    reply_bytes, payloads)``.
    """

    op: dict
    payloads: Sequence[bytes] = ()  # frames that follow the request line
    timeout: float | None = None
    on_done: Callable[[str, bytes, list], None] = _ignore_result
    kind: str = "other"  # "start", "step", "reset", "hard_reset", "other"
    token: int = 0
    #: Whether this call's latency is sampled for the books (decided when it is sent, so that
    #: the order replies arrive in, fast envs first, does not decide which are sampled).
    sampled: bool = False
    #: Holds the measurement gate (``serialize_measurement``) while in flight.
    gated: bool = False
    #: Lowered its env's cgroup memory limit while in flight (see :mod:`.call_memory`).
    memory_lowered: bool = False
    #: A start's: the call waiting for the env's first request (a hard reset's; none for a respawn).
    user_call: Call | None = None
    #: The client request this call is item ``pos`` of, for env ``index`` (no closure per call).
    batch: Any = None
    pos: int = 0
    index: int = 0

    def finish(self, status: str, reply: bytes, payloads: list) -> None:
        if self.batch is not None:
            self.batch.done(self.pos, self.index, status, reply, payloads)
        else:
            self.on_done(status, reply, payloads)


class EnvProcess(EnvPipe):
    """The worker's handle on one env: spawn, send, parse replies, kill.

    Its :attr:`state` is an :class:`EnvState`.
    """

    def __init__(self, index: int, global_index: int, workspace: str):
        self.index = index
        self.global_index = global_index
        #: How many envs this process hosts (its slots: pool indices from ``global_index``).
        self.count = 1
        self.workspace = workspace
        #: a memory snapshot's holder keeps this workspace mounted (it was the env's when it swapped):
        #: the slot's next process gets a new directory (see Spawner.fresh_workspace_if_pinned)
        self.workspace_pinned = False
        self.state = NEW
        self.launched: Launched | None = None
        super().__init__()
        self.stderr_r = -1
        self.current: Call | None = None
        self.queue: collections.deque[Call] = collections.deque()
        self.sent_at = 0.0
        self._stderr = bytearray()
        self.restarts = 0
        self.starting = False
        self.session: Any = None  # its Session (which imports this module)
        #: ``(call, first_op)`` for the start it is queued for: the call waiting for its first request,
        #: and that request.
        self.pending_start: Any = None
        #: What its factory raised, when its last start's answer said so (wire.start_failure).
        self.start_failure: StartFailure | None = None
        #: The inode of the observation region the worker sealed for its process (worker.obs_regions):
        #: the one shared writable mapping a memory snapshot allows, as its copies drop it.
        self.obs_region_inode: int | None = None

    # ------------------------------------------------------------------ process life
    def spawn(self, backend, make_spec: Callable[..., LaunchSpec]) -> None:
        """Start the process through the isolation backend; parent keeps its pipe ends."""
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        if self.count > 1:
            _widen_pipe(out_r)
        try:
            spec = make_spec(self, in_r, out_w, err_w)
            with _batch_scheduling():
                self.launched = backend.launch(spec)
        except BaseException:
            for fd in (in_w, out_r, err_r):  # ours too: a failed launch must not leak them
                os.close(fd)
            raise
        finally:
            for fd in (in_r, out_w, err_w):
                os.close(fd)
        for fd in (in_w, out_r, err_r):
            os.set_blocking(fd, False)
        self.stdin_w, self.stdout_r, self.stderr_r = in_w, out_r, err_r
        self.obs_region_inode = None
        self.reset_buffers()
        self._stderr.clear()
        self.state = STARTING

    @property
    def pid(self) -> int | None:
        return self.launched.pid if self.launched else None

    def kill(self) -> int | None:
        """Kill the whole tree and close our pipe ends; return the pid left to reap."""
        pid = None
        if self.launched is not None:
            self.launched.kill()
            pid = self.launched.pid
        self.drain_stderr()
        for fd in (self.stdin_w, self.stdout_r, self.stderr_r):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self.stdin_w = self.stdout_r = self.stderr_r = -1
        return pid

    def cleanup(self) -> None:
        if self.launched is not None:
            try:
                self.launched.cleanup()
            finally:
                self.launched = None

    # ------------------------------------------------------------------ stderr
    def drain_stderr(self) -> None:
        """Keep the last :data:`STDERR_TAIL_BYTES` of stderr; never block."""
        if self.stderr_r < 0:
            return
        while True:
            try:
                chunk = os.read(self.stderr_r, _READ_CHUNK)
            except (BlockingIOError, OSError):
                return
            if not chunk:
                return
            self._stderr += chunk
            if len(self._stderr) > STDERR_TAIL_BYTES:
                del self._stderr[: len(self._stderr) - STDERR_TAIL_BYTES]

    def stderr_tail(self, limit: int = 2000) -> str:
        return bytes(self._stderr[-limit:]).decode("utf-8", "replace")


#: The pipe size a multi-env sandbox's replies get (the kernel's default is 64 KiB; Linux caps
#: it at /proc/sys/fs/pipe-max-size, 1 MiB unless raised).
SANDBOX_PIPE_BYTES = 1 << 20


def _widen_pipe(fd: int) -> None:
    """Let a sandbox's whole reply (K envs' observations) fit in its pipe: the env writes it in one
    go and the reader takes it in one read, instead of a wake-up per 64 KiB on both sides.
    Best effort: beyond the caller's pipe-memory limit the kernel refuses, and the default stays."""
    try:
        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, SANDBOX_PIPE_BYTES)
    except (OSError, AttributeError):
        pass


@contextlib.contextmanager
def _batch_scheduling() -> Iterator[None]:
    """Fork env processes under SCHED_BATCH (inherited across fork and exec).

    A batch-class process does not preempt the one that woke it. Without this, on a
    busy host each request line the worker writes hands the CPU to the env it woke,
    and the fan-out of one batch is interleaved with n context switches.
    """
    try:
        old = os.sched_getscheduler(0)
        old_param = os.sched_getparam(0)
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    except (AttributeError, OSError):
        yield
        return
    try:
        yield
    finally:
        os.sched_setscheduler(0, old, old_param)


def describe_exit(status: int | None) -> str:
    """Human words for a wait status."""
    if status is None:
        return "still running"
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = str(sig)
        return f"killed by signal {sig} ({name})"
    return f"exited with status {os.WEXITSTATUS(status)}"


def read_progress(workspace: str) -> int | None:
    """The slot a multi-env sandbox was serving, from its progress file (see
    :data:`~boltzlabs_gym.wire.protocol.PROGRESS_FILE`); ``None`` when it was idle or the file is
    missing or not what the env side writes.

    The workspace is the env's: the file is opened without following a link and read only
    if it is a regular file, four bytes at most.
    """
    path = os.path.join(workspace, PROGRESS_FILE)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        data = os.pread(fd, 4, 0)
    except OSError:
        return None
    finally:
        os.close(fd)
    if len(data) != 4:
        return None
    slot = int.from_bytes(data, "little", signed=True)
    return slot if slot >= 0 else None


def json_error(message: str, **extra: Any) -> bytes:
    return json.dumps({"message": message, **extra}, separators=(",", ":")).encode()
