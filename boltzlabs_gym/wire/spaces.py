"""Gymnasium spaces <-> JSON, and :class:`JsonSpace` for envs that declare none.

Spaces cross the sandbox boundary as plain JSON, never as pickles. The env side
describes its spaces with :func:`space_to_json`; the trainer rebuilds them with
:func:`space_from_json`, which treats its input as hostile: unknown types and
fields are refused, every field is type-checked, and sizes are bounded so that an
env cannot announce a space whose batch buffers would eat the trainer's memory.

The JSON forms (all keys required unless marked optional)::

    {"type": "Box", "shape": [3, 2], "dtype": "float32",
     "low": <bound>, "high": <bound>}
    {"type": "Discrete", "n": 4, "start": 0, "dtype": "int64"}
    {"type": "MultiDiscrete", "shape": [2], "nvec": <ints>, "start": <ints>,
     "dtype": "int64"}
    {"type": "MultiBinary", "n": 5}                 # or "n": [2, 3]
    {"type": "Text", "max_length": 8, "min_length": 1, "charset": "abc"}
    {"type": "Dict", "spaces": [["key", <space>], ...]}   # order preserved
    {"type": "Tuple", "spaces": [<space>, ...]}
    {"type": "Sequence", "space": <space>, "stack": false}   # "stack" optional
    {"type": "OneOf", "spaces": [<space>, ...]}
    {"type": "Graph", "node_space": <space>, "edge_space": <space>|null}
    {"type": "Json"}                                 # any JSON value

A ``<bound>`` (and ``<ints>``) is either one scalar, when every element is equal,
or a flat C-order list with one entry per element. JSON has no infinities, so
non-finite floats are written as the strings ``"inf"``, ``"-inf"`` and ``"nan"``.

Seeding: :func:`space_from_json` returns unseeded spaces. A space's random generator
crosses separately, because ``SyncVectorEnv`` batches env 0's own spaces (``batch_space``
copies their generators), so a seed the env's factory gave its action space carries over
to the batched space: :func:`rng_state_to_json` describes the generators of a space and
its subspaces (Dict, Tuple, OneOf; a Sequence's feature space; a Graph's node and edge spaces)::

    {"state": <PCG64 bit_generator.state> | null, "spaces": [<rng json>, ...]}  # "spaces" optional

and :func:`seed_space_from_json` gives a rebuilt space those generators (``null``: the
space was never seeded and stays unseeded, as it was there).

:class:`JsonSpace` is the honest space of an env that does not declare one: its
elements are arbitrary JSON values. It cannot be sampled
(:meth:`JsonSpace.sample` raises :class:`NotImplementedError`, since no
meaningful random JSON value exists), and it batches, like Gymnasium's other
non-array spaces, into a ``Tuple`` of copies (``batch_space`` and
:func:`batch_json_space`); the singledispatch helpers of
``gymnasium.vector.utils`` (``batch_space``, ``concatenate`` and
``create_empty_array``) are registered for it at import; ``iterate`` over a
batched space works as for Gymnasium's ``Text``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Set as AbstractSet
from copy import deepcopy
from typing import Any, cast

import numpy as np
from gymnasium import spaces as gs
from gymnasium.vector.utils import space_utils as _su

__all__ = [
    "JsonSpace",
    "space_to_json",
    "space_from_json",
    "batch_json_space",
    "rng_state_to_json",
    "seed_space_from_json",
    "MAX_ELEMENTS",
    "MAX_NODES",
    "MAX_DEPTH",
    "MAX_DIMS",
    "MAX_TEXT_LENGTH",
    "MAX_CHARSET",
    "ALLOWED_DTYPES",
]

#: Most array elements a whole space (all its leaves together) may hold.
#: 64 Mi elements: a 4K RGB frame is 25 Mi; a hostile 10^12 is refused.
MAX_ELEMENTS = 1 << 26
#: Most spaces (nodes) in one nested space.
MAX_NODES = 10_000
#: Deepest nesting of Dict/Tuple.
MAX_DEPTH = 32
#: Most dimensions of one array space.
MAX_DIMS = 32
#: Largest Text ``max_length``.
MAX_TEXT_LENGTH = 1 << 20
#: Largest Text charset, in characters.
MAX_CHARSET = 1 << 16

#: Dtypes an array space may have: booleans, integers and floats only.
ALLOWED_DTYPES = frozenset(
    ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16", "float32", "float64"]
)
_INT_DTYPES = frozenset(d for d in ALLOWED_DTYPES if "int" in d)


# --------------------------------------------------------------------------- JsonSpace


class JsonSpace(gs.Space):
    """The space of any JSON value: the honest space of an env that declares none.

    ``contains(x)`` is true when ``x`` is JSON-serialisable (NaN and infinities
    allowed, as on the wire). ``sample()`` raises :class:`NotImplementedError`:
    there is no meaningful random JSON value, and a silently random ``None``
    action would hide the mistake. It has no shape and no dtype, is not
    flattenable, and batches into a ``Tuple`` of ``JsonSpace`` (Gymnasium's
    ``batch_space`` does this for it; see :func:`batch_json_space`).
    """

    def __init__(self, seed: int | np.random.Generator | None = None):
        super().__init__(shape=None, dtype=None, seed=seed)

    @property
    def is_np_flattenable(self) -> bool:
        """JSON values have no fixed-size flat form."""
        return False

    def sample(self, mask: Any = None, probability: Any = None) -> Any:
        """Refuse: an undeclared space cannot be sampled."""
        raise NotImplementedError(
            "JsonSpace (an env that declares no space: any JSON value) cannot be sampled; "
            "declare observation_space/action_space in the env's serve(...) call to get a samplable space"
        )

    def contains(self, x: Any) -> bool:
        """True when ``x`` is a JSON-serialisable value."""
        try:
            json.dumps(x, allow_nan=True)
        except (TypeError, ValueError, RecursionError):
            return False
        return True

    def to_jsonable(self, sample_n):
        """JSON values are their own JSON form."""
        return list(sample_n)

    def from_jsonable(self, sample_n):
        """JSON values are their own JSON form."""
        return list(sample_n)

    def __repr__(self) -> str:
        return "JsonSpace()"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, JsonSpace)

    def __hash__(self) -> int:
        return hash(JsonSpace)


def batch_json_space(space: JsonSpace, n: int) -> gs.Tuple:
    """The batched space of ``n`` envs with a :class:`JsonSpace`: a ``Tuple`` of ``n`` copies.

    Identical to ``gymnasium.vector.utils.batch_space(space, n)``.
    """
    # batch_space dispatches a JsonSpace to _batch_space_json below, which returns a Tuple.
    return cast(gs.Tuple, _su.batch_space(space, n))


@_su.batch_space.register(JsonSpace)
def _batch_space_json(space: JsonSpace, n: int = 1) -> gs.Tuple:
    batched = gs.Tuple(tuple(deepcopy(space) for _ in range(n)), seed=deepcopy(space.np_random))
    rng = deepcopy(space.np_random)
    batched.seed(list(map(int, rng.integers(0, int(1e8), n))))
    return batched


@_su.concatenate.register(JsonSpace)
def _concatenate_json(space: JsonSpace, items, out) -> tuple:
    return tuple(items)


@_su.create_empty_array.register(JsonSpace)
def _create_empty_array_json(space: JsonSpace, n: int = 1, fn=np.zeros) -> tuple:
    return tuple(None for _ in range(n))


# ``iterate`` is deliberately *not* registered: Gymnasium iterates a batched
# ``Tuple(JsonSpace, ...)`` with ``iter(items)`` only when its subspaces' types are
# unregistered (as for Text); registering JsonSpace would make it zip over the
# inside of each env's JSON value instead.


# --------------------------------------------------------------------------- to JSON


def _scalar_to_json(x: Any, kind: str) -> Any:
    if kind == "b":
        return bool(x)
    if kind in "iu":
        return int(x)
    f = float(x)
    if math.isfinite(f):
        return f
    if math.isnan(f):
        return "nan"
    return "inf" if f > 0 else "-inf"


def _array_to_json(arr: np.ndarray) -> Any:
    """One scalar when all elements are equal, else a flat C-order list."""
    arr = np.asarray(arr)
    kind = arr.dtype.kind
    flat = arr.reshape(-1)
    if flat.size == 0:
        return []
    first = flat[0]
    if kind == "f":
        uniform = bool(np.all((flat == first) | (np.isnan(flat) & np.isnan(first))))
    else:
        uniform = bool(np.all(flat == first))
    if uniform:
        return _scalar_to_json(first, kind)
    return [_scalar_to_json(x, kind) for x in flat.tolist()]


def space_to_json(space: gs.Space) -> dict:
    """Describe a Gymnasium space as a JSON-serialisable dict (see the module docs).

    Supports Box, Discrete, MultiDiscrete, MultiBinary, Text, Dict (string keys,
    order kept), Tuple, Sequence, OneOf, Graph and :class:`JsonSpace`. Raises
    :class:`ValueError` for any other (custom) space or a Dict with non-string keys.
    Seeds are not part of the description (see :func:`rng_state_to_json`).
    """
    if isinstance(space, JsonSpace):
        return {"type": "Json"}
    if isinstance(space, gs.Box):
        return {
            "type": "Box",
            "shape": list(space.shape),
            "dtype": space.dtype.name,
            "low": _array_to_json(space.low),
            "high": _array_to_json(space.high),
        }
    if isinstance(space, gs.Discrete):
        return {"type": "Discrete", "n": int(space.n), "start": int(space.start), "dtype": space.dtype.name}
    if isinstance(space, gs.MultiDiscrete):
        return {
            "type": "MultiDiscrete",
            "shape": list(space.shape),
            "nvec": _array_to_json(space.nvec),
            "start": _array_to_json(space.start),
            "dtype": space.dtype.name,
        }
    if isinstance(space, gs.MultiBinary):
        n = space.n
        return {"type": "MultiBinary", "n": int(n) if isinstance(n, (int, np.integer)) else [int(d) for d in n]}
    if isinstance(space, gs.Text):
        return {
            "type": "Text",
            "max_length": int(space.max_length),
            "min_length": int(space.min_length),
            "charset": "".join(space.character_list),
        }
    if isinstance(space, gs.Dict):
        pairs = []
        for key, sub in space.spaces.items():
            if not isinstance(key, str):
                raise ValueError(f"Dict space key {key!r} is not a string; only string keys cross as JSON")
            pairs.append([key, space_to_json(sub)])
        return {"type": "Dict", "spaces": pairs}
    if isinstance(space, gs.Tuple):
        return {"type": "Tuple", "spaces": [space_to_json(sub) for sub in space.spaces]}
    if isinstance(space, gs.Sequence):
        return {"type": "Sequence", "space": space_to_json(space.feature_space), "stack": bool(space.stack)}
    if isinstance(space, gs.OneOf):
        return {"type": "OneOf", "spaces": [space_to_json(sub) for sub in space.spaces]}
    if isinstance(space, gs.Graph):
        edge = None if space.edge_space is None else space_to_json(space.edge_space)
        return {"type": "Graph", "node_space": space_to_json(space.node_space), "edge_space": edge}
    raise ValueError(
        f"space type {type(space).__name__} has no JSON form (supported: Box, Discrete, "
        "MultiDiscrete, MultiBinary, Text, Dict, Tuple, Sequence, OneOf, Graph, JsonSpace)"
    )


# --------------------------------------------------------------------------- from JSON


class _Budget:
    def __init__(self, max_elements: int, max_nodes: int):
        self.elements = max_elements
        self.nodes = max_nodes

    def take_node(self, path: str) -> None:
        self.nodes -= 1
        if self.nodes < 0:
            raise ValueError(f"{path}: space has more than the allowed number of subspaces")

    def take_elements(self, n: int, path: str) -> None:
        self.elements -= n
        if self.elements < 0:
            raise ValueError(f"{path}: space has too many elements in total (limit exceeded at this leaf)")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_fields(data: dict, path: str, required: AbstractSet[str], optional: AbstractSet[str] = frozenset()) -> None:
    keys = set(data)
    missing = required - keys
    if missing:
        raise ValueError(f"{path}: missing field {sorted(missing)[0]!r}")
    extra = keys - required - optional - {"type"}
    if extra:
        raise ValueError(f"{path}: unknown field {sorted(extra)[0]!r}")


def _int_field(data: dict, name: str, path: str, lo: int | None = None, hi: int | None = None) -> int:
    v = data[name]
    if not _is_int(v):
        raise ValueError(f"{path}.{name}: expected an integer, got {type(v).__name__}")
    if lo is not None and v < lo:
        raise ValueError(f"{path}.{name}: must be >= {lo}, got {v}")
    if hi is not None and v > hi:
        raise ValueError(f"{path}.{name}: must be <= {hi}, got {v}")
    return v


def _dtype_field(data: dict, name: str, path: str, allowed: frozenset[str] = ALLOWED_DTYPES) -> np.dtype:
    v = data[name]
    if not isinstance(v, str) or v not in allowed:
        raise ValueError(f"{path}.{name}: dtype must be one of {sorted(allowed)}, got {v!r}")
    return np.dtype(v)


def _shape_field(data: dict, name: str, path: str) -> tuple[int, ...]:
    v = data[name]
    if not isinstance(v, list):
        raise ValueError(f"{path}.{name}: expected a list of dimensions, got {type(v).__name__}")
    if len(v) > MAX_DIMS:
        raise ValueError(f"{path}.{name}: more than {MAX_DIMS} dimensions")
    for d in v:
        if not _is_int(d) or d < 0:
            raise ValueError(f"{path}.{name}: dimensions must be non-negative integers, got {d!r}")
        if d > MAX_ELEMENTS:
            raise ValueError(f"{path}.{name}: too many elements: dimension {d} exceeds the element limit")
    return tuple(v)


def _n_elements(shape: tuple[int, ...], path: str) -> int:
    n = 1
    for d in shape:
        n *= d
        if n > MAX_ELEMENTS * MAX_ELEMENTS:  # stop the product growing without bound
            raise ValueError(f"{path}.shape: too many elements")
    return n


def _scalar_from_json(v: Any, dtype: np.dtype, where: str) -> Any:
    kind = dtype.kind
    if kind == "b":
        if isinstance(v, bool) or (_is_int(v) and v in (0, 1)):
            return bool(v)
        raise ValueError(f"{where}: expected a boolean, got {v!r}")
    if kind in "iu":
        if not _is_int(v):
            raise ValueError(f"{where}: expected an integer, got {v!r}")
        info = np.iinfo(dtype)
        if not info.min <= v <= info.max:
            raise ValueError(f"{where}: {v} does not fit {dtype.name}")
        return v
    # float
    if isinstance(v, str):
        if v in ("inf", "-inf", "nan"):
            return float(v)
        raise ValueError(f"{where}: expected a number or 'inf'/'-inf'/'nan', got {v!r}")
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"{where}: expected a number, got {v!r}")
    return float(v)


def _array_from_json(v: Any, shape: tuple[int, ...], size: int, dtype: np.dtype, where: str) -> np.ndarray:
    if isinstance(v, list):
        if len(v) != size:
            raise ValueError(
                f"{where}: expected {size} elements (one per element of shape {list(shape)}), got {len(v)}"
            )
        vals = [_scalar_from_json(x, dtype, where) for x in v]
        return np.array(vals, dtype=dtype).reshape(shape)
    return np.full(shape, _scalar_from_json(v, dtype, where), dtype=dtype)


def _from_json(data: Any, path: str, budget: _Budget, depth: int) -> gs.Space:
    if depth > MAX_DEPTH:
        raise ValueError(f"{path}: spaces nested deeper than {MAX_DEPTH}")
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object describing a space, got {type(data).__name__}")
    budget.take_node(path)
    kind = data.get("type")
    if not isinstance(kind, str):
        raise ValueError(f"{path}.type: missing or not a string")
    try:
        return _BUILDERS[kind](data, path, budget, depth)
    except KeyError:
        if kind not in _BUILDERS:
            raise ValueError(
                f"{path}.type: unknown space type {kind!r} (known: {', '.join(sorted(_BUILDERS))})"
            ) from None
        raise


def _guard(path: str, build):
    """Turn a Gymnasium constructor's TypeError/ValueError into a ValueError naming the path."""
    try:
        return build()
    except (TypeError, ValueError, OverflowError, AssertionError) as exc:
        raise ValueError(f"{path}: {exc}") from None


