"""An env's two protocol pipes, from the reading and writing end: framing and limits.

Everything read from an env is untrusted: a reply must be one JSON object line, at most
:data:`~boltzlabs_gym.wire.protocol.MAX_ENV_LINE_BYTES` long, followed by the binary payloads
it announces (bounded too). Anything else is an :class:`EnvFault`. Both ends that ever
hold an env's pipes use this one parser: the worker (:class:`~boltzlabs_gym.worker.envproc.EnvProcess`)
and a local pool that the worker lent the pipes to (:mod:`boltzlabs_gym.client.direct_lane`).
"""

from __future__ import annotations

import collections
import errno
import os
from typing import TYPE_CHECKING

from .protocol import (
    INFO_COLS_MARK,
    MAX_ENV_LINE_BYTES,
    MAX_ENV_PAYLOAD_BYTES,
    MAX_KNOWN_LINE_BYTES,
    STEP_REPLY_HEAD_PATTERN,
    STEP_REPLY_PATTERN,
    parse_json,
)

if TYPE_CHECKING:  # (NumPy is imported where a large reply needs it: a worker may never load it)
    import numpy as np

__all__ = ["EnvFault", "EnvPipe"]

_READ_CHUNK = 1 << 16
#: The ceilings of a multi-env sandbox's reply (see EnvPipe.serve_envs).
MAX_SANDBOX_LINE_BYTES = 64 << 20
MAX_SANDBOX_PAYLOAD_BYTES = 1 << 30
#: A reply whose payloads are at least this large and not in yet is read straight into one
#: buffer of its exact size (no growing buffer, no copies out of it: its payloads are views).
_DIRECT_READ_MIN = 1 << 16
#: No reply line validated yet (see EnvPipe._announced).
_NOTHING_KNOWN: tuple[bytes, tuple[int, ...]] = (b"", ())


