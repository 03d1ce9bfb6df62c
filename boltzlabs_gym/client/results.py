"""Reading env results: the one place that says what an env's answer means.

Every adapter (``RLPool``, ``BoltzLabsVecEnv``, the SB3 adapter, ``boltzlabs-gym check``)
reads env results through this module and only formats what it returns, so an env
result means the same thing everywhere:

* A step or reset that fails ends the env's episode by **truncation** (Gymnasium's
  meaning: it ended for a reason outside the MDP), never termination: value
  bootstrapping stays right for a transition the env never judged.
* The failure is described once, by a :class:`Failure`, and lands in the env's info
  under one of two keys, always with the same dict shape::

      info["boltzlabs_straggler"] = {"kind": "straggler", "reason": str, "stderr": str, "deadline_s": float}
      info["boltzlabs_error"]     = {"kind": "crash" | "refused" | "bad_reply", "reason": str, "stderr": str,
                                     "deadline_s": None}

>>> r = EnvResult(index=3, status=STRAGGLER, reply={"message": "env 3 missed the 1 s deadline for 'step'"}, payloads=[])
>>> t = read_step(r, deadline_s=1.0)
>>> t.terminated, t.truncated, t.failure.kind.value
(False, True, 'straggler')
>>> t.info["boltzlabs_straggler"]["deadline_s"]
1.0
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, cast

from ..errors import EnvAttributeError, EnvCallError
from ..wire.protocol import ERROR, OK, STRAGGLER, parse_json

__all__ = [
    "ERROR_KEY",
    "STRAGGLER_KEY",
    "EnvResult",
    "Failure",
    "FailureKind",
    "ResetOutcome",
    "Transition",
    "parse_result",
    "read_reset",
    "read_step",
    "read_value",
]

#: Info key of an env that missed its deadline (killed and respawned).
STRAGGLER_KEY = "boltzlabs_straggler"
#: Info key of every other failure: crash, refused request, unreadable reply.
ERROR_KEY = "boltzlabs_error"

#: Decodes an observation (or info) object and its binary payloads into the caller's form.
Decoder = Callable[[Any, list], Any]


@dataclass
class EnvResult:
    """One env's result in a batch: ``status`` is ``"ok"``, ``"straggler"`` or ``"error"``.

    ``reply`` is the env's reply object; from ``batch_wait(raw=True)`` it is ``None`` and
    ``raw`` holds the reply line as the worker sent it, for :func:`parse_result`.
    """

    index: int
    status: str
    reply: dict | None
    payloads: list
    raw: bytes | None = None


class FailureKind(str, enum.Enum):
    """Why an env gave no normal answer."""

    #: Missed its deadline; the worker killed it and is respawning it.
    STRAGGLER = "straggler"
    #: Died, was killed, or broke the channel protocol (garbage, oversized reply); respawned.
    CRASH = "crash"
    #: Answered with an error instead of a result (for example an action it could not decode); still running.
    REFUSED = "refused"
    #: Answered, but the answer could not be read (not a JSON object, a bad reward or observation).
    BAD_REPLY = "bad_reply"


@dataclass(frozen=True)
class Failure:
    """What went wrong with one env's request, for its info and for error messages."""

    index: int
    kind: FailureKind
    reason: str
    stderr: str = ""
    #: The deadline the env missed, in seconds (stragglers only).
    deadline_s: float | None = None

    @property
    def info_key(self) -> str:
        """``"boltzlabs_straggler"`` for a straggler, ``"boltzlabs_error"`` for every other kind."""
        return STRAGGLER_KEY if self.kind is FailureKind.STRAGGLER else ERROR_KEY

    def as_info(self) -> dict:
        """The failure as the env's info entry (see the module docstring for the shape)."""
        return {
            self.info_key: {
                "kind": self.kind.value,
                "reason": self.reason,
                "stderr": self.stderr,
                "deadline_s": self.deadline_s,
            }
        }

    def describe(self) -> str:
        """One message for humans: the reason and the tail of the env's stderr."""
        tail = self.stderr.rstrip()
        return self.reason + (f"\n--- stderr tail ---\n{tail}" if tail else "")


class Transition(NamedTuple):
    """One env's step, read. A failed step has ``obs`` ``None``, reward 0, ``truncated`` True."""

    obs: Any
    reward: float
    terminated: bool
    truncated: bool
    info: dict
    failure: Failure | None = None
    #: Set when the env reset itself in the same request (``SAME_STEP`` autoreset):
    #: the reset observation (``None`` if it could not be read) and its info.
    reset_obs: Any = None
    reset_info: dict | None = None


class ResetOutcome(NamedTuple):
    """One env's reset, read. A failed reset has ``obs`` ``None`` and the failure in ``info``."""

    obs: Any
    info: dict
    failure: Failure | None = None


def parse_result(result: EnvResult) -> EnvResult:
    """Parse a raw result's reply line in place (a reply that is not a JSON object is a bad reply)."""
    if result.reply is None:
        try:
            reply = parse_json(result.raw or b"")
        except ValueError:
            result.status, reply = ERROR, {"message": "reply frame is not JSON", "bad_reply": True}
        if not isinstance(reply, dict):
            result.status, reply = (
                ERROR,
                {"message": f"reply is a {type(reply).__name__}, not an object", "bad_reply": True},
            )
        result.reply, result.raw = reply, None
    return result