def _box(data, path, budget, depth):
    _check_fields(data, path, {"shape", "dtype", "low", "high"})
    shape = _shape_field(data, "shape", path)
    dtype = _dtype_field(data, "dtype", path)
    size = _n_elements(shape, path)
    budget.take_elements(size, path)
    low = _array_from_json(data["low"], shape, size, dtype, f"{path}.low")
    high = _array_from_json(data["high"], shape, size, dtype, f"{path}.high")
    return _guard(path, lambda: gs.Box(low=low, high=high, shape=shape, dtype=dtype))


def _discrete(data, path, budget, depth):
    _check_fields(data, path, {"n"}, {"start", "dtype"})
    dtype = _dtype_field(data, "dtype", path, _INT_DTYPES) if "dtype" in data else np.dtype(np.int64)
    info = np.iinfo(dtype)
    n = _int_field(data, "n", path, 1, info.max)
    start = _int_field(data, "start", path, info.min, info.max) if "start" in data else 0
    if start + n - 1 > info.max:
        raise ValueError(f"{path}.n: start + n - 1 does not fit {dtype.name}")
    budget.take_elements(1, path)
    return _guard(path, lambda: gs.Discrete(n, start=start, dtype=dtype))


def _multidiscrete(data, path, budget, depth):
    _check_fields(data, path, {"shape", "nvec"}, {"start", "dtype"})
    shape = _shape_field(data, "shape", path)
    dtype = _dtype_field(data, "dtype", path, _INT_DTYPES) if "dtype" in data else np.dtype(np.int64)
    size = _n_elements(shape, path)
    budget.take_elements(size, path)
    nvec = _array_from_json(data["nvec"], shape, size, dtype, f"{path}.nvec")
    if nvec.size and nvec.min() < 1:
        raise ValueError(f"{path}.nvec: every entry must be >= 1")
    start = _array_from_json(data.get("start", 0), shape, size, dtype, f"{path}.start")
    return _guard(path, lambda: gs.MultiDiscrete(nvec, dtype=dtype, start=start))


