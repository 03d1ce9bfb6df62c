"""The trainer <-> worker wire format (ZeroMQ multipart) and the limits of both hops.

A request is ``[header, *frames]``; a reply is ``[header, *frames]``. The header is a
small JSON object; frames are raw bytes (an uploaded archive, array payloads). Over a
ROUTER socket the worker additionally sees the client's identity frame first.

Request header::

    {"v": 2, "op": "batch", "seq": 17, "session": "s3",
     "items": [[local_index, {"op": "step", "action": 1}, n_frames], ...]}

Reply header for ``batch``::

    {"v": 2, "seq": 17, "ok": true, "worker_ms": 0.8,
     "results": [[local_index, status, [reply_len, payload_len, ...]], ...]}

followed by exactly one data frame: per result and in order, the env's reply (a
JSON object, forwarded as the env wrote it, or an error object written by the
worker) and then that env's binary payloads, back to back, with the byte sizes the
result lists. ``status`` is set by the worker, never by the env: ``"ok"``,
``"straggler"`` or ``"error"``. (Version 1 sent one frame per reply and payload;
frames cost several microseconds each on both sides.)

Partial replies (:data:`PARTIAL`): a ``batch`` request with ``"partial": true`` is answered in
parts, as its envs finish, not once when the last one has: each part is a ``batch`` reply as
above (same ``seq``) holding the results that came in during one turn of the worker's loop,
with ``"more": true`` on every part but the last. The pool's send/recv and asyncio faces use it
(:mod:`boltzlabs_gym.client.async_steps`, :mod:`boltzlabs_gym.worker.partial_replies`).

Errors: ``{"v": 2, "seq": 17, "ok": false, "error": {"kind": "...", "message": "..."}}``.

Lending (a local pool only: the pool that started the worker, over their socketpair; see
:mod:`boltzlabs_gym.client.direct_lane`). The worker may hand such a pool the pipes of idle envs so that
the pool steps them itself; everything else about those envs stays with the worker.

* ``"lend": true`` (:data:`LEND`), in a ``create`` or ``batch`` request: the pool asks
  for the session's idle envs with the reply.
* ``"lent": [index, ...]`` (:data:`LENT`), in that reply: the envs lent. Their stdin and
  stdout descriptors, two per env in that order, travel with the reply's bytes
  (``SCM_RIGHTS``); the pool keeps them on the header under ``"_fds"`` (:data:`LENT_FDS`,
  never sent on the wire). A lent env is the pool's until a request names it: any item
  for it takes it back first.
* ``"faults": [[index, reason], ...]`` (:data:`FAULTS`), in a ``batch`` request: lent envs
  the pool let go of after seeing them fail while idle (output nobody asked for, a closed
  pipe). The worker kills, reports and respawns each one still lent.
* ``"adopt": [[index, op, seconds_left], ...]`` (:data:`ADOPT`), in a ``batch`` request:
  calls the pool sent to lent envs and stopped waiting for (its wait timed out). The
  worker takes each env back with that call in flight: the reply is dropped when it comes,
  the deadline still holds.
* An item ``{"op": "lent_fault", "reason": str, "straggler": bool}`` (:data:`LENT_FAULT`)
  in a ``batch`` request: the pool's call to a lent env failed (a deadline, a crash, a bad
  reply). The worker kills the env and reports it in that item's result as if the call had
  been its own (``"straggler"`` status when ``straggler``), then respawns it.

* An item ``{"op": "obs_region"}`` (:data:`OBS_REGION`) in a local pool's ``batch``: the env
  process's shared observation region. The worker seals the env's memfd, tells the env to use it
  and passes the descriptor with the reply (``"region_fds": count``, :data:`REGION_FDS`, after the
  lent envs' descriptors); the item's reply is ``{"obs_region": {"bytes", "slots", "slot_bytes",
  "dtype", "shape", "fd_index"}}`` or ``{"error": ...}``. See ``docs/shared-memory.md``.

A ``batch`` may carry only ``faults``/``adopt`` and no items. The rules both sides judge
an env by (its deadline, a late call's message, stray output) are in
:mod:`boltzlabs_gym.wire.call_rules`.

Cancelling calls (:data:`CALL_TAG`, :data:`CANCEL`). A batch item's op may carry ``"tag"``, a
string or int the pool chose for that call (the env sees it too, and ignores it). A ``cancel``
request, ``{"op": "cancel", "session": sid, "token": ..., "calls": [[index, tag], ...]}``,
may come on any connection of the session's owner while the batch is in flight (it does not
become the session's reply address): for each named env whose call with that tag is still
queued, the call is dropped; in flight, the env's whole sandbox is killed and respawned, as for
a fault but not counted as one. Either way that call is answered as an ``"error"`` result with
``"cancelled": true``. The reply is ``{"ok": true, "cancelled": [index, ...]}``, the envs
whose tagged call it found (a call that finished first is not touched). A local pool steps lent
envs itself, so the worker cannot see their calls: with ``"lent": true`` (:data:`CANCEL_LENT`)
a named env that is lent to it is killed and respawned whatever it does (the pool vouches that
the tagged call is the one on its pipes; the pool's wait then sees its pipe close).

A call's memory limit (:data:`CALL_MEMORY_LIMIT`). A batch item's op may carry
``"memory_limit_bytes": n`` (n > 0): where the env has a cgroup of its own, the worker sets that
cgroup's memory limit, for this call only, to what the sandbox holds when the call is sent plus
``n``, never above the session's limit (the kernel's OOM killer then ends whatever outgrows it,
the largest process first), and puts the session's limit back when the call is answered. Where
the env has no cgroup (or the write fails), the key is ignored. The env sees it and ignores it.

Sandboxes of several envs (``envs_per_sandbox=K``; see :mod:`boltzlabs_gym.client.sandbox_replies`).
With K > 1 one sandboxed process hosts up to K envs of the pool, its *slots*: env ``i``
lives in sandbox ``i // K``, slot ``i % K`` (the last sandbox may host fewer). The worker,
its batch items and the lane then address sandboxes, not envs; the pool packs the ops of a
sandbox's envs into one **sandbox request** and unpacks the one **sandbox reply**. The process
learns its envs from its environment: ``BOLTZLABS_ENVS_PER_SANDBOX`` (K),
``BOLTZLABS_ENV_COUNT`` (m, the envs it hosts) and ``BOLTZLABS_ENV_INDEX`` (the pool index
of its slot 0). A sandbox request line::

    {"op": NAME, "slots": [s, ...], "ops": [op, ...], "autoreset": true, "nbin": [c, ...], "_bin": [...]}

``slots`` are distinct slot numbers in ``[0, m)``; ``ops[p]`` is the per-env op of slot
``slots[p]`` exactly as a one-env process gets it, or an int ``a``: shorthand for
``{"op": "step", "action": a}`` (plus ``"autoreset": true`` when the sandbox has it).
``nbin`` (absent: none) counts each op's payloads; they follow the line op by op, and an
op's ``__nd__`` references count from its own first payload. Instead of ``nbin``, a request
may carry its array actions as one batch, ``"actions": {"__nd__": [0, dtype, [P, ...]]}`` (its
one payload: one row per position, each row an action of the env's array space in that dtype);
an op ``null`` is then the step of its position's row (with ``"autoreset": true`` when the
sandbox has it). ``NAME`` is :func:`sandbox_op_name`
of the ops: the deadline rules look only at it (:mod:`boltzlabs_gym.wire.call_rules`), so a sandbox request
with a step in it is held to the step deadline, once, for the whole request; a step batch
with resets in it carries ``"deadline_s"`` (:data:`SANDBOX_DEADLINE`: the step and the reset
deadline together), which the worker and the lane use instead. The process
serves the ops in order and answers with one sandbox reply line::

    {"n": P, "obs": {"__nd__": [0, dtype, [P, ...]]} | null, "reward": {"__nd__": [1, "<f8", [P]]} | null,
     "flags": {"__nd__": [2, "|u1", [P]]} | null, "replies": {"p": reply, ...}, "_bin": [...]}

``P`` is the number of ops. A position ``p`` not in ``replies`` is *plain*: its observation
is row ``p`` of ``obs``, its reward ``reward[p]``, ``flags[p]`` has bit 0 for terminated and
bit 1 for truncated, its info is empty or in the info columns (a plain reset: the row and its
info). The info columns are an optional member after ``flags``::

    "info": {"keys": [key, ...], "tags": [tag, ...], "has": {"__nd__": [L+2, "|u1", [P, C]]},
             "cols": [{"__nd__": [L+3+c, dtype, [P, ...]]}, ...]}

one column per key (``C`` of them), ``has[p, c]`` 1 where position ``p``'s info has key ``c``,
its value ``cols[c][p]``; a tag says what Python value it was (``int``, ``float``, ``bool``: a
Python scalar, ``<i8``/``<f8``/``|b1``; ``np``: a numpy number of the column's dtype; ``nd``: an
array of the row's shape; :mod:`boltzlabs_gym.envside.info_columns`). Their payloads follow
``flags``'s. Every other position (an info that does not fit the columns, an autoreset's reset
observation, an error, any op but step and reset, an observation that is not of the rows'
arrays) has its whole one-env reply in
``replies`` under its position as a string, with its own ``"_bin"`` sizes. An env whose
observations are a Dict or Tuple of arrays only has their skeleton as ``obs``
(:func:`~boltzlabs_gym.wire.slot_layout.rows_skeleton`): each array's ``P`` rows one payload
(``{"__nd__": [k, dtype, [P, ...]]}``, ``k`` from 0 to ``L-1``), ``reward`` and ``flags``
payloads ``L`` and ``L+1``. The payloads follow the line in this order: the ``obs`` arrays,
``reward`` and ``flags`` when present (all or none), then the payloads of each reply in
position order; the top-level ``"_bin"`` lists them all. A request
that cannot be served (not a sandbox request, bad slots) is answered ``{"error": str}``.

While it serves position ``p`` the process keeps ``slots[p]`` (int32, little-endian; -1
between requests) in the 4-byte file :data:`PROGRESS_FILE` of its workspace, so that when a
sandbox must be killed (a missed deadline, a crash) the worker can tell which env was
running: that env is reported as the failure, the others as restarted because of it.

Snapshots (envs_per_sandbox 1). Two per-env ops, as ``batch`` items, and one worker op:

* ``{"op": "snapshot"}``: the env answers ``{"snapshot": {"kind": "portable", "bytes": n}}``
  with one payload, its state blob (:mod:`boltzlabs_gym.envside.state`; only ever unpickled inside
  a sandbox). The worker keeps the blob, within its snapshot budget, and answers the item
  ``{"snapshot": {"id": str, "kind": str, "bytes": n}}`` with no payload; over budget, the
  item is an ``"error"`` result whose message says how much is held and what to release.
* ``{"op": "snapshot", "kind": "memory" | "auto"}`` (boltz mode, namespaces backend): a memory
  snapshot. The worker first copies the env's workspace, sends the env the continued source's
  socket on its control socket (``"swap"``) and arms its seccomp supervisor; the env forks its
  continuation into a nested sandbox and becomes the holder (:mod:`boltzlabs_gym.envside.memory_snapshot`).
  The continuation answers ``{"snapshot": {"kind": "memory"}}`` with no payload, and the worker
  answers the item as above (``bytes``: the holder's memory and the workspace copy). ``auto``
  falls back to the portable kind (its reply) where the env cannot fork; ``memory`` is then an
  ``"error"`` result naming why.
* ``{"op": "restore", "snapshot": id, "reseed": int|null}``: the worker gives the env the
  blob it holds under ``id`` (:data:`SNAPSHOT_ID`) as the request's one payload (an unknown
  or released id is an ``"error"`` result: nothing is sent to the env). The env loads it
  (its env, generators and workspace files), reseeds when asked, and answers as a ``reset``
  does: ``{"obs": ..., "info": {}}``. For a memory snapshot the worker replaces the env's
  process with a copy forked from the holder (into the slot's new cgroup, with the snapshot's
  workspace) and sends it ``{"op": "restore", "kind": "memory", "reseed": ...}`` with no
  payload; the copy answers the same way.
* ``{"op": "snapshots", "session": sid, "action": "release" | "export" | "import", ...}``:
  ``release`` with ``"ids": [...]`` forgets blobs; ``export`` with ``"id"`` answers
  ``{"kind", "bytes"}`` and the blob as one frame; ``import`` sends a blob as one frame and
  answers ``{"snapshot": {"id", "kind", "bytes"}}``. Blobs belong to the session that took or
  imported them and go when it closes.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence
from typing import Any

from ..errors import ProtocolError  # re-exported: raised by decode_header and the worker's handlers

PROTOCOL_VERSION = 2

#: Statuses of one env's result, set by the worker.
OK, STRAGGLER, ERROR = "ok", "straggler", "error"

#: Largest request/reply header, in bytes.
MAX_HEADER_BYTES = 64 << 20
#: Largest JSON reply line an env may write (a longer one kills the env).
MAX_ENV_LINE_BYTES = 16 << 20
#: Largest total of binary payloads one env reply may announce.
MAX_ENV_PAYLOAD_BYTES = 256 << 20
#: Longest reply line a reader remembers as read (a sandbox repeats its all-plain sandbox reply
#: line, a few hundred bytes, every step): what a sandbox can make its readers keep stays small.
MAX_KNOWN_LINE_BYTES = 16 << 10

#: How long a local pool's worker busy-polls for the next request after answering one
#: (``RLPool(busy_poll_us=...)``, worker ``--busy-poll-us``); see Worker._local_replied.
DEFAULT_BUSY_POLL_US = 300.0
#: The longest busy-poll window ``busy_poll_us`` takes, in microseconds.
MAX_POLL_US = 1e6

#: The lending words (see "Lending" above). Request header key: the pool asks for idle envs.
LEND = "lend"
#: Reply header key: the indices of the envs lent with this reply.
LENT = "lent"
#: Pool-side only: the header key under which a received reply keeps its lent envs' descriptors.
LENT_FDS = "_fds"
#: A batch reply's count of observation-region descriptors that travel with it, after the lent envs'
#: (``{"op": "obs_region"}`` items; a local pool only: see :mod:`boltzlabs_gym.client.obs_regions`).
REGION_FDS = "region_fds"
#: Where the pool keeps those descriptors on the reply's header (never sent on the wire).
REGION_FDS_TAKEN = "_region_fds"
#: The item op that asks an env process for its shared observation region.
OBS_REGION = "obs_region"
#: Batch request key: ``[[index, reason], ...]``, lent envs that failed while idle.
FAULTS = "faults"
#: Batch request key: ``[[index, op, seconds_left], ...]``, lent envs' calls nobody waits for.
ADOPT = "adopt"
#: Batch request key: answer in parts as envs finish (see "Partial replies" above); reply key
#: ``more``: another part of the same request follows.
PARTIAL, MORE = "partial", "more"
#: The batch item op by which a local pool hands back a lent env whose call failed on its side.
LENT_FAULT = "lent_fault"


#: Sandbox requests (envs_per_sandbox > 1): the request keys and the reply keys (see above).
SANDBOX_SLOTS, SANDBOX_OPS, SANDBOX_NBIN, SANDBOX_AUTORESET = "slots", "ops", "nbin", "autoreset"
#: The marker key of an array leaf (``{"__nd__": [payload, dtype, shape]}``), as the codec and every
#: reader of arrays on the wire spell it.
ND = "__nd__"
#: A sandbox request's batch of array actions, one row per position (see "Sandboxes of several envs").
SANDBOX_ACTIONS = "actions"
#: Optional sandbox request key, for the worker and the lane (the env ignores it): the request's
#: deadline in seconds when its name's timeout is not the right one (a step batch with resets in it).
SANDBOX_DEADLINE = "deadline_s"
SANDBOX_N, SANDBOX_OBS, SANDBOX_REWARD, SANDBOX_FLAGS, SANDBOX_REPLIES = "n", "obs", "reward", "flags", "replies"
#: A sandbox reply's info columns (after ``flags``; see "Sandboxes of several envs").
SANDBOX_INFO = "info"
#: Bits of a sandbox reply's ``flags``.
FLAG_TERMINATED, FLAG_TRUNCATED = 1, 2
#: The file in a multi-env sandbox's workspace that holds the slot being served (int32 LE, -1: none).
PROGRESS_FILE = ".boltzlabs-progress"
#: The most envs one sandbox may host.
MAX_ENVS_PER_SANDBOX = 4096

#: Snapshots (see above): the per-env ops, the restore item's key naming the blob, and the kind of
#: snapshot an env's own state blob is.
SNAPSHOT, RESTORE, SNAPSHOT_ID = "snapshot", "restore", "snapshot"
#: Snapshot kinds: the env's own state blob (saveable, movable), a held fork of the env process
#: (boltz mode, namespaces: copy-on-write, stays on its worker), and "auto" (a snapshot item's
#: ``kind``: memory where the env can take one, else portable).
PORTABLE, MEMORY, AUTO = "portable", "memory", "auto"
SNAPSHOT_KINDS = (AUTO, MEMORY, PORTABLE)
#: The worker's default snapshot budget: bytes of blobs it holds for all sessions together.
DEFAULT_SNAPSHOT_BUDGET = 1 << 30

#: The pool settings a local pool hands its own worker on its command line, setting -> flag: the
#: one place both the pool (:meth:`PoolOptions.worker_config
#: <boltzlabs_gym.client.options.PoolOptions.worker_config>`) and the worker's flag parser
#: (:mod:`boltzlabs_gym.worker.flags`, whose ``boltzlabs-gym worker`` takes the same) read them.
WORKER_FLAGS = {
    "busy_poll_us": "--busy-poll-us",
    "metrics_port": "--metrics-port",
    "snapshot_budget": "--snapshot-budget",
}


def sandbox_op_name(ops: Sequence[Any]) -> str:
    """The name of a sandbox request with these per-env ops (ints are steps, and so are ``None`` ops:
    rows of a batch of actions): ``"step"`` if any op steps, else ``"reset"`` if any resets, else
    the first op's name.

    >>> sandbox_op_name([1, {"op": "reset", "seed": None}])
    'step'
    >>> sandbox_op_name([{"op": "describe"}, {"op": "describe"}])
    'describe'
    """
    names = ["step" if type(op) is int or op is None else op.get("op") for op in ops]
    for name in ("step", "reset"):
        if name in names:
            return name
    return str(names[0]) if names else "step"


def check_poll_us(name: str, value: object) -> float:
    """``value`` as a busy-poll window in microseconds, or ValueError naming ``name``.

    >>> check_poll_us("busy_poll_us", 500)
    500.0
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= MAX_POLL_US:
        raise ValueError(f"{name} must be a number of microseconds in [0, {MAX_POLL_US:.0e}], got {value!r}")
    return float(value)


