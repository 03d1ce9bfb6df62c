"""Reading env results: one place that turns what an env sent back into a transition.

Every adapter (``RLPool``, ``BoltzLabsVecEnv``, the SB3 adapter, ``boltzlabs-gym check``)
formats from here, so an env result means the same thing everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

from .protocol import ERROR, OK, STRAGGLER, parse_json


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


def parse_result(result: EnvResult) -> EnvResult:
    """Parse a raw result's reply line in place (a reply that is not a JSON object is an error)."""
    if result.reply is None:
        try:
            reply = parse_json(result.raw)
        except ValueError:
            result.status, reply = ERROR, {"message": "reply frame is not JSON"}
        if not isinstance(reply, dict):
            result.status, reply = ERROR, {"message": f"reply is a {type(reply).__name__}, not an object"}
        result.reply, result.raw = reply, None
    return result


def step_fields(r: EnvResult, step_timeout: float):
    """(obs, reward, terminated, truncated, info) of one env's step result."""
    if r.status == OK:
        reply = r.reply
        if "error" in reply and "obs" not in reply:
            return None, 0.0, True, False, {"boltzlabs_error": {"reason": f"env refused the step: {reply['error']}", "stderr": ""}}
        info = reply.get("info")
        info = dict(info) if isinstance(info, dict) else {}
        try:
            reward = float(reply.get("reward", 0.0))
        except (TypeError, ValueError):
            return None, 0.0, True, False, {"boltzlabs_error": {"reason": f"reward {reply.get('reward')!r} is not a number", "stderr": ""}}
        terminated = bool(reply.get("terminated", reply.get("done", False)))
        truncated = bool(reply.get("truncated", False))
        return reply.get("obs"), reward, terminated, truncated, info
    return None, 0.0, r.status == ERROR, r.status == STRAGGLER, failure_info(r, step_timeout)


def reset_fields(r: EnvResult):
    """(obs, info) of one env's reset result."""
    if r.status == OK:
        if "error" in r.reply and "obs" not in r.reply:
            return None, {"boltzlabs_error": {"reason": f"env refused the reset: {r.reply['error']}", "stderr": ""}}
        info = r.reply.get("info")
        return r.reply.get("obs"), dict(info) if isinstance(info, dict) else {}
    return None, failure_info(r, None)


def failure_info(r: EnvResult, step_timeout: float | None) -> dict:
    reason = str(r.reply.get("message", "unknown failure"))
    stderr = str(r.reply.get("stderr", ""))
    if r.status == STRAGGLER:
        return {"boltzlabs_straggler": {"reason": reason, "deadline_s": step_timeout}}
    return {"boltzlabs_error": {"reason": reason, "stderr": stderr}}
