"""What every env process shares, whichever server it runs: the channel, framing, failures, boltz hook.

Imported by :mod:`boltzlabs_gym.env` (``serve()``, the plain env protocol), by
:mod:`boltzlabs_gym.envside.gym_server` (Gymnasium envs) and by the boltz fork loop
(:mod:`boltzlabs_gym.envside.forkserver`). It is standard-library only and imports nothing of
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
import mmap
import os
import struct
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any, BinaryIO, NamedTuple, Protocol

# The one ProtocolError of the library; errors.py is standard-library only, like this module.
from ..errors import ProtocolError

__all__ = [
    "ENV_DIR",
    "WORKSPACE",
    "ENV_INDEX",
    "PerEnvInt",
    "PerEnvStr",
    "in_template",
    "install_template_hook",
    "install_memory_snapshots",
    "memory_snapshots",
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
    "writev_all",
    "protect_channel_fds",
    "protect_channel",
    "freeze_heap",
    "failed_transition",
    "error_transition",
    "PROGRESS_FILE",
    "MAX_ENVS_PER_SANDBOX",
    "GroupConfig",
    "group_config",
    "Progress",
    "GroupRequest",
    "check_group",
    "group_ops",
    "workspace_now",
    "encode_reply",
    "group_reply_line",
    "group_reply",
    "write_group_reply",
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


#: What makes memory snapshots in this env process (boltz mode's namespaces backend installs it; see
#: :mod:`boltzlabs_gym.envside.memory_snapshot`), or None where there are none.
_memory_snapshots: Any = None


def install_memory_snapshots(maker: Any) -> None:
    """Let this env take memory snapshots through ``maker`` (``refusal()``, ``snapshot()``, ``take_copy()``)."""
    global _memory_snapshots
    _memory_snapshots = maker


def memory_snapshots() -> Any:
    """This process's memory-snapshot maker, or None (every env that is not a boltz namespaces env)."""
    return _memory_snapshots


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


#: The protocol's fds (requests in, replies out) once :func:`protect_channel_fds` took them.
_channel: tuple[int, int] | None = None


def channel_fds() -> tuple[int, int] | None:
    """The fds this env reads requests from and writes replies to, or None before it serves."""
    return _channel


def protect_channel_fds() -> tuple[int, int]:
    """Take fds 0/1 for the protocol and point ``print()`` (and fd 1) at stderr.

    User code, the libraries it imports and the subprocesses it starts all write
    to fd 1 by habit; any such byte would corrupt the reply stream. After this,
    fd 1 is a copy of stderr and only the returned fds (private copies of the old
    0 and 1) reach the worker.
    """
    global _channel
    proto_in, proto_out = os.dup(0), os.dup(1)
    _channel = (proto_in, proto_out)
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


# ----------------------------------------------------------------------------------- sandboxes of several envs
# The wire is specified in boltzlabs_gym.wire.protocol ("Sandboxes of several envs"). Its constants are
# repeated here because this module imports nothing of the package but errors (it must load in a
# sandbox with nothing else installed); tests/envside/test_multienv_side.py checks that both agree.

#: The file in a multi-env sandbox's workspace that holds the slot being served (int32 LE, -1: none).
PROGRESS_FILE = ".boltzlabs-progress"
#: The most envs one sandbox may host.
MAX_ENVS_PER_SANDBOX = 4096
_IDLE = -1
_GROUP_KEYS = ("slots", "ops", "nbin", "autoreset")


class GroupConfig(NamedTuple):
    """How many envs this process hosts, from its environment (:func:`group_config`)."""

    #: ``envs_per_sandbox`` (K): with K > 1 every request is a group request, even where ``count`` is 1.
    envs_per_sandbox: int
    #: The envs this process hosts (m, its slots ``0 .. m-1``); at most K.
    env_count: int


def _env_int(environ: Any, name: str, default: int, low: int, high: int) -> int:
    text = environ.get(name)
    if text is None or text == "":
        return default
    try:
        value = int(text)
    except ValueError:
        value = low - 1
    if not low <= value <= high:
        sys.stderr.write(f"boltzlabs: {name}={text!r} is not an integer in [{low}, {high}]\n")
        sys.stderr.flush()
        sys.exit(2)
    return value


