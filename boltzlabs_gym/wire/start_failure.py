"""An env factory's exception, as data: what a sandbox says when building its env raised.

The Gymnasium env host answers its first request with one line instead of serving,
``{"start_error": {"types": [...], "message": "..."}}``: the exception's class and its bases
as qualified names, most derived first, and its message. Strings only: nothing from a
sandbox is ever unpickled, so the trainer can only *name* the exception, and
:mod:`boltzlabs_gym.client.start_errors` maps those names onto a known set of classes.

The worker recognises the line by its first bytes (:func:`parse_start_failure`; every other
reply is left unparsed), kills the env and reports the start failure with the names in its
error reply (:func:`error_fields`). Standard library only.

>>> line = describe_start_failure(KeyError("level"))
>>> failure = parse_start_failure(line)
>>> failure.types[:2], failure.message
(('builtins.KeyError', 'builtins.LookupError'), "'level'")
>>> failure.reason
"its env factory raised KeyError: 'level'"
>>> parse_start_failure(b'{"obs": [0.1]}\\n') is None
True
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

__all__ = ["START_ERROR", "StartFailure", "describe_start_failure", "parse_start_failure", "error_fields"]

#: The reply key of a start failure, and the field of the worker's ``env_start`` error that carries the names.
START_ERROR = "start_error"
EXC_TYPES = "exc_types"
#: How a start failure's line begins (compact JSON, the key first): replies are matched on it unparsed.
_PREFIX = b'{"' + START_ERROR.encode() + b'"'
#: Bounds on what a sandbox may say: this many names, each this long, and a message this long.
MAX_TYPES = 16
MAX_NAME_CHARS = 200
MAX_MESSAGE_CHARS = 2000


class StartFailure(NamedTuple):
    """A start failure as the worker read it: ``types`` (qualified class names, most derived
    first) and ``message`` (the exception's ``str``), both bounded."""

    types: tuple[str, ...]
    message: str

    @property
    def reason(self) -> str:
        """The failure in the words the trainer's error starts with."""
        name = self.types[0].rpartition(".")[2] if self.types else "an exception"
        return f"its env factory raised {name}: {self.message}" if self.message else f"its env factory raised {name}"


def describe_start_failure(exc: BaseException) -> bytes:
    """The line a sandbox writes when building its env raised ``exc`` (env side)."""
    types = [f"{cls.__module__}.{cls.__qualname__}" for cls in type(exc).__mro__ if issubclass(cls, BaseException)]
    try:
        message = str(exc)
    except Exception:  # noqa: BLE001 - a broken __str__ must not hide the failure
        message = ""
    body = {"types": [t[:MAX_NAME_CHARS] for t in types[:MAX_TYPES]], "message": message[:MAX_MESSAGE_CHARS]}
    return json.dumps({START_ERROR: body}, separators=(",", ":")).encode() + b"\n"


def parse_start_failure(reply: bytes | bytearray | memoryview) -> StartFailure | None:
    """The start failure ``reply`` reports, or ``None`` if it is any other reply (worker side).

    Untrusted input: anything that is not the expected shape counts as not a start failure,
    and what is kept is cut to the bounds above.
    """
    if bytes(reply[: len(_PREFIX)]) != _PREFIX:
        return None
    try:
        obj = json.loads(bytes(reply))
    except ValueError:
        return None
    body = obj.get(START_ERROR) if isinstance(obj, dict) else None
    if not isinstance(body, dict) or not isinstance(body.get("types"), list):
        return None
    types = tuple(t[:MAX_NAME_CHARS] for t in body["types"][:MAX_TYPES] if isinstance(t, str))
    message = body.get("message")
    return StartFailure(types, message[:MAX_MESSAGE_CHARS] if isinstance(message, str) else "")


def error_fields(failure: StartFailure | None) -> dict[str, Any]:
    """The fields an ``env_start`` error reply adds for ``failure`` (none without one)."""
    return {} if failure is None else {EXC_TYPES: list(failure.types)}
