"""One resident env process as the worker sees it: pipes, buffers, the reply parser.

Everything read from an env is untrusted: a reply must be one JSON object line,
at most :data:`~boltzlabs_gym.protocol.MAX_ENV_LINE_BYTES` long, followed by the
binary payloads it announces (bounded too). Anything else is an :class:`EnvFault`,
and the worker kills and respawns the env.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import json
import os
import re
import signal
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ..protocol import MAX_ENV_LINE_BYTES, MAX_ENV_PAYLOAD_BYTES, parse_json
from .sandbox import Launched, LaunchSpec

#: How much of an env's stderr the worker keeps for error reports.
STDERR_TAIL_BYTES = 8192
_READ_CHUNK = 1 << 16


class EnvFault(Exception):
    """The env broke the protocol or died; ``reason`` says how, for the user."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


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
    #: Holds the measurement gate (``serialize_measurement``) while in flight.
    gated: bool = False
    #: A start's: the call waiting for the env's first reset (a hard reset's, a respawn's).
    user_call: "Call | None" = None
    #: The client request this call is item ``pos`` of, for env ``index`` (no closure per call).
    batch: Any = None
    pos: int = 0
    index: int = 0

    def finish(self, status: str, reply: bytes, payloads: list) -> None:
        if self.batch is not None:
            self.batch.done(self.pos, self.index, status, reply, payloads)
        else:
            self.on_done(status, reply, payloads)


class EnvProcess:
    """The worker's handle on one env: spawn, send, parse replies, kill.

    States: ``new`` -> ``starting`` (spawned, first reset in flight) -> ``idle`` <->
    ``busy``; ``dead`` after a kill until respawned; ``closed`` at the end.
    """

    def __init__(self, index: int, global_index: int, workspace: str):
        self.index = index
        self.global_index = global_index
        self.workspace = workspace
        self.state = "new"
        self.launched: Launched | None = None
        self.stdin_w = self.stdout_r = self.stderr_r = -1
        self.current: Call | None = None
        self.queue: collections.deque[Call] = collections.deque()
        self.sent_at = 0.0
        self._rbuf = bytearray()
        self._scan_from = 0
        self._line: bytes | None = None
        self._need: list[int] = []
        self._wbuf = b""
        self._stderr = bytearray()
        self.restarts = 0
        self.starting = False
        self.session = None
        self.pending_start = None

    # ------------------------------------------------------------------ process life
    def spawn(self, backend, make_spec: Callable[..., LaunchSpec]) -> None:
        """Start the process through the isolation backend; parent keeps its pipe ends."""
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
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
        self._rbuf.clear()
        self._scan_from = 0
        self._line = None
        self._need = []
        self._wbuf = b""
        self._stderr.clear()
        self.state = "starting"

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

    # ------------------------------------------------------------------ writing
    def write(self, data: bytes) -> bool:
        """Write (part of) a request; True when everything went out."""
        if not self._wbuf:
            # The usual case: the pipe has room for the whole request, no buffer needed.
            n = self._write_some(data)
            if n == len(data):
                return True
            data = data[n:]
        self._wbuf += data
        return self.flush()

    def flush(self) -> bool:
        while self._wbuf:
            n = self._write_some(self._wbuf)
            if not n:
                return False
            self._wbuf = self._wbuf[n:]
        return True

    def _write_some(self, data: bytes) -> int:
        """Bytes of ``data`` the pipe took now (0 when it is full)."""
        try:
            return os.write(self.stdin_w, data)
        except BlockingIOError:
            return 0
        except OSError as exc:
            if exc.errno in (errno.EPIPE, errno.EBADF):
                raise EnvFault("the env closed its stdin (it has probably exited)") from None
            raise

    @property
    def write_pending(self) -> bool:
        return bool(self._wbuf)

    @property
    def partial_output(self) -> bool:
        """Whether part of a reply (a line or its payloads) has been read but not completed."""
        return bool(self._rbuf) or self._line is not None

    # ------------------------------------------------------------------ reading
    def read_replies(self) -> list[tuple[bytes, list[bytes]]]:
        """Read what is available; return every complete reply. Raises EnvFault."""
        replies = []
        while True:
            try:
                chunk = os.read(self.stdout_r, _READ_CHUNK)
            except BlockingIOError:
                break
            if not chunk:
                self._parse(replies)
                raise EnvFault("the env closed its stdout (exited or crashed)")
            if self._rbuf or self._line is not None or not self._take_whole_reply(chunk, replies):
                self._rbuf += chunk
                self._parse(replies)
            if len(chunk) < _READ_CHUNK:
                break
        return replies

    def _take_whole_reply(self, chunk: bytes, out: list) -> bool:
        """The usual case, without the buffer: ``chunk`` is exactly one whole reply.

        Validated as :meth:`_parse` would; False (nothing taken) for anything else.
        """
        nl = chunk.find(b"\n")
        if nl < 0 or nl > MAX_ENV_LINE_BYTES:
            return False
        line = chunk[: nl + 1]
        need = _announced_payloads(line)
        if nl + 1 + sum(need) != len(chunk):
            return False
        # Views, not copies: ``chunk`` is a fresh immutable read, and the batch reply joins them.
        out.append((line, _split(memoryview(chunk), nl + 1, need, copy=False)))
        return True

    def _parse(self, out: list) -> None:
        while True:
            if self._line is None:
                nl = self._rbuf.find(b"\n", self._scan_from)
                if nl < 0:
                    if len(self._rbuf) > MAX_ENV_LINE_BYTES:
                        raise EnvFault(f"reply line longer than {MAX_ENV_LINE_BYTES} bytes")
                    self._scan_from = len(self._rbuf)
                    return
                if nl > MAX_ENV_LINE_BYTES:
                    raise EnvFault(f"reply line longer than {MAX_ENV_LINE_BYTES} bytes")
                line = bytes(self._rbuf[: nl + 1])
                del self._rbuf[: nl + 1]
                self._scan_from = 0
                self._need = _announced_payloads(line)
                self._line = line
            total = sum(self._need)
            if len(self._rbuf) < total:
                return
            payloads = _split(self._rbuf, 0, self._need)
            del self._rbuf[:total]
            out.append((self._line, payloads))
            self._line = None
            self._need = []

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


