"""Values <-> (JSON skeleton, raw payloads): round trips, infos, hostile input."""

from __future__ import annotations

import enum
import json

import numpy as np
import pytest
from gymnasium import spaces as gs
from gymnasium.utils.env_checker import data_equivalence

from boltzlabs_gym.wire.codec import (
    ArrayLeaf,
    CodecError,
    decode,
    decode_info,
    encode,
    encode_action,
    encode_info,
    to_json_safe,
)
from boltzlabs_gym.wire.protocol import STEP_REPLY_LAYOUT, STEP_REPLY_PATTERN
from boltzlabs_gym.wire.slot_layout import array_leaves, array_skeleton, payload_layout
from boltzlabs_gym.wire.spaces import JsonSpace


def _wire(obj, payloads):
    """Through the wire: a JSON line (NaN allowed, as write_message does) and bytes payloads."""
    return json.loads(json.dumps(obj, allow_nan=True)), [bytes(p) for p in payloads]


def _assert_equal(space, a, b):
    if isinstance(space, (gs.Box, gs.MultiBinary, gs.MultiDiscrete)):
        assert isinstance(b, np.ndarray) and b.dtype == space.dtype and b.shape == space.shape
        np.testing.assert_array_equal(a, b)
    elif isinstance(space, gs.Discrete):
        assert isinstance(b, np.integer) and b.dtype == space.dtype and a == b
    elif isinstance(space, gs.Dict):
        assert list(b) == list(space.spaces)
        for k, sub in space.spaces.items():
            _assert_equal(sub, a[k], b[k])
    elif isinstance(space, gs.Tuple):
        assert isinstance(b, tuple) and len(b) == len(space.spaces)
        for sub, x, y in zip(space.spaces, a, b):
            _assert_equal(sub, x, y)
    else:
        assert a == b


NESTED = gs.Dict(
    [
        ("pos", gs.Box(-np.inf, np.inf, (3,), np.float32)),
        ("img", gs.Box(0, 255, (4, 5, 3), np.uint8)),
        ("mode", gs.Discrete(3, start=-1)),
        ("pair", gs.Tuple([gs.MultiBinary([2, 2]), gs.MultiDiscrete([3, 5], dtype=np.int32)])),
        ("name", gs.Text(6)),
    ]
)

SPACES = {
    "box_f32": gs.Box(-1, 1, (2, 3), np.float32),
    "box_f64_scalar": gs.Box(-1, 1, (), np.float64),
    "box_f16": gs.Box(-1, 1, (4,), np.float16),
    "box_int16": gs.Box(-100, 100, (5,), np.int16),
    "box_uint64": gs.Box(0, 2**60, (2,), np.uint64),
    "box_bool": gs.Box(0, 1, (3,), bool),
    "box_empty": gs.Box(0, 1, (0, 2), np.float32),
    "discrete": gs.Discrete(4),
    "discrete_int32_start": gs.Discrete(4, start=10, dtype=np.int32),
    "multibinary": gs.MultiBinary(7),
    "multidiscrete": gs.MultiDiscrete([[2, 3], [4, 5]]),
    "text": gs.Text(8, charset="ab c"),
    "tuple": gs.Tuple([gs.Discrete(2), gs.Box(0, 1, (2,), np.float32)]),
    "nested": NESTED,
}


@pytest.mark.parametrize("name", sorted(SPACES))
def test_round_trip(name):
    space = SPACES[name]
    space.seed(1)
    for _ in range(3):
        value = space.sample()
        obj, payloads = encode(space, value)
        assert all(isinstance(p, bytes) for p in payloads)
        obj, payloads = _wire(obj, payloads)
        _assert_equal(space, value, decode(space, obj, payloads))
        _assert_equal(space, value, decode(space, obj, payloads, copy=True))


def test_array_leaves_are_payload_references_not_lists():
    space = gs.Box(0, 255, (64, 64, 3), np.uint8)
    value = np.arange(64 * 64 * 3, dtype=np.uint8).reshape(64, 64, 3)
    obj, payloads = encode(space, value)
    assert obj == {"__nd__": [0, "|u1", [64, 64, 3]]}
    assert payloads == [value.tobytes()]


