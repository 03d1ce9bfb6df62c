"""The worker's reading of env reply lines: the plain-step fast path is as strict as JSON."""

from __future__ import annotations

import json

import numpy as np
import pytest
from gymnasium import spaces as gs

from boltzlabs_gym.wire.codec import ArrayLeaf
from boltzlabs_gym.wire.protocol import MAX_ENV_PAYLOAD_BYTES, env_request_line
from boltzlabs_gym.wire.envpipe import _PLAIN_STEP, EnvFault, _announced_payloads

SPACES = [
    gs.Box(-1, 1, (4,), np.float32),
    gs.Box(0, 255, (84, 84, 4), np.uint8),
    gs.MultiBinary(3),
    gs.Box(0, 1, (), np.float64),
    gs.MultiDiscrete([3, 4]),
]


@pytest.mark.parametrize("space", SPACES, ids=str)
@pytest.mark.parametrize("reward", [1.0, -0.0, 1e-05, 1e300, -3.25, 123456.789])
def test_plain_step_lines_take_the_fast_path(space, reward):
    leaf = ArrayLeaf.of(space)
    line = leaf.step_line(reward, True, False)
    assert _PLAIN_STEP.fullmatch(line)
    assert _announced_payloads(line) == json.loads(line)["_bin"] == [leaf.nbytes]


PLAIN = b'{"obs":{"__nd__":[0,"<f4",[4]]},"reward":1.0,"terminated":false,"truncated":false,"info":{},"_bin":[16]}\n'


@pytest.mark.parametrize(
    "old,new",
    [
        (b"[16]}", b"[016]}"),  # leading zero: not JSON
        (b"1.0,", b"01.0,"),
        (b"1.0,", b"1.,"),
        (b"1.0,", b"NaN,"),  # Python's json would take it; the fast path does not
        (b'false,"info"', b'nope,"info"'),
        (b"[16]}\n", b"[16]}"),  # no newline
        (b"[4]]", b"[04]]"),
        (b'"<f4"', b'"<f4\\"'),
        (b"{}", b"{ }"),  # valid JSON, but not the plain shape
    ],
)
def test_near_misses_are_left_to_the_json_parser(old, new):
    line = PLAIN.replace(old, new, 1)
    assert line != PLAIN
    assert _PLAIN_STEP.fullmatch(line) is None
    try:
        expected = json.loads(line)["_bin"]
    except ValueError:
        with pytest.raises(EnvFault):
            _announced_payloads(line)
    else:
        assert _announced_payloads(line) == expected


def test_plain_step_over_the_payload_limit_is_a_fault():
    line = PLAIN.replace(b"[16]}", b"[%d]}" % (MAX_ENV_PAYLOAD_BYTES + 1))
    assert _PLAIN_STEP.fullmatch(line)
    with pytest.raises(EnvFault, match="over the limit"):
        _announced_payloads(line)


@pytest.mark.parametrize(
    "op",
    [
        {"op": "step", "action": 3},
        {"op": "step", "action": -(10**20)},
        {"op": "step", "action": True},
        {"op": "step", "action": 1, "autoreset": True},
        {"op": "reset", "seed": 1},
    ],
)
def test_request_lines_are_one_json_object_line(op):
    line = env_request_line(op)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert json.loads(line) == op


def test_a_large_reply_is_read_whole_across_many_reads():
    """A reply with more payload than a pipe holds arrives in many reads; the rest of it after the
    first read goes straight into one buffer, and every byte lands where it belongs."""
    import os
    import threading

    from boltzlabs_gym.wire.envpipe import EnvPipe

    r, w = os.pipe()
    os.set_blocking(r, False)
    rng = np.random.default_rng(0)
    first, second = rng.bytes(100_000), rng.bytes(250_001)
    small = b'{"n":1}\n'
    data = json.dumps({"_bin": [len(first), len(second)]}).encode() + b"\n" + first + second + small
    writer = threading.Thread(target=lambda: os.write(w, data) and None)
    writer.start()
    pipe = EnvPipe(-1, r)
    got = []
    try:
        for _ in range(10_000):
            got += pipe.read_replies()
            if len(got) == 2:
                break
        writer.join(5)
    finally:
        os.close(w)
        os.close(r)
    (line, payloads), (line2, payloads2) = got
    assert [bytes(p) for p in payloads] == [first, second] and line2 == small and payloads2 == []
    assert not pipe.partial_output


def test_the_same_reply_line_again_is_followed_by_its_own_payloads():
    """A sandbox answers each plain step with the same line; the reader validates it once and
    still reads each reply's own payloads, whole or in pieces, and still holds a line that is
    not the same to the limits."""
    import os

    from boltzlabs_gym.wire.envpipe import EnvPipe

    r, w = os.pipe()
    os.set_blocking(r, False)
    line = b'{"n":2,"_bin":[3,2]}\n'
    pipe = EnvPipe(-1, r)
    try:
        got = []
        for k in range(4):
            os.write(w, line + bytes([k]) * 5)  # one whole reply per read
            got += pipe.read_replies()
        os.write(w, line + b"abcde" + line[:5])  # a reply, then part of the next one's line
        got += pipe.read_replies()
        os.write(w, line[5:] + b"xyzuv")
        got += pipe.read_replies()
        assert [bytes(b"".join(p)) for _, p in got] == [bytes([k]) * 5 for k in range(4)] + [b"abcde", b"xyzuv"]
        assert all(got_line == line for got_line, _ in got) and not pipe.partial_output
        pipe.max_payload = 4
        os.write(w, b'{"n":2,"_bin":[3,2],"x":0}\n' + b"z" * 5)
        with pytest.raises(EnvFault, match="over the limit"):
            pipe.read_replies()
    finally:
        os.close(w)
        os.close(r)


def test_a_reply_cut_short_in_its_payload_is_a_fault():
    import os

    from boltzlabs_gym.wire.envpipe import EnvPipe

    r, w = os.pipe()
    os.set_blocking(r, False)
    os.write(w, b'{"_bin":[200000]}\n' + b"x" * 60_000)
    os.close(w)
    pipe = EnvPipe(-1, r)
    try:
        with pytest.raises(EnvFault, match="closed its stdout"):
            for _ in range(100):
                pipe.read_replies()
    finally:
        os.close(r)
