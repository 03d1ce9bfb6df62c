"""Request lines encoded once (wire/protocol.encode_once): the line an op carries is the line the
general encoder writes, for as long as the op lives, whatever other ops came and went."""

from __future__ import annotations

from boltzlabs_gym.wire import protocol
from boltzlabs_gym.wire.protocol import encode_once, env_request_line


def steady_op(m: int) -> dict:
    return {"op": "step", "slots": list(range(m)), "ops": [None] * m, "actions": {"__nd__": [0, "<f4", [m, 6]]}}


def test_an_encoded_op_writes_what_the_encoder_writes():
    op = encode_once(steady_op(8), [192])
    assert env_request_line(op, [bytes(192)]) == env_request_line(dict(op), [bytes(192)])
    # Payloads of other sizes than the line announces: encoded as they are, never the stored line.
    assert env_request_line(op, [bytes(10)]) == env_request_line(dict(op), [bytes(10)])


def test_an_op_dropped_from_the_bounded_cache_is_encoded_again_on_its_next_use():
    op = encode_once(steady_op(4), [96])
    others = [encode_once(steady_op(2), [48]) for _ in range(protocol._MAX_ENCODED_LINES + 1)]
    assert protocol._ENCODED_LINES.get(id(op), (None,))[0] is not op  # dropped with the rest
    assert encode_once(op, [96]) is op and protocol._ENCODED_LINES[id(op)][0] is op
    assert env_request_line(op, [bytes(96)]) == env_request_line(dict(op), [bytes(96)])
    del others