def test_payload_list_is_shared_between_values():
    space = gs.Box(0, 1, (2,), np.float32)
    payloads: list = []
    a, _ = encode(space, np.zeros(2), payloads)
    b, _ = encode(space, np.ones(2), payloads)
    c, _ = encode_info({"x": np.arange(3)}, payloads)
    assert (a["__nd__"][0], b["__nd__"][0], c["x"]["__nd__"][0]) == (0, 1, 2)
    np.testing.assert_array_equal(decode(space, b, payloads), [1, 1])
    np.testing.assert_array_equal(decode_info(c, payloads)["x"], [0, 1, 2])


def test_zero_copy_and_read_only_views():
    space = gs.Box(0, 1, (2, 2), np.float32)
    value = np.arange(4, dtype=np.float32).reshape(2, 2)
    obj, payloads = encode(space, value, zero_copy=True)
    assert isinstance(payloads[0], memoryview) and len(payloads[0]) == 16
    value[0, 0] = 9.0  # a view: sees the change
    out = decode(space, obj, payloads)
    assert out[0, 0] == 9.0
    out = decode(space, *_wire(obj, payloads))
    assert not out.flags.writeable  # frombuffer on bytes: read-only, zero-copy
    out2 = decode(space, *_wire(obj, payloads), copy=True)
    assert out2.flags.writeable


def test_encode_casts_to_space_dtype_and_checks_shape():
    space = gs.Box(-1, 1, (3,), np.float32)
    obj, payloads = encode(space, [0.5, 0.25, -1.0])  # float64 list -> float32, as SyncVectorEnv stacks
    assert obj["__nd__"][1] == "<f4"
    np.testing.assert_array_equal(decode(space, obj, payloads), np.array([0.5, 0.25, -1.0], np.float32))
    with pytest.raises(CodecError, match="shape"):
        encode(space, np.zeros(4))
    with pytest.raises(CodecError, match="Discrete value must be an integer"):
        encode(gs.Discrete(3), 1.5)
    with pytest.raises(CodecError, match="Discrete value must be an integer"):
        encode(gs.Discrete(3), True)
    # A Python int stays a JSON int; a numpy integer keeps its type (SAME_STEP's
    # final_obs holds the env's own value, as in SyncVectorEnv).
    assert encode(gs.Discrete(3), 2)[0] == 2 and type(decode(gs.Discrete(3), 2)) is int
    assert encode(gs.Discrete(3), np.int64(2))[0] == {"__np__": ["<i8", 2]}
    assert encode(gs.Discrete(3), np.array(2, np.int32))[0] == {"__np__": ["<i4", 2]}
    back = decode(gs.Discrete(3), *_wire(*encode(gs.Discrete(3), np.int32(2))))
    assert type(back) is np.int32 and back == 2
    # An int subclass (an IntEnum member) crosses as its plain value; it used to raise AttributeError.
    level = enum.IntEnum("Level", {"LOW": 1})
    assert encode(gs.Discrete(3), level.LOW)[0] == 1 and type(encode(gs.Discrete(3), level.LOW)[0]) is int
    with pytest.raises(CodecError, match="Text"):
        encode(gs.Text(3), b"ab")
    with pytest.raises(CodecError, match="lacks key"):
        encode(NESTED, {"pos": np.zeros(3)})
    with pytest.raises(CodecError, match="Tuple value"):
        encode(SPACES["tuple"], (1,))
    with pytest.raises(CodecError, match=r"value\['pair'\]\[1\]"):
        bad = NESTED.sample()
        bad["pair"] = (bad["pair"][0], np.zeros(3))
        encode(NESTED, bad)


def test_json_space_passes_through_and_converts_numpy():
    space = JsonSpace()
    value = {"a": [1, 2], "b": np.float32(0.5), "c": np.arange(3), "d": (1, "x"), 3: None}
    obj, payloads = encode(space, value)
    assert payloads == []
    assert obj == {"a": [1, 2], "b": 0.5, "c": [0, 1, 2], "d": [1, "x"], "3": None}
    assert decode(space, obj, []) is obj
    assert to_json_safe(np.bool_(True)) is True


def test_lenient_decode_accepts_plain_json_for_arrays():
    space = gs.Tuple([gs.Discrete(2), gs.Box(-1, 1, (2,), np.float32)])
    value = decode(space, [1, [0.5, -0.5]], [], lenient=True)
    assert value[1].dtype == np.float32
    np.testing.assert_array_equal(value[1], [0.5, -0.5])
    with pytest.raises(CodecError):
        decode(space, [1, [0.5, -0.5]], [])  # strict: arrays must be payload references
    with pytest.raises(CodecError, match="shape"):
        decode(space, [1, [0.5]], [], lenient=True)


