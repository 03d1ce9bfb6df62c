"""Sandboxes of several envs, from inside: how many envs this process hosts, sandbox requests, sandbox replies.

With ``BOLTZLABS_ENVS_PER_SANDBOX`` (K) above 1 an env process hosts ``BOLTZLABS_ENV_COUNT``
envs (its slots, :func:`sandbox_config`), every request is a sandbox request
(:func:`check_sandbox_request`), and every reply a sandbox reply (:func:`sandbox_reply_parts`); while it
serves a slot, :class:`Progress` says which in its workspace. The wire is specified in
:mod:`boltzlabs_gym.wire.protocol` ("Sandboxes of several envs"). Its constants are repeated
here because the env side imports nothing of the package but errors and limits (it must load
in a sandbox with nothing else installed); tests/envside/test_multienv_side.py checks that
both agree.
"""

from __future__ import annotations

import mmap
import os
import struct
import sys
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from ..errors import ProtocolError
from .framing import MessageWriter, payload_nbytes, write_all

__all__ = [
    "PROGRESS_FILE",
    "MAX_ENVS_PER_SANDBOX",
    "SandboxConfig",
    "sandbox_config",
    "Progress",
    "SandboxRequest",
    "check_sandbox_request",
    "sandbox_ops",
    "spelled_out",
    "NO_SANDBOX_ARRAYS",
    "sandbox_reply_line",
    "sandbox_reply",
    "sandbox_reply_parts",
    "write_sandbox_reply",
]

#: The file in a multi-env sandbox's workspace that holds the slot being served (int32 LE, -1: none).
PROGRESS_FILE = ".boltzlabs-progress"
#: The most envs one sandbox may host.
MAX_ENVS_PER_SANDBOX = 4096
_IDLE = -1
_SANDBOX_KEYS = ("slots", "ops", "nbin", "autoreset")


class SandboxConfig(NamedTuple):
    """How many envs this process hosts, from its environment (:func:`sandbox_config`)."""

    #: ``envs_per_sandbox`` (K): with K > 1 every request is a sandbox request, even where ``count`` is 1.
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


def sandbox_config(environ: Any = None) -> SandboxConfig:
    """``BOLTZLABS_ENVS_PER_SANDBOX`` (K, default 1) and ``BOLTZLABS_ENV_COUNT`` (m, default K).

    Read when serving starts, never at import: a boltz fork gets its environment from the
    worker after the template imported everything (call this after :func:`template_fork`).
    A bad value is a start-up failure: a message on stderr and exit status 2.
    """
    environ = os.environ if environ is None else environ
    k = _env_int(environ, "BOLTZLABS_ENVS_PER_SANDBOX", 1, 1, MAX_ENVS_PER_SANDBOX)
    m = _env_int(environ, "BOLTZLABS_ENV_COUNT", k, 1, k)
    return SandboxConfig(k, m)


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


class SandboxRequest(NamedTuple):
    """A checked sandbox request (:func:`check_sandbox_request`): ``ops[p]`` is for slot ``slots[p]``."""

    slots: list[int]
    #: Each a per-env op object, or an int: the shorthand of a step of that action.
    ops: list[Any]
    #: Each op's payloads, or ``None`` when the request has none at all.
    payloads: list[Sequence[bytes]] | None
    #: Whether an int op steps with ``"autoreset": true``.
    autoreset: bool
    #: The batch of array actions (``"actions"``): its dtype, its shape ``[P, ...]`` and its payload;
    #: a ``None`` op steps with its position's row.
    actions: tuple[str, list, bytes] | None = None


_OP_TYPES = {int, dict}
_ROW_OP_TYPES = {int, dict, type(None)}


def _is_int(value: Any) -> bool:
    return type(value) is int  # not a bool


def check_sandbox_request(msg: dict, payloads: Sequence[bytes], count: int) -> SandboxRequest:
    """Check a sandbox request of a process hosting ``count`` slots; :class:`ProtocolError` says what is wrong.

    The whole line was read, so the stream is still in sync: the process answers
    ``{"error": ...}`` and serves on.
    """
    slots, ops, nbin, autoreset = (msg.get(key) for key in _SANDBOX_KEYS)
    actions = msg.get("actions")
    if not isinstance(slots, list) or not isinstance(ops, list):
        raise ProtocolError(f"not a group request (this process hosts {count} envs): it needs 'slots' and 'ops' lists")
    if len(ops) != len(slots):
        raise ProtocolError(f"a group request has {len(slots)} slots but {len(ops)} ops")
    # Checked with set/min/max (C loops, not Python ones): this runs for every request.
    if slots and (set(map(type, slots)) != {int} or min(slots) < 0 or max(slots) >= count):
        raise ProtocolError(f"group slots must be ints in [0, {count}), got {slots!r}"[:500])
    if len(set(slots)) != len(slots):
        raise ProtocolError(f"group slots must be distinct, got {slots!r}"[:500])
    if not set(map(type, ops)) <= (_OP_TYPES if actions is None else _ROW_OP_TYPES):
        raise ProtocolError("each op of a group request must be an op object or an int (a step's action)")
    if autoreset is not None and not isinstance(autoreset, bool):
        raise ProtocolError(f"a group request's autoreset must be a bool, got {type(autoreset).__name__}")
    if actions is not None:
        return SandboxRequest(slots, ops, None, bool(autoreset), _action_rows(actions, nbin, payloads, len(ops)))
    return SandboxRequest(slots, ops, _split_payloads(nbin, payloads, len(ops)), bool(autoreset))


