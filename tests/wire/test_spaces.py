"""Gymnasium spaces <-> JSON: round trips, hostile input, and JsonSpace."""

from __future__ import annotations

import copy
import json
import pickle

import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces as gs
from gymnasium.vector.utils import batch_space, concatenate, create_empty_array, iterate

from boltzlabs_gym.wire.spaces import (JsonSpace, batch_json_space, rng_state_to_json, seed_space_from_json, space_from_json,
                                   space_to_json)


def _wire(data):
    """What crosses the wire: strict JSON (no NaN/Infinity literals)."""
    return json.loads(json.dumps(data, allow_nan=False))


SPACES = {
    "box_uniform": gs.Box(0.0, 1.0, (3, 2), np.float32),
    "box_inf": gs.Box(-np.inf, np.inf, (4,), np.float64),
    "box_mixed": gs.Box(np.array([-np.inf, 0.5, -1.0], np.float32), np.array([1.0, np.inf, 1e30], np.float32)),
    "box_scalar_shape": gs.Box(-1.0, 1.0, (), np.float32),
    "box_f16": gs.Box(-2.0, 2.0, (2,), np.float16),
    "box_uint8_image": gs.Box(0, 255, (8, 8, 3), np.uint8),
    "box_int64_extremes": gs.Box(np.iinfo(np.int64).min, np.iinfo(np.int64).max, (2,), np.int64),
    "box_uint64": gs.Box(0, np.iinfo(np.uint64).max, (2,), np.uint64),
    "box_int8_varied": gs.Box(np.array([-128, 0], np.int8), np.array([5, 127], np.int8), dtype=np.int8),
    "box_bool": gs.Box(0, 1, (3,), bool),
    "box_empty": gs.Box(0.0, 1.0, (0,), np.float32),
    "discrete": gs.Discrete(5),
    "discrete_start": gs.Discrete(3, start=-1),
    "discrete_int32": gs.Discrete(7, start=2, dtype=np.int32),
    "multidiscrete": gs.MultiDiscrete([3, 4, 5]),
    "multidiscrete_2d_start": gs.MultiDiscrete(np.array([[2, 3], [4, 5]]), start=np.array([[0, -1], [2, 3]])),
    "multidiscrete_int8": gs.MultiDiscrete([2, 2], dtype=np.int8),
    "multibinary_int": gs.MultiBinary(6),
    "multibinary_shape": gs.MultiBinary([2, 3]),
    "text_default": gs.Text(12),
    "text_charset_order": gs.Text(5, min_length=0, charset="zyx10"),
    "text_set_charset": gs.Text(3, charset=frozenset("cab")),
    "tuple": gs.Tuple([gs.Discrete(2), gs.Box(0, 1, (2,), np.float32)]),
    "dict_order": gs.Dict([("z", gs.Discrete(2)), ("a", gs.MultiBinary(2)), ("m", gs.Text(4))]),
    "nested": gs.Dict(
        [
            ("pos", gs.Box(-np.inf, np.inf, (3,), np.float32)),
            ("inner", gs.Tuple([gs.Dict([("k", gs.Discrete(3, start=1))]), gs.Tuple([gs.MultiDiscrete([2, 9])])])),
        ]
    ),
    "empty_tuple": gs.Tuple([]),
    "json": JsonSpace(),
    "dict_with_json": gs.Dict([("free", JsonSpace()), ("n", gs.Discrete(2))]),
}


@pytest.mark.parametrize("name", sorted(SPACES))
def test_round_trip(name):
    space = SPACES[name]
    data = space_to_json(space)
    back = space_from_json(_wire(data))
    assert type(back) is type(space)
    assert back == space
    assert space_to_json(back) == data  # stable description
    if isinstance(space, gs.Dict):
        assert list(back.spaces) == list(space.spaces)  # order kept, not sorted
    if isinstance(space, gs.Box):
        assert back.dtype == space.dtype and back.shape == space.shape
        np.testing.assert_array_equal(back.low, space.low)
        np.testing.assert_array_equal(back.high, space.high)
    if isinstance(space, gs.Text):
        assert back.character_list == space.character_list
        assert (back.min_length, back.max_length) == (space.min_length, space.max_length)