# --------------------------------------------------------------------------- hostile payloads

BOX = gs.Box(0, 1, (2, 3), np.float32)
GOOD = {"__nd__": [0, "<f4", [2, 3]]}
GOOD_PAYLOADS = [bytes(24)]

HOSTILE = [
    ({"__nd__": [0, "<f8", [2, 3]]}, [bytes(48)], "dtype <f8 does not match"),
    ({"__nd__": [0, "<i4", [2, 3]]}, [bytes(24)], "dtype <i4 does not match"),
    ({"__nd__": [0, ">f4", [2, 3]]}, [bytes(24)], "does not match"),
    ({"__nd__": [0, "|O", [2, 3]]}, [bytes(48)], "refused"),
    ({"__nd__": [0, "O", [2, 3]]}, [bytes(48)], "refused"),
    ({"__nd__": [0, "<U1", [2, 3]]}, [bytes(24)], "refused"),
    ({"__nd__": [0, "V4", [2, 3]]}, [bytes(24)], "refused"),
    ({"__nd__": [0, "(1000000000,)f4", [1]]}, [bytes(4)], "refused"),
    ({"__nd__": [0, "<f4", [3, 2]]}, [bytes(24)], "shape"),
    ({"__nd__": [0, "<f4", [6]]}, [bytes(24)], "shape"),
    ({"__nd__": [0, "<f4", [2, -3]]}, [bytes(24)], "shape"),
    ({"__nd__": [0, "<f4", "2,3"]}, [bytes(24)], "shape"),
    ({"__nd__": [0, "<f4", [2, 3.0]]}, [bytes(24)], "shape"),
    ({"__nd__": [0, "<f4", [2, 3]]}, [bytes(20)], "has 20 bytes"),
    ({"__nd__": [0, "<f4", [2, 3]]}, [bytes(28)], "has 28 bytes"),
    ({"__nd__": [1, "<f4", [2, 3]]}, [bytes(24)], "out of range"),
    ({"__nd__": [-1, "<f4", [2, 3]]}, [bytes(24)], "out of range"),
    ({"__nd__": [True, "<f4", [2, 3]]}, [bytes(24)], "out of range"),
    ({"__nd__": ["0", "<f4", [2, 3]]}, [bytes(24)], "out of range"),
    ({"__nd__": [0, "<f4", [2, 3]]}, [], "out of range"),
    ({"__nd__": [0, "<f4"]}, [bytes(24)], "index, dtype, shape"),
    ({"__nd__": [0, "<f4", [2, 3]], "x": 1}, [bytes(24)], "array leaf"),
    ([[0, 0, 0], [0, 0, 0]], [], "array leaf"),
    (None, [], "array leaf"),
]


@pytest.mark.parametrize("obj,payloads,match", HOSTILE, ids=[str(i) for i in range(len(HOSTILE))])
def test_hostile_array_refused(obj, payloads, match):
    with pytest.raises(CodecError, match=match):
        decode(BOX, obj, payloads)


def test_good_array_accepted():
    assert decode(BOX, GOOD, GOOD_PAYLOADS).shape == (2, 3)
    assert decode(BOX, GOOD, [bytearray(24)]).shape == (2, 3)
    assert decode(BOX, GOOD, [memoryview(bytes(24))]).shape == (2, 3)


@pytest.mark.parametrize(
    "space,obj,match",
    [
        (gs.Discrete(3), 3, "out of range"),
        (gs.Discrete(3, start=1), 0, "out of range"),
        (gs.Discrete(3), 1.0, "must be an int"),
        (gs.Discrete(3), True, "must be an int"),
        (gs.Discrete(3), "1", "must be an int"),
        (gs.Discrete(3), {"__nd__": [0, "<i8", []]}, "must be an int"),
        (gs.Discrete(3), {"__np__": ["<i8", 3]}, "out of range"),
        (gs.Discrete(3), {"__np__": ["<f8", 1.0]}, "must be an integer"),
        (gs.Discrete(3), {"__np__": ["<i8", 1.5]}, "not a valid int64"),
        (gs.Text(3), 5, "Text value must be a string"),
        (NESTED, [], "Dict value must be a JSON object"),
        (gs.Dict([("a", gs.Discrete(2))]), {"a": 0, "b": 1}, "do not match"),
        (gs.Dict([("a", gs.Discrete(2)), ("b", gs.Discrete(2))]), {"a": 0, "c": 1}, "do not match"),
        (gs.Dict([("a", gs.Discrete(2))]), {}, "do not match"),
        (gs.Tuple([gs.Discrete(2)]), [0, 1], "length 1"),
        (gs.Tuple([gs.Discrete(2)]), {"0": 0}, "list of length"),
        (gs.Tuple([gs.Dict([("k", gs.Discrete(2))])]), [{"k": 5}], r"value\[0\]\['k'\]: Discrete value 5 out of range"),
    ],
)
def test_hostile_values_refused(space, obj, match):
    with pytest.raises(CodecError, match=match):
        decode(space, obj, [])
    assert issubclass(CodecError, ValueError)


