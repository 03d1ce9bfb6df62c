"""What a reply is when user code raised: a terminal transition whose info carries the traceback.

An exception in an env's ``reset`` or ``step`` (or in decoding its action, or encoding its
result) must not kill the env process: both env hosts answer it with
:func:`error_transition` (``obs`` null, reward 0, ``terminated`` true,
``info["boltzlabs_exception"] = {"where": ..., "traceback": ...}``) and serve on. Standard
library only: it is loaded inside every sandbox.
"""

from __future__ import annotations

import sys
import traceback

__all__ = ["MAX_TRACEBACK_CHARS", "failed_transition", "error_transition"]

#: Largest traceback text carried in an info dict.
MAX_TRACEBACK_CHARS = 8000


def failed_transition(where: str, traceback_text: str) -> dict:
    """The terminal transition that stands for a failure: ``info["boltzlabs_exception"]`` says where and why."""
    return {
        "obs": None,
        "reward": 0.0,
        "terminated": True,
        "truncated": False,
        "info": {"boltzlabs_exception": {"where": where, "traceback": traceback_text}},
    }


def error_transition(where: str) -> dict:
    """A user exception (the one being handled) becomes a terminal transition, not a dead process."""
    tb = traceback.format_exc()[-MAX_TRACEBACK_CHARS:]
    sys.stderr.write(tb)
    sys.stderr.flush()
    return failed_transition(where, tb)
