"""Several envs per sandbox, trainer side: packing envs' ops into sandbox requests, and reading
the sandbox replies back as envs' results.

With ``envs_per_sandbox=K`` one sandboxed process hosts up to K envs of a pool: env ``i``
is slot ``i % K`` of sandbox ``i // K`` (:class:`SandboxLayout`). The worker and the direct
lane then see sandboxes, one request line and one reply per sandbox per batch (the wire is
documented in :mod:`boltzlabs_gym.wire.protocol`, "Sandboxes of several envs"). This module is the
one place that maps between the two views:

* :func:`pack` turns a batch of per-env items ``(index, op, payloads)`` into one item per
  sandbox, with a :class:`SandboxPlan` saying which item and env each position stands for;
* :class:`SandboxResult` is one sandbox's answer: :meth:`SandboxResult.read` validates the
  untrusted sandbox reply once and hands array observations, rewards and flags of its plain
  positions over as arrays (the vector env assembles its batch by slicing them), and every
  other position as that env's own :class:`~boltzlabs_gym.client.results.EnvResult`;
  :meth:`SandboxResult.expand` gives every position as an ``EnvResult``, the shape one-env
  sandboxes answer in, for every other reader.

A sandbox that fails (a missed deadline, a crash) is killed with all its envs: the env that
was running when it failed (the worker reads it from the sandbox's progress file) is reported
with the failure, its neighbours as restarted because of it.

>>> layout = SandboxLayout(n=5, k=2)
>>> layout.sandboxes, [layout.envs(b) for b in range(layout.sandboxes)]
(3, [range(0, 2), range(2, 4), range(4, 5)])
>>> items, plans = pack(layout, [(1, {"op": "step", "action": 0}, ()), (4, {"op": "reset", "seed": 7}, ())])
>>> [(b, op) for b, op, _ in items]
[(0, {'op': 'step', 'slots': [1], 'ops': [0]}), (2, {'op': 'reset', 'slots': [0], 'ops': [{'op': 'reset', 'seed': 7}]})]
>>> plans[0].positions, plans[0].indices
([0], [1])
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from ..wire.codec import ND, encode_info
from ..wire.info_layout import InfoLayout, InfoRows, numeric_rows
from ..wire.protocol import (
    ERROR,
    FLAG_TERMINATED,
    FLAG_TRUNCATED,
    MAX_ENVS_PER_SANDBOX,
    MAX_KNOWN_LINE_BYTES,
    OK,
    SANDBOX_ACTIONS,
    SANDBOX_AUTORESET,
    SANDBOX_DEADLINE,
    SANDBOX_FLAGS,
    SANDBOX_INFO,
    SANDBOX_N,
    SANDBOX_NBIN,
    SANDBOX_OBS,
    SANDBOX_OPS,
    SANDBOX_REPLIES,
    SANDBOX_REWARD,
    SANDBOX_SLOTS,
    sandbox_op_name,
)
from ..wire.slot_layout import array_refs, copy_skeleton, map_array_refs
from .results import EnvResult, parse_result

__all__ = [
    "BadSandboxReply",
    "SandboxPlan",
    "SandboxReply",
    "SandboxResult",
    "SandboxLayout",
    "check_envs_per_sandbox",
    "pack",
    "pack_action_rows",
    "pack_steps",
]

#: The op of a hard reset; it restarts a whole sandbox, so it must name every env of it.
HARD_RESET = "hard_reset"


def check_envs_per_sandbox(value: object) -> int:
    """``value`` as a number of envs per sandbox, or ValueError.

    >>> check_envs_per_sandbox(8)
    8
    """
    if type(value) is not int or not 1 <= value <= MAX_ENVS_PER_SANDBOX:
        raise ValueError(f"envs_per_sandbox must be an int in [1, {MAX_ENVS_PER_SANDBOX}], got {value!r}")
    return value


class SandboxLayout:
    """Which sandbox and slot each of a pool's ``n`` envs has, ``k`` envs per sandbox."""

    __slots__ = ("n", "k", "sandboxes", "steady")

    def __init__(self, n: int, k: int):
        self.n, self.k = n, k
        self.sandboxes = -(-n // k)
        #: The requests and plans of steady step batches, made once per kind (see :func:`pack_action_rows`).
        self.steady: dict[tuple, list] = {}

    def envs(self, sandbox: int) -> range:
        """The pool indices of the envs of ``sandbox``."""
        return range(sandbox * self.k, min(self.n, (sandbox + 1) * self.k))

    def describe(self, sandbox: int) -> str:
        """``"envs 4-7"``: the envs of ``sandbox``, for messages."""
        envs = self.envs(sandbox)
        return f"env {envs[0]}" if len(envs) == 1 else f"envs {envs[0]}-{envs[-1]}"


@dataclass
class SandboxPlan:
    """What one sandbox's request stands for: batch positions and env indices, per position."""

    sandbox: int
    positions: list[int] = field(default_factory=list)
    indices: list[int] = field(default_factory=list)
    op: str = ""
    #: Whether ``indices`` are the sandbox's envs in order, from its first: its rows are one slice.
    whole: bool = False


def _bad_index(index: Any, n: int) -> Exception:
    if type(index) is not int and not isinstance(index, np.integer):
        return TypeError(f"env index must be an int, got {type(index).__name__}")
    return IndexError(f"env index {index} out of range for a pool of {n}")


def _shorthand(op: dict) -> int | None:
    """The int a plain Discrete step op packs into (see the wire), or None."""
    action = op.get("action")
    if (
        type(action) is int
        and op.get("op") == "step"
        and (len(op) == 2 or (len(op) == 3 and op.get(SANDBOX_AUTORESET) is True))
    ):
        return action
    return None


def pack(
    layout: SandboxLayout, items: Sequence[tuple[int, dict, Sequence[bytes]]], mixed_deadline: float | None = None
) -> tuple[list, list[SandboxPlan]]:
    """One item ``(sandbox, sandbox op, payloads)`` per sandbox the per-env ``items`` name, and their plans.

    ``mixed_deadline``: the deadline of a step batch with resets in it (see
    :data:`~boltzlabs_gym.wire.protocol.SANDBOX_DEADLINE`). Raises ``IndexError``/``TypeError`` for an
    index outside the pool, ``ValueError`` for an env named twice, an op that is not an op
    object, or a hard reset that leaves out envs of its sandbox.
    """
    n, k = layout.n, layout.k
    ops_of: dict[int, list] = {}
    plans: dict[int, SandboxPlan] = {}
    seen: set[int] = set()
    for pos, (index, op, payloads) in enumerate(items):
        if type(index) is not int and not isinstance(index, np.integer) or not 0 <= index < n:
            raise _bad_index(index, n)
        if type(op) is not dict or type(op.get("op")) is not str:
            raise ValueError(f"env {index}: op must be an object with an 'op' string, got {str(op)[:80]}")
        sandbox = int(index) // k
        plan = plans.get(sandbox)
        if plan is None:
            plan = plans[sandbox] = SandboxPlan(sandbox)
            ops_of[sandbox] = []
        if index in seen:
            raise ValueError(f"env index {index} appears twice in one batch")
        seen.add(int(index))
        plan.positions.append(pos)
        plan.indices.append(int(index))
        ops_of[sandbox].append((int(index) - sandbox * k, op, payloads))
    out = []
    for sandbox, plan in plans.items():
        request, frames = _sandbox_request(ops_of[sandbox], mixed_deadline)
        plan.op = request["op"]
        if plan.op == HARD_RESET and len(plan.indices) != len(layout.envs(sandbox)):
            raise ValueError(
                f"a hard reset restarts a whole sandbox: hard-reset {layout.describe(sandbox)} together "
                f"(envs_per_sandbox={k}; RLPool.reset(hard=True) widens its mask to whole sandboxes)"
            )
        out.append((sandbox, request, frames))
    return out, list(plans.values())


def pack_steps(
    layout: SandboxLayout,
    actions: list[int],
    resets: np.ndarray,
    autoreset: bool,
    mixed_deadline: float | None = None,
) -> tuple[list, list[SandboxPlan]]:
    """:func:`pack` for a vector env's Discrete step batch, without per-env work in Python: every
    env steps with its int action, but those in ``resets``, which reset (seed ``None``) instead;
    ``autoreset`` marks every step for a reset in the same request (``SAME_STEP``)."""
    return _pack_whole(layout, lambda lo, hi: actions[lo:hi], None, resets, autoreset, mixed_deadline)


def pack_action_rows(
    layout: SandboxLayout,
    actions: np.ndarray,
    resets: np.ndarray,
    autoreset: bool,
    mixed_deadline: float | None = None,
) -> tuple[list, list[SandboxPlan]]:
    """:func:`pack_steps` for a batch of array actions (``actions``: ``(n, ...)``, C-contiguous, a
    numeric dtype): each sandbox's rows go as one payload (``"actions"``), every stepping position
    the op ``None`` (its row), those in ``resets`` a reset (seed ``None``) instead. Each env gets
    its row in the batch's dtype, as SyncVectorEnv hands it a row of the batch."""
    return _pack_whole(layout, lambda lo, hi: [None] * (hi - lo), actions, resets, autoreset, mixed_deadline)


def _pack_whole(
    layout: SandboxLayout,
    step_ops: Any,
    rows: np.ndarray | None,
    resets: np.ndarray,
    autoreset: bool,
    mixed_deadline: float | None,
) -> tuple[list, list[SandboxPlan]]:
    """One request per sandbox for a step of every env: ``step_ops(lo, hi)`` the ops of envs
    ``lo .. hi-1`` (a new list), those in ``resets`` replaced by a reset (seed ``None``); with
    ``rows`` (a batch of array actions), the sandbox's rows as the request's one payload."""
    out = []
    plans = []
    reset_at = np.flatnonzero(resets).tolist() if resets.any() else []
    if rows is not None and not reset_at:
        return _steady_action_rows(layout, rows, autoreset)
    cursor = 0
    for sandbox in range(layout.sandboxes):
        envs = layout.envs(sandbox)
        lo, hi = envs.start, envs.stop
        ops: list = step_ops(lo, hi)
        resetting = 0
        while cursor < len(reset_at) and reset_at[cursor] < hi:
            ops[reset_at[cursor] - lo] = {"op": "reset", "seed": None}
            resetting += 1
            cursor += 1
        # No env of the sandbox steps: the reset deadline holds (and no actions go).
        name = "reset" if resetting == hi - lo else "step"
        request: dict = {"op": name, SANDBOX_SLOTS: _slots(hi - lo), SANDBOX_OPS: ops}
        frames: Sequence[bytes] = ()
        if rows is not None and name == "step":
            request[SANDBOX_ACTIONS] = {ND: [0, rows.dtype.str, [hi - lo, *rows.shape[1:]]]}
            frames = [rows[lo:hi].tobytes()]  # a copy: the caller may change its array once step_async returns
        if autoreset:
            request[SANDBOX_AUTORESET] = True
        if resetting and name == "step" and mixed_deadline is not None:
            request[SANDBOX_DEADLINE] = mixed_deadline
        out.append((sandbox, request, frames))
        plans.append(SandboxPlan(sandbox, list(envs), list(envs), name, whole=True))
    return out, plans


def _steady_action_rows(layout: SandboxLayout, rows: np.ndarray, autoreset: bool) -> tuple[list, list[SandboxPlan]]:
    """:func:`_pack_whole` of a batch of array actions with no reset in it, the commonest batch of
    continuous control: every sandbox's request is the same each step but for its payload's
    bytes (its line is encoded once: :func:`~boltzlabs_gym.wire.protocol.sandbox_step_line`), so the
    request and the plan are made once per kind of batch and reused (both are only ever read)."""
    key = (rows.dtype.str, rows.shape, autoreset)
    steady = layout.steady.get(key)
    if steady is None:
        steady = []
        for sandbox in range(layout.sandboxes):
            envs = layout.envs(sandbox)
            m = len(envs)
            request: dict = {"op": "step", SANDBOX_SLOTS: _slots(m), SANDBOX_OPS: [None] * m}
            request[SANDBOX_ACTIONS] = {ND: [0, rows.dtype.str, [m, *rows.shape[1:]]]}
            if autoreset:
                request[SANDBOX_AUTORESET] = True
            plan = SandboxPlan(sandbox, list(envs), list(envs), "step", whole=True)
            steady.append((sandbox, envs.start, envs.stop, request, plan))
        if len(layout.steady) >= 8:
            layout.steady.clear()
        layout.steady[key] = steady
    # Each sandbox's rows are a copy: the caller may change its array once step_async returns.
    out = [(sandbox, request, [rows[lo:hi].tobytes()]) for sandbox, lo, hi, request, _ in steady]
    return out, [plan for *_, plan in steady]


_SLOTS: dict[int, list[int]] = {}


def _slots(m: int) -> list[int]:
    """``[0, ..., m - 1]``, one shared list per size (only ever read: it is encoded, never changed)."""
    slots = _SLOTS.get(m)
    if slots is None:
        slots = _SLOTS[m] = list(range(m))
    return slots


def _sandbox_request(
    slot_ops: list[tuple[int, dict, Sequence[bytes]]], mixed_deadline: float | None = None
) -> tuple[dict, list]:
    """The sandbox op for ``(slot, op, payloads)`` triples, and its payload frames in order."""
    slots: list[int] = []
    ops: list = []
    counts: list[int] = []
    frames: list = []
    autoreset: bool | None = None
    hard = False
    for slot, op, payloads in slot_ops:
        slots.append(slot)
        counts.append(len(payloads))
        frames.extend(payloads)
        if op.get("op") == HARD_RESET:
            hard = True
            op = {k: v for k, v in op.items() if k != "op"} | {"op": "reset"}
        action = _shorthand(op) if not payloads else None
        if action is not None:
            flavour = len(op) == 3
            if autoreset is None:
                autoreset = flavour
            if flavour == autoreset:
                ops.append(action)
                continue
        ops.append(op)
    request: dict = {"op": HARD_RESET if hard else sandbox_op_name(ops), SANDBOX_SLOTS: slots, SANDBOX_OPS: ops}
    if autoreset:
        request[SANDBOX_AUTORESET] = True
    if (
        request["op"] == "step"
        and mixed_deadline is not None
        and any(type(op) is dict and op.get("op") == "reset" for op in ops)
    ):
        request[SANDBOX_DEADLINE] = mixed_deadline
    if frames:
        request[SANDBOX_NBIN] = counts
    return request, frames


# ----------------------------------------------------------------------------------- replies


class SandboxReply:
    """One sandbox reply, validated: plain positions as arrays, the others as env results."""

    __slots__ = ("plain", "leaves", "skeleton", "reward", "flags", "others", "info", "all_plain")

    def __init__(
        self,
        plain: np.ndarray,
        leaves: list[np.ndarray] | None,
        skeleton: Any,
        reward: np.ndarray | None,
        flags: np.ndarray | None,
        others: dict,
        info: InfoRows | None = None,
        all_plain: bool | None = None,
    ):
        #: Positions answered plainly (bool per position).
        self.plain = plain
        #: Each array of the observations as ``(P, *shape)`` rows (rows of other positions are
        #: meaningless), in payload order: one for an array space, several for a Dict/Tuple; or None.
        self.leaves = leaves
        #: One observation's skeleton (``{"__nd__": [k, dtype, shape]}`` leaves; see
        #: :func:`~boltzlabs_gym.wire.slot_layout.array_skeleton`), with the leaves. Read it, never
        #: change it: a line read before shares it with every reply of that line (see expand()).
        self.skeleton = skeleton
        self.reward = reward
        self.flags = flags
        #: position -> that env's :class:`EnvResult` (parsed), for every position not plain.
        self.others = others
        #: The plain positions' infos as typed columns (:mod:`~boltzlabs_gym.wire.info_layout`), or None.
        self.info = info
        #: Whether every position was answered plainly (worked out when not told).
        self.all_plain = all_plain if all_plain is not None else not others and bool(plain.all())

    @property
    def obs(self) -> np.ndarray | None:
        """An array space's ``(P, *shape)`` observations (None for a Dict/Tuple's, or none)."""
        if self.leaves is None or not (isinstance(self.skeleton, dict) and ND in self.skeleton):
            return None
        return self.leaves[0]


class BadSandboxReply(ValueError):
    """A sandbox reply that does not follow the wire; every env of it gets a ``bad_reply``."""


@dataclass
class SandboxResult:
    """One sandbox's answer to its part of a batch (see :func:`pack`)."""

    plan: SandboxPlan
    result: EnvResult
    #: The sandbox's envs (:meth:`SandboxLayout.envs`: from the pool's layout, never from the reply);
    #: the progress file's slot counts from the first.
    envs: range
    #: For a failed sandbox, once read: its envs that were not in the request, and why they restarted.
    restarted: dict[int, str] | None = None
    _read: SandboxReply | list[EnvResult] | None = None

    def read(self, row_skeleton: Any = None, arrays: bool = True) -> SandboxReply | list[EnvResult]:
        """The reply, validated (read once, then kept): its observations' rows must make
        ``row_skeleton`` when given (one observation's, as
        :func:`~boltzlabs_gym.wire.slot_layout.array_skeleton` or an
        :class:`~boltzlabs_gym.wire.codec.ArrayLeaf`'s ``skeleton`` gives it; else what the reply
        declares), and there must be none unless ``arrays`` (a reader whose space has no array
        form); a list of per-env results instead when the sandbox failed or its reply breaks the
        wire."""
        if self._read is None:
            self._read = self._read_now(row_skeleton, arrays)
        return self._read

    def _read_now(self, row_skeleton: Any, arrays: bool) -> SandboxReply | list[EnvResult]:
        r, npos = self.result, len(self.plan.indices)
        line = r.raw if r.status == OK and r.reply is None else None
        known = _KNOWN_LINES.get(line, npos) if arrays else None
        try:
            if known is not None:  # the same bytes as a line read before: no JSON to parse
                return _read_known_line(known, r.payloads, row_skeleton, npos)
            parse_result(r)
            reply = r.reply if isinstance(r.reply, dict) else {}
            if r.status == OK:
                if not arrays and reply.get(SANDBOX_OBS) is not None:
                    raise BadSandboxReply("array observations for a space that has no array form")
                return _read_sandbox(reply, r.payloads, row_skeleton, self.plan.indices, line)
        except (BadSandboxReply, ValueError, TypeError, OverflowError) as exc:  # all of it untrusted
            return self._bad(str(exc)[:500])
        if reply.get("bad_reply"):
            return self._bad(str(reply.get("message")))
        return self._failed(reply)

    def failures(self) -> list[EnvResult]:
        """The envs of this sandbox that failed as the worker reports failures (straggler or error
        status); none when the sandbox answered."""
        if self.result.status == OK:
            return []
        read = self.read()
        return [r for r in read if r.status != OK] if isinstance(read, list) else []

    def expand(self) -> list[EnvResult]:
        """Every position as the :class:`EnvResult` a one-env sandbox would have answered with."""
        read = self.read()
        if isinstance(read, list):
            return read
        skeleton = copy_skeleton(read.skeleton) if read.skeleton is not None else None
        out: list[EnvResult] = []
        for p, index in enumerate(self.plan.indices):
            other = read.others.get(p)
            if other is not None:
                out.append(other)
                continue
            assert read.reward is not None and read.flags is not None and read.leaves is not None
            flags = int(read.flags[p])
            payloads = [np.ascontiguousarray(rows[p]).tobytes() for rows in read.leaves]
            reply: dict[str, Any] = {
                "obs": skeleton,
                "reward": float(read.reward[p]),
                "terminated": bool(flags & FLAG_TERMINATED),
                "truncated": bool(flags & FLAG_TRUNCATED),
                "info": encode_info(read.info.info_of(p), payloads)[0] if read.info is not None else {},
            }
            out.append(EnvResult(index, OK, reply, payloads))
        return out

    def _failed(self, detail: dict) -> list[EnvResult]:
        """A killed sandbox: the env that was running gets the failure; its neighbours are restarted with it."""
        status = self.result.status
        reason = str(detail.get("message", "the sandbox failed"))
        envs = self.envs
        slot = detail.get("slot")
        culprit = envs[slot] if type(slot) is int and 0 <= slot < len(envs) else None
        if culprit is not None:
            others = f"sandbox restarted because env {culprit} failed: {reason}"
        else:
            others = (
                f"{reason} (its sandbox, shared with envs {envs[0]}-{envs[-1]}, was restarted; "
                "which env was running is not known)"
            )
        out = []
        for index in self.plan.indices:
            if index == culprit:
                out.append(EnvResult(index, status, dict(detail), []))
            elif culprit is None:
                out.append(EnvResult(index, status, dict(detail, message=others), []))
            else:
                out.append(EnvResult(index, ERROR, dict(detail, message=others, straggler=False), []))
        self.restarted = {i: others for i in envs if i not in self.plan.indices}
        return out

    def _bad(self, why: str) -> list[EnvResult]:
        message = f"sandbox of envs {self.plan.indices} sent a bad sandbox reply: {why}"
        return [EnvResult(i, ERROR, {"message": message, "bad_reply": True}, []) for i in self.plan.indices]


def _nd(ref: int, dtype: str, shape: list) -> dict:
    return {ND: [ref, dtype, shape]}


def _declared_rows(obs: Any, npos: int) -> tuple[list[tuple[np.dtype, tuple]], Any]:
    """The arrays a sandbox reply's ``obs`` declares (each one's dtype and row shape, in payload
    order) and one observation's skeleton (each leaf's shape without its ``npos`` rows, its
    dtype canonical), checked: a skeleton of arrays only
    (:func:`~boltzlabs_gym.wire.slot_layout.array_refs`) whose leaves are
    ``{"__nd__": [k, dtype, [npos, ...]]}`` of a numeric dtype, ``k`` counting from 0."""
    refs = array_refs(obs)
    if refs is None:
        raise BadSandboxReply(f"its observations {str(obs)[:120]} are not a skeleton of numeric arrays of {npos} rows")
    leaves = [_declared_array(ref, k, npos) for k, ref in enumerate(refs)]

    def row(ref: list) -> dict:
        dtype, shape = leaves[ref[0]]
        return {ND: [ref[0], dtype.str, list(shape)]}

    return leaves, map_array_refs(obs, row)


def _declared_array(ref: Any, k: int, npos: int) -> tuple[np.dtype, tuple]:
    """The dtype and row shape of the ``k``-th leaf's reference, ``[k, dtype, [npos, ...]]``, checked."""
    rows = numeric_rows(ref, npos)
    if rows is None or rows[0] != k:
        raise BadSandboxReply(f"its observations' array {k}, {str(ref)[:80]}, is not a numeric array of {npos} rows")
    return rows[1], rows[2]


class _Layout(NamedTuple):
    """What a sandbox reply's line says of its arrays, checked: each array's dtype and row shape
    (in payload order), one observation's skeleton, and the byte sizes of the arrays' payloads
    with the rewards' and flags' after them."""

    declared: list[tuple[np.dtype, tuple]]
    skeleton: Any
    sizes: list[int]
    #: The plain positions' info columns, when the reply has them.
    info: InfoLayout | None = None


class _KnownLines:
    """The layouts of plain sandbox reply lines already read, by line and positions: a sandbox
    answers every all-plain step with the same line (its numbers are all in its payloads), so
    its JSON is parsed and checked once instead of once a step. Bounded: a sandbox that sends
    ever new lines only makes it start over, and a line longer than
    :data:`~boltzlabs_gym.wire.protocol.MAX_KNOWN_LINE_BYTES` is never kept."""

    LIMIT = 256

    def __init__(self) -> None:
        self._layouts: dict[tuple[bytes, int], _Layout] = {}

    def get(self, line: bytes | None, npos: int) -> _Layout | None:
        return self._layouts.get((line, npos)) if line is not None else None

    def remember(self, line: bytes, npos: int, layout: _Layout) -> None:
        if len(self._layouts) >= self.LIMIT:
            self._layouts.clear()
        self._layouts[(line, npos)] = layout


_KNOWN_LINES = _KnownLines()


def _read_sandbox(
    reply: dict, payloads: list, row_skeleton: Any, indices: list[int], line: bytes | None = None
) -> SandboxReply:
    """Validate a parsed sandbox reply for the envs ``indices`` (it comes from untrusted code); an
    all-plain one's layout is remembered under its ``line`` when given (:class:`_KnownLines`)."""
    npos = len(indices)
    if "error" in reply and SANDBOX_N not in reply:
        # The sandbox refused the whole request: every env of it refused its op.
        refused = {p: EnvResult(i, OK, {"error": reply["error"]}, []) for p, i in enumerate(indices)}
        return SandboxReply(np.zeros(npos, dtype=bool), None, None, None, None, refused)
    if reply.get(SANDBOX_N) != npos:
        raise BadSandboxReply(
            f"it answers {reply.get(SANDBOX_N)!r} positions for {npos} ops (is env.py serving several envs? "
            "envs_per_sandbox > 1 needs serve(factory=...) or a Gymnasium env)"
        )
    lengths = [len(p) for p in payloads]
    cursor = 0
    layout = None
    if reply.get(SANDBOX_OBS) is not None:
        layout = _arrays_layout(reply, npos, row_skeleton)
        cursor = len(layout.sizes)
    elif reply.get(SANDBOX_REWARD) is not None or reply.get(SANDBOX_FLAGS) is not None:
        raise BadSandboxReply("reward or flags without observations")
    replies = reply.get(SANDBOX_REPLIES) or {}
    if not isinstance(replies, dict):
        raise BadSandboxReply("'replies' is not an object")
    others: dict[int, EnvResult] = {}
    plain = np.ones(npos, dtype=bool)
    for p in sorted(_position_key(key, npos) for key in replies):
        one = replies[str(p)]
        if not isinstance(one, dict):
            raise BadSandboxReply(f"reply of position {p} is a {type(one).__name__}, not an object")
        sizes = one.get("_bin") or []
        if not isinstance(sizes, list) or lengths[cursor : cursor + len(sizes)] != sizes:
            raise BadSandboxReply(f"reply of position {p} announces payloads {str(sizes)[:80]} that do not follow")
        others[p] = EnvResult(indices[p], OK, one, payloads[cursor : cursor + len(sizes)])
        cursor += len(sizes)
        plain[p] = False
    if cursor != len(payloads):
        raise BadSandboxReply(f"{len(payloads) - cursor} payloads follow that no position claims")
    if layout is None:
        if plain.any():
            raise BadSandboxReply("positions without a reply and no arrays to read them from")
        return SandboxReply(plain, None, None, None, None, others)
    read = _with_arrays(layout, payloads, npos, plain, others)
    if line is not None and not replies and len(line) <= MAX_KNOWN_LINE_BYTES:
        _KNOWN_LINES.remember(line, npos, layout._replace(skeleton=copy_skeleton(layout.skeleton)))
    return read


def _arrays_layout(reply: dict, npos: int, row_skeleton: Any) -> _Layout:
    """The layout of a sandbox reply's arrays, checked: the observations' skeleton (as
    :func:`_declared_rows` checks it; ``row_skeleton``'s when given), then the rewards and
    flags after them."""
    declared, skeleton = _declared_rows(reply[SANDBOX_OBS], npos)
    _check_rows_of(skeleton, row_skeleton)
    count = len(declared)
    expected = (_nd(count, "<f8", [npos]), _nd(count + 1, "|u1", [npos]))
    got = (reply.get(SANDBOX_REWARD), reply.get(SANDBOX_FLAGS))
    if got != expected:
        raise BadSandboxReply(f"its reward and flags {str(got)[:200]} are not {expected}")
    # Python ints: no wrap-around
    sizes = [npos * dtype.itemsize * math.prod(shape) for dtype, shape in declared] + [8 * npos, npos]
    member = reply.get(SANDBOX_INFO)
    info = InfoLayout.read(member, npos, count + 2) if member is not None else None
    return _Layout(declared, skeleton, sizes + info.sizes if info is not None else sizes, info)


def _check_rows_of(skeleton: Any, row_skeleton: Any) -> None:
    """The reply's observations' skeleton must be the reader's (``row_skeleton``), when it gives one."""
    if row_skeleton is not None and skeleton != row_skeleton:
        raise BadSandboxReply(f"its observations are {str(skeleton)[:200]}, not {str(row_skeleton)[:200]}")


def _with_arrays(layout: _Layout, payloads: list, npos: int, plain: np.ndarray, others: dict) -> SandboxReply:
    """The sandbox reply whose arrays are the first payloads, as ``layout`` declares them (checked
    against their sizes); ``plain`` and ``others`` for the positions."""
    sizes = layout.sizes
    count = len(layout.declared)
    lengths = [len(p) for p in payloads[: len(sizes)]]
    if lengths != sizes:
        raise BadSandboxReply(f"its array payloads have {lengths} bytes, not {sizes}")
    leaves = [
        np.frombuffer(payload, dtype=dtype).reshape(npos, *shape)
        for payload, (dtype, shape) in zip(payloads, layout.declared)
    ]
    reward = np.frombuffer(payloads[count], dtype=_F8)
    flags = np.frombuffer(payloads[count + 1], dtype=np.uint8)
    info = layout.info.rows(payloads[count + 2 : len(sizes)]) if layout.info is not None else None
    all_plain = plain is _ALL_PLAIN.get(npos)
    return SandboxReply(plain, leaves, layout.skeleton, reward, flags, others, info, all_plain)


_F8 = np.dtype("<f8")


def _read_known_line(layout: _Layout, payloads: list, row_skeleton: Any, npos: int) -> SandboxReply:
    """A sandbox reply whose line was read before (:class:`_KnownLines`): all positions plain,
    its arrays as ``layout`` says, its payloads those arrays' and nothing more."""
    if row_skeleton is not None and layout.skeleton is not row_skeleton:
        _check_rows_of(layout.skeleton, row_skeleton)
    if len(payloads) != len(layout.sizes):
        raise BadSandboxReply(f"{len(payloads) - len(layout.sizes)} payloads follow that no position claims")
    return _with_arrays(layout, payloads, npos, _all_plain(npos), {})


def _all_plain(npos: int) -> np.ndarray:
    """``np.ones(npos, dtype=bool)``, one read-only array per size (only ever read)."""
    plain = _ALL_PLAIN.get(npos)
    if plain is None:
        plain = _ALL_PLAIN[npos] = np.ones(npos, dtype=bool)
        plain.flags.writeable = False
    return plain


_ALL_PLAIN: dict[int, np.ndarray] = {}


def _position_key(key: str, npos: int) -> int:
    """A ``replies`` key as a position; only the canonical spelling ``str(p)`` of ``0 <= p < npos``."""
    if not (isinstance(key, str) and key.isascii() and key.isdigit() and str(int(key)) == key and int(key) < npos):
        raise BadSandboxReply(f"reply position {str(key)[:20]!r} is not a position of the {npos} ops")
    return int(key)
