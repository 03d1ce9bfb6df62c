"""Infos as typed columns of a sandbox reply: what MuJoCo and Atari envs put in every step's info
(``x_position``, ``lives``, ...) travels as one array per key, not one JSON value per env.

A sandbox of several envs writes each plain position's info into row ``p`` of the column of each of
its keys, and a presence byte per key, so a step whose info holds numbers is still a row of the
sandbox reply (the wire: "Sandboxes of several envs" in :mod:`boltzlabs_gym.wire.protocol`). A
column is kept for every key seen with a value of one of these kinds, its *tag* saying which:

========  ===========================  ==========================================
tag       value                        column
========  ===========================  ==========================================
``int``   a Python ``int`` (64 bits)   ``<i8``
``float`` a Python ``float``           ``<f8``
``bool``  a Python ``bool``            ``|b1``
``np``    a numpy number (scalar)      its dtype
``nd``    a small numeric array        its dtype, its shape after the row
========  ===========================  ==========================================

These are the values Gymnasium batches into typed arrays (``VectorEnv._add_info``); anything
else (a string, a nested dict, a numpy bool, a value of a key whose kind changed) makes the
position's info go as a one-env reply, as before. Columns are added as keys first appear (up to
:data:`MAX_COLUMNS`) and kept; a key absent from an info has its presence byte 0.
"""

from __future__ import annotations

import json
from typing import Any, cast

import numpy as np

from ..wire.info_layout import RESERVED_KEYS, TAG_DTYPES

__all__ = ["InfoColumns", "MAX_COLUMNS", "MAX_CELL_BYTES", "RESERVED_KEYS"]

#: The most keys a sandbox keeps columns for; an info with a further key goes as its own reply.
MAX_COLUMNS = 64
#: The largest array value (bytes) a column takes; a larger one goes in its own reply.
MAX_CELL_BYTES = 4096
_INT64 = (-(1 << 63), (1 << 63) - 1)
#: In a plan of :meth:`InfoColumns.put`: the value is a Python int, checked against :data:`_INT64`.
_IN_RANGE = object()
#: A Python scalar's tag and its column's dtype (the reader holds its columns to the same dtypes).
_PY_TAGS: dict[type, tuple[str, np.dtype]] = {
    py: (tag, cast(np.dtype, TAG_DTYPES[tag])) for py, tag in ((int, "int"), (float, "float"), (bool, "bool"))
}


def _kind_of(value: Any) -> tuple[str, np.dtype, tuple] | None:
    """``(tag, dtype, row shape)`` of a value a column can hold, else ``None``."""
    py = _PY_TAGS.get(type(value))
    if py is not None:
        if py[0] == "int" and not _INT64[0] <= value <= _INT64[1]:
            return None
        return py[0], py[1], ()
    if isinstance(value, np.number) and value.dtype.kind in "iuf":
        return "np", value.dtype, ()
    if type(value) is np.ndarray and value.dtype.kind in "biuf" and value.nbytes <= MAX_CELL_BYTES:
        return "nd", value.dtype, value.shape
    return None


