"""The layout of an observation in a shared slot: which spaces have one, and checks of what an
env says of its slot.

A Dict or Tuple observation space (nested or not) whose array leaves are Box, MultiBinary or
MultiDiscrete spaces, beside any Discrete or Text leaves, always encodes to the same payloads
(:func:`payload_layout`): a shared observation slot holds them back to back
(:func:`slot_spans`). When its leaves are all arrays, every observation has one skeleton
(:func:`array_skeleton`), and its arrays can be taken out of a value without encoding it
(:func:`array_leaves`), and a sandbox reply's rows of several envs' observations have that
skeleton with ``P`` rows in front of each shape (:func:`rows_skeleton`). An env describes its
slot to the worker and the pool as JSON; they check that description with :func:`layout_spans`
and :func:`skeleton_fits`, and a sandbox reply's skeleton with :func:`array_refs` (see
``docs/shared-memory.md``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from gymnasium import spaces as gs

from .codec import _ARRAY_SPACES, _DTYPE_RE, MAX_INFO_DEPTH, ND

__all__ = [
    "MAX_LAYOUT_PAYLOADS",
    "array_bytes",
    "LeafPaths",
    "array_leaves",
    "array_refs",
    "array_skeleton",
    "copy_skeleton",
    "rows_skeleton",
    "layout_spans",
    "map_array_refs",
    "payload_layout",
    "skeleton_fits",
    "slot_spans",
]


def payload_layout(space: gs.Space) -> tuple[tuple[np.dtype, tuple[int, ...]], ...] | None:
    """The ``(dtype, shape)`` of each payload :func:`encode` makes for every value of ``space``, in
    order, when they are always the same: a Dict or Tuple (nested or not) whose array leaves are
    Box, MultiBinary or MultiDiscrete spaces, beside any Discrete or Text leaves (those go inline).
    ``None`` for a space whose values make a varying number of payloads (Sequence, Graph, OneOf, a
    JSON space), for a top-level array space (:class:`ArrayLeaf` covers it) and for one with no
    array leaf at all. A shared observation region holds these payloads back to back.

    >>> [(d.str, s) for d, s in payload_layout(gs.Dict({"a": gs.Box(0, 1, (2,)), "b": gs.Discrete(3)}))]
    [('<f4', (2,))]
    """
    if isinstance(space, _ARRAY_SPACES):
        return None
    layout: list[tuple[np.dtype, tuple[int, ...]]] = []
    if not _fixed_payloads(space, layout) or not layout:
        return None
    return tuple(layout)


def _fixed_payloads(space: gs.Space, layout: list) -> bool:
    """Append the payloads ``space``'s values make (in :func:`_encode`'s order); False if they vary."""
    if isinstance(space, _ARRAY_SPACES):
        layout.append((np.dtype(space.dtype), tuple(space.shape)))
        return True
    if isinstance(space, (gs.Discrete, gs.Text)):
        return True
    if isinstance(space, gs.Dict):
        return all(_fixed_payloads(sub, layout) for sub in space.spaces.values())
    if isinstance(space, gs.Tuple):
        return all(_fixed_payloads(sub, layout) for sub in space.spaces)
    return False


def array_skeleton(space: gs.Space) -> Any:
    """The skeleton :func:`encode` makes for every value of a Dict or Tuple space (nested or not)
    whose leaves are all array spaces, or ``None`` for any other space: it is the same for all
    of them (``{"__nd__": [k, dtype, shape]}`` leaves, ``k`` counting from 0 in order).

    >>> array_skeleton(gs.Dict({"a": gs.Box(0, 1, (2,)), "b": gs.MultiBinary(3)}))
    {'a': {'__nd__': [0, '<f4', [2]]}, 'b': {'__nd__': [1, '|i1', [3]]}}
    """
    if isinstance(space, _ARRAY_SPACES) or not isinstance(space, (gs.Dict, gs.Tuple)):
        return None
    count = [0]
    return _array_skeleton(space, count)


def _array_skeleton(space: gs.Space, count: list) -> Any:
    if isinstance(space, _ARRAY_SPACES):
        count[0] += 1
        return {ND: [count[0] - 1, np.dtype(space.dtype).str, list(space.shape)]}
    if isinstance(space, gs.Dict):
        subs = {key: _array_skeleton(sub, count) for key, sub in space.spaces.items()}
        return None if any(v is None for v in subs.values()) else subs
    if isinstance(space, gs.Tuple):
        items = [_array_skeleton(sub, count) for sub in space.spaces]
        return None if any(v is None for v in items) else items
    return None


def rows_skeleton(skeleton: Any, rows: int, key: str = ND) -> Any:
    """``skeleton`` (one observation's: ``{"__nd__": [k, dtype, shape]}`` leaves) with ``rows``
    in front of each leaf's shape, and its leaves under ``key`` (``"__nd__"`` or ``"__shm__"``):
    the ``obs`` of a sandbox reply of ``rows`` positions.

    >>> rows_skeleton({"a": {"__nd__": [0, "|u1", [2]]}}, 3, "__shm__")
    {'a': {'__shm__': [0, '|u1', [3, 2]]}}
    """
    return map_array_refs(skeleton, lambda ref: {key: [ref[0], ref[1], [rows, *ref[2]]]})


def copy_skeleton(skeleton: Any) -> Any:
    """A copy of a skeleton of arrays, for a reader that may keep (or change) it.

    >>> skeleton = {"a": {"__nd__": [0, "|u1", [2]]}}
    >>> copy = copy_skeleton(skeleton)
    >>> copy == skeleton and copy["a"]["__nd__"][2] is not skeleton["a"]["__nd__"][2]
    True
    """
    return map_array_refs(skeleton, lambda ref: {ND: [ref[0], ref[1], list(ref[2])]})


def map_array_refs(skeleton: Any, leaf: Callable[[list], Any]) -> Any:
    """``skeleton`` (one :func:`array_refs` accepts) with each ``{"__nd__": ref}`` replaced by
    ``leaf(ref)``, in order."""
    if isinstance(skeleton, dict):
        ref = skeleton.get(ND)
        if ref is not None:
            return leaf(ref)
        return {k: map_array_refs(v, leaf) for k, v in skeleton.items()}
    return [map_array_refs(v, leaf) for v in skeleton]


def array_leaves(space: gs.Space, value: Any, out: list) -> bool:
    """Append the array leaves of ``value`` (a value of a space :func:`array_skeleton` covers) to
    ``out`` in :func:`encode`'s order, as they are (not converted); False if its structure is not
    the space's (a missing key, a Tuple of another length). :class:`LeafPaths` does the same for
    many values of one space."""
    return LeafPaths(space).take(value, out)


class LeafPaths:
    """Where the array leaves of a Dict/Tuple space's values are (their keys and indices, in
    :func:`encode`'s order), found once: :meth:`take` reads them out of a value in a fraction of
    a microsecond per leaf, on the hot path of a step.

    >>> paths = LeafPaths(gs.Dict({"a": gs.Box(0, 1, (2,)), "b": gs.Tuple((gs.MultiBinary(3),))}))
    >>> paths.paths, paths.tuples
    ((('a',), ('b', 0)), ((('b',), 1),))
    >>> out = []; paths.take({"a": 1, "b": [2]}, out), out
    (True, [1, 2])
    >>> paths.take({"a": 1, "b": [2, 3]}, [])  # a Tuple of another length
    False
    >>> len(paths.arrays({"a": np.zeros(2, np.float32), "b": [np.zeros(3, np.int8)]}))
    2
    >>> paths.arrays({"a": np.zeros(2, np.float64), "b": [np.zeros(3, np.int8)]}) is None  # another dtype
    True
    """

    def __init__(self, space: gs.Space):
        paths: list[tuple] = []
        tuples: list[tuple[tuple, int]] = []
        leaves: list[tuple[np.dtype, tuple] | None] = []
        _find_leaves(space, (), paths, tuples, leaves)
        #: Each leaf's keys and indices from the value's top.
        self.paths = tuple(paths)
        #: Each Tuple's keys and indices, and its length (a value's must be a tuple or list of it).
        self.tuples = tuple(tuples)
        #: Each leaf's ``(dtype, shape)``, for an array space's leaf (else ``None``).
        self.leaves = tuple(leaves)

    def take(self, value: Any, out: list) -> bool:
        """Append ``value``'s leaves to ``out`` as they are; False if its structure is not the
        space's (``out`` may then hold some of them)."""
        try:
            for path, length in self.tuples:
                node = value
                for key in path:
                    node = node[key]
                if not isinstance(node, (tuple, list)) or len(node) != length:
                    return False
            for path in self.paths:
                node = value
                for key in path:
                    node = node[key]
                out.append(node)
        except (KeyError, TypeError, IndexError, ValueError):  # a key missing, a value not a mapping
            return False
        return True

    def arrays(self, value: Any) -> list | None:
        """``value``'s leaves (of a space whose leaves are all arrays) when each is a numpy array
        of its space's dtype and shape; else ``None``."""
        out: list = []
        if not self.take(value, out):
            return None
        for array, (dtype, shape) in zip(out, self.leaves):  # type: ignore[misc]  # arrays only
            # (``is`` first: an env's arrays mostly carry numpy's one instance of their dtype)
            if type(array) is not np.ndarray or not (array.dtype is dtype or array.dtype == dtype):
                return None
            if array.shape != shape:
                return None
        return out


def _find_leaves(space: gs.Space, path: tuple, paths: list, tuples: list, leaves: list) -> None:
    if isinstance(space, gs.Dict):
        for key, sub in space.spaces.items():
            _find_leaves(sub, (*path, key), paths, tuples, leaves)
    elif isinstance(space, gs.Tuple):
        tuples.append((path, len(space.spaces)))
        for i, sub in enumerate(space.spaces):
            _find_leaves(sub, (*path, i), paths, tuples, leaves)
    else:
        paths.append(path)
        leaves.append((np.dtype(space.dtype), tuple(space.shape)) if isinstance(space, _ARRAY_SPACES) else None)


#: The most payloads a Dict/Tuple observation's shared slot may hold.
MAX_LAYOUT_PAYLOADS = 1024


def array_bytes(dtype: np.dtype, shape: tuple) -> int | None:
    """The bytes of one array of ``dtype`` and ``shape``, or ``None`` if a shared slot may not
    hold one (not a bool/int/uint/float dtype, or a dimension that is not a small int)."""
    if dtype.kind not in "biuf" or not all(type(d) is int and 0 <= d < 1 << 31 for d in shape):
        return None
    return dtype.itemsize * int(np.prod(shape, dtype=np.int64))


def slot_spans(layout: Sequence[tuple[np.dtype, tuple]]) -> tuple[tuple[int, int], ...] | None:
    """``(start, size)`` of each array of ``layout`` (``(dtype, shape)`` pairs, as
    :func:`payload_layout` gives them) in a shared slot, back to back; ``None`` if a slot may not
    hold one of them (:func:`array_bytes`)."""
    spans, start = [], 0
    for dtype, shape in layout:
        size = array_bytes(dtype, shape)
        if size is None:
            return None
        spans.append((start, size))
        start += size
    return tuple(spans)


def layout_spans(layout: object) -> tuple[tuple[int, int], ...] | None:
    """:func:`slot_spans` of a ``layout`` as an env describes its region (``[[dtype, shape], ...]``,
    untrusted JSON); ``None`` if it is not a list of arrays a slot may hold."""
    if not isinstance(layout, list) or not 0 < len(layout) <= MAX_LAYOUT_PAYLOADS:
        return None
    parsed = []
    for entry in layout:
        if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str)):
            return None
        if not _DTYPE_RE.match(entry[0]) or not isinstance(entry[1], list):
            return None
        parsed.append((np.dtype(entry[0]), tuple(entry[1])))
    return slot_spans(parsed)