def _multibinary(data, path, budget, depth):
    _check_fields(data, path, {"n"})
    n = data["n"]
    if _is_int(n):
        if not 1 <= n <= MAX_ELEMENTS:
            raise ValueError(f"{path}.n: must be between 1 and {MAX_ELEMENTS}, got {n}")
        budget.take_elements(n, path)
        return _guard(path, lambda: gs.MultiBinary(n))
    shape = _shape_field(data, "n", path)
    if any(d < 1 for d in shape):
        raise ValueError(f"{path}.n: every dimension must be >= 1")
    budget.take_elements(_n_elements(shape, path), path)
    return _guard(path, lambda: gs.MultiBinary(list(shape)))


def _text(data, path, budget, depth):
    _check_fields(data, path, {"max_length"}, {"min_length", "charset"})
    max_length = _int_field(data, "max_length", path, 0, MAX_TEXT_LENGTH)
    min_length = _int_field(data, "min_length", path, 0, max_length) if "min_length" in data else min(1, max_length)
    kwargs: dict[str, Any] = {"min_length": min_length}
    if "charset" in data:
        charset = data["charset"]
        if not isinstance(charset, str) or not charset:
            raise ValueError(f"{path}.charset: expected a non-empty string")
        if len(charset) > MAX_CHARSET:
            raise ValueError(f"{path}.charset: longer than {MAX_CHARSET} characters")
        kwargs["charset"] = charset
    budget.take_elements(1, path)
    return _guard(path, lambda: gs.Text(max_length, **kwargs))