def _action_rows(actions: Any, nbin: Any, payloads: Sequence[bytes], n_ops: int) -> tuple[str, list, bytes]:
    """A request's batch of actions (``"actions"``), checked as far as the wire goes: its one
    payload, of ``n_ops`` rows of whole bytes (the env checks the dtype and the row shape)."""
    ref: Any = actions.get("__nd__") if type(actions) is dict and len(actions) == 1 else None
    ok = isinstance(ref, list) and len(ref) == 3 and ref[0] == 0 and type(ref[0]) is int and type(ref[1]) is str
    shape: Any = ref[2] if ok else None
    ok = ok and isinstance(shape, list) and shape[:1] == [n_ops] and all(_is_int(d) and d >= 0 for d in shape)
    if not ok or nbin is not None or len(payloads) != 1:
        raise ProtocolError(f"a group request's actions must be one payload of {n_ops} rows, got {str(actions)[:120]}")
    if n_ops and len(payloads[0]) % n_ops:
        raise ProtocolError(f"a group request's actions of {len(payloads[0])} bytes are not {n_ops} rows")
    return ref[1], shape, payloads[0]


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


def sandbox_ops(msg: dict, payloads: Sequence[bytes], count: int) -> list[tuple[int, dict, Sequence[bytes]]]:
    """``(slot, op, op_payloads)`` for each position of a sandbox request, int shorthands written out
    as the step ops they stand for; :class:`ProtocolError` as :func:`check_sandbox_request`."""
    return spelled_out(check_sandbox_request(msg, payloads, count))


def spelled_out(req: SandboxRequest) -> list[tuple[int, dict, Sequence[bytes]]]:
    """``(slot, op, op_payloads)`` for each position of a checked sandbox request, int shorthands
    written out as the step ops they stand for."""
    out = []
    row_bytes = len(req.actions[2]) // len(req.ops) if req.actions is not None and req.ops else 0
    for p, (slot, op) in enumerate(zip(req.slots, req.ops)):
        own: Sequence[bytes] = req.payloads[p] if req.payloads is not None else ()
        if op is None and req.actions is not None:  # its row of the batch of actions
            dtype, shape, data = req.actions
            op, own = (
                {"op": "step", "action": {"__nd__": [0, dtype, shape[1:]]}},
                (data[p * row_bytes : (p + 1) * row_bytes],),
            )
            if req.autoreset:
                op["autoreset"] = True
        elif _is_int(op):
            op = {"op": "step", "action": op, "autoreset": True} if req.autoreset else {"op": "step", "action": op}
        out.append((slot, op, own))
    return out


#: A sandbox reply's arrays when it has none (no array observations, or no plain position).
NO_SANDBOX_ARRAYS = b'"obs":null,"reward":null,"flags":null'


def sandbox_reply_line(
    n: int, replies: Sequence[tuple[int, bytes]], sizes: Sequence[int], arrays: bytes | None = None
) -> bytes:
    """A sandbox reply line: ``n`` positions, ``arrays`` (the ``"obs":..,"reward":..,"flags":..``
    members, else nulls), the encoded replies by position, and ``"_bin"`` listing ``sizes`` (all
    payloads: the arrays' and then each reply's, in position order) when there are any.

    >>> sandbox_reply_line(2, [(1, b'{"error":"unknown op"}')], [])
    b'{"n":2,"obs":null,"reward":null,"flags":null,"replies":{"1":{"error":"unknown op"}}}\\n'
    """
    parts = [b'{"n":%d,' % n, NO_SANDBOX_ARRAYS if arrays is None else arrays, b',"replies":{']
    parts.append(b",".join([b'"%d":%s' % (p, r) for p, r in replies]))
    if sizes:
        parts.append(b'},"_bin":[%s]}\n' % b",".join([b"%d" % s for s in sizes]))
    else:
        parts.append(b"}}\n")
    return b"".join(parts)


def sandbox_reply(
    n: int,
    replies: Sequence[tuple[int, bytes, Sequence]],
    arrays: bytes | None = None,
    array_payloads: Sequence = (),
) -> bytes:
    """A whole sandbox reply, its line and then its payloads: ``replies`` are ``(position,
    encode_reply(...), that reply's payloads)`` in position order, after the arrays' payloads."""
    parts = sandbox_reply_parts(n, replies, arrays, array_payloads)
    return b"".join(parts) if len(parts) > 1 else parts[0]


def sandbox_reply_parts(
    n: int,
    replies: Sequence[tuple[int, bytes, Sequence]],
    arrays: bytes | None = None,
    array_payloads: Sequence = (),
) -> list:
    """:func:`sandbox_reply` as its line and payloads, for :func:`writev_all`."""
    payloads = list(array_payloads)
    for _p, _r, own in replies:
        payloads.extend(own)
    line = sandbox_reply_line(n, [(p, r) for p, r, _own in replies], [payload_nbytes(x) for x in payloads], arrays)
    return [line, *payloads]


def write_sandbox_reply(
    stream: MessageWriter,
    n: int,
    replies: Sequence[tuple[int, bytes, Sequence]],
    arrays: bytes | None = None,
    array_payloads: Sequence = (),
) -> None:
    """Write :func:`sandbox_reply` to ``stream`` in one write, and flush it."""
    stream.write(sandbox_reply(n, replies, arrays, array_payloads))
    stream.flush()
