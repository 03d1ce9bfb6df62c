"""The sandbox request a steady step batch sends every step, recognised by its bytes.

A pool stepping a sandbox of several envs with a batch of array actions (continuous control: a
Box action per env) sends the same request line every step: the same slots, every op ``None``
(each env steps with its row), the same dtype and shape of the batch; only the payload's bytes
change (the trainer encodes that line once, :func:`boltzlabs_gym.wire.protocol.sandbox_step_line`). Its
JSON would be parsed and checked again every step. :class:`SteadyRequests` parses and checks the
first one as the general path does (:func:`~.sandbox_slots.check_sandbox_request`), then knows
the next by comparing bytes: its line the same, its payload the size the line announces. Any
other request, or one that arrives in pieces, goes the general path.

>>> steady = SteadyRequests(count=2)
>>> line = b'{"op":"step","slots":[0,1],"ops":[null,null],"actions":{"__nd__":[0,"<f4",[2,1]]},"_bin":[8]}\\n'
>>> steady.match(line + bytes(8)).actions[:2]
('<f4', [2, 1])
>>> steady.match(line + bytes(8)) is not None, steady.match(line + bytes(4))
(True, None)
"""

from __future__ import annotations

from ..errors import ProtocolError
from .framing import decode_json
from .sandbox_slots import SandboxRequest, check_sandbox_request

__all__ = ["SteadyRequests"]

#: The longest request line remembered (a steady line is a few hundred bytes even for K=4096: its
#: ops are ``null`` and its slots short ints; a longer one is read the general way).
MAX_STEADY_LINE = 64 << 10
_ACTIONS_KEY = b'"actions"'


class SteadyRequests:
    """The last steady sandbox request a process of ``count`` slots was sent, by its line's bytes."""

    __slots__ = ("count", "line", "nbytes", "request")

    def __init__(self, count: int):
        self.count = count
        #: The steady request's line (with its newline); empty until one was seen.
        self.line = b""
        #: Its payload's size: the line announces it.
        self.nbytes = -1
        #: The request as checked the first time, its payload left out.
        self.request: SandboxRequest | None = None

    def match(self, data: bytes) -> SandboxRequest | None:
        """The checked request ``data`` is, when it is exactly one steady request (its line and its
        whole payload, nothing more); ``None`` for anything else, which the caller reads as usual."""
        line, request = self.line, self.request
        if request is not None and len(data) == len(line) + self.nbytes and data.startswith(line):
            dtype, shape, _ = request.actions  # type: ignore[misc]  # a steady request has actions
            return request._replace(actions=(dtype, shape, data[len(line) :]))
        return self._learn(data)

    def _learn(self, data: bytes) -> SandboxRequest | None:
        """Check ``data`` as the general path would, and remember it when it is a steady request."""
        nl = data.find(b"\n", 0, MAX_STEADY_LINE)
        if nl < 0 or data.find(_ACTIONS_KEY, 0, nl) < 0:
            return None  # not one whole line, or no batch of actions: cheap to turn away
        try:
            msg = decode_json(data[: nl + 1].decode())
        except (ValueError, RecursionError):
            return None
        payload = data[nl + 1 :]
        if type(msg) is not dict or msg.get("op") != "step" or msg.get("_bin") != [len(payload)]:
            return None
        try:
            request = check_sandbox_request(msg, [payload], self.count)
        except ProtocolError:
            return None  # the general path answers what is wrong
        if request.actions is None or any(op is not None for op in request.ops):
            return None  # an env resets in it, or steps otherwise: not the same next time
        self.line, self.nbytes = data[: nl + 1], len(payload)
        self.request = request._replace(actions=(request.actions[0], request.actions[1], b""))
        return request
