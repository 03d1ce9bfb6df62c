"""Values of a space <-> (JSON skeleton, raw byte payloads), so arrays never go through JSON.

:func:`encode` turns a value of a Gymnasium space into a JSON-able skeleton plus a
list of raw payloads; :func:`decode` turns them back. The skeleton, by space:

* Box, MultiBinary, MultiDiscrete: ``{"__nd__": [k, dtype, shape]}``, where ``k``
  indexes the payload list, ``dtype`` is the numpy dtype string (``"<f4"``) and
  ``shape`` a list of ints; payload ``k`` holds the C-order bytes of the array.
* Discrete: a JSON int for a Python int, ``{"__np__": [dtype, value]}`` for a numpy
  integer (decoded back to the same type). Text: a JSON string.
* Dict: a JSON object (the space's keys, in its order). Tuple: a JSON list.
* Sequence: a JSON list of its elements (a stacked one is unstacked on the wire).
  OneOf: ``[index, value]``. Graph: ``{"nodes": <rows>, "edges": <rows>|null,
  "edge_links": <array>|null}``, where rows of an array or Discrete space are one array
  with a leading dimension of any length, and rows of any other space a list of values.
* :class:`~boltzlabs_gym.wire.spaces.JsonSpace`: the value itself; on encode, numpy
  scalars and arrays inside it are converted to plain JSON (arrays to nested lists).

:func:`decode` runs on the trainer with data from an *untrusted* sandbox and
validates strictly: the dtype must equal the space's dtype, the shape must equal
the space's shape, the payload length must equal ``prod(shape) * itemsize``, the
payload index must be in range, object/structured dtypes are refused, Discrete
values must be ints within range, Text values strings, Dict keys exactly the
space's. Anything else raises :class:`CodecError` (a :class:`ValueError`) saying
what was wrong and where.

Arrays are decoded with ``np.frombuffer``: zero-copy, and therefore **read-only**
views on the payload (``copy=True`` gives writable copies). For an observation
that is one array, :class:`ArrayLeaf` decodes it as strictly and faster.

Infos (schemaless dicts) use :func:`encode_info` / :func:`decode_info`: JSON
values pass through; numpy arrays of bool/int/uint/float dtype become ``__nd__``
payload references; numpy scalars become ``{"__np__": [dtype, value]}`` inline
(decoded back to numpy scalars of the same dtype); tuples ``{"__tuple__": [items]}`` (decoded back to
tuples: JSON has none), lists stay lists; a dict that would look like a marker is escaped; any other
object is replaced by its ``repr()`` (truncated).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from typing import Any, cast

import numpy as np
from gymnasium import spaces as gs
from gymnasium.vector.utils import concatenate, create_empty_array, iterate

from ..errors import CodecError
from .info_layout import BadInfoMember, decode_cols
from .protocol import INFO_COLS_MARK, ND, STEP_REPLY_FLAGS, step_reply_prefix, step_reply_suffix
from .spaces import JsonSpace

__all__ = [
    "CodecError",
    "encode",
    "encode_action",
    "decode",
    "encode_info",
    "decode_info",
    "to_json_safe",
    "ArrayLeaf",
    "payload_len",
    "ND",
]

#: The key of a reference to an observation in the env's shared region (``{"__shm__": [slot, dtype, shape]}``;
#: see :mod:`boltzlabs_gym.client.obs_regions`). Only a local pool that asked for a region gets one.
SHM = "__shm__"
#: The marker key of a numpy scalar in an info: ``{"__np__": [dtype, value]}``.
NP = "__np__"
#: The marker key of a tuple in an info: ``{"__tuple__": [items]}`` (JSON arrays decode as lists).
TUPLE = "__tuple__"
#: The marker key of an escaped user dict in an info (a dict that looked like a marker).
_ESC = "__esc__"
#: An info of numbers as typed columns of one row (:mod:`~boltzlabs_gym.wire.info_layout`).
COLS = "__cols__"
_MARKERS = (ND, NP, TUPLE, _ESC, COLS)
#: Deepest nesting decode_info / to_json_safe follow.
MAX_INFO_DEPTH = 64
#: Longest repr() kept for a non-JSON object in an info.
MAX_REPR_CHARS = 1000

_DTYPE_RE = re.compile(r"^[<>|=]?[biuf][1248]$")
_ARRAY_SPACES = (gs.Box, gs.MultiBinary, gs.MultiDiscrete)
_ArraySpace = gs.Box | gs.MultiBinary | gs.MultiDiscrete


Payloads = Sequence[Any]  # bytes-like objects: bytes, bytearray, memoryview, zmq frames' buffers


# --------------------------------------------------------------------------- encode


# Numpy's stubs declare ndarray.__buffer__ for Python >= 3.12 only, so on our 3.10 floor the type checker
# does not see an array as a buffer; memoryview() and bytes.join() take one all the same.
def _array_payload(arr: np.ndarray, zero_copy: bool) -> Any:
    if zero_copy:
        return memoryview(arr.reshape(-1).view(np.uint8))  # type: ignore[arg-type]  # ndarray is a buffer: see above
    return arr.tobytes()


def _contiguous(arr: np.ndarray) -> np.ndarray:
    # Not np.ascontiguousarray: it turns 0-d arrays into 1-d ones.
    return arr if arr.flags.c_contiguous else np.ascontiguousarray(arr)


def _encode_array(arr: np.ndarray, payloads: list, zero_copy: bool) -> dict:
    k = len(payloads)
    payloads.append(_array_payload(arr, zero_copy))
    return {ND: [k, arr.dtype.str, list(arr.shape)]}


def encode(space: gs.Space, value: Any, payloads: list | None = None, *, zero_copy: bool = False) -> tuple[Any, list]:
    """Encode ``value`` (an element of ``space``) as ``(skeleton, payloads)``.

    Array leaves are cast to the space's dtype (as Gymnasium's own vectorizers do
    when they stack observations) and must have the space's shape. Pass an existing
    ``payloads`` list to append to it (several values in one message share one
    list); the same list is returned. With ``zero_copy=True`` array payloads are
    ``memoryview`` s on the (contiguous) array instead of ``bytes`` copies: only
    safe when the message is written before the array can change.

    Raises :class:`CodecError` when the value does not fit the space.
    """
    if payloads is None:
        payloads = []
    return _encode(space, value, payloads, zero_copy, "value"), payloads


def encode_action(space: gs.Space, value: Any) -> tuple[Any, list]:
    """Encode one env's action as :func:`encode` does, except that a top-level array action
    given as a numpy array or scalar of another numeric dtype keeps that dtype.

    ``SyncVectorEnv`` hands each env a row of the caller's batch as it is (a ``float64``
    row for a ``float32`` space, a numpy scalar for ``Box(())``); the env side decodes such
    an action with :meth:`ArrayLeaf.decode_action`, so the env sees the same. Array leaves
    inside Dict/Tuple actions are cast to their space's dtype, as :func:`encode` does.

    >>> from gymnasium import spaces
    >>> encode_action(spaces.Box(-1, 1, (2,)), np.zeros(2, np.float64))[0]
    {'__nd__': [0, '<f8', [2]]}
    >>> encode_action(spaces.Box(-1, 1, (2,)), [0.0, 0.5])[0]
    {'__nd__': [0, '<f4', [2]]}
    """
    if (
        isinstance(space, _ARRAY_SPACES)
        and isinstance(value, (np.ndarray, np.generic))
        and value.dtype != space.dtype
        and value.dtype.kind in "biuf"
    ):
        arr = _contiguous(np.asarray(value))
        if arr.shape != space.shape:
            raise CodecError(f"value: shape {arr.shape} does not match the space's {space.shape}")
        payloads: list = []
        return _encode_array(arr, payloads, False), payloads
    return encode(space, value)


def _encode(space: gs.Space, value: Any, payloads: list, zero_copy: bool, path: str) -> Any:
    if isinstance(space, _ARRAY_SPACES):
        try:
            arr = _contiguous(np.asarray(value, dtype=space.dtype))
        except (TypeError, ValueError) as exc:
            raise CodecError(f"{path}: cannot convert to a {space.dtype} array: {exc}") from None
        if arr.shape != space.shape:
            raise CodecError(f"{path}: shape {arr.shape} does not match the space's {space.shape}")
        return _encode_array(arr, payloads, zero_copy)
    if isinstance(space, gs.Discrete):
        return _encode_int(value, path, "Discrete value")
    if isinstance(space, gs.Text):
        if not isinstance(value, str):
            raise CodecError(f"{path}: Text value must be a str, got {type(value).__name__}")
        return value
    if isinstance(space, gs.Dict):
        try:
            return {
                key: _encode(sub, value[key], payloads, zero_copy, f"{path}[{key!r}]")
                for key, sub in space.spaces.items()
            }
        except (KeyError, TypeError, IndexError) as exc:
            raise CodecError(f"{path}: Dict value lacks key {exc}") from None
    if isinstance(space, gs.Tuple):
        if not isinstance(value, (tuple, list)) or len(value) != len(space.spaces):
            raise CodecError(f"{path}: Tuple value must be a tuple of length {len(space.spaces)}")
        return [
            _encode(sub, v, payloads, zero_copy, f"{path}[{i}]") for i, (sub, v) in enumerate(zip(space.spaces, value))
        ]
    if isinstance(space, JsonSpace):
        return to_json_safe(value)
    if isinstance(space, gs.Sequence):
        if space.stack:
            try:
                value = list(iterate(space.stacked_feature_space, value))
            except Exception as exc:  # noqa: BLE001 - iterate raises whatever the value provokes
                raise CodecError(f"{path}: not a stacked Sequence value: {exc}") from None
        elif not isinstance(value, (tuple, list)):
            raise CodecError(f"{path}: Sequence value must be a tuple, got {type(value).__name__}")
        return [_encode(space.feature_space, v, payloads, zero_copy, f"{path}[{i}]") for i, v in enumerate(value)]
    if isinstance(space, gs.OneOf):
        if not isinstance(value, (tuple, list)) or len(value) != 2:
            raise CodecError(f"{path}: OneOf value must be a tuple (index, value)")
        index = _encode_int(value[0], path, "OneOf index")
        if not 0 <= int(value[0]) < len(space.spaces):
            raise CodecError(f"{path}: OneOf index {value[0]} out of range [0, {len(space.spaces)})")
        return [index, _encode(space.spaces[int(value[0])], value[1], payloads, zero_copy, f"{path}[1]")]
    if isinstance(space, gs.Graph):
        return _encode_graph(space, value, payloads, zero_copy, path)
    raise CodecError(f"{path}: cannot encode values of space type {type(space).__name__}")


def _encode_int(value: Any, path: str, what: str) -> Any:
    """An integer (a Discrete value, a OneOf index) as a JSON int, or ``{"__np__": [dtype, value]}``
    for a numpy integer: it keeps its type across (SAME_STEP's final_obs shows the env's own value)."""
    if isinstance(value, np.ndarray) and value.shape == ():
        value = value[()]
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise CodecError(f"{path}: {what} must be an integer, got {type(value).__name__}")
    if isinstance(value, np.integer):
        return {NP: [value.dtype.str, int(value)]}
    return int(value)  # an int, or a subclass such as an IntEnum member: its plain value


def _encode_rows(space: gs.Space, batched: gs.Space, rows: Any, payloads: list, zero_copy: bool, path: str) -> Any:
    """A Graph's nodes or edges (``k`` values of ``space`` batched as ``batched``): one array of
    shape ``(k, *space.shape)`` for an array or Discrete space, else a list of the ``k`` values."""
    if not isinstance(space, _ARRAY_SPACES + (gs.Discrete,)):
        try:
            items = list(iterate(batched, rows))
        except Exception as exc:  # noqa: BLE001 - iterate raises whatever the value provokes
            raise CodecError(f"{path}: not a batch of {space}: {exc}") from None
        return [_encode(space, v, payloads, zero_copy, f"{path}[{i}]") for i, v in enumerate(items)]
    try:
        arr = _contiguous(np.asarray(rows, dtype=space.dtype))
    except (TypeError, ValueError) as exc:
        raise CodecError(f"{path}: cannot convert to a {space.dtype} array: {exc}") from None
    row_shape = cast("tuple[int, ...]", space.shape)  # an array or Discrete space: never None (Discrete's is ())
    if arr.ndim != 1 + len(row_shape) or arr.shape[1:] != row_shape:
        raise CodecError(f"{path}: shape {arr.shape} is not (k, *{row_shape})")
    return _encode_array(arr, payloads, zero_copy)


def _encode_graph(space: gs.Graph, value: Any, payloads: list, zero_copy: bool, path: str) -> dict:
    if not isinstance(value, gs.GraphInstance):
        raise CodecError(f"{path}: Graph value must be a GraphInstance, got {type(value).__name__}")
    out: dict = {
        "nodes": _encode_rows(
            space.node_space, space.batch_node_space, value.nodes, payloads, zero_copy, f"{path}.nodes"
        ),
        "edges": None,
        "edge_links": None,
    }
    if value.edges is None and value.edge_links is None:
        return out
    if space.edge_space is None or value.edges is None or value.edge_links is None:
        raise CodecError(f"{path}: edges and edge_links go together, and only with an edge space")
    edges = out["edges"] = _encode_rows(
        space.edge_space, space.batch_edge_space, value.edges, payloads, zero_copy, f"{path}.edges"
    )
    n_edges = len(edges) if isinstance(edges, list) else edges[ND][2][0]
    links = _contiguous(np.asarray(value.edge_links))
    if links.dtype.kind not in "iu" or links.shape != (n_edges, 2):
        raise CodecError(f"{path}.edge_links: expected integers of shape (edges, 2), got {links.dtype} {links.shape}")
    out["edge_links"] = _encode_array(links, payloads, zero_copy)
    return out


def to_json_safe(value: Any, _depth: int = 0) -> Any:
    """A plain-JSON copy of ``value``: numpy scalars to Python scalars, arrays and
    tuples to lists, dict keys to strings; other objects to their ``repr()``."""
    if isinstance(value, np.generic):
        return value.item() if value.dtype.kind in "biuf" else _repr(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if _depth > MAX_INFO_DEPTH:
        return _repr(value)
    if isinstance(value, np.ndarray):
        return value.tolist() if value.dtype.kind in "biuf" else _repr(value)
    if isinstance(value, dict):
        return {k if isinstance(k, str) else str(k): to_json_safe(v, _depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_json_safe(v, _depth + 1) for v in value]
    return _repr(value)


def _repr(value: Any) -> str:
    try:
        text = repr(value)
    except Exception as exc:  # a broken __repr__ must not break the reply
        text = f"<unrepresentable {type(value).__name__}: {exc!r}>"
    return text[:MAX_REPR_CHARS]


# --------------------------------------------------------------------------- decode


def payload_len(p: Any) -> int:
    """The bytes of a payload (a ``memoryview``'s in bytes, whatever its item size)."""
    return p.nbytes if isinstance(p, memoryview) else len(p)


def _parse_nd(obj: Any, payloads: Payloads, path: str) -> tuple[int, np.dtype, tuple[int, ...]]:
    """Validate an ``{"__nd__": [k, dtype, shape]}`` leaf; return its parts."""
    if not isinstance(obj, dict) or len(obj) != 1 or ND not in obj:
        raise CodecError(f"{path}: expected an array leaf {{'{ND}': [index, dtype, shape]}}, got {type(obj).__name__}")
    ref = obj[ND]
    if not isinstance(ref, list) or len(ref) != 3:
        raise CodecError(f"{path}: array leaf must be [index, dtype, shape]")
    k, dtype_str, shape = ref
    if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k < len(payloads):
        raise CodecError(f"{path}: payload index {k!r} out of range (message has {len(payloads)} payloads)")
    if not isinstance(dtype_str, str) or not _DTYPE_RE.match(dtype_str):
        raise CodecError(f"{path}: dtype {dtype_str!r} refused (only bool/int/uint/float dtypes)")
    dtype = np.dtype(dtype_str)
    if (
        not isinstance(shape, list)
        or len(shape) > 32
        or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
    ):
        raise CodecError(f"{path}: shape {shape!r} is not a list of non-negative ints")
    n = dtype.itemsize
    for d in shape:
        n *= d
    got = payload_len(payloads[k])
    if got != n:
        raise CodecError(f"{path}: payload {k} has {got} bytes, shape {shape} of {dtype_str} needs {n}")
    return k, dtype, tuple(shape)


def _check_array(space: _ArraySpace, obj: Any, payloads: Payloads, path: str) -> tuple[int, tuple[int, ...]]:
    k, dtype, shape = _parse_nd(obj, payloads, path)
    if dtype != space.dtype:
        raise CodecError(f"{path}: dtype {dtype.str} does not match the space's {space.dtype.str}")
    if shape != space.shape:
        raise CodecError(f"{path}: shape {shape} does not match the space's {space.shape}")
    return k, shape


def _decode_discrete(space: gs.Discrete, obj: Any, path: str):
    start = int(space.start)
    return _decode_int(obj, start, start + int(space.n), path, "Discrete value")


def _decode_int(obj: Any, start: int, stop: int, path: str, what: str):
    """A Python int for a JSON int, a numpy integer for ``{"__np__": [dtype, value]}``: the type
    the sender's value had (Gymnasium's vectorizers hand the env's own value on, in ``final_obs``)."""
    scalar = None
    if isinstance(obj, dict) and len(obj) == 1 and NP in obj:
        scalar = _decode_np_scalar(obj[NP], path)
        if scalar.dtype.kind not in "iu":
            raise CodecError(f"{path}: {what} must be an integer, got {scalar.dtype.name}")
        obj = int(scalar)
    elif not isinstance(obj, int) or isinstance(obj, bool):
        raise CodecError(f"{path}: {what} must be an int, got {type(obj).__name__}")
    if not start <= obj < stop:
        raise CodecError(f"{path}: {what} {obj} out of range [{start}, {stop})")
    return obj if scalar is None else scalar


def _decode_lenient_array(space: gs.Space, obj: Any, path: str) -> np.ndarray:
    """Plain JSON numbers/lists for an array space (trusted senders only)."""
    try:
        arr = np.array(obj, dtype=space.dtype)
    except (TypeError, ValueError, OverflowError) as exc:
        raise CodecError(f"{path}: cannot convert to a {space.dtype} array: {exc}") from None
    if arr.shape != space.shape:
        raise CodecError(f"{path}: shape {arr.shape} does not match the space's {space.shape}")
    return arr


def decode(space: gs.Space, obj: Any, payloads: Payloads = (), *, copy: bool = False, lenient: bool = False) -> Any:
    """Decode a skeleton and its payloads (from :func:`encode`) back to a value of ``space``.

    Validates strictly (see the module docs) and raises :class:`CodecError`. Arrays
    are zero-copy read-only ``np.frombuffer`` views on the payloads unless
    ``copy=True``. Discrete values come back as they were sent (a Python int, or a numpy
    integer of the sender's dtype),
    Tuple values as tuples, Dict values as dicts in the space's key order, JSON-space
    values as they are. ``lenient=True`` (for data from a trusted sender, e.g. actions
    arriving at an env) also accepts plain JSON numbers/lists for array spaces.
    """
    return _decode(space, obj, payloads, copy, lenient, "value")


def _decode(space: gs.Space, obj: Any, payloads: Payloads, copy: bool, lenient: bool, path: str) -> Any:
    if isinstance(space, _ARRAY_SPACES):
        if lenient and not isinstance(obj, dict):
            return _decode_lenient_array(space, obj, path)
        k, shape = _check_array(space, obj, payloads, path)
        arr = np.frombuffer(payloads[k], dtype=space.dtype).reshape(shape)
        return arr.copy() if copy else arr
    if isinstance(space, gs.Discrete):
        return _decode_discrete(space, obj, path)
    if isinstance(space, gs.Text):
        if not isinstance(obj, str):
            raise CodecError(f"{path}: Text value must be a string, got {type(obj).__name__}")
        return obj
    if isinstance(space, gs.Dict):
        if not isinstance(obj, dict):
            raise CodecError(f"{path}: Dict value must be a JSON object, got {type(obj).__name__}")
        if len(obj) != len(space.spaces) or any(key not in obj for key in space.spaces):
            raise CodecError(f"{path}: Dict keys {sorted(obj)[:20]} do not match the space's {list(space.spaces)}")
        return {
            key: _decode(sub, obj[key], payloads, copy, lenient, f"{path}[{key!r}]")
            for key, sub in space.spaces.items()
        }
    if isinstance(space, gs.Tuple):
        if not isinstance(obj, list) or len(obj) != len(space.spaces):
            raise CodecError(f"{path}: Tuple value must be a list of length {len(space.spaces)}")
        return tuple(
            _decode(sub, v, payloads, copy, lenient, f"{path}[{i}]")
            for i, (sub, v) in enumerate(zip(space.spaces, obj))
        )
    if isinstance(space, JsonSpace):
        return obj
    if isinstance(space, gs.Sequence):
        if not isinstance(obj, list):
            raise CodecError(f"{path}: Sequence value must be a list, got {type(obj).__name__}")
        items = [_decode(space.feature_space, v, payloads, copy, lenient, f"{path}[{i}]") for i, v in enumerate(obj)]
        if not space.stack:
            return tuple(items)
        out = create_empty_array(space.feature_space, len(items))
        # out is None for a custom feature space, which concatenate takes (its annotation leaves None out).
        return concatenate(space.feature_space, items, out) if items else out  # type: ignore[arg-type]
    if isinstance(space, gs.OneOf):
        if not isinstance(obj, list) or len(obj) != 2:
            raise CodecError(f"{path}: OneOf value must be a list [index, value]")
        index = _decode_int(obj[0], 0, len(space.spaces), f"{path}[0]", "OneOf index")
        return index, _decode(space.spaces[int(index)], obj[1], payloads, copy, lenient, f"{path}[1]")
    if isinstance(space, gs.Graph):
        return _decode_graph(space, obj, payloads, copy, path)
    raise CodecError(f"{path}: cannot decode values of space type {type(space).__name__}")


def _decode_rows(space: gs.Space, obj: Any, payloads: Payloads, copy: bool, path: str) -> Any:
    """What :func:`_encode_rows` wrote: ``k`` values of ``space``, batched as Gymnasium batches them."""
    if not isinstance(space, _ARRAY_SPACES + (gs.Discrete,)):
        if not isinstance(obj, list):
            raise CodecError(f"{path}: expected a list of values, got {type(obj).__name__}")
        items = [_decode(space, v, payloads, copy, False, f"{path}[{i}]") for i, v in enumerate(obj)]
        out = create_empty_array(space, len(items))
        # out is None for a custom space, which concatenate takes (its annotation leaves None out).
        return concatenate(space, items, out) if items else out  # type: ignore[arg-type]
    k, dtype, shape = _parse_nd(obj, payloads, path)
    if dtype != space.dtype:
        raise CodecError(f"{path}: dtype {dtype.str} does not match the space's {space.dtype.str}")
    row_shape = cast("tuple[int, ...]", space.shape)  # an array or Discrete space: never None (Discrete's is ())
    if len(shape) != 1 + len(row_shape) or shape[1:] != row_shape:
        raise CodecError(f"{path}: shape {shape} is not (k, *{row_shape})")
    arr = np.frombuffer(payloads[k], dtype=dtype).reshape(shape)
    return arr.copy() if copy else arr


def _decode_graph(space: gs.Graph, obj: Any, payloads: Payloads, copy: bool, path: str) -> gs.GraphInstance:
    if not isinstance(obj, dict) or set(obj) != {"nodes", "edges", "edge_links"}:
        raise CodecError(f"{path}: Graph value must be an object with nodes, edges and edge_links")
    nodes = _decode_rows(space.node_space, obj["nodes"], payloads, copy, f"{path}.nodes")
    if obj["edges"] is None and obj["edge_links"] is None:
        return gs.GraphInstance(nodes, None, None)
    if space.edge_space is None or obj["edges"] is None or obj["edge_links"] is None:
        raise CodecError(f"{path}: edges and edge_links go together, and only with an edge space")
    edges = _decode_rows(space.edge_space, obj["edges"], payloads, copy, f"{path}.edges")
    n_edges = len(obj["edges"]) if isinstance(obj["edges"], list) else len(edges)
    k, dtype, shape = _parse_nd(obj["edge_links"], payloads, f"{path}.edge_links")
    if dtype.kind not in "iu" or shape != (n_edges, 2):
        raise CodecError(f"{path}.edge_links: expected integers of shape ({n_edges}, 2), got {dtype.str} {shape}")
    links = np.frombuffer(payloads[k], dtype=dtype).reshape(shape)
    return gs.GraphInstance(nodes, edges, links.copy() if copy else links)


#: Where the payload sizes of a shared-region step line with typed-column info begin (its first, the
#: observation's, empty)
_SHM_INFO_BINS = b',"_bin":[0,'


class ArrayLeaf:
    """The one skeleton a top-level array space's values always have, for hot paths.

    A Box/MultiBinary/MultiDiscrete value encoded first in a message is always
    ``{"__nd__": [0, dtype, shape]}`` with a payload of ``nbytes``: comparing a
    received skeleton with :attr:`skeleton` (one dict comparison) and the payload's
    length validates it exactly as :func:`decode` would, at a fraction of the cost.
    Anything else goes through :func:`decode` (which says what was wrong).

    >>> leaf = ArrayLeaf.of(gs.Box(-1, 1, (4,), np.float32))
    >>> leaf.decode({"__nd__": [0, "<f4", [4]]}, [bytes(16)])
    array([0., 0., 0., 0.], dtype=float32)
    """

    __slots__ = (
        "space",
        "dtype",
        "shape",
        "nbytes",
        "skeleton",
        "skeleton_json",
        "step_prefix",
        "step_suffix",
        "shm_skeleton",
        "shm_prefix",
        "shm_suffix",
    )

    def __init__(self, space: _ArraySpace):
        self.space = space
        self.dtype = np.dtype(space.dtype)
        self.shape = tuple(space.shape)
        self.nbytes = int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize
        self.skeleton = {ND: [0, self.dtype.str, list(self.shape)]}
        self.skeleton_json = json.dumps(self.skeleton, separators=(",", ":"))
        # The bytes around the reward and done flags of a plain step reply line (see step_line).
        self.step_prefix = step_reply_prefix(self.skeleton_json.encode())
        self.step_suffix = step_reply_suffix(self.nbytes)
        # The same line when the observation is in the env's shared region (slot 0): no payload bytes.
        self.shm_skeleton = {SHM: [0, self.dtype.str, list(self.shape)]}
        self.shm_prefix = step_reply_prefix(json.dumps(self.shm_skeleton, separators=(",", ":")).encode())
        self.shm_suffix = step_reply_suffix(0)

    @classmethod
    def of(cls, space: gs.Space) -> ArrayLeaf | None:
        """The leaf of ``space`` if it is a top-level array space, else ``None``."""
        return cls(space) if isinstance(space, _ARRAY_SPACES) else None

    def decode(self, obj: Any, payloads: Payloads) -> np.ndarray:
        """A writable copy of the value; falls back to :func:`decode` for any other skeleton."""
        if obj == self.skeleton and payloads and payload_len(payloads[0]) == self.nbytes:
            return np.frombuffer(payloads[0], dtype=self.dtype).reshape(self.shape).copy()
        return decode(self.space, obj, payloads, copy=True)

    def decode_action(self, obj: Any, payloads: Payloads) -> np.ndarray:
        """An action as :func:`encode_action` sent it: a writable array of the space's shape in
        the sender's numeric dtype (the space's own, unless the caller's batch had another)."""
        if obj == self.skeleton and payloads and payload_len(payloads[0]) == self.nbytes:
            return np.frombuffer(payloads[0], dtype=self.dtype).reshape(self.shape).copy()
        if isinstance(obj, dict) and ND in obj:
            k, dtype, shape = _parse_nd(obj, payloads, "action")
            if shape != self.shape:
                raise CodecError(f"action: shape {shape} does not match the space's {self.shape}")
            return np.frombuffer(payloads[k], dtype=dtype).reshape(shape).copy()
        return decode(self.space, obj, payloads, copy=True, lenient=True)

    # A step with an empty info and no autoreset is the hot path of every rollout. Its reply
    # line has one fixed shape (protocol.STEP_REPLY_LAYOUT), written by the Gymnasium env host and
    # read back by the vector env without a JSON parser; both ends use these methods.
    def step_line(self, reward: float, terminated: bool, truncated: bool) -> bytes:
        """The reply line of a plain step (a finite ``reward``); the payload follows it.

        >>> leaf = ArrayLeaf.of(gs.Box(-1, 1, (2,), np.float32))
        >>> leaf.step_line(1.0, False, True)
        b'{"obs":{"__nd__":[0,"<f4",[2]]},"reward":1.0,"terminated":false,"truncated":true,"info":{},"_bin":[8]}\\n'
        >>> leaf.parse_step_line(leaf.step_line(0.5, True, False))
        (0.5, True, False)
        """
        return b"".join(
            (
                self.step_prefix,
                repr(float(reward)).encode(),
                _STEP_FLAGS_BYTES[bool(terminated), bool(truncated)],
                self.step_suffix,
            )
        )

    def info_step_suffix(self, member: bytes, sizes: list[int], shm: bool = False) -> bytes:
        """The end of a step reply line whose info is typed columns (``{"__cols__": member}``, its
        payloads of ``sizes`` after the observation's; :mod:`~boltzlabs_gym.wire.info_layout`):
        what :meth:`step_reply` writes after the flags in place of the empty info's. ``shm``: the
        observation is in the env's shared region (:meth:`shm_step_reply`), its payload empty.

        >>> leaf = ArrayLeaf.of(gs.Box(-1, 1, (2,), np.float32))
        >>> leaf.info_step_suffix(b'{"keys":[]}', [1, 8])
        b',"info":{"__cols__":{"keys":[]}},"_bin":[8,1,8]}\\n'
        >>> leaf.info_step_suffix(b'{"keys":[]}', [1, 8], shm=True)
        b',"info":{"__cols__":{"keys":[]}},"_bin":[0,1,8]}\\n'
        """
        bins = b",".join(b"%d" % s for s in (0 if shm else self.nbytes, *sizes))
        return b',"info":{"%s":%s},"_bin":[%s]}\n' % (COLS.encode(), member, bins)

    def step_reply(
        self,
        obs: Any,
        reward: float,
        terminated: bool,
        truncated: bool,
        info_suffix: bytes | None = None,
        info_payloads: Sequence[Any] = (),
    ) -> bytes | None:
        """The whole reply of a plain step (:meth:`step_line` and the observation's bytes), or
        ``None`` when ``obs`` is not an array of the space's dtype and shape or ``reward`` is
        not finite (the generic encoders then say what is wrong, or write NaN). With
        ``info_suffix`` (:meth:`info_step_suffix`), its info is typed columns, whose payloads
        ``info_payloads`` follow the observation's."""
        if (
            type(obs) is not np.ndarray
            or obs.dtype != self.dtype
            or obs.shape != self.shape
            or not obs.flags.c_contiguous
            or not math.isfinite(reward)
        ):
            return None
        # The array itself (its buffer) joins the line: no view objects on the hot path. (The type checker
        # does not see an ndarray as a buffer on Python < 3.12: see _array_payload.)
        parts: tuple[Any, ...] = (
            self.step_prefix,
            repr(reward).encode(),
            _STEP_FLAGS_BYTES[terminated, truncated],
            self.step_suffix if info_suffix is None else info_suffix,
            obs,
            *info_payloads,
        )
        return b"".join(parts)

    def shm_step_reply(
        self,
        obs: Any,
        reward: float,
        terminated: bool,
        truncated: bool,
        slot: Any,
        info_suffix: bytes | None = None,
        info_payloads: Sequence[Any] = (),
    ) -> bytes | None:
        """:meth:`step_reply` for an env with a shared observation region: the observation is copied
        into ``slot`` (an array of the space's dtype and shape on the region) and the line refers to
        it (``{"__shm__": [0, dtype, shape]}``, ``"_bin":[0]``); ``None`` as for :meth:`step_reply`.
        With ``info_suffix`` (:meth:`info_step_suffix` with ``shm``), its info is typed columns,
        whose payloads ``info_payloads`` follow the line."""
        if (
            type(obs) is not np.ndarray
            or obs.dtype != self.dtype
            or obs.shape != self.shape
            or not math.isfinite(reward)
        ):
            return None
        slot[...] = obs
        parts: tuple[Any, ...] = (
            self.shm_prefix,
            repr(reward).encode(),
            _STEP_FLAGS_BYTES[terminated, truncated],
            self.shm_suffix if info_suffix is None else info_suffix,
            *info_payloads,
        )
        return b"".join(parts)

    def shm_line(self, reward: float, terminated: bool, truncated: bool) -> bytes:
        """The line of :meth:`shm_step_reply` alone (the observation already in its slot)."""
        return b"".join(
            (self.shm_prefix, repr(float(reward)).encode(), _STEP_FLAGS_BYTES[terminated, truncated], self.shm_suffix)
        )

    def shm_to_step_line(self, line: bytes) -> bytes | None:
        """The plain step line (:meth:`step_line`) a shared-region step line stands for, or ``None``
        when ``line`` is not exactly one (the reference then goes the general way)."""
        prefix, suffix = self.shm_prefix, self.shm_suffix
        if not (line.startswith(prefix) and line.endswith(suffix)):
            return None
        return b"".join((self.step_prefix, line[len(prefix) : len(line) - len(suffix)], self.step_suffix))

    def shm_to_info_step_line(self, line: bytes) -> bytes | None:
        """The step line with typed-column info (:meth:`info_step_suffix`) that a shared-region one
        (:meth:`shm_step_reply`'s) stands for: the same line with the observation as its first
        payload. ``None`` when ``line`` is not one (the reference then goes the general way). The
        rest of the line is left for the reader to check, as it checks an env's own.

        >>> leaf = ArrayLeaf.of(gs.Box(-1, 1, (2,), np.float32))
        >>> end = leaf.info_step_suffix(b'{"keys":[]}', [1, 8], shm=True)
        >>> leaf.shm_to_info_step_line(leaf.shm_line(0.5, True, False).replace(leaf.shm_suffix, end))
        b'{"obs":{"__nd__":[0,"<f4",[2]]},"reward":0.5,"terminated":true,"truncated":false,"info":{"__cols__":{"keys":[]}},"_bin":[8,1,8]}\\n'
        """
        prefix = self.shm_prefix
        if not line.startswith(prefix):
            return None
        cut = line.find(INFO_COLS_MARK, len(prefix))
        bins = line.rfind(_SHM_INFO_BINS)
        if cut < 0 or bins < cut or not line.endswith(b"]}\n"):
            return None
        return b"".join(
            (
                self.step_prefix,
                line[len(prefix) : bins],
                b',"_bin":[%d,' % self.nbytes,
                line[bins + len(_SHM_INFO_BINS) :],
            )
        )

    def parse_info_step_line(self, line: bytes) -> tuple[float, bool, bool, bytes] | None:
        """``(reward, terminated, truncated, end)`` of a step line whose info is typed columns (its
        ``end`` from the info on, :meth:`info_step_suffix`'s, for the reader to look up), else ``None``.

        >>> leaf = ArrayLeaf.of(gs.Box(-1, 1, (2,), np.float32))
        >>> end = leaf.info_step_suffix(b'{"keys":[]}', [1, 8])
        >>> leaf.parse_info_step_line(leaf.step_line(0.5, True, False).replace(leaf.step_suffix, end))[:3]
        (0.5, True, False)
        """
        prefix = self.step_prefix
        if not line.startswith(prefix):
            return None
        cut = line.find(INFO_COLS_MARK, len(prefix))
        if cut < 0:
            return None
        middle = line[len(prefix) : cut]
        comma = middle.find(b",")
        flags = _STEP_FLAGS.get(middle[comma:]) if comma > 0 else None
        if flags is None:
            return None
        try:
            return (float(middle[:comma]), *flags, line[cut:])
        except ValueError:
            return None

    def parse_step_line(self, line: bytes) -> tuple[float, bool, bool] | None:
        """``(reward, terminated, truncated)`` of a line of exactly :meth:`step_line`'s shape, else ``None``.

        The line comes from the worker, which has checked it is one JSON object; any line
        that is not exactly this shape (other keys, an info, a reset observation) gives
        ``None`` and is parsed as JSON.
        """
        prefix, suffix = self.step_prefix, self.step_suffix
        if not (line.startswith(prefix) and line.endswith(suffix)):
            return None
        middle = line[len(prefix) : len(line) - len(suffix)]
        comma = middle.find(b",")
        flags = _STEP_FLAGS.get(middle[comma:]) if comma > 0 else None
        if flags is None:
            return None
        try:
            return (float(middle[:comma]), *flags)
        except ValueError:
            return None


_STEP_FLAGS_BYTES = STEP_REPLY_FLAGS
# The flags back from their bytes: in the layout they run from the first comma after the reward.
_STEP_FLAGS = {v: k for k, v in _STEP_FLAGS_BYTES.items()}


# --------------------------------------------------------------------------- infos


def _decode_np_scalar(ref: Any, path: str) -> np.generic:
    if not isinstance(ref, list) or len(ref) != 2:
        raise CodecError(f"{path}: numpy scalar must be [dtype, value]")
    dtype_str, v = ref
    if not isinstance(dtype_str, str) or not _DTYPE_RE.match(dtype_str):
        raise CodecError(f"{path}: dtype {dtype_str!r} refused (only bool/int/uint/float dtypes)")
    dtype = np.dtype(dtype_str)
    kind = dtype.kind
    if kind == "b":
        ok = isinstance(v, bool)
    elif kind in "iu":
        ok = isinstance(v, int) and not isinstance(v, bool) and np.iinfo(dtype).min <= v <= np.iinfo(dtype).max
    else:
        ok = isinstance(v, (int, float)) and not isinstance(v, bool)
    if not ok:
        raise CodecError(f"{path}: value {v!r} is not a valid {dtype.name}")
    return dtype.newbyteorder("=").type(v)


def encode_info(value: Any, payloads: list | None = None, *, zero_copy: bool = False) -> tuple[Any, list]:
    """Encode a schemaless value (an info dict, a ``call`` result) as ``(skeleton, payloads)``.

    JSON values pass through (NaN/inf floats included; the line protocol allows
    them). Numpy arrays of bool/int/uint/float dtype become ``__nd__`` payload
    references, numpy scalars of those dtypes ``{"__np__": [dtype, value]}``
    inline (no payload); tuples ``{"__tuple__": [items]}`` (so that they decode as tuples, as
    SyncVectorEnv passes them on: ALE's ``info["seeds"]``), lists stay lists; dict
    keys become strings; a user dict whose only key is a marker (``"__nd__"`` /
    ``"__np__"``/``"__tuple__"``/``"__esc__"``) is escaped as ``{"__esc__": dict}``; anything else (objects,
    complex or string arrays) becomes its ``repr()`` string, truncated to
    :data:`MAX_REPR_CHARS`. Appends to ``payloads`` when given.
    """
    if payloads is None:
        payloads = []
    return _encode_info(value, payloads, zero_copy, 0), payloads


def _encode_info(value: Any, payloads: list, zero_copy: bool, depth: int) -> Any:
    if isinstance(value, np.generic):  # before the Python scalars: np.float64 is a float
        if value.dtype.kind in "biuf":
            return {NP: [value.dtype.str, value.item()]}
        return _repr(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if depth > MAX_INFO_DEPTH:
        return _repr(value)
    if isinstance(value, np.ndarray):
        if value.dtype.kind in "biuf":
            return _encode_array(_contiguous(value), payloads, zero_copy)
        return _repr(value)
    if isinstance(value, dict):
        out = {
            k if isinstance(k, str) else str(k): _encode_info(v, payloads, zero_copy, depth + 1)
            for k, v in value.items()
        }
        if len(out) == 1 and next(iter(out)) in _MARKERS:
            return {_ESC: out}
        return out
    if isinstance(value, tuple):
        return {TUPLE: [_encode_info(v, payloads, zero_copy, depth + 1) for v in value]}
    if isinstance(value, list):
        return [_encode_info(v, payloads, zero_copy, depth + 1) for v in value]
    return _repr(value)


def decode_info(obj: Any, payloads: Payloads = (), *, copy: bool = False) -> Any:
    """Decode :func:`encode_info` output (untrusted): ``__nd__`` leaves become arrays,
    ``__np__`` leaves numpy scalars, ``__tuple__`` leaves tuples, escaped dicts are unwrapped, the rest is JSON.

    Validates every array reference (index, dtype, payload length) and the nesting
    depth; raises :class:`CodecError`. Arrays are read-only views unless ``copy=True``.
    """
    return _decode_info(obj, payloads, copy, 0, "info")


def _decode_info(obj: Any, payloads: Payloads, copy: bool, depth: int, path: str) -> Any:
    if depth > MAX_INFO_DEPTH:
        raise CodecError(f"{path}: nested deeper than {MAX_INFO_DEPTH}")
    if isinstance(obj, dict):
        if len(obj) == 1:
            if ND in obj:
                k, dtype, shape = _parse_nd(obj, payloads, path)
                arr = np.frombuffer(payloads[k], dtype=dtype).reshape(shape)
                return arr.copy() if copy else arr
            if NP in obj:
                return _decode_np_scalar(obj[NP], path)
            if COLS in obj:
                try:
                    return decode_cols(obj[COLS], payloads, copy)
                except BadInfoMember as exc:
                    raise CodecError(f"{path}: {exc}") from None
            if TUPLE in obj:
                items = obj[TUPLE]
                if not isinstance(items, list):
                    raise CodecError(f"{path}: tuple must be a list of items")
                return tuple(_decode_info(v, payloads, copy, depth + 1, f"{path}[{i}]") for i, v in enumerate(items))
            if _ESC in obj:
                inner = obj[_ESC]
                if not isinstance(inner, dict):
                    raise CodecError(f"{path}: escaped value must be an object")
                return {k: _decode_info(v, payloads, copy, depth + 1, f"{path}[{k!r}]") for k, v in inner.items()}
        return {k: _decode_info(v, payloads, copy, depth + 1, f"{path}[{k!r}]") for k, v in obj.items()}
    if isinstance(obj, list):
        return [_decode_info(v, payloads, copy, depth + 1, f"{path}[{i}]") for i, v in enumerate(obj)]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise CodecError(f"{path}: not a JSON value: {type(obj).__name__}")
