"""Request lines encoded once per kind (wire/protocol.sandbox_step_line, array_step_line's twin): a
steady sandbox step's line is the line the general encoder writes; any other op is encoded as it is."""

from __future__ import annotations

import json

import pytest

from boltzlabs_gym.wire import protocol
from boltzlabs_gym.wire.protocol import env_request_line


def general(op: dict, payloads: list) -> bytes:
    return (json.dumps(dict(op, _bin=[len(p) for p in payloads]), separators=(",", ":")) + "\n").encode()


def steady_op(m: int, autoreset: bool = False) -> dict:
    op = {"op": "step", "slots": list(range(m)), "ops": [None] * m, "actions": {"__nd__": [0, "<f4", [m, 6]]}}
    return dict(op, autoreset=True) if autoreset else op


@pytest.mark.parametrize("autoreset", [False, True])
def test_a_steady_sandbox_step_is_written_as_the_encoder_writes_it(autoreset):
    protocol.sandbox_step_line.cache_clear()
    op = steady_op(8, autoreset)
    assert env_request_line(op, [bytes(192)]) == general(op, [bytes(192)])
    assert protocol.sandbox_step_line.cache_info().misses == 1
    assert env_request_line(steady_op(8, autoreset), [bytes(192)]) == general(op, [bytes(192)])
    assert protocol.sandbox_step_line.cache_info().hits == 1


@pytest.mark.parametrize(
    "change",
    [
        {"slots": [1, 0, 2, 3]},  # slots out of order
        {"ops": [None, None, {"op": "reset", "seed": None}, None]},  # an env resets
        {"ops": [None, None, 0, None]},  # an int op
        {"actions": {"__nd__": [0, "<f4", [3, 6]]}},  # rows for another number of slots
        {"actions": {"__nd__": [0, ["<f4"], [4, 6]]}},  # an unhashable dtype
        {"deadline": 5.0},  # a member more
        {"autoreset": False},
    ],
    ids=["order", "reset", "int-op", "rows", "unhashable", "deadline", "autoreset-false"],
)
def test_any_other_sandbox_op_is_encoded_as_it_is(change):
    op = dict(steady_op(4), **change)
    assert env_request_line(op, [bytes(96)]) == general(op, [bytes(96)])
