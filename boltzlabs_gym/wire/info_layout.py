"""Infos as typed columns, reader's side: the ``"info"`` member of a sandbox reply checked once
per line, and the columns read as arrays; and the one-row form a one-env step reply carries as its
info, ``{"__cols__": member}`` (:func:`decode_cols`). The writer's side is
:mod:`boltzlabs_gym.envside.info_columns`.

The member comes from untrusted code: its keys must be distinct strings (none of the vector env's
own, ``final_obs``/``final_info``), its tags known, its presence bytes and columns arrays of
``P`` rows whose dtypes fit their tags. A reply that breaks this is a bad sandbox reply.

>>> layout = InfoLayout.read({"keys": ["lives"], "tags": ["int"],
...     "has": {"__nd__": [3, "|u1", [2, 1]]}, "cols": [{"__nd__": [4, "<i8", [2]]}]}, 2, 3)
>>> layout.sizes
[2, 16]
>>> rows = layout.rows([b"\\x01\\x00", np.array([5, 0], dtype="<i8").tobytes()])
>>> rows.info_of(0), rows.info_of(1)
({'lives': 5}, {})
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

from .protocol import ND

__all__ = ["BadInfoMember", "InfoLayout", "InfoRows", "RESERVED_KEYS", "TAG_DTYPES", "decode_cols", "numeric_rows"]

#: The dtype each tag's column must have (``None``: any numeric dtype of that kind).
TAG_DTYPES: dict[str, np.dtype | None] = {
    "int": np.dtype("<i8"),
    "float": np.dtype("<f8"),
    "bool": np.dtype("|b1"),
    "np": None,
    "nd": None,
}
#: Keys the vector env gives a meaning of its own (SAME_STEP's final observation and info): never a column.
RESERVED_KEYS = frozenset({"final_obs", "final_info"})
_MAX_COLUMNS = 256


class BadInfoMember(ValueError):
    """The ``"info"`` member of a sandbox reply does not follow the wire."""


class InfoLayout(NamedTuple):
    """What a reply's ``"info"`` member declares, checked: keys, tags, each column's dtype and row
    shape, and the byte sizes of the presence payload and of each column's."""

    keys: tuple[str, ...]
    tags: tuple[str, ...]
    columns: tuple[tuple[np.dtype, tuple[int, ...]], ...]
    sizes: list[int]

    @classmethod
    def read(cls, member: Any, npos: int, first_ref: int) -> InfoLayout:
        """The layout of ``member`` for a reply of ``npos`` positions whose info payloads start at
        reference ``first_ref``; :class:`BadInfoMember` saying what is wrong otherwise."""
        if not isinstance(member, dict) or set(member) != {"keys", "tags", "has", "cols"}:
            raise BadInfoMember(f"its info member {str(member)[:120]} is not keys, tags, has and cols")
        keys, tags, has, cols = member["keys"], member["tags"], member["has"], member["cols"]
        if not (isinstance(keys, list) and isinstance(tags, list) and isinstance(cols, list)):
            raise BadInfoMember("its info member's keys, tags and cols are not lists")
        count = len(keys)
        if not 0 < count <= _MAX_COLUMNS or len(tags) != count or len(cols) != count:
            raise BadInfoMember(f"its info member has {len(keys)} keys, {len(tags)} tags and {len(cols)} columns")
        if any(type(k) is not str or k in RESERVED_KEYS for k in keys) or len(set(keys)) != count:
            raise BadInfoMember(f"its info keys {str(keys)[:120]} are not distinct strings of an env's info")
        if has != {ND: [first_ref, "|u1", [npos, count]]}:
            raise BadInfoMember(f"its info presence {str(has)[:120]} is not [{first_ref}, '|u1', [{npos}, {count}]]")
        columns = tuple(_column(col, tag, first_ref + 1 + c, npos) for c, (col, tag) in enumerate(zip(cols, tags)))
        sizes = [npos * count] + [npos * dtype.itemsize * math.prod(shape) for dtype, shape in columns]
        return cls(tuple(keys), tuple(tags), columns, sizes)

    def rows(self, payloads: list, npos: int | None = None) -> InfoRows:
        """The columns of a reply as arrays (views of ``payloads``, whose sizes were checked); ``npos``
        rows (default: the layout's), e.g. the one row of several one-env replies joined."""
        if npos is None:
            npos = self.sizes[0] // len(self.keys)
        # The usual case, told by one compare of the presence bytes: every position has every key.
        every = payloads[0] == _present(len(payloads[0]))
        if every:
            has = _all_present(npos, len(self.keys))
        else:
            has = np.frombuffer(payloads[0], dtype=np.bool_).reshape(npos, len(self.keys))
        cols = [
            np.frombuffer(payload, dtype=dtype)
            if not shape
            else np.frombuffer(payload, dtype=dtype).reshape(npos, *shape)
            for payload, (dtype, shape) in zip(payloads[1:], self.columns)
        ]
        return InfoRows(self, has, cols, every)

    @property
    def native_dtypes(self) -> tuple[np.dtype, ...]:
        """Each column's dtype in this machine's byte order: the dtype of the batched info array that
        Gymnasium's ``_add_info`` builds for the key."""
        return tuple(dtype.newbyteorder("=") for dtype, _ in self.columns)