def _dict(data, path, budget, depth):
    _check_fields(data, path, {"spaces"})
    items = data["spaces"]
    if not isinstance(items, list):
        raise ValueError(f"{path}.spaces: expected a list of [key, space] pairs")
    pairs = []
    seen = set()
    for i, item in enumerate(items):
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str)):
            raise ValueError(f"{path}.spaces[{i}]: expected a [string key, space] pair")
        key = item[0]
        if key in seen:
            raise ValueError(f"{path}.spaces[{i}]: duplicate key {key!r}")
        seen.add(key)
        pairs.append((key, _from_json(item[1], f"{path}[{key!r}]", budget, depth + 1)))
    return _guard(path, lambda: gs.Dict(pairs))


def _tuple(data, path, budget, depth):
    _check_fields(data, path, {"spaces"})
    items = data["spaces"]
    if not isinstance(items, list):
        raise ValueError(f"{path}.spaces: expected a list of spaces")
    subs = [_from_json(item, f"{path}[{i}]", budget, depth + 1) for i, item in enumerate(items)]
    return _guard(path, lambda: gs.Tuple(subs))


def _sequence(data, path, budget, depth):
    _check_fields(data, path, {"space"}, {"stack"})
    stack = data.get("stack", False)
    if not isinstance(stack, bool):
        raise ValueError(f"{path}.stack: expected a boolean, got {type(stack).__name__}")
    feature = _from_json(data["space"], f"{path}.space", budget, depth + 1)
    return _guard(path, lambda: gs.Sequence(feature, stack=stack))