def test_compact_bounds_and_nonfinite_strings():
    data = space_to_json(gs.Box(-np.inf, np.inf, (1000,), np.float32))
    assert data["low"] == "-inf" and data["high"] == "inf"
    data = space_to_json(SPACES["box_mixed"])
    assert data["low"][0] == "-inf" and data["high"][1] == "inf"
    assert len(json.dumps(space_to_json(gs.Box(0, 255, (84, 84, 4), np.uint8)))) < 200


def test_sampling_after_seed_is_deterministic():
    space = space_from_json(space_to_json(SPACES["nested"]))
    space.seed(3)
    a = space.sample()
    space.seed(3)
    b = space.sample()
    np.testing.assert_array_equal(a["pos"], b["pos"])
    assert a["inner"][0]["k"] == b["inner"][0]["k"]


def test_none_means_json_space():
    assert isinstance(space_from_json(None), JsonSpace)
    assert space_to_json(JsonSpace()) == {"type": "Json"}


class CustomSpace(gs.Space):
    """A space of the user's own: no JSON form."""


def test_unsupported_spaces_refused_on_encode():
    with pytest.raises(ValueError, match="CustomSpace has no JSON form"):
        space_to_json(CustomSpace())
    with pytest.raises(ValueError, match="not a string"):
        space_to_json(gs.Dict({1: gs.Discrete(2)}))


BOX = {"type": "Box", "shape": [2], "dtype": "float32", "low": 0.0, "high": 1.0}


def _box(**kw):
    return dict(BOX, **kw)


HOSTILE = [
    ([1, 2], "expected a JSON object"),
    ({"n": 2}, "type"),
    ({"type": "Pickle", "data": "..."}, "unknown space type 'Pickle'"),
    ({"type": "Box", "shape": [2], "dtype": "float32", "low": 0.0}, "missing field 'high'"),
    (_box(evil=1), "unknown field 'evil'"),
    (_box(dtype="object"), "dtype"),
    (_box(dtype="O"), "dtype"),
    (_box(dtype="float128"), "dtype"),
    (_box(dtype=4), "dtype"),
    (_box(shape=[-1]), "shape"),
    (_box(shape=[2.0]), "shape"),
    (_box(shape=[True]), "shape"),
    (_box(shape="2"), "shape"),
    (_box(shape=[1] * 40), "dimensions"),
    (_box(shape=[10**6, 10**6]), "too many elements"),
    (_box(shape=[10**12]), "element limit"),
    (_box(low=[0.0, 0.0, 0.0]), "space.low: expected 2 elements"),
    (_box(low="infinity"), "space.low"),
    (_box(low=None), "space.low"),
    (_box(high=[1.0, {"x": 1}]), "space.high"),
    (_box(dtype="int8", low=-1000, high=1), "does not fit int8"),
    (_box(dtype="int32", low=0.5, high=1), "expected an integer"),
    (_box(dtype="uint8", low="-inf", high=1), "expected an integer"),
    ({"type": "Discrete", "n": 0}, "space.n: must be >= 1"),
    ({"type": "Discrete", "n": True}, "space.n: expected an integer"),
    ({"type": "Discrete", "n": 2.5}, "space.n"),
    ({"type": "Discrete", "n": 2, "start": "0"}, "space.start"),
    ({"type": "Discrete", "n": 2, "dtype": "float32"}, "dtype"),
    ({"type": "Discrete", "n": 2**70}, "space.n"),
    ({"type": "MultiDiscrete", "shape": [2], "nvec": [2, 0]}, "nvec"),
    ({"type": "MultiDiscrete", "shape": [2], "nvec": [2]}, "nvec"),
    ({"type": "MultiDiscrete", "shape": [10**9], "nvec": 2}, "too many elements"),
    ({"type": "MultiBinary", "n": 0}, "space.n"),
    ({"type": "MultiBinary", "n": 10**12}, "space.n"),
    ({"type": "MultiBinary", "n": [10**5, 10**5]}, "too many elements"),
    ({"type": "MultiBinary", "n": [2, 0]}, "space.n"),
    ({"type": "Text", "max_length": 10**9}, "max_length"),
    ({"type": "Text", "max_length": 4, "min_length": 5}, "min_length"),
    ({"type": "Text", "max_length": 4, "charset": ""}, "charset"),
    ({"type": "Text", "max_length": 4, "charset": ["a"]}, "charset"),
    ({"type": "Dict", "spaces": {"a": {"type": "Discrete", "n": 2}}}, "pairs"),
    ({"type": "Dict", "spaces": [["a", {"type": "Discrete", "n": 2}], ["a", {"type": "Discrete", "n": 2}]]}, "duplicate key 'a'"),
    ({"type": "Dict", "spaces": [[1, {"type": "Discrete", "n": 2}]]}, "pair"),
    ({"type": "Dict", "spaces": [["pos", _box(dtype="object")]]}, r"space\['pos'\]\.dtype"),
    ({"type": "Tuple", "spaces": [{"type": "Discrete", "n": 2}, {"type": "Bogus"}]}, r"space\[1\].type"),
    ({"type": "Tuple", "spaces": "x"}, "space.spaces"),
    ({"type": "Json", "extra": 1}, "unknown field 'extra'"),
]