class InfoColumns:
    """The info columns of a sandbox's ``m`` slots (see the module's docstring)."""

    def __init__(self, m: int):
        self.m = m
        self.keys: list[str] = []
        self._index: dict[str, int] = {}
        #: Per column: the Python type its values have (checked per value), its tag, dtype and row shape.
        self._types: list[Any] = []
        self._kinds: list[tuple[str, np.dtype, tuple]] = []
        self.cols: list[np.ndarray] = []
        #: ``has[p, c]``: whether position ``p``'s info has column ``c``'s key.
        self.has = np.zeros((m, 0), dtype=np.uint8)
        #: Bumped when a column is added: the reply line changes then.
        self.version = 0
        #: The plans of :meth:`put` by an info's keys, in order: ``(columns, types, dtypes, has row)``.
        self._known: dict[tuple, tuple[list[int], list[Any], list[Any], np.ndarray]] = {}

    def __len__(self) -> int:
        return len(self.keys)

    def put(self, p: int, info: dict) -> bool:
        """Write the info of position ``p`` (a non-empty dict) into its row, and ``True``; ``False``,
        writing nothing, when a value is not of its key's column kind (or cannot have a column)."""
        # The usual info: the same keys in the same order as a step before, each value of its
        # column's Python type and (a numpy value) the very dtype object, an int in range, an
        # array of its shape: one check per value, one store per value, one for the presence row.
        keys = tuple(info)
        known = self._known.get(keys)
        if known is not None:
            columns, types, checks, has_row = known
            values = info.values()
            value: Any
            for value, typ, check in zip(values, types, checks):
                if type(value) is not typ:
                    break
                if check is None:
                    continue
                if check is _IN_RANGE:
                    if not _INT64[0] <= value <= _INT64[1]:
                        break
                elif type(check) is tuple:
                    if value.dtype is not check[0] or value.shape != check[1]:
                        break
                elif value.dtype is not check:
                    break
            else:
                cols = self.cols
                for c, value in zip(columns, values):
                    cols[c][p] = value
                self.has[p] = has_row
                return True
        if not self._put(p, info):
            return False
        if known is None:
            self._remember(keys, info)
        return True

    def _remember(self, keys: tuple, info: dict) -> None:
        """Keep the plan :meth:`put` takes for infos of ``info``'s keys, in order, and of its values'
        types: per column, what a value must be besides its type (see :meth:`put`)."""
        index, kinds = self._index, self._kinds
        columns, types, checks = [], [], []
        for key, value in info.items():
            c = index[key]
            tag = kinds[c][0]
            columns.append(c)
            types.append(type(value))
            if tag == "np":
                checks.append(value.dtype)
            elif tag == "nd":
                checks.append((value.dtype, value.shape))
            else:
                checks.append(_IN_RANGE if tag == "int" else None)
        has_row = np.zeros(len(self.keys), dtype=np.uint8)
        has_row[columns] = 1
        if len(self._known) >= 64:
            self._known.clear()
        self._known[keys] = (columns, types, checks, has_row)

    def _put(self, p: int, info: dict) -> bool:
        """:meth:`put`, every value checked against its column's kind."""
        index, types, kinds = self._index, self._types, self._kinds
        value: Any
        for key, value in info.items():
            c = index.get(key)
            if c is None:
                if not self._add_column(key, value):
                    return False
                continue
            if type(value) is not types[c]:
                return False
            tag, dtype, shape = kinds[c]
            if tag == "nd":
                if value.dtype != dtype or value.shape != shape:
                    return False
            elif tag == "np":
                if value.dtype != dtype:
                    return False
            elif tag == "int" and not _INT64[0] <= value <= _INT64[1]:
                return False
        has, cols = self.has[p], self.cols
        has[:] = 0
        for key, value in info.items():
            c = index[key]
            cols[c][p] = value
            has[c] = 1
        return True

    def clear_has(self, p: int) -> bool:
        """Position ``p``'s info is empty (``True``, for the hot path's condition)."""
        self.has[p] = 0
        return True

    def clear(self, p: int) -> None:
        """Position ``p`` has no info in the columns (an empty info, or its own reply)."""
        if self.keys:
            self.has[p] = 0
            for col in self.cols:
                col[p] = 0

    def _add_column(self, key: Any, value: Any) -> bool:
        kind = _kind_of(value)
        if kind is None or type(key) is not str or key in RESERVED_KEYS or len(self.keys) >= MAX_COLUMNS:
            return False
        tag, dtype, shape = kind
        self._index[key] = len(self.keys)
        self.keys.append(key)
        self._types.append(type(value))
        self._kinds.append((tag, dtype.newbyteorder("<") if dtype.byteorder == ">" else dtype, shape))
        self.cols.append(np.zeros((self.m, *shape), dtype=self._kinds[-1][1]))
        has = np.zeros((self.m, len(self.keys)), dtype=np.uint8)
        has[:, :-1] = self.has
        self.has = has
        self.version += 1
        self._known.clear()  # their presence rows are one byte short now
        return True

    def member(self, n: int, first_ref: int) -> bytes:
        """The reply line's ``"info"`` member for ``n`` positions, its payloads' references counting
        from ``first_ref``: ``"info":{"keys":[...],"tags":[...],"has":ND,"cols":[ND,...]}``; empty
        when there are no columns."""
        if not self.keys:
            return b""
        return b',"info":' + self.member_json(n, first_ref)

    def member_json(self, n: int, first_ref: int) -> bytes:
        """The member's value alone (see :meth:`member`): what a one-env step reply's info is the
        ``"__cols__"`` of."""
        cols = [
            {"__nd__": [first_ref + 1 + c, dtype.str, [n, *shape]]} for c, (_, dtype, shape) in enumerate(self._kinds)
        ]
        member = {
            "keys": self.keys,
            "tags": [tag for tag, _, _ in self._kinds],
            "has": {"__nd__": [first_ref, "|u1", [n, len(self.keys)]]},
            "cols": cols,
        }
        return json.dumps(member, separators=(",", ":")).encode()

    def payloads(self, n: int) -> list:
        """The first ``n`` rows of the presence bytes and of each column, as the member refers to them."""
        if not self.keys:
            return []
        # An ndarray is a buffer (the type checker does not see it as one on Python < 3.12).
        arrays: list[Any] = [self.has[:n], *(col[:n] for col in self.cols)]
        return [memoryview(a).cast("B") for a in arrays]

    def sizes(self, n: int) -> list[int]:
        return [n * len(self.keys)] + [n * col[0].nbytes for col in self.cols] if self.keys else []
