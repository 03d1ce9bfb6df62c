"""Infos as typed columns: what the env side writes (envside/info_columns.py) reads back as the
info the env returned, and a member that breaks the wire (it comes from untrusted code) is refused
with what is wrong."""

from __future__ import annotations

import json

import numpy as np
import pytest

from boltzlabs_gym.envside.info_columns import MAX_COLUMNS, InfoColumns
from boltzlabs_gym.wire import codec
from boltzlabs_gym.wire.info_layout import ND, BadInfoMember, InfoLayout, decode_cols


def test_the_marker_is_the_codecs():
    assert ND == codec.ND


def written(columns: InfoColumns, n: int, first_ref: int = 3):
    member = json.loads(columns.member_json(n, first_ref))
    return InfoLayout.read(member, n, first_ref), [bytes(p) for p in columns.payloads(n)]


def test_what_is_written_reads_back_with_its_types():
    columns = InfoColumns(3)
    infos = [
        {"x": np.float64(0.5), "lives": 3, "ok": True, "v": np.arange(3, dtype=np.int16), "r": np.float32(-1)},
        {"lives": 2},
        {},
    ]
    for p, info in enumerate(infos):
        assert columns.put(p, info) if info else columns.clear_has(p)
    layout, payloads = written(columns, 3)
    assert layout.keys == ("x", "lives", "ok", "v", "r") and layout.tags == ("np", "int", "bool", "nd", "np")
    rows = layout.rows(payloads)
    for p, info in enumerate(infos):
        got = rows.info_of(p)
        assert list(got) == list(info)
        for key, value in info.items():
            assert type(got[key]) is type(value) and np.array_equal(got[key], value)
            assert getattr(got[key], "dtype", None) == getattr(value, "dtype", None)


@pytest.mark.parametrize(
    "info",
    [
        {"s": "text"},
        {"b": np.bool_(True)},
        {"d": {"inner": 1}},
        {"big": 1 << 70},
        {"final_info": 1},
        {"a": np.zeros(10_000)},
        {"c": np.complex64(1)},
        {1: 2},
    ],
    ids=["str", "np.bool_", "dict", "int>64bit", "reserved", "large-array", "complex", "non-str-key"],
)
def test_values_that_cannot_be_columns_are_refused(info):
    assert not InfoColumns(2).put(0, info)


def test_a_key_whose_kind_changes_is_refused_and_nothing_is_written():
    columns = InfoColumns(2)
    assert columns.put(0, {"a": 1, "b": np.float32(1)})
    assert not columns.put(1, {"a": 2, "b": np.float64(1)})  # b's dtype changed
    assert not columns.put(1, {"a": 2.0})  # a's type changed
    assert not columns.put(1, {"a": np.zeros(2)}) and columns.has[1].tolist() == [0, 0]


def test_an_info_like_one_before_is_written_as_the_general_path_writes_it():
    # The second put of the same keys takes the remembered plan; what it writes must be what a
    # first put would, and a value whose type or dtype moved must still be refused.
    planned, fresh = InfoColumns(2), InfoColumns(2)
    first = {"x": np.float64(0.5), "ok": True, "r": np.float32(-1)}
    second = {"x": np.float64(-2.0), "ok": False, "r": np.float32(3)}
    assert planned.put(0, first) and planned.put(1, second)
    assert fresh.put(0, first) and fresh._put(1, second)
    assert written(planned, 2)[1] == written(fresh, 2)[1]
    assert not planned.put(1, {"x": np.float32(1), "ok": True, "r": np.float32(3)})  # x's dtype moved
    assert not planned.put(1, {"x": np.float64(1), "ok": 1, "r": np.float32(3)})  # ok is no bool now
    assert planned.has[1].tolist() == [1, 1, 1] and planned.cols[0][1] == -2.0  # nothing was written


def test_a_remembered_plan_follows_keys_in_another_order_or_with_fewer_keys():
    columns = InfoColumns(3)
    assert columns.put(0, {"a": 1.0, "b": True})
    assert columns.put(1, {"b": False, "a": 2.0}) and columns.put(2, {"b": True})
    assert columns.put(2, {"b": True})  # its plan, remembered the line before
    layout, payloads = written(columns, 3)
    rows = layout.rows(payloads)
    assert [rows.info_of(p) for p in range(3)] == [{"a": 1.0, "b": True}, {"a": 2.0, "b": False}, {"b": True}]
    assert not rows.every  # position 2 has no "a"