def group_config(environ: Any = None) -> GroupConfig:
    """``BOLTZLABS_ENVS_PER_SANDBOX`` (K, default 1) and ``BOLTZLABS_ENV_COUNT`` (m, default K).

    Read when serving starts, never at import: a boltz fork gets its environment from the
    worker after the template imported everything (call this after :func:`template_fork`).
    A bad value is a start-up failure: a message on stderr and exit status 2.
    """
    environ = os.environ if environ is None else environ
    k = _env_int(environ, "BOLTZLABS_ENVS_PER_SANDBOX", 1, 1, MAX_ENVS_PER_SANDBOX)
    m = _env_int(environ, "BOLTZLABS_ENV_COUNT", k, 1, k)
    return GroupConfig(k, m)


def workspace_now() -> str:
    """The workspace directory as the environment says it now (a boltz fork's, once forked)."""
    return os.environ.get("BOLTZLABS_WORKSPACE") or WORKSPACE


class Progress:
    """The slot a multi-env process is serving, in :data:`PROGRESS_FILE` of its workspace.

    When the worker must kill a sandbox (a missed deadline, a crash), the file says which of
    its envs was running. :meth:`set` is one store into a shared mapping of the file (no system
    call), cheap enough for every position of every request. A workspace where the file cannot
    be made (read-only, gone) costs the worker that attribution, not the env its service: the
    process says so on stderr and serves on with :meth:`set` storing nowhere.
    """

    def __init__(self, workspace: str):
        self.path = os.path.join(workspace, PROGRESS_FILE)
        self._map: mmap.mmap | None = None
        # Where set() stores: the mapped file, or a private cell when there is none.
        cell: Any = memoryview(bytearray(4)).cast("i")
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
            try:
                write_all(fd, struct.pack("<i", _IDLE))
                self._map = mmap.mmap(fd, 4)
            finally:
                os.close(fd)
        except (OSError, ValueError) as exc:
            sys.stderr.write(f"boltzlabs: cannot keep {PROGRESS_FILE} in {workspace!r} ({exc}); serving without it\n")
            sys.stderr.flush()
        self.set: Callable[[int], None] = self._store
        if self._map is not None:
            if sys.byteorder == "little":
                cell = memoryview(self._map).cast("i")
            else:  # the file is little-endian whatever the host
                self.set = self._store_packed
        self._cell = cell
        self.set(_IDLE)

    def _store(self, slot: int) -> None:
        self._cell[0] = slot

    def _store_packed(self, slot: int) -> None:
        assert self._map is not None
        struct.pack_into("<i", self._map, 0, slot)

    def idle(self) -> None:
        """Between requests: no slot is being served."""
        self.set(_IDLE)


class GroupRequest(NamedTuple):
    """A checked group request (:func:`check_group`): ``ops[p]`` is for slot ``slots[p]``."""

    slots: list[int]
    #: Each a per-env op object, or an int: the shorthand of a step of that action.
    ops: list[Any]
    #: Each op's payloads, or ``None`` when the request has none at all.
    payloads: list[Sequence[bytes]] | None
    #: Whether an int op steps with ``"autoreset": true``.
    autoreset: bool


_OP_TYPES = {int, dict}


def _is_int(value: Any) -> bool:
    return type(value) is int  # not a bool


def check_group(msg: dict, payloads: Sequence[bytes], count: int) -> GroupRequest:
    """Check a group request of a process hosting ``count`` slots; :class:`ProtocolError` says what is wrong.

    The whole line was read, so the stream is still in sync: the process answers
    ``{"error": ...}`` and serves on.
    """
    slots, ops, nbin, autoreset = (msg.get(key) for key in _GROUP_KEYS)
    if not isinstance(slots, list) or not isinstance(ops, list):
        raise ProtocolError(f"not a group request (this process hosts {count} envs): it needs 'slots' and 'ops' lists")
    if len(ops) != len(slots):
        raise ProtocolError(f"a group request has {len(slots)} slots but {len(ops)} ops")
    # Checked with set/min/max (C loops, not Python ones): this runs for every request.
    if slots and (set(map(type, slots)) != {int} or min(slots) < 0 or max(slots) >= count):
        raise ProtocolError(f"group slots must be ints in [0, {count}), got {slots!r}"[:500])
    if len(set(slots)) != len(slots):
        raise ProtocolError(f"group slots must be distinct, got {slots!r}"[:500])
    if not set(map(type, ops)) <= _OP_TYPES:
        raise ProtocolError("each op of a group request must be an op object or an int (a step's action)")
    if autoreset is not None and not isinstance(autoreset, bool):
        raise ProtocolError(f"a group request's autoreset must be a bool, got {type(autoreset).__name__}")
    return GroupRequest(slots, ops, _split_payloads(nbin, payloads, len(ops)), bool(autoreset))


