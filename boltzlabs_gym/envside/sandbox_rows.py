"""The arrays of a sandbox reply (a sandbox of several envs): each plain position's observation,
reward and flags, written in place as the process serves its envs.

A plain position (an empty info or one of numbers the info columns take, no autoreset in it, an
observation of the declared arrays) is a
row of the reply's arrays instead of a one-env reply ("Sandboxes of several envs" in
:mod:`boltzlabs_gym.wire.protocol`). The observation is one array (``obs`` is then
``{"__nd__": [0, dtype, [P, ...]]}``), or a Dict/Tuple of arrays only: its skeleton
(:func:`~boltzlabs_gym.wire.slot_layout.array_skeleton`) with each array's rows as one payload
(``[P, ...]`` shapes, references ``0 .. L-1``), the rewards and flags after them (``L`` and
``L+1``).

The rows are preallocated once for the process's ``m`` slots and reused by every request, so a
plain position costs one copy per array and two stores; the reply's payloads are views of the
first ``P`` rows, and its line is prebuilt (no JSON encoder). Once the pool maps the process's
shared observation region (:meth:`SandboxRows.share`), the rows live there: each array's ``m``
rows back to back, one array after the other (so a sandbox's rows of one array are one block),
and the reply refers to them (``"__shm__"`` in place of ``"__nd__"``, empty payloads).
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Sequence
from math import isfinite
from typing import Any, cast

import numpy as np

from ..wire.codec import ND, SHM, ArrayLeaf
from ..wire.slot_layout import LeafPaths, rows_skeleton, slot_spans
from . import obs_region
from .info_columns import InfoColumns

__all__ = ["SandboxRows"]


class SandboxRows:
    """The rows of a sandbox reply's arrays for a process's ``m`` slots (see the module's docstring).

    The observation ``space`` is one array, or a Dict/Tuple of arrays only (``skeleton`` is then
    the one all its values encode to, :func:`~boltzlabs_gym.wire.slot_layout.array_skeleton`).
    """

    def __init__(self, m: int, space: Any, skeleton: Any = None):
        self._paths = LeafPaths(space)
        #: Each array's ``(dtype, shape)``, in payload order.
        self._leaves = cast(tuple, self._paths.leaves)
        spans = slot_spans(self._leaves) if None not in self._leaves else None
        if not spans:
            raise ValueError(f"group rows need a space of arrays a slot may hold, got {space}")
        self.m = m
        self.skeleton = skeleton
        #: One array's hot-path helper (what a slot holds, for the region's description); None for a Dict/Tuple.
        self.leaf = ArrayLeaf(space) if skeleton is None else None
        self._spans = spans
        #: One observation's bytes (all its arrays): the region's slot size.
        self.row_bytes = sum(size for _, size in spans)
        #: The first array's dtype and row shape (one array's, which the hot path of a Discrete step checks inline).
        self.dtype, self.shape = self._leaves[0]
        self._private = bytearray(m * self.row_bytes)
        # array/bytearray rather than numpy: a store into them is several times cheaper.
        self.rewards = array("d", bytes(8 * m))
        self.flags = bytearray(m)
        self._reward_bytes = memoryview(self.rewards).cast("B")
        self._flags_bytes = memoryview(self.flags)
        #: Each plain position's info, as typed columns (:mod:`~boltzlabs_gym.envside.info_columns`).
        self.info = InfoColumns(m)
        #: Whether the rows live in the process's shared observation region (:meth:`share`).
        self.shared = False
        self._place_rows(memoryview(self._private))

    def _place_rows(self, memory: memoryview) -> None:
        """Lay each array's ``m`` rows out in ``memory``, one array after the other."""
        m = self.m
        self._memory = memory
        self.arrays_of = [
            np.ndarray((m, *shape), dtype, buffer=memory, offset=m * start)
            for (dtype, shape), (start, _) in zip(self._leaves, self._spans)
        ]
        #: One array: its rows (the hot path of a Discrete step writes them inline); ``None`` for a Dict/Tuple.
        self.obs: np.ndarray | None = self.arrays_of[0] if self.skeleton is None else None
        self._lines: dict[tuple[int, int], tuple[bytes, bytes]] = {}

    @classmethod
    def of(cls, hosts: Sequence[Any]) -> SandboxRows | None:
        """The rows for these slots' :class:`~boltzlabs_gym.envside.gym_host.GymHost`\\ s, or
        ``None`` (every position then in ``replies``) unless every slot's observations are one
        array of one dtype and shape, or a Dict/Tuple of arrays only of one skeleton."""
        leaves: list[ArrayLeaf | None] = [host._obs_leaf for host in hosts]
        first = leaves[0]
        if first is not None:
            if any(leaf is None or (leaf.dtype, leaf.shape) != (first.dtype, first.shape) for leaf in leaves):
                return None
            return cls(len(hosts), first.space)
        skeleton = hosts[0]._obs_skeleton
        if skeleton is None or any(host._obs_skeleton != skeleton for host in hosts):
            return None
        return cls(len(hosts), hosts[0].obs_space, skeleton)

    def describe(self) -> ArrayLeaf | tuple:
        """What a slot of the region holds, for :func:`~boltzlabs_gym.envside.gym_host.region_reply`."""
        return self.leaf if self.leaf is not None else self._leaves

    def share(self, region: obs_region.ObsRegion) -> None:
        """Keep the rows in ``region`` from now on: a reply's observations are then references to
        its first rows (``"__shm__"`` leaves, empty payloads) instead of their bytes."""
        self._place_rows(region.memory[: self.m * self.row_bytes])
        self.shared = True
        obs_region.on_forget(self._unshare)

    def _unshare(self) -> None:
        """Back to the rows of this process's own memory (the region is being dropped)."""
        self._place_rows(memoryview(self._private))
        self.shared = False

    def put(self, p: int, obs: Any, reward: float, terminated: bool, truncated: bool, info: dict) -> bool:
        """Write position ``p``'s row and ``True``, or ``False`` when ``obs`` is not of the space's
        arrays (dtype and shape), ``reward`` is not finite (the one-env reply says what is wrong
        then, or carries the NaN: it is what the one-env encoders would write) or ``info`` (a dict)
        does not fit the info columns."""
        values = self._paths.arrays(obs)
        if values is None or not isfinite(reward):
            return False
        if info:
            if not self.info.put(p, info):
                return False
        elif self.info.keys:
            self.info.clear_has(p)
        for value, rows in zip(values, self.arrays_of):
            rows[p] = value  # a copy: the env may reuse its buffer
        self.rewards[p] = reward
        self.flags[p] = terminated | truncated << 1
        return True

    def clear(self, p: int) -> None:
        """Zero position ``p`` (one in ``replies``), so that a reply's bytes depend on this request only."""
        for rows in self.arrays_of:
            rows[p] = 0
        self.rewards[p] = 0.0
        self.flags[p] = 0
        self.info.clear(p)

    def arrays(self, n: int) -> bytes:
        """The ``obs``/``reward``/``flags`` members of a reply of ``n`` positions."""
        return self._line_parts(n)[0]

    def payloads(self, n: int) -> list:
        """The first ``n`` rows of each array (empty when shared), rewards and flags: the first
        payloads of the reply."""
        if self.shared:
            obs: list = [b""] * len(self._spans)
        else:
            m, memory = self.m, self._memory
            obs = [memory[m * start : m * start + n * size] for start, size in self._spans]
        return [*obs, self._reward_bytes[: 8 * n], self._flags_bytes[:n], *self.info.payloads(n)]

    def plain_line(self, n: int) -> bytes:
        """The whole line of a reply whose ``n`` positions are all plain."""
        return self._line_parts(n)[1]

    def _line_parts(self, n: int) -> tuple[bytes, bytes]:
        """The arrays members and the all-plain line of a reply of ``n`` positions (made once per ``n``)."""
        parts = self._lines.get((n, self.info.version))
        if parts is None:
            key = SHM if self.shared else ND
            if self.skeleton is None:
                dtype, shape = self._leaves[0]
                obs = {key: [0, dtype.str, [n, *shape]]}
            else:
                obs = rows_skeleton(self.skeleton, n, key)
            count = len(self._leaves)
            members = {
                "obs": obs,
                "reward": {ND: [count, np.dtype(np.float64).str, [n]]},
                "flags": {ND: [count + 1, "|u1", [n]]},
            }
            arrays = json.dumps(members, separators=(",", ":"))[1:-1].encode() + self.info.member(n, count + 2)
            sizes = [0 if self.shared else n * size for _, size in self._spans] + [8 * n, n] + self.info.sizes(n)
            line = b'{"n":%d,%s,"replies":{},"_bin":%s}\n' % (n, arrays, json.dumps(sizes).replace(" ", "").encode())
            parts = self._lines[(n, self.info.version)] = (arrays, line)
        return parts