def test_ints_are_range_checked_on_every_put():
    columns = InfoColumns(1)
    assert columns.put(0, {"lives": 3}) and columns.put(0, {"lives": 2})
    assert not columns.put(0, {"lives": 1 << 64}) and columns.cols[0][0] == 2


def test_arrays_keep_their_shape_and_dtype_on_every_put():
    columns = InfoColumns(1)
    assert columns.put(0, {"v": np.zeros(3, np.float32)}) and columns.put(0, {"v": np.ones(3, np.float32)})
    assert not columns.put(0, {"v": np.ones(4, np.float32)})  # another shape
    assert not columns.put(0, {"v": np.ones(3, np.float64)})  # another dtype
    assert columns.cols[0][0].tolist() == [1.0, 1.0, 1.0]


def test_a_new_key_makes_room_in_the_remembered_presence_rows():
    columns = InfoColumns(2)
    assert columns.put(0, {"a": 1.0}) and columns.put(1, {"a": 2.0})
    assert columns.put(0, {"a": 3.0, "b": 4.0}) and columns.put(1, {"a": 5.0})
    assert columns.has.tolist() == [[1, 1], [1, 0]]


def test_columns_stop_at_their_limit():
    columns = InfoColumns(1)
    assert columns.put(0, {f"k{i}": i for i in range(MAX_COLUMNS)})
    assert not columns.put(0, {"one_more": 1})


def member(**changes):
    m = {"keys": ["a"], "tags": ["int"], "has": {ND: [3, "|u1", [2, 1]]}, "cols": [{ND: [4, "<i8", [2]]}]}
    m.update(changes)
    return m


@pytest.mark.parametrize(
    "bad, why",
    [
        (member(keys=["a", "a"], tags=["int", "int"], cols=[{ND: [4, "<i8", [2]]}, {ND: [5, "<i8", [2]]}]), "distinct"),
        (member(keys=["final_obs"]), "distinct strings"),
        (member(keys=[1]), "distinct strings"),
        (member(tags=["pickle"]), "unknown tag"),
        (member(tags=["float"]), "cannot be <i8"),
        (member(has={ND: [3, "|u1", [2, 2]]}), "presence"),
        (member(cols=[{ND: [5, "<i8", [2]]}]), "not a numeric array"),
        (member(cols=[{ND: [4, "<U8", [2]]}]), "not a numeric array"),
        (member(cols=[{ND: [4, "<i8", [3]]}]), "not a numeric array"),
        (member(tags=["np"], cols=[{ND: [4, "|b1", [2]]}]), "cannot be"),
        (member(extra=1), "keys, tags, has and cols"),
        ("no", "keys, tags, has and cols"),
        (member(keys=[], tags=[], cols=[]), "0 keys"),
    ],
)
def test_a_member_that_breaks_the_wire_is_refused(bad, why):
    with pytest.raises(BadInfoMember, match=why):
        InfoLayout.read(bad, 2, 3)


def test_a_one_env_reply_decodes_its_columns_and_checks_their_sizes():
    columns = InfoColumns(1)
    columns.put(0, {"lives": 5, "x": np.float32(2)})
    obj = {codec.COLS: json.loads(columns.member_json(1, 1))}
    payloads = [b"obs", *(bytes(p) for p in columns.payloads(1))]
    assert codec.decode_info(obj, payloads) == {"lives": 5, "x": np.float32(2)}
    with pytest.raises(codec.CodecError, match="payloads are not"):
        codec.decode_info(obj, [*payloads[:-1], b"\0"])
    with pytest.raises(BadInfoMember, match="do not refer"):
        decode_cols({"has": {ND: [9, "|u1", [1, 2]]}}, payloads)
    # A user's dict that looks like the marker is escaped, and comes back as it was.
    assert codec.decode_info(*codec.encode_info({codec.COLS: 1})) == {codec.COLS: 1}