# --------------------------------------------------------------------------- infos


def test_info_round_trip():
    info = {
        "f32": np.float32(1.5),
        "f64": np.float64(2.25),
        "i8": np.int8(-3),
        "u64": np.uint64(2**63 + 5),
        "flag": np.bool_(True),
        "arr": np.arange(6, dtype=np.int16).reshape(2, 3),
        "img": np.zeros((2, 2, 3), np.uint8),
        "nested": {"episode": {"r": np.float64(10.0), "l": 7, "t": 0.5}},
        "tuple": (1, np.float32(2.0)),
        "list": [1, (2, [3])],
        "tuple_marker_like": {"__tuple__": [1]},
        "nan": float("nan"),
        "inf": float("inf"),
        "s": "text",
        "none": None,
        "marker_like": {"__nd__": [0, "<f4", [1]]},
        "np_marker_like": {"__np__": 1},
        "obj": object(),
        "strs": np.array(["a", "b"]),
        5: "int key",
    }
    obj, payloads = encode_info(info)
    obj, payloads = _wire(obj, payloads)
    back = decode_info(obj, payloads)
    for key in ("f32", "f64", "i8", "u64", "flag"):
        assert type(back[key]) is type(info[key]) and back[key] == info[key]
    np.testing.assert_array_equal(back["arr"], info["arr"])
    assert back["arr"].dtype == np.int16 and back["img"].shape == (2, 2, 3)
    assert back["nested"] == {"episode": {"r": 10.0, "l": 7, "t": 0.5}}
    assert type(back["nested"]["episode"]["r"]) is np.float64
    assert back["tuple"] == (1, 2.0) and type(back["tuple"][1]) is np.float32  # a tuple, as SyncVectorEnv's
    assert back["list"] == [1, (2, [3])]
    assert back["tuple_marker_like"] == {"__tuple__": [1]}
    assert np.isnan(back["nan"]) and back["inf"] == float("inf")
    assert back["s"] == "text" and back["none"] is None
    assert back["marker_like"] == {"__nd__": [0, "<f4", [1]]}
    assert back["np_marker_like"] == {"__np__": 1}
    assert back["obj"].startswith("<object object")
    assert back["strs"].startswith("array(")
    assert back["5"] == "int key"


def test_info_arrays_read_only_unless_copied():
    obj, payloads = _wire(*encode_info({"a": np.arange(3)}))
    assert not decode_info(obj, payloads)["a"].flags.writeable
    assert decode_info(obj, payloads, copy=True)["a"].flags.writeable


@pytest.mark.parametrize(
    "obj,payloads,match",
    [
        ({"x": {"__nd__": [0, "|O", [1]]}}, [bytes(8)], "refused"),
        ({"x": {"__nd__": [0, "<f4", [2]]}}, [bytes(4)], "has 4 bytes"),
        ({"x": {"__nd__": [3, "<f4", [1]]}}, [bytes(4)], "out of range"),
        ({"x": {"__np__": ["|i1", 300]}}, [], "not a valid int8"),
        ({"x": {"__np__": ["<f4", "1.0"]}}, [], "not a valid float32"),
        ({"x": {"__np__": ["|b1", 1]}}, [], "not a valid bool"),
        ({"x": {"__np__": ["|O", 1]}}, [], "refused"),
        ({"x": {"__np__": [1]}}, [], "dtype, value"),
        ({"x": {"__esc__": [1]}}, [], "escaped"),
        ({"x": {"__tuple__": {"a": 1}}}, [], "tuple must be a list"),
    ],
)
def test_hostile_info_refused(obj, payloads, match):
    with pytest.raises(CodecError, match=match):
        decode_info(obj, payloads)


