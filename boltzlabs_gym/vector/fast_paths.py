"""The step batch's fast paths: replies read straight into the batch's buffers, without the
general decoder, where their shape is known. Each takes only the replies it can prove plain and
leaves every other to the general path (:meth:`StepBatch.take_step
<boltzlabs_gym.vector.step_batch.StepBatch.take_step>`), which says what happened.

* :class:`PlainSteps`: an array observation; a plain step's reply line is parsed without JSON
  and its one payload copied into the env's row; an info of numbers (typed columns, a line end
  read once) is gathered and added to the batch's infos column by column at the end.
* :class:`ArraysSteps`: a Dict/Tuple of arrays only; each payload copied into its array's row.
* :class:`SandboxRows`: several envs per sandbox; a sandbox's rows go into the batch as whole
  blocks of observations, rewards and flags, by slicing, and its info columns into Gymnasium's
  batched infos column by column (:func:`add_info_rows`).

Each holds the batch's own buffers (which are written in place and never replaced), so that a
reply costs no lookup through the batch.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import gymnasium as gym
import numpy as np

from ..client.pool import OK
from ..client.results import EnvResult
from ..client.sandbox_replies import SandboxReply, SandboxResult
from ..wire import codec, slot_layout
from ..wire.info_layout import InfoLayout, InfoRows
from ..wire.protocol import FLAG_TERMINATED, FLAG_TRUNCATED

__all__ = ["ArraysSteps", "SandboxRows", "PlainSteps", "add_info_rows"]


class PlainSteps:
    """Plain steps of an array observation space, each reply line parsed without JSON."""

    #: The most line ends of infos as typed columns kept (:meth:`info_layout`).
    KNOWN_ENDS = 64

    def __init__(self, leaf: codec.ArrayLeaf, observations: np.ndarray, rewards, terminations, truncations):
        self.leaf = leaf
        self.observations = observations
        self.rewards, self.terminations, self.truncations = rewards, terminations, truncations
        #: Line ends of infos as typed columns read before, and the layout each declares.
        self._known_ends: dict[bytes, InfoLayout] = {}
        #: This batch's infos as typed columns, not yet in its infos: ``(env, layout, payloads)``.
        self.pending_infos: list[tuple[int, InfoLayout, list]] = []

    def take(self, r: EnvResult, same_step: bool) -> bool:
        """Store a plain step's transition (array obs, an empty info or one of typed columns, no
        autoreset) without parsing JSON; False, storing nothing, for any other reply."""
        if r.raw is None:
            return False  # read already (an observation from a shared region, copied out): the general path
        leaf = self.leaf
        parsed = leaf.parse_step_line(r.raw)
        if parsed is None:
            return self.take_with_info(r, same_step)
        if len(r.payloads) != 1 or len(r.payloads[0]) != leaf.nbytes:
            return False
        reward, terminated, truncated = parsed
        if same_step and (terminated or truncated):
            return False  # the env should have reset itself: the general path says what happened
        i = r.index
        self.observations[i] = np.frombuffer(r.payloads[0], dtype=leaf.dtype).reshape(leaf.shape)
        self.rewards[i], self.terminations[i], self.truncations[i] = reward, terminated, truncated
        return True

    def take_with_info(self, r: EnvResult, same_step: bool) -> bool:
        """:meth:`take` of a plain step whose info is typed columns: the transition stored, its info
        kept for :meth:`add_pending_infos`."""
        leaf = self.leaf
        parsed = leaf.parse_info_step_line(r.raw) if r.raw is not None else None
        if parsed is None:
            return False
        reward, terminated, truncated, end = parsed
        layout = self.info_layout(end)
        payloads = r.payloads
        if layout is None or len(payloads) != 1 + len(layout.sizes) or len(payloads[0]) != leaf.nbytes:
            return False
        if [len(p) for p in payloads[1:]] != layout.sizes:
            return False
        if same_step and (terminated or truncated):
            return False  # the env should have reset itself: the general path says what happened
        i = r.index
        self.observations[i] = np.frombuffer(payloads[0], dtype=leaf.dtype).reshape(leaf.shape)
        self.rewards[i], self.terminations[i], self.truncations[i] = reward, terminated, truncated
        self.pending_infos.append((i, layout, payloads[1:]))
        return True

    def info_layout(self, end: bytes) -> InfoLayout | None:
        """The layout a step line's end declares (``,"info":{"__cols__":...},"_bin":[...]}``), read
        and checked the first time it is seen; ``None`` if it is not one (the general path then)."""
        layout = self._known_ends.get(end)
        if layout is not None:
            return layout
        try:
            tail = json.loads(b"{" + end[1:])
            cols = tail["info"][codec.COLS]
            layout = InfoLayout.read(cols, 1, 1)
            if set(tail) != {"info", "_bin"} or len(tail["info"]) != 1:
                return None
            if tail["_bin"] != [self.leaf.nbytes, *layout.sizes]:
                return None
        except (ValueError, TypeError, KeyError, IndexError):
            return None
        if len(self._known_ends) >= self.KNOWN_ENDS:
            self._known_ends.clear()
        self._known_ends[end] = layout
        return layout

    def add_pending_infos(self, infos: dict, n: int) -> dict:
        """Add the infos :meth:`take_with_info` kept to ``infos``, a column at a time for each layout."""
        pending, self.pending_infos = self.pending_infos, []
        by_layout: dict[int, list] = {}  # by identity: the layouts of one line end are one object
        for item in pending:
            by_layout.setdefault(id(item[1]), []).append(item)
        for items in by_layout.values():
            layout = items[0][1]
            envs = np.array([i for i, _, _ in items])
            parts = list(zip(*(payloads for _, _, payloads in items)))
            rows = layout.rows([b"".join(column) for column in parts], len(items))
            infos = add_info_rows(infos, rows, envs, slice(None), n)
        return infos


class ArraysSteps:
    """Plain steps of a Dict/Tuple of arrays only, the same for every env: its skeleton on the
    wire (:func:`~boltzlabs_gym.wire.slot_layout.array_skeleton`), and the batch's arrays in the
    order of its payloads, whose rows are written in place as replies are read."""

    def __init__(self, skeleton: Any, leaves: list[np.ndarray], rewards, terminations, truncations):
        #: The skeleton a plain step's reply has (then its payloads are the arrays, in order).
        self.skeleton = skeleton
        #: The batch's arrays, and each one's (dtype, row shape, row bytes), in payload order.
        self.leaves = leaves
        self.rows = [(leaf.dtype, leaf.shape[1:], leaf[0].nbytes) for leaf in leaves]
        self.rewards, self.terminations, self.truncations = rewards, terminations, truncations

    @classmethod
    def of(
        cls, space: gym.Space, observations: Any, obs_spaces: list, gym_host: bool, rewards, terminations, truncations
    ) -> ArraysSteps | None:
        """The fast path for a batch of ``observations`` of ``space``, when it is a Dict/Tuple of
        arrays only and every env has the same space; else None."""
        skeleton = slot_layout.array_skeleton(space) if gym_host else None
        if skeleton is None or any(other is not obs_spaces[0] for other in obs_spaces):
            return None
        leaves: list = []
        slot_layout.array_leaves(space, observations, leaves)
        return cls(skeleton, leaves, rewards, terminations, truncations)

    def take(self, r: EnvResult, same_step: bool) -> bool:
        """Store a plain step of a Dict/Tuple of arrays (its reply exactly the skeleton, an empty
        info, a float reward, bool flags; its payloads the arrays' bytes) by copying each payload
        into its batch row, without the general decoder; False, storing nothing, otherwise."""
        reply, payloads, leaves = r.reply, r.payloads, self.leaves
        if r.status != OK or type(reply) is not dict or len(reply) != 5:
            return False
        reward, terminated, truncated = reply.get("reward"), reply.get("terminated"), reply.get("truncated")
        if type(reward) is not float or type(terminated) is not bool or type(truncated) is not bool:
            return False
        if reply.get("info") != {} or reply.get("obs") != self.skeleton or len(payloads) != len(leaves):
            return False
        if same_step and (terminated or truncated):
            return False  # the env should have reset itself: the general path says what happened
        rows = self.rows
        for payload, (_, _, nbytes) in zip(payloads, rows):
            if codec.payload_len(payload) != nbytes:
                return False
        i = r.index
        for batch, payload, (dtype, shape, _) in zip(leaves, payloads, rows):
            batch[i] = np.frombuffer(payload, dtype=dtype).reshape(shape)
        self.rewards[i], self.terminations[i], self.truncations[i] = reward, terminated, truncated
        return True


def add_info_rows(infos: dict, info: InfoRows, rows: Any, positions: Any, n: int) -> dict:
    """Gymnasium's batched infos (``VectorEnv._add_info``: ``infos[key]`` an array of ``n`` rows,
    ``infos["_key"]`` which envs have it) with the info columns of a sandbox reply's ``positions``
    (a slice or indices) added as the envs ``rows``, one column at a time.

    The same arrays ``_add_info`` builds env by env: a key's array has its value's type (a Python
    int's is int64, as ``np.zeros(n, dtype=int)``; an array value's rows its shape), and a value
    of another type is cast into an array that exists already."""
    has = info.has[positions]
    every = has.all(axis=0).tolist()  # the usual case: every position has the key
    some = has.any(axis=0).tolist()
    for c, key in enumerate(info.layout.keys):
        if every[c]:
            values, targets = info.cols[c][positions], rows
        elif some[c]:
            present = has[:, c]
            envs = np.arange(n)[rows] if isinstance(rows, slice) else np.asarray(rows)
            values, targets = info.cols[c][positions][present], envs[present]
        else:
            continue
        array = infos.get(key)
        if array is None:
            array = np.zeros((n, *values.shape[1:]), dtype=values.dtype.newbyteorder("="))
        array[targets] = values
        mask = infos.get(f"_{key}")
        if mask is None:
            mask = np.zeros(n, dtype=np.bool_)
        mask[targets] = True
        infos[key], infos[f"_{key}"] = array, mask
    return infos


#: The general path for one env's result of a step batch: ``(r, reset_op, same_step, failed, infos, limits)``.
TakeStep = Callable[[EnvResult, bool, bool, np.ndarray, dict, tuple], dict]
#: The general path for one env's reset result: ``(r, infos, reset_timeout)``.
TakeReset = Callable[[EnvResult, dict, float], dict]


class SandboxRows:
    """A sandbox of several envs' replies, read by whole blocks of rows into the batch.

    ``observations`` is the batch's array for an array space, else None; ``leaves`` the batch's
    arrays for a Dict/Tuple of arrays only, else None. ``row_skeleton`` is one observation's
    skeleton in a sandbox reply's rows (None when the space has no rows)."""

    def __init__(
        self,
        row_skeleton: Any,
        observations: np.ndarray | None,
        leaves: list | None,
        rewards,
        terminations,
        truncations,
    ):
        self.row_skeleton = row_skeleton
        self.observations = observations
        self.leaves = leaves
        #: Whether rows are written into the batch as they are read (else each env's observation
        #: is decoded against its own space).
        self.batch_rows = observations is not None or leaves is not None
        self.rewards, self.terminations, self.truncations = rewards, terminations, truncations
        #: The info columns of whole, plain sandboxes of this batch not yet in its infos, in the
        #: order they were read: ``(first env, InfoRows)`` (see :meth:`add_pending_info`).
        self.pending_info: list[tuple[int, InfoRows]] = []
        #: Each info layout's columns' native dtypes, by the layout's identity (a known line's
        #: layout is one object for as long as the line is known).
        self._native_dtypes: dict[int, tuple[InfoLayout, tuple]] = {}

    def read(self, sandbox: SandboxResult):
        """A sandbox's reply, read against the observation space (see :meth:`SandboxResult.read`)."""
        skeleton = self.row_skeleton
        # Without arrays in the space (a Dict with a Discrete in it, an env dir's JSON values) rows
        # are a wire violation: nothing would check them against the space.
        return sandbox.read(skeleton) if skeleton is not None else sandbox.read(arrays=False)

    def one_by_one(self, sandbox: SandboxResult, read: SandboxReply | list[EnvResult]) -> list[EnvResult] | None:
        """A sandbox's results env by env when its rows cannot go into the batch as blocks: it
        failed or broke the wire (``read`` is a list), or its rows are of a space kept per env
        (a Dict whose envs' spaces differ); ``None`` otherwise."""
        if isinstance(read, list):
            return read
        if read.leaves is not None and not self.batch_rows:
            return sandbox.expand()
        return None

    def set_rows(self, leaves: list[np.ndarray], rows: Any, positions: Any) -> None:
        """Copy a sandbox reply's ``positions`` (its arrays' rows, as read) into the batch's ``rows``."""
        if self.observations is not None:
            self.observations[rows] = leaves[0][positions]
            return
        for batch, leaf in zip(self.leaves or (), leaves):
            batch[rows] = leaf[positions]

    def take_reset(self, sandbox: SandboxResult, infos: dict, reset_timeout: float, take_reset: TakeReset) -> dict:
        """Store a sandbox's resets: its plain positions' observations as one block, the rest one by
        one (``take_reset``)."""
        read = self.read(sandbox)
        one_by_one = self.one_by_one(sandbox, read)
        if one_by_one is not None:
            for r in one_by_one:
                infos = take_reset(r, infos, reset_timeout)
            return infos
        if read.leaves is not None:
            positions = np.flatnonzero(read.plain)
            rows = np.asarray(sandbox.plan.indices)[positions]
            self.set_rows(read.leaves, rows, positions)
            if read.info is not None:
                infos = add_info_rows(infos, read.info, rows, positions, len(self.rewards))
        for r in read.others.values():
            infos = take_reset(r, infos, reset_timeout)
        return infos

    def take_steady(self, sandbox: SandboxResult, same_step: bool) -> bool:
        """Store the commonest sandbox reply of a step batch with no reset in it: every env of the
        sandbox stepped and answered plainly, and (in SAME_STEP mode) none ended. Its rows go into
        the batch as whole blocks; its info columns wait in :attr:`pending_info`. False, storing
        nothing, for any other reply."""
        plan = sandbox.plan
        if not (plan.whole and self.batch_rows):
            return False
        read = self.read(sandbox)
        if type(read) is not SandboxReply or not read.all_plain or read.leaves is None:
            return False
        flags = read.flags
        assert flags is not None
        if same_step and flags.any():
            return False  # an episode ended without the env resetting itself: take_step says what happened
        first = plan.indices[0]
        rows = slice(first, first + len(plan.indices))
        if self.observations is not None:
            self.observations[rows] = read.leaves[0]
        else:
            for batch, leaf in zip(self.leaves or (), read.leaves):
                batch[rows] = leaf
        self.rewards[rows] = read.reward
        self.terminations[rows] = flags & FLAG_TERMINATED
        self.truncations[rows] = flags & FLAG_TRUNCATED
        if read.info is not None:
            self.pending_info.append((first, read.info))
        return True

    def add_pending_info(self, infos: dict, n: int) -> dict:
        """Add the info columns :meth:`take_steady` kept to ``infos``. When they are the whole batch
        (every env, in order, one layout, every key present: the usual step), each key's array is
        one concatenation of the sandboxes' columns and its mask all True, the arrays
        ``_add_info`` would build env by env; otherwise each sandbox's are added as
        :func:`add_info_rows` adds them, in the order they were read."""
        pending, self.pending_info = self.pending_info, []
        if not pending:
            return infos
        layout = pending[0][1].layout
        expected = 0
        tiles = not infos
        for first, info in pending:
            tiles = tiles and first == expected and info.layout is layout and info.every
            expected = first + len(info.has)
        if tiles and expected == n:
            dtypes = self.native_dtypes(layout)
            for c, key in enumerate(layout.keys):
                infos[key] = np.concatenate([info.cols[c] for _, info in pending], dtype=dtypes[c])
                infos[f"_{key}"] = np.ones(n, dtype=np.bool_)
            return infos
        for first, info in pending:
            infos = add_info_rows(infos, info, slice(first, first + len(info.has)), slice(None), n)
        return infos

    def native_dtypes(self, layout: InfoLayout) -> tuple:
        """:attr:`InfoLayout.native_dtypes`, worked out once per layout."""
        known = self._native_dtypes.get(id(layout))
        if known is None or known[0] is not layout:
            if len(self._native_dtypes) >= 64:
                self._native_dtypes.clear()
            known = self._native_dtypes[id(layout)] = (layout, layout.native_dtypes)
        return known[1]

    def take_step(
        self,
        sandbox: SandboxResult,
        reset_ops: np.ndarray,
        same_step: bool,
        failed: np.ndarray,
        infos: dict,
        limits: tuple,
        take_step: TakeStep,
    ) -> dict:
        """Store a sandbox's results of a step batch: its plain positions as whole blocks of
        observations, rewards and flags (by slicing; no per-env work), the rest one by one
        (``take_step``)."""
        # Infos go in in the order replies were read (Gymnasium's _add_info casts a later value into
        # the array an earlier one made): those of steady sandboxes read before this one first.
        infos = self.add_pending_info(infos, len(self.rewards))
        read = self.read(sandbox)
        one_by_one = self.one_by_one(sandbox, read)
        if one_by_one is not None:
            for r in one_by_one:
                infos = take_step(r, bool(reset_ops[r.index]), same_step, failed, infos, limits)
            return infos
        if read.leaves is not None:
            indices = sandbox.plan.indices
            plain, flags = read.plain, read.flags
            assert flags is not None and read.reward is not None
            first, count = indices[0], len(indices)
            if sandbox.plan.whole and plain.all():
                rows: Any = slice(first, first + count)  # the usual case: the whole sandbox, plain
                positions: Any = slice(None)
            else:
                positions = np.flatnonzero(plain)
                rows = np.asarray(indices)[positions]
            resets = reset_ops[rows]
            ended = flags[positions]
            if same_step and (ended[~resets] != 0).any():
                # An episode ended without the env resetting itself (it should have): the general
                # path, env by env, says what happened.
                for r in sandbox.expand():
                    infos = take_step(r, bool(reset_ops[r.index]), same_step, failed, infos, limits)
                return infos
            self.set_rows(read.leaves, rows, positions)
            if not resets.any():  # the usual case: every position stepped
                self.rewards[rows] = read.reward[positions]
                self.terminations[rows] = ended & FLAG_TERMINATED
                self.truncations[rows] = ended & FLAG_TRUNCATED
            else:
                self.rewards[rows] = np.where(resets, 0.0, read.reward[positions])
                self.terminations[rows] = (ended & FLAG_TERMINATED).astype(bool) & ~resets
                self.truncations[rows] = (ended & FLAG_TRUNCATED).astype(bool) & ~resets
            if read.info is not None:
                infos = add_info_rows(infos, read.info, rows, positions, len(self.rewards))
        for r in read.others.values():
            infos = take_step(r, bool(reset_ops[r.index]), same_step, failed, infos, limits)
        return infos