def _reply_of(r: EnvResult) -> dict:
    """The result's reply object, parsing a raw result first."""
    if r.reply is None:
        parse_result(r)
    return cast(dict, r.reply)


def _plain_obs(obj: Any, payloads: list) -> Any:
    return obj


def _plain_info(obj: Any, payloads: list) -> dict:
    return dict(obj) if isinstance(obj, dict) else {}


def failure_of(r: EnvResult, op: str, deadline_s: float | None = None) -> Failure | None:
    """The failure in a ``reset`` or ``step`` result, or ``None`` if the env answered it."""
    reply = _reply_of(r)
    if r.status == OK:
        if "error" in reply and "obs" not in reply:
            return Failure(r.index, FailureKind.REFUSED, f"env refused the {op}: {reply['error']}")
        return None
    reason = str(reply.get("message", "unknown failure"))
    stderr = str(reply.get("stderr", ""))
    if r.status == STRAGGLER:
        return Failure(r.index, FailureKind.STRAGGLER, reason, stderr, deadline_s)
    kind = FailureKind.BAD_REPLY if reply.get("bad_reply") else FailureKind.CRASH
    return Failure(r.index, kind, reason, stderr)


def _failed_step(failure: Failure, info: dict | None = None) -> Transition:
    return Transition(None, 0.0, False, True, {**(info or {}), **failure.as_info()}, failure)


def read_step(
    r: EnvResult,
    deadline_s: float | None = None,
    decode_obs: Decoder = _plain_obs,
    decode_info: Decoder = _plain_info,
) -> Transition:
    """Read one env's step result (a raw one is parsed first, see :func:`parse_result`).

    ``decode_obs``/``decode_info`` turn the reply's objects and payloads into the
    adapter's form (the defaults keep JSON values as they are); a decoder that raises
    ``TypeError``/``ValueError`` makes the step a ``bad_reply`` failure.
    """
    failure = failure_of(r, "step", deadline_s)
    if failure is not None:
        return _failed_step(failure)
    reply = _reply_of(r)
    info = decode_info(reply.get("info"), r.payloads)
    try:
        reward = float(reply.get("reward", 0.0))
    except (TypeError, ValueError):
        bad = Failure(r.index, FailureKind.BAD_REPLY, f"reward {reply.get('reward')!r} is not a number")
        return _failed_step(bad, info)
    try:
        obs = reply.get("obs")
        obs = None if obs is None else decode_obs(obs, r.payloads)
    except (TypeError, ValueError) as exc:
        bad = Failure(r.index, FailureKind.BAD_REPLY, f"env {r.index} sent a bad step reply: {exc}")
        return _failed_step(bad, info)
    terminated = bool(reply.get("terminated", reply.get("done", False)))
    truncated = bool(reply.get("truncated", False))
    if "reset_obs" not in reply and "reset_info" not in reply:
        return Transition(obs, reward, terminated, truncated, info)
    reset = _read_reset_reply(r, reply.get("reset_obs"), reply.get("reset_info"), decode_obs, decode_info)
    return Transition(obs, reward, terminated, truncated, info, None, reset.obs, reset.info)


def read_reset(
    r: EnvResult,
    deadline_s: float | None = None,
    decode_obs: Decoder = _plain_obs,
    decode_info: Decoder = _plain_info,
) -> ResetOutcome:
    """Read one env's reset result; see :func:`read_step`."""
    failure = failure_of(r, "reset", deadline_s)
    if failure is not None:
        return ResetOutcome(None, failure.as_info(), failure)
    reply = _reply_of(r)
    return _read_reset_reply(r, reply.get("obs"), reply.get("info"), decode_obs, decode_info)


def _read_reset_reply(r: EnvResult, obs: Any, info: Any, decode_obs: Decoder, decode_info: Decoder) -> ResetOutcome:
    info = decode_info(info, r.payloads)
    if obs is None:
        return ResetOutcome(None, info)
    try:
        return ResetOutcome(decode_obs(obs, r.payloads), info)
    except (TypeError, ValueError) as exc:
        bad = Failure(r.index, FailureKind.BAD_REPLY, f"env {r.index} sent a bad reset observation: {exc}")
        return ResetOutcome(None, {**info, **bad.as_info()}, bad)


def read_value(r: EnvResult, what: str, decode: Decoder = _plain_obs) -> Any:
    """The value of a ``call``/``get_attr``/``set_attr``/``render`` result, or an exception.

    Raises :class:`~boltzlabs_gym.errors.EnvCallError` naming the env when it failed or the
    call raised inside it; :class:`~boltzlabs_gym.errors.EnvAttributeError` (also an
    ``AttributeError``) when what raised there was an ``AttributeError``, as Gymnasium's
    and SB3's vectorizers do for a missing attribute.
    """
    reply = _reply_of(r)
    if r.status != OK:
        failure = cast(Failure, failure_of(r, what))
        raise EnvCallError(
            f"env {r.index}: {what} failed ({failure.kind.value}): {failure.describe()}", index=r.index, failure=failure
        )
    if "error" in reply:
        err = str(reply["error"])
        failure = Failure(r.index, FailureKind.REFUSED, err)
        if "AttributeError" in err:
            last = err.strip().splitlines()[-1] if err.strip() else err
            raise EnvAttributeError(f"env {r.index}: {what}: {last}", index=r.index, failure=failure)
        raise EnvCallError(f"env {r.index}: {what} failed inside the env:\n{err}", index=r.index, failure=failure)
    return decode(reply.get("value", reply.get("frame")), r.payloads)