def numeric_rows(ref: Any, npos: int) -> tuple[Any, np.dtype, tuple[int, ...]] | None:
    """``(payload, dtype, row shape)`` of an untrusted array reference ``[payload, dtype, [npos, ...]]``
    (an ``"__nd__"`` value) when it declares a numeric array of ``npos`` rows, of at most 32 more
    dimensions, each a small int; else ``None``. The payload reference is the caller's to check.

    >>> numeric_rows([3, "<f4", [2, 6]], 2)
    (3, dtype('float32'), (6,))
    >>> numeric_rows([3, "<U4", [2]], 2) is None
    True
    """
    try:
        k, dtype_str, shape = ref
        dtype = np.dtype(dtype_str)
    except (TypeError, ValueError, KeyError):
        return None
    ok = type(k) is int and dtype.kind in "biuf"
    ok = ok and isinstance(shape, list) and shape[:1] == [npos] and len(shape) <= 33
    ok = ok and all(type(d) is int and 0 <= d < 1 << 31 for d in shape)
    return (k, dtype, tuple(shape[1:])) if ok else None


def _column(col: Any, tag: Any, ref: int, npos: int) -> tuple[np.dtype, tuple[int, ...]]:
    if tag not in TAG_DTYPES:
        raise BadInfoMember(f"info column {ref} has the unknown tag {str(tag)[:20]!r}")
    rows = numeric_rows(col.get(ND), npos) if isinstance(col, dict) and len(col) == 1 else None
    if rows is None or rows[0] != ref:
        raise BadInfoMember(f"info column {ref}, {str(col)[:80]}, is not a numeric array of {npos} rows")
    _, dtype, row_shape = rows
    wanted = TAG_DTYPES[tag]
    wrong_dtype = (wanted is not None and dtype != wanted) or (tag == "np" and dtype.kind == "b")
    if wrong_dtype or (tag != "nd" and row_shape):
        raise BadInfoMember(f"info column {ref} of tag {tag!r} cannot be {dtype.str} of shape {[npos, *row_shape]}")
    return dtype, row_shape


def _present(size: int) -> bytes:
    """Presence bytes of ``size`` positions and keys, every one present."""
    ones = _PRESENT.get(size)
    if ones is None:
        ones = _PRESENT[size] = b"\x01" * size
    return ones


_PRESENT: dict[int, bytes] = {}


def _all_present(npos: int, count: int) -> np.ndarray:
    """``has`` of ``npos`` positions that all have ``count`` keys: one read-only array per shape."""
    has = _ALL_PRESENT.get((npos, count))
    if has is None:
        has = _ALL_PRESENT[(npos, count)] = np.ones((npos, count), dtype=np.bool_)
        has.flags.writeable = False
    return has


_ALL_PRESENT: dict[tuple[int, int], np.ndarray] = {}


class InfoRows:
    """One reply's info columns: ``has[p, c]`` and ``cols[c][p]`` for position ``p``, key ``c``;
    ``every``: whether every position has every key."""

    __slots__ = ("layout", "has", "cols", "every")

    def __init__(self, layout: InfoLayout, has: np.ndarray, cols: list[np.ndarray], every: bool = False):
        self.layout = layout
        self.has = has
        self.cols = cols
        self.every = every

    def info_of(self, p: int) -> dict:
        """Position ``p``'s info as the env returned it (Python scalars, numpy scalars, arrays)."""
        out: dict = {}
        for c in np.flatnonzero(self.has[p]).tolist():
            tag, value = self.layout.tags[c], self.cols[c][p]
            if tag == "nd":
                out[self.layout.keys[c]] = value.copy()
            elif tag == "np":
                out[self.layout.keys[c]] = value  # a numpy scalar of the column's dtype
            else:
                out[self.layout.keys[c]] = value.item()  # int, float or bool
        return out


def decode_cols(member: Any, payloads: Any, copy: bool = False) -> dict:
    """The info a one-env reply carries as ``{"__cols__": member}``: one row, its payloads where the
    member's references say (checked: their sizes too)."""
    try:
        first_ref = member["has"][ND][0]
    except (TypeError, KeyError, IndexError):
        first_ref = None
    if type(first_ref) is not int or not 0 <= first_ref < len(payloads):
        raise BadInfoMember(f"its info columns {str(member)[:120]} do not refer to its payloads")
    layout = InfoLayout.read(member, 1, first_ref)
    own = payloads[first_ref : first_ref + len(layout.sizes)]
    if [len(p) for p in own] != layout.sizes:
        raise BadInfoMember(f"its info columns' payloads are not {layout.sizes} bytes")
    return layout.rows(list(own)).info_of(0)