def poll_us_argument(text: str) -> float:
    """The argparse ``type`` of a busy-poll option (the worker's ``--busy-poll-us``)."""
    import argparse

    try:
        return check_poll_us("the value", float(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of microseconds in [0, {MAX_POLL_US:.0e}]: {text!r}") from None


#: Ops the worker understands.
WORKER_OPS = (
    "ping", "has_archive", "upload", "create", "batch", "memory", "close", "status", "report", "snapshots", "cancel",
)  # fmt: skip
#: The worker op that cancels tagged calls, and an op's key for its tag (see "Cancelling calls" above).
CANCEL, CALL_TAG = "cancel", "tag"
#: A cancel request's key: also kill named envs lent to the (local) pool.
CANCEL_LENT = "lent"
#: An op's key for its call's memory limit in bytes (see "A call's memory limit" above).
CALL_MEMORY_LIMIT = "memory_limit_bytes"
#: Per-env ops the worker handles itself rather than forwarding to the env.
WORKER_ENV_OPS = ("hard_reset",)


# Prebuilt: json.dumps with non-default arguments builds a new encoder per call.
_encode_json = json.JSONEncoder(separators=(",", ":"), allow_nan=True).encode
_decode_json = json.JSONDecoder().decode


def encode_header(header: dict) -> bytes:
    header.setdefault("v", PROTOCOL_VERSION)
    return _encode_json(header).encode()


def decode_header(frame: bytes | memoryview) -> dict:
    """Parse and minimally validate a header frame."""
    if len(frame) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {len(frame)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        header = _decode_json(bytes(frame).decode())
    except (ValueError, RecursionError) as exc:  # RecursionError: nesting too deep to parse
        raise ProtocolError(f"header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise ProtocolError(f"header must be a JSON object, got {type(header).__name__}")
    version = header.get("v")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {version!r} not supported (this side speaks {PROTOCOL_VERSION})")
    return header


def error_reply(seq: Any, kind: str, message: str, **extra: Any) -> dict:
    return {"seq": seq, "ok": False, "error": {"kind": kind, "message": message, **extra}}


# --------------------------------------------------------------------------- the plain step lines
# The commonest request and reply of all each have one fixed byte layout, written and read
# without a JSON encoder or parser (a line of any other shape goes through JSON). Each layout
# is defined here, once; every writer and reader uses these pieces.

#: How a plain Discrete step request line starts; the action's digits and then
#: :data:`DISCRETE_STEP_TAIL` (or :data:`DISCRETE_AUTORESET_TAIL`, SAME_STEP autoreset)
#: end it. Written by :func:`env_request_line`, recognised by the Gymnasium env host with
#: :func:`parse_discrete_step`.
DISCRETE_STEP_HEAD = b'{"op":"step","action":'
DISCRETE_STEP_TAIL = b"}\n"
DISCRETE_AUTORESET_TAIL = b',"autoreset":true}\n'

#: The plain step reply line: a step of an env with an array observation space, a finite reward,
#: an empty info and no reset in the reply. ``<obs>`` is the observation's array skeleton
#: (``{"__nd__":[0,dtype,shape]}``, :class:`boltzlabs_gym.wire.codec.ArrayLeaf`), ``<reward>`` is
#: ``repr(float)``, the flags are JSON booleans and ``<nbytes>`` is the length of the one payload
#: (the observation's bytes) that follows the line. The Gymnasium env host writes it
#: (``ArrayLeaf.step_reply``); the worker and the lane recognise it without a JSON parser
#: (:data:`STEP_REPLY_PATTERN`, in :mod:`boltzlabs_gym.wire.envpipe`); the vector env reads it back
#: (``ArrayLeaf.parse_step_line``). An env with a shared observation region writes the same line with
#: ``<obs>`` ``{"__shm__":[0,dtype,shape]}`` and ``<nbytes>`` 0 (its observation is in the region).
STEP_REPLY_LAYOUT = (
    b'{"obs":<obs>,"reward":<reward>,"terminated":<terminated>,"truncated":<truncated>,"info":{},"_bin":[<nbytes>]}\n'
)
# The layout's fixed text around its five fields (unpacking fails at import if the layout loses one).
(_REPLY_OBS_HEAD, _REPLY_REWARD_HEAD, _REPLY_TERMINATED_HEAD, _REPLY_TRUNCATED_HEAD, _REPLY_NBYTES_HEAD, _REPLY_END) = (
    re.split(rb"<(?:obs|reward|terminated|truncated|nbytes)>", STEP_REPLY_LAYOUT)
)
_JSON_BOOL = {False: b"false", True: b"true"}

#: The bytes between the reward and the info of a plain step reply, by ``(terminated, truncated)``.
STEP_REPLY_FLAGS = {
    (t, u): _REPLY_TERMINATED_HEAD + _JSON_BOOL[t] + _REPLY_TRUNCATED_HEAD + _JSON_BOOL[u]
    for t in (False, True)
    for u in (False, True)
}


def step_reply_prefix(obs_skeleton: bytes) -> bytes:
    """A plain step reply's bytes up to its reward, for observations with this (compact JSON) skeleton.

    >>> step_reply_prefix(b'{"__nd__":[0,"<f4",[2]]}')
    b'{"obs":{"__nd__":[0,"<f4",[2]]},"reward":'
    """
    return _REPLY_OBS_HEAD + obs_skeleton + _REPLY_REWARD_HEAD


def step_reply_suffix(nbytes: int) -> bytes:
    """A plain step reply's bytes after its flags, for an observation payload of ``nbytes``.

    >>> step_reply_suffix(8)
    b',"info":{},"_bin":[8]}\\n'
    """
    return _REPLY_NBYTES_HEAD + b"%d" % nbytes + _REPLY_END


_UINT = rb"(?:0|[1-9]\d{0,17})"  # JSON has no leading zeros
# What each field of the layout may hold; only valid JSON, so a line that matches needs no parser.
_REPLY_FIELD_PATTERNS = (
    rb'\{"__(?:nd|shm)__":\[0,"[<>|=][a-zA-Z]\d{1,2}",\[(?:' + _UINT + rb"(?:," + _UINT + rb"){0,31})?\]\]\}",  # obs
    rb"-?(?:0|[1-9]\d{0,400})(?:\.\d{1,400})?(?:[eE][+-]?\d{1,4})?",  # reward
    rb"(?:true|false)",  # terminated
    rb"(?:true|false)",  # truncated
    rb"(" + _UINT + rb")",  # nbytes: the pattern's one group
)
#: Matches (``fullmatch``) exactly the lines of :data:`STEP_REPLY_LAYOUT` with any array skeleton of
#: up to 32 dimensions; group 1 is ``<nbytes>``. The reader of untrusted env output uses it.
STEP_REPLY_PATTERN = re.compile(
    b"".join(
        re.escape(text) + field
        for text, field in zip(
            (_REPLY_OBS_HEAD, _REPLY_REWARD_HEAD, _REPLY_TERMINATED_HEAD, _REPLY_TRUNCATED_HEAD, _REPLY_NBYTES_HEAD),
            _REPLY_FIELD_PATTERNS,
        )
    )
    + re.escape(_REPLY_END)
)
#: Matches (``fullmatch``) a plain step reply line up to and with its flags: what a step line whose
#: info is typed columns has before :data:`INFO_COLS_MARK`.
STEP_REPLY_HEAD_PATTERN = re.compile(
    b"".join(
        re.escape(text) + field
        for text, field in zip(
            (_REPLY_OBS_HEAD, _REPLY_REWARD_HEAD, _REPLY_TERMINATED_HEAD, _REPLY_TRUNCATED_HEAD),
            _REPLY_FIELD_PATTERNS,
        )
    )
)
#: Where a step reply line whose info is typed columns has its info (``ArrayLeaf.info_step_suffix``).
INFO_COLS_MARK = b',"info":{"__cols__":'


def _encode_line(op: dict, sizes: list[int]) -> bytes:
    if sizes:
        op = dict(op, _bin=sizes)
    return _encode_json(op).encode() + b"\n"


def env_request_line(op: dict, payloads: Sequence[bytes] = ()) -> bytes:
    """The line the worker writes to an env's stdin (payloads follow it).

    >>> env_request_line({"op": "step", "action": 3, "autoreset": True})
    b'{"op":"step","action":3,"autoreset":true}\\n'
    """
    if not payloads and type(op.get("action")) is int and op.get("op") == "step":
        # A Discrete action, the commonest request of all, without the JSON encoder.
        if len(op) == 2:
            return b"%s%d%s" % (DISCRETE_STEP_HEAD, op["action"], DISCRETE_STEP_TAIL)
        if len(op) == 3 and op.get("autoreset") is True:
            return b"%s%d%s" % (DISCRETE_STEP_HEAD, op["action"], DISCRETE_AUTORESET_TAIL)
    if len(payloads) == 1 and op.get("op") == "step":
        # An array action (Box...), the commonest request of continuous control: its line is one of
        # a few, by dtype, shape and autoreset, each encoded once.
        action = op.get("action")
        ref = action.get(ND) if type(action) is dict and len(action) == 1 else None
        autoreset = len(op) == 3 and op.get("autoreset") is True
        if type(ref) is list and len(ref) == 3 and ref[0] == 0 and (len(op) == 2 or autoreset):
            try:
                return array_step_line(ref[1], tuple(ref[2]), len(payloads[0]), autoreset)
            except TypeError:  # an unhashable dtype or shape: not one of ours; encoded as it is
                pass
        line = _steady_sandbox_line(op, len(payloads[0])) if SANDBOX_ACTIONS in op else None
        if line is not None:
            return line
    return _encode_line(op, [len(p) for p in payloads])


@functools.lru_cache(maxsize=64)
def array_step_line(dtype: str, shape: tuple, nbytes: int, autoreset: bool) -> bytes:
    """The request line of a step with an array action of ``dtype`` and ``shape`` (its one payload of
    ``nbytes``): what :func:`env_request_line` writes, encoded once per kind.

    >>> array_step_line("<f4", (2,), 8, False)
    b'{"op":"step","action":{"__nd__":[0,"<f4",[2]]},"_bin":[8]}\\n'
    """
    op: dict[str, Any] = {"op": "step", "action": {ND: [0, dtype, list(shape)]}}
    if autoreset:
        op["autoreset"] = True
    op["_bin"] = [nbytes]
    return _encode_json(op).encode() + b"\n"


def _steady_sandbox_line(op: dict, nbytes: int) -> bytes | None:
    """The line of a sandbox's steady step (every slot in order, each stepping with its row of the
    batch of actions, ``nbytes`` of rows): what :func:`env_request_line` writes, from
    :func:`sandbox_step_line`; ``None`` for any other op."""
    slots, ops, actions = op.get(SANDBOX_SLOTS), op.get(SANDBOX_OPS), op.get(SANDBOX_ACTIONS)
    autoreset = op.get(SANDBOX_AUTORESET) is True
    if len(op) != (5 if autoreset else 4) or type(slots) is not list or type(ops) is not list:
        return None
    m = len(slots)
    ref = actions.get(ND) if type(actions) is dict and len(actions) == 1 else None
    if type(ref) is not list or len(ref) != 3 or ref[0] != 0 or type(ref[2]) is not list or ref[2][:1] != [m]:
        return None
    if len(ops) != m or ops.count(None) != m or slots != list(range(m)):
        return None
    try:
        return sandbox_step_line(m, ref[1], tuple(ref[2][1:]), nbytes, autoreset)
    except TypeError:  # an unhashable dtype or shape: not one of ours; encoded as it is
        return None


@functools.lru_cache(maxsize=64)
def sandbox_step_line(m: int, dtype: str, row_shape: tuple, nbytes: int, autoreset: bool) -> bytes:
    """The request line of a step of every slot of a sandbox of ``m`` with its row of a batch of
    actions of ``dtype`` and ``row_shape`` (their one payload of ``nbytes``): the request a steady
    step batch sends every step, encoded once per kind (:func:`array_step_line`'s twin for a
    sandbox of several envs).

    >>> sandbox_step_line(2, "<f4", (1,), 8, False)
    b'{"op":"step","slots":[0,1],"ops":[null,null],"actions":{"__nd__":[0,"<f4",[2,1]]},"_bin":[8]}\\n'
    """
    op: dict[str, Any] = {
        "op": "step",
        SANDBOX_SLOTS: list(range(m)),
        SANDBOX_OPS: [None] * m,
        SANDBOX_ACTIONS: {ND: [0, dtype, [m, *row_shape]]},
    }
    if autoreset:
        op[SANDBOX_AUTORESET] = True
    return _encode_line(op, [nbytes])


def env_request(op: dict, payloads: Sequence[bytes] = ()) -> bytes:
    """The bytes that carry ``op`` to an env: its request line, then its payloads.

    >>> env_request({"op": "step", "action": 1})
    b'{"op":"step","action":1}\\n'
    """
    line = env_request_line(op, payloads)
    return b"".join([line, *payloads]) if payloads else line


def parse_discrete_step(data: bytes) -> tuple[int, bool] | None:
    """``(action, autoreset)`` of ``data`` when it is exactly one plain Discrete step line as
    :func:`env_request_line` writes it (a non-negative action), else ``None``.

    >>> parse_discrete_step(b'{"op":"step","action":3,"autoreset":true}\\n')
    (3, True)
    >>> parse_discrete_step(b'{"op":"step","action":1}\\n{"op":"close"}\\n') is None
    True
    """
    if len(data) > len(DISCRETE_STEP_HEAD) + 40 or not data.startswith(DISCRETE_STEP_HEAD):
        return None
    autoreset = data.endswith(DISCRETE_AUTORESET_TAIL)
    if not autoreset and not data.endswith(DISCRETE_STEP_TAIL):
        return None
    digits = data[len(DISCRETE_STEP_HEAD) : -len(DISCRETE_AUTORESET_TAIL if autoreset else DISCRETE_STEP_TAIL)]
    return (int(digits), autoreset) if digits.isdigit() else None


def parse_json(data: bytes | memoryview) -> Any:
    """Parse untrusted JSON bytes (ValueError on bad JSON, bad UTF-8 or too deep nesting)."""
    try:
        return _decode_json((data if type(data) is bytes else bytes(data)).decode())
    except RecursionError:
        raise ValueError("JSON nested too deeply to parse") from None


def jsonable(value: Any) -> Any:
    """Turn numpy scalars and arrays (and tuples) into plain JSON values for JSON-protocol envs."""
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    tolist = getattr(value, "tolist", None)
    if tolist is not None:
        return tolist()
    raise TypeError(f"{type(value).__name__} is not JSON-serialisable")