def _oneof(data, path, budget, depth):
    _check_fields(data, path, {"spaces"})
    items = data["spaces"]
    if not isinstance(items, list) or not items:
        raise ValueError(f"{path}.spaces: expected a non-empty list of spaces")
    subs = [_from_json(item, f"{path}[{i}]", budget, depth + 1) for i, item in enumerate(items)]
    return _guard(path, lambda: gs.OneOf(subs))


def _graph(data, path, budget, depth):
    _check_fields(data, path, {"node_space", "edge_space"})
    node = _from_json(data["node_space"], f"{path}.node_space", budget, depth + 1)
    edge = None
    if data["edge_space"] is not None:
        edge = _from_json(data["edge_space"], f"{path}.edge_space", budget, depth + 1)
    return _guard(path, lambda: gs.Graph(node, edge))


def _json(data, path, budget, depth):
    _check_fields(data, path, set())
    return JsonSpace()


_BUILDERS = {
    "Box": _box,
    "Discrete": _discrete,
    "MultiDiscrete": _multidiscrete,
    "MultiBinary": _multibinary,
    "Text": _text,
    "Dict": _dict,
    "Tuple": _tuple,
    "Sequence": _sequence,
    "OneOf": _oneof,
    "Graph": _graph,
    "Json": _json,
}


