"""The env channel's framing: a message is one JSON object line, then the raw payloads it announces.

Both env hosts (:mod:`~boltzlabs_gym.envside.json_host` and :mod:`~boltzlabs_gym.envside.gym_host`)
read their requests and write their replies with these; the wire format itself is specified in
:mod:`boltzlabs_gym.wire.protocol` (``"_bin": [n0, n1, ...]`` lists the byte lengths of the
payloads that follow the line, back to back). :class:`FdReader`/:class:`FdWriter` do it over
raw fds, without buffered streams, for the hosts whose hot path reads requests itself.
Standard library only: it is loaded inside every sandbox.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any, Protocol

# The one ProtocolError of the library; errors.py is standard-library only, like this module.
from ..errors import ProtocolError

__all__ = [
    "MAX_LINE_BYTES",
    "ProtocolError",
    "STILL_IN_SYNC",
    "MessageReader",
    "MessageWriter",
    "encode_json",
    "decode_json",
    "read_message",
    "write_message",
    "encode_reply",
    "payload_nbytes",
    "FdReader",
    "FdWriter",
    "write_all",
    "writev_all",
]

#: Largest request line an env host accepts, in bytes (requests come from the trusted
#: worker; the bound only stops a corrupted stream from eating memory).
MAX_LINE_BYTES = 256 << 20

# Prebuilt codec objects: json.dumps/loads with non-default arguments build a new
# encoder on every call, which was a third of the per-step cost of a tiny env.
encode_json = json.JSONEncoder(separators=(",", ":"), allow_nan=True).encode
decode_json = json.JSONDecoder().decode


class MessageReader(Protocol):
    """What :func:`read_message` reads from: a binary stream, or an :class:`FdReader`."""

    def readline(self, limit: int = -1, /) -> bytes: ...

    def read(self, n: int, /) -> bytes: ...


class MessageWriter(Protocol):
    """What :func:`write_message` writes to: a binary stream, or an :class:`FdWriter`."""

    def write(self, data: Any, /) -> Any: ...

    def flush(self) -> None: ...


def read_message(stream: MessageReader, max_bytes: int = MAX_LINE_BYTES) -> tuple[dict, list[bytes]] | None:
    """Read one message (a JSON object line plus announced binary payloads).

    Returns ``None`` at end of stream. Raises :class:`ProtocolError` for a line
    that is not a JSON object, too long, or announces payloads that never arrive.
    """
    line = stream.readline(max_bytes + 1)
    if not line:
        return None
    if len(line) > max_bytes:
        raise ProtocolError(f"line longer than {max_bytes} bytes")
    if not line.endswith(b"\n"):
        raise ProtocolError("stream ended in the middle of a line")
    try:
        msg = decode_json(line.decode())
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError too
        raise ProtocolError(f"line is not JSON: {exc}") from None
    if not isinstance(msg, dict):
        raise ProtocolError(f"expected a JSON object, got {type(msg).__name__}")
    lengths = msg.get("_bin")
    if not lengths:
        return msg, []
    payloads = []
    if not isinstance(lengths, list) or not all(isinstance(n, int) and 0 <= n <= max_bytes for n in lengths):
        raise ProtocolError(f"bad _bin announcement: {lengths!r}")
    for n in lengths:
        data = stream.read(n)
        if len(data) != n:
            raise ProtocolError(f"binary payload truncated: {len(data)} of {n} bytes")
        payloads.append(data)
    return msg, payloads


#: How :func:`read_message`'s errors begin when the whole line was read: the stream is still in
#: sync, so a host may answer the error and read the next request.
STILL_IN_SYNC = ("line is not JSON", "expected a JSON object")


def write_message(stream: MessageWriter, msg: dict, payloads: list[bytes] | tuple = ()) -> None:
    """Write one message: a compact JSON line, then the binary payloads it announces."""
    if payloads:
        msg = dict(msg, _bin=[len(p) for p in payloads])
    line = encode_json(msg).encode() + b"\n"
    if payloads:
        stream.write(b"".join([line, *payloads]))
    else:
        stream.write(line)
    stream.flush()


def payload_nbytes(payload: Any) -> int:
    """A payload's size in bytes (a memoryview's ``nbytes``, not its item count)."""
    return payload.nbytes if type(payload) is memoryview else len(payload)


def encode_reply(reply: dict, payloads: Sequence = ()) -> bytes:
    """One env's reply object as compact JSON (no newline), with ``"_bin"`` when it has payloads.

    Raises TypeError/ValueError when the reply is not JSON-serialisable.
    """
    if payloads:
        reply = dict(reply, _bin=[payload_nbytes(p) for p in payloads])
    return encode_json(reply).encode()


class FdReader:
    """``readline``/``read`` (what :func:`read_message` needs) over a raw fd, one buffer.

    A serving loop that owns the reader may also take whole ``os.read`` results itself
    while :attr:`buf` is empty (a hot path recognising one short request line), and hand
    anything it does not recognise back with :meth:`push`.
    """

    __slots__ = ("fd", "buf")

    def __init__(self, fd: int):
        self.fd = fd
        self.buf = bytearray()

    def push(self, data: bytes) -> None:
        """Put bytes read from the fd (by the caller) back in front of the stream."""
        self.buf[:0] = data

    def _fill(self) -> bool:
        data = os.read(self.fd, 1 << 16)
        self.buf += data
        return bool(data)

    def readline(self, limit: int = -1) -> bytes:
        """Up to and including the next newline, at most ``limit`` bytes; ``b""`` at end of stream."""
        scanned = 0
        while True:
            end = self.buf.find(b"\n", scanned)
            if end >= 0:
                end += 1
                break
            scanned = len(self.buf)
            if 0 <= limit <= scanned or not self._fill():
                end = scanned
                break
        if limit >= 0:
            end = min(end, limit)
        line = bytes(self.buf[:end])
        del self.buf[:end]
        return line

    def read(self, n: int) -> bytes:
        """``n`` bytes, or fewer at end of stream."""
        while len(self.buf) < n and self._fill():
            pass
        data = bytes(self.buf[:n])
        del self.buf[:n]
        return data


class FdWriter:
    """``write``/``flush`` (what :func:`write_message` needs) straight to a raw fd: every
    write goes out whole, so flushing has nothing left to do."""

    __slots__ = ("fd",)

    def __init__(self, fd: int):
        self.fd = fd

    def write(self, data: Any) -> None:
        write_all(self.fd, data)

    def flush(self) -> None:
        pass


def write_all(fd: int, data: Any) -> None:
    """``os.write`` until every byte of ``data`` (bytes or a buffer) is written."""
    done = os.write(fd, data)
    if done < (data.nbytes if type(data) is memoryview else len(data)):
        view = memoryview(data).cast("B")
        while done < len(view):
            done += os.write(fd, view[done:])


def writev_all(fd: int, parts: Sequence[Any]) -> None:
    """Write ``parts`` (bytes or buffers) back to back with ``writev``: a reply's line and its
    array payloads go out without being joined into one more copy first. At most ``IOV_MAX``
    parts go to one call (the kernel refuses more); a call the pipe took part of is finished
    with :func:`write_all`."""
    for start in range(0, len(parts), _IOV_MAX):
        chunk = parts[start : start + _IOV_MAX]
        done = os.writev(fd, chunk)
        total = sum(p.nbytes if type(p) is memoryview else len(p) for p in chunk)
        if done < total:
            write_all(fd, memoryview(b"".join(chunk))[done:])


def _iov_max() -> int:
    try:
        return max(16, os.sysconf("SC_IOV_MAX"))
    except (ValueError, OSError):
        return 1024


_IOV_MAX = _iov_max()
