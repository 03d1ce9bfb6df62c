"""The steady sandbox request known by its bytes (envside/steady_requests.py) answers as the general
path (read_message + check_sandbox_request) would, and turns away everything else."""

from __future__ import annotations

import json

import pytest

from boltzlabs_gym.envside.framing import decode_json
from boltzlabs_gym.envside.sandbox_slots import check_sandbox_request
from boltzlabs_gym.envside.steady_requests import SteadyRequests

ACTIONS = {"__nd__": [0, "<f4", [2, 3]]}


def request(ops=(None, None), payload=bytes(24), **extra) -> bytes:
    msg = {"op": "step", "slots": [0, 1], "ops": list(ops), "actions": ACTIONS, **extra, "_bin": [len(payload)]}
    return json.dumps(msg, separators=(",", ":")).encode() + b"\n" + payload


def general(data: bytes):
    line, _, payload = data.partition(b"\n")
    return check_sandbox_request(decode_json(line.decode()), [payload], 2)


def test_a_steady_request_is_the_general_paths_with_each_steps_payload():
    steady = SteadyRequests(2)
    for step in range(3):
        data = request(payload=bytes([step]) * 24)
        assert steady.match(data) == general(data)
    assert steady.line == request().partition(b"\n")[0] + b"\n"


@pytest.mark.parametrize(
    "data",
    [
        request(ops=(None, {"op": "reset", "seed": None})),  # an env resets in it
        request(ops=(0, None)),  # an int op
        request(payload=bytes(11)),  # 2 rows of no whole bytes: the general path says so
        request()[:-1],  # a payload that is not all there
        request() + request(),  # two requests in one read
        b'{"op":"step","slots":[0,1],"ops":[null,null]}\n',  # no batch of actions
        b"not json\n",
        b'{"op":"step","actions":' + b"[" * 5000 + b"\n",
        request().replace(b'"op":"step"', b'"op":"obs_region"'),
    ],
    ids=["reset", "int-op", "bad-rows", "torn", "two", "no-actions", "not-json", "deep", "other-op"],
)
def test_anything_else_goes_the_general_path_and_is_not_remembered(data):
    steady = SteadyRequests(2)
    assert steady.match(data) is None and steady.request is None


def test_a_known_line_with_a_payload_of_another_size_is_not_it():
    steady = SteadyRequests(2)
    assert steady.match(request()) is not None
    assert steady.match(request() + b"x") is None  # a byte more than announced
    assert steady.match(request(ops=(None, {"op": "reset", "seed": None}))) is None
    assert steady.match(request()) is not None  # still known