def test_info_depth_limit():
    deep: object = 1
    for _ in range(200):
        deep = [deep]
    with pytest.raises(CodecError, match="nested deeper"):
        decode_info(deep, [])
    obj, _ = encode_info(deep)  # encoding never fails: the deep tail becomes a repr string
    json.dumps(obj)


# ----------------------------------------------------------------------------- the plain step line


@pytest.mark.parametrize(
    "space", [gs.Box(-1, 1, (4,), np.float32), gs.Box(0, 255, (3, 2), np.uint8), gs.MultiBinary(5)]
)
@pytest.mark.parametrize("reward", [1.0, -0.0, 1e-05, 1e300, -3.25])
@pytest.mark.parametrize("flags", [(False, False), (True, False), (False, True), (True, True)])
def test_step_line_is_the_json_it_claims(space, reward, flags):
    """The line the Gymnasium env host writes without a JSON encoder is the JSON object a generic
    encoder would write, and parsing it back without a JSON parser gives the same values."""
    leaf = ArrayLeaf.of(space)
    line = leaf.step_line(reward, *flags)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    msg = json.loads(line)
    assert msg == {
        "obs": leaf.skeleton,
        "reward": reward,
        "terminated": flags[0],
        "truncated": flags[1],
        "info": {},
        "_bin": [leaf.nbytes],
    }
    assert leaf.parse_step_line(line) == (reward, *flags)


@pytest.mark.parametrize(
    "space", [gs.Box(-1, 1, (4,), np.float32), gs.Box(0, 255, (3, 2), np.uint8), gs.MultiBinary(5)]
)
@pytest.mark.parametrize("flags", [(False, False), (True, False), (False, True), (True, True)])
def test_step_line_is_the_one_layout_in_protocol(space, flags):
    """The writer (codec) and the reader of env output (envpipe's pattern) use protocol's one layout."""
    leaf = ArrayLeaf.of(space)
    line = leaf.step_line(-3.25, *flags)
    fields = {
        b"<obs>": leaf.skeleton_json.encode(),
        b"<reward>": b"-3.25",
        b"<terminated>": json.dumps(flags[0]).encode(),
        b"<truncated>": json.dumps(flags[1]).encode(),
        b"<nbytes>": b"%d" % leaf.nbytes,
    }
    expected = STEP_REPLY_LAYOUT
    for field, value in fields.items():
        expected = expected.replace(field, value)
    assert line == expected
    assert int(STEP_REPLY_PATTERN.fullmatch(line).group(1)) == leaf.nbytes


@pytest.mark.parametrize(
    "line",
    [
        # every one is valid JSON, but not the plain shape: the JSON path must take it
        b'{"obs":{"__nd__":[0,"<f4",[4]]},"reward":1.0,"terminated":false,"truncated":false,"info":{"a":1},"_bin":[16]}\n',
        b'{"obs":{"__nd__":[0,"<f4",[4]]},"reward":"1.0","terminated":false,"truncated":false,"info":{},"_bin":[16]}\n',
        b'{"obs":{"__nd__":[0,"<f4",[4]]},"reward":true,"terminated":false,"truncated":false,"info":{},"_bin":[16]}\n',
        b'{"obs":{"__nd__":[0,"<f4",[4]]},"reward":[1,2],"terminated":false,"truncated":false,"info":{},"_bin":[16]}\n',
        b'{"obs":{"__nd__":[0,"<f4",[4]]},"reward":1.0,"terminated":false,"truncated":false,"reset_obs":1,"info":{},"_bin":[16]}\n',
        b'{"obs":{"__nd__":[0,"<f4",[4]]},"reward":1.0,"terminated":0,"truncated":false,"info":{},"_bin":[16]}\n',
        b'{"obs":{"__nd__":[0,"<f4",[4]]},"reward":1.0,"truncated":false,"terminated":false,"info":{},"_bin":[16]}\n',
        b'{"obs":{"__nd__":[0,"<f8",[2]]},"reward":1.0,"terminated":false,"truncated":false,"info":{},"_bin":[16]}\n',
        b'{"obs":{"__nd__":[0,"<f4",[4]]},"reward":1.0,"terminated":false,"truncated":false,"info":{},"_bin":[8,8]}\n',
        b'{"obs":{"__nd__":[0,"<f4",[4]]},"reward":,"terminated":false,"truncated":false,"info":{},"_bin":[16]}\n',
    ],
)
def test_parse_step_line_leaves_every_other_shape_to_json(line):
    assert ArrayLeaf.of(gs.Box(-1, 1, (4,), np.float32)).parse_step_line(line) is None