class EnvFault(Exception):
    """The env broke the protocol or died; ``reason`` says how, for the user."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class EnvPipe:
    """The parent's ends of one env's stdin and stdout (non-blocking), with their buffers.

    :meth:`write` sends a request (queuing what the pipe cannot take yet, for
    :meth:`flush`); :meth:`read_replies` returns every whole, validated reply read so far.
    """

    def __init__(self, stdin_w: int = -1, stdout_r: int = -1):
        self.stdin_w, self.stdout_r = stdin_w, stdout_r
        self.max_line, self.max_payload = MAX_ENV_LINE_BYTES, MAX_ENV_PAYLOAD_BYTES
        self.reset_buffers()

    def serve_envs(self, envs: int) -> None:
        """The process behind these pipes hosts ``envs`` envs: one reply carries up to that many
        envs' answers, so its limits are that many times one env's, up to a ceiling
        (:data:`MAX_SANDBOX_LINE_BYTES`, :data:`MAX_SANDBOX_PAYLOAD_BYTES`): what one sandbox may make
        its reader hold stays bounded however many envs it hosts."""
        self.max_line = min(MAX_ENV_LINE_BYTES * envs, MAX_SANDBOX_LINE_BYTES)
        self.max_payload = min(MAX_ENV_PAYLOAD_BYTES * envs, MAX_SANDBOX_PAYLOAD_BYTES)
        self._known = _NOTHING_KNOWN  # (read under other limits)
        self._known_ends.clear()

    def reset_buffers(self) -> None:
        """Forget anything half-read or half-written (the pipes are new)."""
        self._rbuf = bytearray()
        self._scan_from = 0
        self._line: bytes | None = None
        self._need: list[int] = []
        self._body: np.ndarray | None = None  # a large reply's payloads, being read in place
        self._filled = 0
        self._wbuf: collections.deque[memoryview] = collections.deque()  # what the pipe has not taken yet
        #: The last reply line validated, with the payload sizes it announces: a sandbox of several
        #: envs answers a plain step with the same line every time (its numbers are in its payloads).
        self._known = _NOTHING_KNOWN
        #: The ends of step lines whose info is typed columns already validated, with their payload sizes.
        self._known_ends: dict[bytes, tuple[int, ...]] = {}

    # ------------------------------------------------------------------ writing
    def write(self, data: bytes | memoryview) -> bool:
        """Write (part of) a request; True when everything went out."""
        if not self._wbuf:
            # The usual case: the pipe has room for the whole request, no buffer needed.
            n = self._write_some(data)
            if n == len(data):
                return True
            data = memoryview(data)[n:]
        self._wbuf.append(memoryview(data))
        return self.flush()

    def write_parts(self, parts: list) -> bool:
        """Write a request given as parts (its line, then its payloads), none of them joined into a
        copy first: a restore's blob of hundreds of MiB goes out as it is held. True when all went out."""
        for part in parts:
            if len(part):
                self._wbuf.append(memoryview(part))
        return self.flush()

    def flush(self) -> bool:
        # A queue of views, each advanced in place: what a full pipe leaves is never copied (slicing
        # bytes after each 64 KiB the pipe took made a large request cost its size squared).
        queue = self._wbuf
        while queue:
            head = queue[0]
            n = self._write_some(head)
            if not n:
                return False
            if n == len(head):
                queue.popleft()
            else:
                queue[0] = head[n:]
        return True

    def _write_some(self, data: bytes | memoryview) -> int:
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

    @property
    def mid_transfer(self) -> bool:
        """Whether a request is half written or a reply half read: the pipes cannot change hands."""
        return self.write_pending or self.partial_output

    # ------------------------------------------------------------------ reading
    def read_replies(self) -> list[tuple[bytes, list[bytes]]]:
        """Read what is available; return every complete reply. Raises EnvFault."""
        replies: list[tuple[bytes, list[bytes]]] = []
        while True:
            if self._body is not None:
                if not self._read_body(replies):
                    break
                continue
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

    def _read_body(self, out: list) -> bool:
        """Read more of a large reply's payloads into their buffer; whether to read on (the pipe
        had all that was asked, or the reply is complete)."""
        body = self._body
        assert body is not None and self._line is not None
        want = len(body) - self._filled
        try:
            n = os.readv(self.stdout_r, [body.data[self._filled :]])
        except BlockingIOError:
            return False
        if not n:
            raise EnvFault("the env closed its stdout (exited or crashed)")
        self._filled += n
        if self._filled < len(body):
            return n == want
        # Views, not copies: the buffer is this reply's alone and is never reused.
        out.append((self._line, _split(body.data, 0, self._need, copy=False)))
        self._line, self._need, self._body, self._filled = None, [], None, 0
        return True

    def _take_whole_reply(self, chunk: bytes, out: list) -> bool:
        """The usual case, without the buffer: ``chunk`` is exactly one whole reply.

        Validated as :meth:`_parse` would; False (nothing taken) for anything else.
        """
        nl = chunk.find(b"\n")
        if nl < 0 or nl > self.max_line:
            return False
        line = chunk[: nl + 1]
        need = self._announced(line)
        if nl + 1 + sum(need) != len(chunk):
            return False
        # Views, not copies: ``chunk`` is a fresh immutable read, and the batch reply joins them.
        out.append((line, _split(memoryview(chunk), nl + 1, need, copy=False)))
        return True

    def _announced(self, line: bytes) -> list[int]:
        """:func:`_announced_payloads` of ``line``, remembered for the next line like it."""
        known_line, known_need = self._known
        if line == known_line:
            return list(known_need)
        # A step line whose info is typed columns: its numbers are in its head, its end (the info's
        # layout and the payload sizes) the same step after step, so the end is parsed once.
        cut = line.find(INFO_COLS_MARK)
        head_is_plain = cut > 0 and STEP_REPLY_HEAD_PATTERN.fullmatch(line, 0, cut) is not None
        if head_is_plain:
            known_end = self._known_ends.get(line[cut:])
            if known_end is not None:
                return list(known_end)
        need = _announced_payloads(line, self.max_payload)
        if head_is_plain and len(line) <= MAX_KNOWN_LINE_BYTES:
            if len(self._known_ends) >= 64:
                self._known_ends.clear()
            self._known_ends[line[cut:]] = tuple(need)
        # (a plain one-env step, one payload, is cheaper to match than to remember)
        if len(need) > 1 and len(line) <= MAX_KNOWN_LINE_BYTES:
            self._known = (line, tuple(need))
        return need

    def _parse(self, out: list) -> None:
        while self._body is None:
            if self._line is None:
                nl = self._rbuf.find(b"\n", self._scan_from)
                if nl < 0:
                    if len(self._rbuf) > self.max_line:
                        raise EnvFault(f"reply line longer than {self.max_line} bytes")
                    self._scan_from = len(self._rbuf)
                    return
                if nl > self.max_line:
                    raise EnvFault(f"reply line longer than {self.max_line} bytes")
                line = bytes(self._rbuf[: nl + 1])
                del self._rbuf[: nl + 1]
                self._scan_from = 0
                self._need = self._announced(line)
                self._line = line
            total = sum(self._need)
            if len(self._rbuf) < total:
                if total >= _DIRECT_READ_MIN:
                    # The rest goes straight into a buffer of its own (see _read_body); uninitialised:
                    # zeroing a megabyte first cost more than reading it.
                    import numpy as np  # (here: a worker that never reads such a reply never loads it)

                    try:
                        self._body = np.empty(total, dtype=np.uint8)
                    except MemoryError:
                        raise EnvFault(
                            f"reply announces {total} payload bytes, more than this process can hold"
                        ) from None
                    self._body[: len(self._rbuf)] = np.frombuffer(self._rbuf, dtype=np.uint8)
                    self._filled = len(self._rbuf)
                    self._rbuf.clear()
                return
            payloads = _split(self._rbuf, 0, self._need)
            del self._rbuf[:total]
            out.append((self._line, payloads))
            self._line = None
            self._need = []


def _split(buf: bytes | bytearray | memoryview, pos: int, sizes: list[int], copy: bool = True) -> list:
    """The payloads of the given sizes that follow each other in ``buf`` from ``pos``
    (``bytes`` copies, or slices of ``buf`` with ``copy=False``)."""
    out = []
    for n in sizes:
        out.append(bytes(buf[pos : pos + n]) if copy else buf[pos : pos + n])
        pos += n
    return out


# The plain step reply of a Gymnasium env host (protocol.STEP_REPLY_LAYOUT): the pattern admits only
# valid JSON objects, so a line it matches needs no JSON parser; every other line is parsed.
_PLAIN_STEP = STEP_REPLY_PATTERN


def _announced_payloads(line: bytes, max_payload: int = MAX_ENV_PAYLOAD_BYTES) -> list[int]:
    """Validate a reply line; return the byte lengths of the payloads it announces (at most
    ``max_payload`` bytes in all)."""
    plain = _PLAIN_STEP.fullmatch(line)
    if plain is not None:
        n = int(plain.group(1))
        if n > max_payload:
            raise EnvFault(f"reply announces {n} payload bytes, over the limit of {max_payload}")
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
    if sum(lengths) > max_payload:
        raise EnvFault(f"reply announces {sum(lengths)} payload bytes, over the limit of {max_payload}")
    return lengths