def _split_payloads(nbin: Any, payloads: Sequence[bytes], n_ops: int) -> list[Sequence[bytes]] | None:
    """Each op's payloads, by the request's ``nbin`` (``None`` when there are none)."""
    if nbin is None:
        if payloads:
            raise ProtocolError(f"a group request with {len(payloads)} payloads needs 'nbin'")
        return None
    if not isinstance(nbin, list) or len(nbin) != n_ops or not all(_is_int(c) and c >= 0 for c in nbin):
        raise ProtocolError(f"a group request's nbin must be {n_ops} counts, got {nbin!r}"[:500])
    if sum(nbin) != len(payloads):
        raise ProtocolError(f"a group request's nbin counts {sum(nbin)} payloads but {len(payloads)} came")
    out: list[Sequence[bytes]] = []
    start = 0
    for c in nbin:
        out.append(payloads[start : start + c])
        start += c
    return out


def group_ops(msg: dict, payloads: Sequence[bytes], count: int) -> list[tuple[int, dict, Sequence[bytes]]]:
    """``(slot, op, op_payloads)`` for each position of a group request, int shorthands written out
    as the step ops they stand for; :class:`ProtocolError` as :func:`check_group`."""
    req = check_group(msg, payloads, count)
    out = []
    for p, (slot, op) in enumerate(zip(req.slots, req.ops)):
        if _is_int(op):
            op = {"op": "step", "action": op, "autoreset": True} if req.autoreset else {"op": "step", "action": op}
        out.append((slot, op, req.payloads[p] if req.payloads is not None else ()))
    return out


def _nbytes(payload: Any) -> int:
    return payload.nbytes if type(payload) is memoryview else len(payload)


def encode_reply(reply: dict, payloads: Sequence = ()) -> bytes:
    """One env's reply object as compact JSON (no newline), with ``"_bin"`` when it has payloads.

    Raises TypeError/ValueError when the reply is not JSON-serialisable.
    """
    if payloads:
        reply = dict(reply, _bin=[_nbytes(p) for p in payloads])
    return encode_json(reply).encode()


#: A group reply's arrays when it has none (no array observations, or no plain position).
NO_GROUP_ARRAYS = b'"obs":null,"reward":null,"flags":null'


def group_reply_line(
    n: int, replies: Sequence[tuple[int, bytes]], sizes: Sequence[int], arrays: bytes | None = None
) -> bytes:
    """A group reply line: ``n`` positions, ``arrays`` (the ``"obs":..,"reward":..,"flags":..``
    members, else nulls), the encoded replies by position, and ``"_bin"`` listing ``sizes`` (all
    payloads: the arrays' and then each reply's, in position order) when there are any.

    >>> group_reply_line(2, [(1, b'{"error":"unknown op"}')], [])
    b'{"n":2,"obs":null,"reward":null,"flags":null,"replies":{"1":{"error":"unknown op"}}}\\n'
    """
    parts = [b'{"n":%d,' % n, NO_GROUP_ARRAYS if arrays is None else arrays, b',"replies":{']
    parts.append(b",".join([b'"%d":%s' % (p, r) for p, r in replies]))
    if sizes:
        parts.append(b'},"_bin":[%s]}\n' % b",".join([b"%d" % s for s in sizes]))
    else:
        parts.append(b"}}\n")
    return b"".join(parts)


def group_reply(
    n: int,
    replies: Sequence[tuple[int, bytes, Sequence]],
    arrays: bytes | None = None,
    array_payloads: Sequence = (),
) -> bytes:
    """A whole group reply, its line and then its payloads: ``replies`` are ``(position,
    encode_reply(...), that reply's payloads)`` in position order, after the arrays' payloads."""
    parts = group_reply_parts(n, replies, arrays, array_payloads)
    return b"".join(parts) if len(parts) > 1 else parts[0]


def group_reply_parts(
    n: int,
    replies: Sequence[tuple[int, bytes, Sequence]],
    arrays: bytes | None = None,
    array_payloads: Sequence = (),
) -> list:
    """:func:`group_reply` as its line and payloads, for :func:`writev_all`."""
    payloads = list(array_payloads)
    for _p, _r, own in replies:
        payloads.extend(own)
    line = group_reply_line(n, [(p, r) for p, r, _own in replies], [_nbytes(x) for x in payloads], arrays)
    return [line, *payloads]


def write_group_reply(
    stream: MessageWriter,
    n: int,
    replies: Sequence[tuple[int, bytes, Sequence]],
    arrays: bytes | None = None,
    array_payloads: Sequence = (),
) -> None:
    """Write :func:`group_reply` to ``stream`` in one write, and flush it."""
    stream.write(group_reply(n, replies, arrays, array_payloads))
    stream.flush()