# --------------------------------------------------------------------------- Sequence, OneOf, Graph

VARIABLE_SPACES = {
    "sequence": gs.Sequence(gs.Discrete(3)),
    "sequence_stacked_box": gs.Sequence(gs.Box(0, 1, (2,), np.float32), stack=True),
    "sequence_stacked_dict": gs.Sequence(gs.Dict({"a": gs.Discrete(2), "b": gs.Box(0, 1, (2,))}), stack=True),
    "oneof": gs.OneOf([gs.Discrete(2), gs.Box(0, 1, (2,), np.float32)]),
    "graph": gs.Graph(gs.Box(0, 1, (3,), np.float32), gs.Discrete(4)),
    "graph_no_edges": gs.Graph(gs.Discrete(5), None),
    "graph_of_dicts": gs.Graph(
        gs.Dict({"pos": gs.Box(-10, 10, (3,)), "label": gs.Discrete(5)}), gs.Tuple((gs.Discrete(4), gs.Box(0, 1, (2,))))
    ),
    "sequence_of_graphs": gs.Sequence(gs.Graph(gs.Box(-1, 1, (2, 2)), gs.Discrete(4))),
    "nested": gs.Tuple(
        [gs.Sequence(gs.OneOf([gs.Discrete(2), gs.Text(3)])), gs.Graph(gs.Discrete(2), gs.Box(0, 1, ()))]
    ),
}


@pytest.mark.parametrize("name", sorted(VARIABLE_SPACES))
def test_variable_spaces_round_trip(name):
    space = VARIABLE_SPACES[name]
    space.seed(3)
    for _ in range(5):
        value = space.sample()
        back = decode(space, *_wire(*encode(space, value)), copy=True)
        assert back in space and data_equivalence(back, value, exact=True)
    if isinstance(space, gs.Sequence) and space.stack:
        empty = decode(space, [], [])
        assert empty in space


@pytest.mark.parametrize(
    "space,obj,match",
    [
        (gs.Sequence(gs.Discrete(2)), {"0": 1}, "Sequence value must be a list"),
        (gs.Sequence(gs.Discrete(2)), [0, 2], r"value\[1\]: Discrete value 2 out of range"),
        (gs.OneOf([gs.Discrete(2)]), [1, 0], "OneOf index 1 out of range"),
        (gs.OneOf([gs.Discrete(2)]), [True, 0], "OneOf index must be an int"),
        (gs.OneOf([gs.Discrete(2)]), [0], "list \\[index, value\\]"),
        (gs.Graph(gs.Discrete(2), None), {"nodes": None}, "nodes, edges and edge_links"),
        (
            gs.Graph(gs.Discrete(2), None),
            {"nodes": {"__nd__": [1, "<i8", [1]]}, "edges": None, "edge_links": None},
            "payload index 1 out of range",
        ),
        (
            gs.Graph(gs.Discrete(2), None),
            {"nodes": {"__nd__": [0, "<i8", [1]]}, "edges": {"__nd__": [0, "<i8", [1]]}, "edge_links": None},
            "go together",
        ),
    ],
)
def test_hostile_variable_values_refused(space, obj, match):
    with pytest.raises(CodecError, match=match):
        decode(space, obj, [bytes(8)])


def test_graph_values_are_checked_against_the_space():
    space = gs.Graph(gs.Box(0, 1, (3,), np.float32), gs.Discrete(4))
    nodes = np.zeros((2, 3), np.float32)
    bad_links = gs.GraphInstance(nodes, np.array([1, 2]), np.array([0, 1]))
    with pytest.raises(CodecError, match="edge_links"):
        encode(space, bad_links)
    wrong_rows = {"nodes": {"__nd__": [0, "<f4", [2, 2]]}, "edges": None, "edge_links": None}
    with pytest.raises(CodecError, match=r"is not \(k, \*\(3,\)\)"):
        decode(space, wrong_rows, [bytes(16)])
    links = {"__nd__": [2, "<f8", [1, 2]]}
    obj = {"nodes": {"__nd__": [0, "<f4", [2, 3]]}, "edges": {"__nd__": [1, "<i8", [1]]}, "edge_links": links}
    with pytest.raises(CodecError, match="expected integers of shape"):
        decode(space, obj, [bytes(24), bytes(8), bytes(16)])


