"""The rules an env's caller follows, shared by the worker and a local pool's direct lane.

A call to an env goes either through the worker or, for a lent env, straight from the
pool's lane (:mod:`boltzlabs_gym.client.direct_lane`); both must judge an env the same way, or the
same env would fail differently depending on who held its pipes. Standard library only:
the client side imports it without the worker's dependencies.

>>> timeouts = OpTimeouts(step_timeout=1.0, reset_timeout=5.0)
>>> timeouts["step"], timeouts["reset"], timeouts["hard_reset"]
(1.0, 5.0, 5.0)
>>> missed_deadline(1.0, "step", 1.25)
"missed the 1 s deadline for 'step' (waited 1.25 s); killed"
>>> missed_deadline(60.0, None, 61.0)
'missed the 60 s deadline for its start-up (interpreter start and first request) (waited 61.00 s); killed'
>>> leftover_is_stray(replied=False, idle=False)  # the rest of a reply still on its way
False
"""

from __future__ import annotations

__all__ = [
    "STEP",
    "STRAY_OUTPUT",
    "OpTimeouts",
    "call_timeout",
    "is_straggler_op",
    "leftover_is_stray",
    "missed_deadline",
]

#: A sandbox request's own deadline (protocol.SANDBOX_DEADLINE; not imported: this module stands alone).
_DEADLINE_KEY = "deadline_s"

#: The op whose deadline is the step timeout, and whose late reply makes a straggler (not an error).
STEP = "step"
#: The fault of an env that wrote bytes no call was waiting for.
STRAY_OUTPUT = "the env wrote output nobody asked for"


class OpTimeouts(dict):
    """Op name -> seconds an env has to answer it: ``step_timeout`` for a step, ``reset_timeout``
    for anything else (a reset, a hard reset, a custom op).

    A dict, so that looking a step's timeout up on the hot path is one dict lookup, with no
    Python call (:meth:`__missing__` only runs for the other, rarer, ops).
    """

    def __init__(self, step_timeout: float, reset_timeout: float):
        super().__init__({STEP: step_timeout})
        self.step_timeout = step_timeout
        self.reset_timeout = reset_timeout

    def __missing__(self, name: str) -> float:
        return self.reset_timeout


def call_timeout(timeouts: OpTimeouts, op: dict) -> float:
    """The seconds an env has to answer ``op``: its name's timeout, or the deadline a sandbox request
    carries (a step batch with resets in it: the step and the reset deadline together).

    >>> call_timeout(OpTimeouts(1.0, 5.0), {"op": "step", "deadline_s": 6.0})
    6.0
    """
    deadline = op.get(_DEADLINE_KEY)
    if isinstance(deadline, (int, float)) and not isinstance(deadline, bool) and 0 < deadline <= 86400:
        return float(deadline)
    return timeouts[op["op"]]


def is_straggler_op(name: str) -> bool:
    """Whether a call of op ``name`` that misses its deadline is a straggler (the env is
    restarted and the step reported late) rather than an error."""
    return name == STEP


def missed_deadline(timeout: float, op: str | None, waited: float) -> str:
    """The fault reason of an env that did not answer op ``op`` (``None``: the first request
    of its start-up) within ``timeout`` seconds, after ``waited`` seconds."""
    what = "its start-up (interpreter start and first request)" if op is None else f"'{op}'"
    return f"missed the {timeout:g} s deadline for {what} (waited {waited:.2f} s); killed"


def leftover_is_stray(replied: bool, idle: bool) -> bool:
    """Whether the incomplete output an env left in its pipe was never asked for.

    Called when a read left part of a message unread: bytes after a reply (``replied``: the
    read completed one) or arriving when no call is in flight (``idle``) would otherwise be
    taken as the start of the next call's reply, so the env is faulted with
    :data:`STRAY_OUTPUT`. Without either, it is the rest of the awaited reply, still coming.
    """
    return replied or idle
