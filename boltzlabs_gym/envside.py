"""What every env process shares, whichever server it runs: the channel, framing, failures, boltz hook.

Imported by :mod:`boltzlabs_gym.env` (``serve()``, the plain env protocol), by
:mod:`boltzlabs_gym.gym_server` (Gymnasium envs) and by the boltz fork loop
(:mod:`boltzlabs_gym.worker.forkserver`). It is standard-library only and imports nothing of
the package: it is loaded inside every sandbox, possibly by an interpreter that has nothing
else installed, and dependencies point from the worker to it, never back.

``mode="boltz"``: a template process runs the env's ``env.py`` and must fork envs from inside
``serve()``. The fork loop is worker code; this module only holds the hook it installs
(:func:`install_template_hook`, called by the template's bootstrap before ``env.py`` runs) and
:func:`template_fork`, which ``serve()`` calls and which returns only in a forked env.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any, BinaryIO, Protocol

# The one ProtocolError of the library; errors.py is standard-library only, like this module.
from .errors import ProtocolError

__all__ = [
    "ENV_DIR",
    "WORKSPACE",
    "ENV_INDEX",
    "PerEnvInt",
    "PerEnvStr",
    "in_template",
    "install_template_hook",
    "template_fork",
    "MAX_LINE_BYTES",
    "MAX_TRACEBACK_CHARS",
    "ProtocolError",
    "MessageReader",
    "MessageWriter",
    "encode_json",
    "decode_json",
    "read_message",
    "write_message",
    "FdReader",
    "FdWriter",
    "write_all",
    "protect_channel_fds",
    "protect_channel",
    "freeze_heap",
    "failed_transition",
    "error_transition",
]

# ----------------------------------------------------------------------------------- where the env is

#: Where the env directory is, read-only. ``/env`` inside a namespace sandbox; the
#: real directory under the ``process`` backend. Portable env code uses this name.
ENV_DIR: str = os.environ.get("BOLTZLABS_ENV_DIR", "/env")
#: The env's private, writable directory (``/workspace`` inside a sandbox).
WORKSPACE: str = os.environ.get("BOLTZLABS_WORKSPACE", "/workspace")
#: This env's index in its pool (0-based), or -1 when run by hand.
ENV_INDEX: int = int(os.environ.get("BOLTZLABS_ENV_INDEX", "-1"))


class PerEnvInt(int):
    """In a boltz template: ``ENV_INDEX``, found by identity and rebound in every forked env."""


class PerEnvStr(str):
    """In a boltz template: ``ENV_DIR``/``WORKSPACE``, rebound in every forked env."""


# ----------------------------------------------------------------------------------- mode="boltz"

#: Set (to the isolation kind) only in a ``mode="boltz"`` template process: serve() forks envs.
_template: str = os.environ.get("BOLTZLABS_TEMPLATE", "")
if _template:
    # Distinct objects the fork loop finds by identity in every module that imported them.
    ENV_DIR, WORKSPACE, ENV_INDEX = PerEnvStr(ENV_DIR), PerEnvStr(WORKSPACE), PerEnvInt(ENV_INDEX)
#: The fork loop, installed by the template's bootstrap (worker code, never imported from here).
_template_hook: Callable[[], None] | None = None


def in_template() -> bool:
    """Whether this process is a boltz template (``serve()`` forks envs) rather than an env."""
    return bool(_template)


def install_template_hook(hook: Callable[[], None]) -> None:
    """Make :func:`template_fork` run ``hook``: the fork loop, which returns only in a forked env."""
    global _template_hook
    _template_hook = hook


def template_fork() -> None:
    """``mode="boltz"``: in the template, serve fork requests here; returns only in a forked env.

    A no-op in every ordinary env process (and in a forked env: it is an env from then on).
    """
    global _template
    if not _template:
        return
    if _template_hook is None:
        sys.exit(
            "boltzlabs: BOLTZLABS_TEMPLATE is set, but this interpreter was not started by a boltz template "
            "(no fork loop installed)"
        )
    _template_hook()
    _template = ""


# ----------------------------------------------------------------------------------- the channel

#: Largest request line an env server accepts, in bytes (requests come from the trusted
#: worker; the bound only stops a corrupted stream from eating memory).
MAX_LINE_BYTES = 256 << 20
#: Largest traceback text carried in an info dict.
MAX_TRACEBACK_CHARS = 8000

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


def protect_channel_fds() -> tuple[int, int]:
    """Take fds 0/1 for the protocol and point ``print()`` (and fd 1) at stderr.

    User code, the libraries it imports and the subprocesses it starts all write
    to fd 1 by habit; any such byte would corrupt the reply stream. After this,
    fd 1 is a copy of stderr and only the returned fds (private copies of the old
    0 and 1) reach the worker.
    """
    proto_in, proto_out = os.dup(0), os.dup(1)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(2, 1)
    sys.stdin = open(os.devnull)  # noqa: SIM115 - stdin for the life of the process
    sys.stdout = sys.stderr
    return proto_in, proto_out


def protect_channel() -> tuple[BinaryIO, BinaryIO]:
    """:func:`protect_channel_fds`, as buffered streams."""
    proto_in, proto_out = protect_channel_fds()
    return os.fdopen(proto_in, "rb", buffering=1 << 16), os.fdopen(proto_out, "wb", buffering=1 << 16)


def freeze_heap() -> None:
    """Move everything alive now (modules, the env, its simulator) out of the cyclic GC's reach.

    Called once the env is built, before serving: a serving env allocates a few container
    objects per step, so the collector runs every few dozen steps, and each older-generation
    collection walks every tracked object of the interpreter (tens of thousands with
    Gymnasium and NumPy imported), in a process whose caches are cold at every step.
    Measured on 64 CartPole envs on 2 cores: about 25% less env CPU per step. The young
    generations are collected first (2 ms); a full collection would add 12-21 ms to every
    env start and hard reset and found nothing to free after building CartPole. What the
    env allocates later is collected as usual.
    """
    gc.collect(1)
    gc.freeze()


# ----------------------------------------------------------------------------------- failures


def failed_transition(where: str, traceback_text: str) -> dict:
    """The terminal transition that stands for a failure: ``info["boltzlabs_exception"]`` says where and why."""
    return {
        "obs": None,
        "reward": 0.0,
        "terminated": True,
        "truncated": False,
        "info": {"boltzlabs_exception": {"where": where, "traceback": traceback_text}},
    }


def error_transition(where: str) -> dict:
    """A user exception (the one being handled) becomes a terminal transition, not a dead process."""
    tb = traceback.format_exc()[-MAX_TRACEBACK_CHARS:]
    sys.stderr.write(tb)
    sys.stderr.flush()
    return failed_transition(where, tb)