def test_an_array_action_keeps_the_callers_numeric_dtype_across():
    """encode_action / ArrayLeaf.decode_action: what SyncVectorEnv hands an env."""
    box = gs.Box(-1, 1, (2,), np.float32)
    leaf = ArrayLeaf(box)
    got = leaf.decode_action(*_wire(*encode_action(box, np.array([0.5, -0.25], np.float64))))
    assert got.dtype == np.float64 and got.tolist() == [0.5, -0.25] and got.flags.writeable
    same = leaf.decode_action(*_wire(*encode_action(box, np.array([0.5, 1.0], np.float32))))
    assert same.dtype == np.float32
    listed = leaf.decode_action(*_wire(*encode_action(box, [0.5, 1.0])))
    assert listed.dtype == np.float32  # a list has no dtype of its own: the space's
    with pytest.raises(CodecError, match="shape"):
        encode_action(box, np.zeros(3, np.float64))
    with pytest.raises(CodecError, match="shape"):
        leaf.decode_action(*_wire(*encode(gs.Box(-1, 1, (3,)), np.zeros(3, np.float32))))
    with pytest.raises(CodecError, match="dtype"):
        leaf.decode_action({"__nd__": [0, "|O", [2]]}, [b"x" * 16])


# ------------------------------------------------------------------ payload layouts
_FIXED = {
    "dict": gs.Dict({"img": gs.Box(0, 255, (4, 3), np.uint8), "d": gs.Discrete(5), "v": gs.Box(-1, 1, (2,))}),
    "nested": gs.Tuple((gs.MultiBinary(3), gs.Dict({"t": gs.Text(8), "m": gs.MultiDiscrete([2, 3])}))),
    "scalar box": gs.Dict({"x": gs.Box(-1.0, 1.0, (), np.float64)}),
}


@pytest.mark.parametrize("name", sorted(_FIXED))
def test_payload_layout_is_what_encode_writes(name):
    """A fixed layout is every value's payloads, in order and size (a shared slot holds them so)."""
    space = _FIXED[name]
    space.seed(3)
    layout = payload_layout(space)
    assert layout is not None
    for _ in range(20):
        _, payloads = encode(space, space.sample())
        sizes = [memoryview(p).nbytes for p in payloads]
        assert sizes == [dtype.itemsize * int(np.prod(shape)) for dtype, shape in layout]


@pytest.mark.parametrize(
    "space",
    [
        gs.Box(0, 1, (3,)),  # one array: ArrayLeaf's
        gs.Dict({"d": gs.Discrete(2), "t": gs.Text(4)}),  # no payload at all
        gs.Dict({"s": gs.Sequence(gs.Box(0, 1, (2,)))}),  # as many payloads as the value has items
        gs.Tuple((gs.Box(0, 1, (2,)), gs.OneOf((gs.Discrete(2), gs.Box(0, 1, (1,)))))),
        gs.Graph(gs.Box(0, 1, (2,)), None),
        JsonSpace(),
    ],
    ids=["box", "no-arrays", "sequence", "oneof", "graph", "json"],
)
def test_payload_layout_is_none_where_payloads_vary(space):
    assert payload_layout(space) is None


def test_array_skeleton_is_what_encode_writes_for_arrays_only():
    space = gs.Dict({"b": gs.Tuple((gs.Box(0, 1, (2,)), gs.MultiDiscrete([2, 3]))), "a": gs.MultiBinary(4)})
    space.seed(1)
    skeleton = array_skeleton(space)
    for _ in range(10):
        value = space.sample()
        assert encode(space, value)[0] == skeleton
        leaves: list = []
        assert array_leaves(space, value, leaves)
        assert [leaf.shape for leaf in leaves] == [(4,), (2,), (2,)]  # encode's order: the space's keys, sorted
    assert not array_leaves(space, {"a": np.zeros(4, np.int8)}, [])  # a key missing
    assert not array_leaves(space, {"a": np.zeros(4, np.int8), "b": (np.zeros(2),)}, [])  # a short Tuple
    assert array_skeleton(_FIXED["dict"]) is None  # a Discrete leaf: its value is inline
    assert array_skeleton(gs.Box(0, 1, (2,))) is None  # one array: ArrayLeaf's