@pytest.mark.parametrize("data,match", HOSTILE, ids=[str(i) for i in range(len(HOSTILE))])
def test_hostile_json_refused(data, match):
    with pytest.raises(ValueError, match=match):
        space_from_json(data)


def test_element_budget_is_total_across_leaves():
    from boltzlabs_gym.wire.spaces import MAX_ELEMENTS

    with pytest.raises(ValueError, match="too many elements"):
        space_from_json(_box(shape=[MAX_ELEMENTS + 1]))
    leaf = _box(shape=[1 << 16])
    space_from_json({"type": "Tuple", "spaces": [leaf] * 4}, max_elements=4 << 16)
    with pytest.raises(ValueError, match=r"space\[4\]: space has too many elements"):
        space_from_json({"type": "Tuple", "spaces": [leaf] * 100}, max_elements=4 << 16)


def test_node_and_depth_limits():
    many = {"type": "Tuple", "spaces": [{"type": "Discrete", "n": 2}] * 20_000}
    with pytest.raises(ValueError, match="subspaces"):
        space_from_json(many)
    deep: dict = {"type": "Discrete", "n": 2}
    for _ in range(100):
        deep = {"type": "Tuple", "spaces": [deep]}
    with pytest.raises(ValueError, match="nested deeper"):
        space_from_json(deep)


# --------------------------------------------------------------------------- JsonSpace


def test_json_space_contains_and_sample():
    space = JsonSpace()
    assert space.contains({"a": [1, 2.5, None, "x", True]})
    assert space.contains(None)
    assert space.contains(float("nan"))
    assert not space.contains({"a": object()})
    assert not space.contains(np.zeros(2))
    with pytest.raises(NotImplementedError, match="cannot be sampled"):
        space.sample()
    assert not space.is_np_flattenable
    assert space == JsonSpace() and hash(space) == hash(JsonSpace())
    assert space != gs.Discrete(2)
    assert pickle.loads(pickle.dumps(space)) == space
    assert copy.deepcopy(space) == space


def test_json_space_batches_like_gymnasium_custom_spaces():
    space = JsonSpace(seed=0)
    batched = batch_space(space, 3)
    assert batched == gs.Tuple([JsonSpace()] * 3)
    assert batch_json_space(space, 3) == batched
    empty = create_empty_array(space, 3)
    assert empty == (None, None, None)
    items = [{"a": 1}, [1, 2], "s"]
    assert concatenate(space, items, empty) == tuple(items)
    assert list(iterate(batched, tuple(items))) == items
    # A Tuple mixing JSON and array leaves batches and iterates per env.
    mixed = gs.Tuple([JsonSpace(), gs.Discrete(2)])
    bm = batch_space(mixed, 2)
    assert list(iterate(bm, (({"a": 1}, [2]), np.array([0, 1])))) == [({"a": 1}, 0), ([2], 1)]