def skeleton_fits(skeleton: Any, layout: list) -> bool:
    """Whether ``skeleton`` (untrusted JSON) refers to exactly the payloads of ``layout``, in
    order, as :func:`array_skeleton` makes it for a Dict/Tuple of arrays."""
    refs = array_refs(skeleton)
    return refs is not None and refs == [[k, *entry] for k, entry in enumerate(layout)]


def array_refs(skeleton: Any) -> list | None:
    """The ``__nd__`` references (``[k, dtype, shape]``, unchecked) of a skeleton of arrays only
    (untrusted JSON), in order: objects and lists, none empty, down to leaves that are exactly
    ``{"__nd__": ref}``, at most :data:`~boltzlabs_gym.wire.codec.MAX_INFO_DEPTH` deep and
    :data:`MAX_LAYOUT_PAYLOADS` many; ``None`` for anything else.

    >>> array_refs([{"__nd__": [0, "|u1", [2]]}, {"b": {"__nd__": [1, "<f4", []]}}])
    [[0, '|u1', [2]], [1, '<f4', []]]
    >>> array_refs({"a": {"__nd__": [0, "|u1", [2]], "x": 1}}) is None
    True
    """
    refs: list = []
    if not isinstance(skeleton, (dict, list)) or not _array_refs(skeleton, refs, 0) or len(refs) > MAX_LAYOUT_PAYLOADS:
        return None
    return refs


def _array_refs(node: Any, refs: list, depth: int) -> bool:
    """Collect the ``__nd__`` references of a skeleton of arrays only; False for anything else."""
    if depth > MAX_INFO_DEPTH or len(refs) > MAX_LAYOUT_PAYLOADS:
        return False
    if isinstance(node, dict):
        if len(node) == 1 and ND in node:
            refs.append(node[ND])
            return True
        return bool(node) and all(isinstance(k, str) and _array_refs(v, refs, depth + 1) for k, v in node.items())
    if isinstance(node, list):
        return bool(node) and all(_array_refs(v, refs, depth + 1) for v in node)
    return False