# --------------------------------------------------------------------------- generators


def _subspaces(space: gs.Space) -> list:
    if isinstance(space, gs.Dict):
        return list(space.spaces.values())
    if isinstance(space, (gs.Tuple, gs.OneOf)):
        return list(space.spaces)
    if isinstance(space, gs.Sequence):
        return [space.feature_space]
    if isinstance(space, gs.Graph):
        return [space.node_space] + ([] if space.edge_space is None else [space.edge_space])
    return []


def rng_state_to_json(space: gs.Space) -> dict:
    """The state of ``space``'s random generator and its subspaces' (see the module docs).

    A generator that was never created (the space was never seeded or sampled) is ``null``:
    reading ``space.np_random`` would seed it, a side effect this must not have. Only
    Gymnasium's own bit generator (PCG64) is described; any other is ``null``.
    """
    rng = getattr(space, "_np_random", None)
    state = None
    if isinstance(rng, np.random.Generator) and type(rng.bit_generator) is np.random.PCG64:
        state = rng.bit_generator.state
    out: dict[str, Any] = {"state": state}
    subs = _subspaces(space)
    if subs:
        out["spaces"] = [rng_state_to_json(sub) for sub in subs]
    return out


def seed_space_from_json(space: gs.Space, data: Any) -> None:
    """Give ``space`` (and its subspaces) the generator states :func:`rng_state_to_json` described.

    The data comes from the sandbox: anything malformed leaves that (sub)space unseeded
    rather than failing, since a generator's state is a convenience, not a contract.
    """
    if not isinstance(data, dict):
        return
    state = data.get("state")
    if isinstance(state, dict) and state.get("bit_generator") == "PCG64":
        bit_generator = np.random.PCG64()
        try:
            # Untrusted, hence only a dict to the type checker: the setter validates it and raises what is caught below.
            bit_generator.state = state  # type: ignore[assignment]
        except (TypeError, ValueError, KeyError, OverflowError):
            pass
        else:
            # Space has no public setter for its generator; seed() cannot set a given state.
            space._np_random = np.random.Generator(bit_generator)
    subs, children = _subspaces(space), data.get("spaces")
    if subs and isinstance(children, list) and len(children) == len(subs):
        for sub, child in zip(subs, children):
            seed_space_from_json(sub, child)


def space_from_json(data: dict | None, *, max_elements: int = MAX_ELEMENTS, max_nodes: int = MAX_NODES) -> gs.Space:
    """Rebuild a Gymnasium space from its JSON form, validating it as untrusted input.

    ``None`` (an env that declares no space, as ``serve()``'s ``describe`` sends it)
    gives a :class:`JsonSpace`. Raises :class:`ValueError` naming the offending field
    (e.g. ``"space['pos'].shape: ..."``) for an unknown type, a missing, unknown or
    ill-typed field, or a space over the limits: ``max_elements`` array elements in
    total, ``max_nodes`` subspaces, :data:`MAX_DEPTH` nesting, :data:`MAX_DIMS`
    dimensions. The space is unseeded: call ``space.seed(...)`` for reproducible samples.
    """
    if data is None:
        return JsonSpace()
    return _from_json(data, "space", _Budget(max_elements, max_nodes), 0)