class _JsonEnv(gym.Env):
    """An env with undeclared (JSON) observation and action spaces."""

    observation_space = JsonSpace()
    action_space = JsonSpace()

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return {"t": 0, "seed": seed}, {}

    def step(self, action):
        self.t += 1
        return {"t": self.t, "echo": action}, 1.0, self.t >= 3, False, {}


def test_json_space_works_in_gymnasium_sync_vector_env():
    envs = gym.vector.SyncVectorEnv([_JsonEnv, _JsonEnv])
    assert envs.observation_space == gs.Tuple([JsonSpace(), JsonSpace()])
    obs, _ = envs.reset(seed=5)
    assert obs == ({"t": 0, "seed": 5}, {"t": 0, "seed": 6})
    obs, rew, term, trunc, _ = envs.step(("a", {"b": [1]}))
    assert obs == ({"t": 1, "echo": "a"}, {"t": 1, "echo": {"b": [1]}})
    np.testing.assert_array_equal(rew, [1.0, 1.0])
    envs.close()


def test_generator_states_cross_as_json():
    space = gs.Dict({"a": gs.Box(0, 1, (2,), np.float32), "b": gs.Tuple((gs.Discrete(3), gs.MultiBinary(4)))})
    space.seed(5)
    data = json.loads(json.dumps(rng_state_to_json(space)))
    rebuilt = space_from_json(space_to_json(space))
    seed_space_from_json(rebuilt, data)
    for _ in range(5):
        a, b = space.sample(), rebuilt.sample()
        assert np.array_equal(a["a"], b["a"]) and a["b"][0] == b["b"][0] and np.array_equal(a["b"][1], b["b"][1])


def test_unseeded_generators_stay_unseeded_and_bad_states_are_ignored():
    space = gs.Box(0, 1, (2,))
    assert rng_state_to_json(space) == {"state": None} and space._np_random is None  # no side effect
    for bad in (None, [], {"state": "x"}, {"state": {"bit_generator": "PCG64", "state": "nope"}},
                {"state": {"bit_generator": "MT19937", "state": {}}}, {"state": None, "spaces": [1, 2, 3]}):
        target = gs.Tuple((gs.Discrete(2), gs.Discrete(3)))
        seed_space_from_json(target, bad)
        assert target._np_random is None


@pytest.mark.parametrize(
    "space",
    [
        gs.Sequence(gs.Discrete(3)),
        gs.Sequence(gs.Box(0, 1, (2,), np.float32), stack=True),
        gs.OneOf([gs.Discrete(2), gs.Dict({"a": gs.Text(4)})]),
        gs.Graph(gs.Box(-1, 1, (3,), np.float32), gs.Discrete(4)),
        gs.Graph(gs.Discrete(5), None),
        gs.Graph(gs.Dict({"pos": gs.Box(-10, 10, (3,)), "label": gs.Discrete(5)}),
                 gs.Tuple((gs.Discrete(4), gs.Box(0, 1)))),
    ],
    ids=repr,
)
def test_sequence_oneof_graph_cross_as_json(space):
    """JSON-expressible spaces cross as themselves, samplable, not as JsonSpace."""
    back = space_from_json(_wire(space_to_json(space)))
    assert back == space and type(back) is type(space)
    back.seed(0)
    assert back.sample() in space


@pytest.mark.parametrize(
    "data,match",
    [
        ({"type": "Sequence", "space": {"type": "Discrete", "n": 2}, "stack": 1}, "stack: expected a boolean"),
        ({"type": "Sequence"}, "missing field 'space'"),
        ({"type": "OneOf", "spaces": []}, "non-empty list"),
        ({"type": "Graph", "node_space": {"type": "Nope"}, "edge_space": None}, "node_space.type: unknown space"),
        ({"type": "Graph", "node_space": {"type": "Discrete", "n": 2}}, "missing field 'edge_space'"),
    ],
)
def test_hostile_sequence_oneof_graph_refused(data, match):
    with pytest.raises(ValueError, match=match):
        space_from_json(data)