@contextlib.contextmanager
def _batch_scheduling():
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


def _split(buf: bytes | bytearray | memoryview, pos: int, sizes: list[int], copy: bool = True) -> list:
    """The payloads of the given sizes that follow each other in ``buf`` from ``pos``
    (``bytes`` copies, or slices of ``buf`` with ``copy=False``)."""
    out = []
    for n in sizes:
        out.append(bytes(buf[pos : pos + n]) if copy else buf[pos : pos + n])
        pos += n
    return out


# The plain step reply of a gym server (array observation, finite reward, empty info; see
# codec.ArrayLeaf.step_line). The pattern admits only valid JSON objects, so a line it matches
# needs no JSON parser; every other line is parsed.
_UINT = rb"(?:0|[1-9]\d{0,17})"  # JSON has no leading zeros
_PLAIN_STEP = re.compile(
    rb'\{"obs":\{"__nd__":\[0,"[<>|=][a-zA-Z]\d{1,2}",\[(?:' + _UINT + rb"(?:," + _UINT + rb"){0,31})?\]\]\},"
    rb'"reward":-?(?:0|[1-9]\d{0,400})(?:\.\d{1,400})?(?:[eE][+-]?\d{1,4})?,'
    rb'"terminated":(?:true|false),"truncated":(?:true|false),"info":\{\},"_bin":\[(' + _UINT + rb")\]\}\n"
)


def _announced_payloads(line: bytes) -> list[int]:
    """Validate a reply line; return the byte lengths of the payloads it announces."""
    plain = _PLAIN_STEP.fullmatch(line)
    if plain is not None:
        n = int(plain.group(1))
        if n > MAX_ENV_PAYLOAD_BYTES:
            raise EnvFault(f"reply announces {n} payload bytes, over the limit of {MAX_ENV_PAYLOAD_BYTES}")
        return [n]
    try:
        msg = parse_json(line)
    except ValueError:
        preview = line[:80].decode("utf-8", "replace").rstrip("\n")
        raise EnvFault(f"malformed reply: not a JSON line (starts with {preview!r})") from None
    if not isinstance(msg, dict):
        raise EnvFault(f"malformed reply: expected a JSON object, got {type(msg).__name__}")
    lengths = msg.get("_bin")
    if lengths is None:
        return []
    if not isinstance(lengths, list) or not all(type(n) is int and n >= 0 for n in lengths):
        raise EnvFault(f"malformed reply: bad _bin announcement {str(lengths)[:80]}")
    if sum(lengths) > MAX_ENV_PAYLOAD_BYTES:
        raise EnvFault(f"reply announces {sum(lengths)} payload bytes, over the limit of {MAX_ENV_PAYLOAD_BYTES}")
    return lengths


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


def json_error(message: str, **extra: Any) -> bytes:
    return json.dumps({"message": message, **extra}, separators=(",", ":")).encode()
