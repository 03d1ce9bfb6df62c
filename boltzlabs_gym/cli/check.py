"""``boltzlabs-gym check``: run an env directory in the sandbox and explain what is wrong.

For env authors: starts one env, asks it to describe itself, resets it and steps
it a few times, and checks every reply against the protocol in
:mod:`boltzlabs_gym.env`. Each problem is printed with what to change.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

from ..client.pool import RLPool
from ..client.results import EnvResult, FailureKind, failure_of
from ..errors import BoltzLabsError, EnvStartError
from ..wire.protocol import OK


def _problems_in_reset(reply: dict) -> list[str]:
    """What is wrong with a reset reply the env did answer (see :func:`_failure_problem`)."""
    out = []
    if "obs" not in reply:
        out.append("reset reply has no 'obs' key: return the first observation from reset()")
    if "info" in reply and not isinstance(reply["info"], dict):
        out.append(f"reset info must be a JSON object, got {type(reply['info']).__name__}")
    exc = (reply.get("info") or {}).get("boltzlabs_exception") if isinstance(reply.get("info"), dict) else None
    if exc:
        out.append(f"reset() raised:\n{exc.get('traceback', '')}")
    return out


def _problems_in_step(reply: dict) -> list[str]:
    """What is wrong with a step reply the env did answer (see :func:`_failure_problem`)."""
    out = []
    for key in ("obs", "reward"):
        if key not in reply:
            out.append(f"step reply has no {key!r} key")
    if "reward" in reply and (isinstance(reply["reward"], bool) or not isinstance(reply["reward"], (int, float))):
        out.append(f"reward must be a number, got {reply['reward']!r}")
    if not any(k in reply for k in ("terminated", "done")):
        out.append("step reply has neither 'terminated' nor 'done'")
    info = reply.get("info", {})
    if not isinstance(info, dict):
        out.append(f"step info must be a JSON object, got {type(info).__name__}")
    elif info.get("boltzlabs_exception"):
        out.append(f"step() raised:\n{info['boltzlabs_exception'].get('traceback', '')}")
    return out


#: Worker failure reasons an env author can fix, and what to change.
_HINTS = (
    (
        ("not a JSON line", "expected a JSON object", "bad _bin announcement", "nobody asked for"),
        "something wrote to the env's stdout outside serve(): stdout is the reply channel and every byte "
        "on it must be a reply. Write logs to stderr; print() inside reset/step is safe (serve() sends it "
        "to stderr), but output before serve() starts (at import time, from a library or a subprocess "
        "started earlier) or to a saved copy of fd 1 corrupts the channel",
    ),
    (
        ("longer than",),
        "a reply line exceeded the worker's limit: return smaller observations, or send arrays as binary payloads",
    ),
    (
        ("exceeded its memory limit",),
        "the env used more memory than its limit: use less, or raise Limits(memory_bytes=...)",
    ),
    (
        ("closed its stdout", "closed its stdin", "exited with status", "killed by signal"),
        "the env process died or closed its channel: see its stderr above; env.py must keep serve() running",
    ),
    (("deadline",), "the env did not answer in time: make it faster or raise the pool's timeouts"),
)


def _hint(reason: str) -> str:
    for needles, hint in _HINTS:
        if any(n in reason for n in needles):
            return f"\n  hint: {hint}"
    return ""


def check_env_dir(
    env_dir: str,
    *,
    steps: int = 5,
    isolation: str = "auto",
    actions: list[str] | None = None,
    out: Callable[[str], Any] = print,
) -> list[str]:
    """Run ``env_dir`` through describe, reset and ``steps`` steps; return the problems found."""
    problems: list[str] = []
    if not os.path.isfile(os.path.join(env_dir, "env.py")):
        problems.append(f"{env_dir} has no env.py: the worker runs env.py, which must call serve(reset=..., step=...)")
        out(problems[-1])
        return problems
    parsed = [json.loads(a) for a in actions] if actions else [0]
    try:
        pool = RLPool(env_dir, 1, isolation=isolation, start_timeout=60, step_timeout=30, reset_timeout=30)
    except EnvStartError as exc:
        problems.append(f"the env did not start or did not answer its first request: {exc}{_hint(str(exc))}")
        out(problems[-1])
        return problems
    except BoltzLabsError as exc:
        problems.append(str(exc))
        out(problems[-1])
        return problems
    with pool:
        out(f"started 1 env: {pool.isolation}")
        described = pool.call_envs({"op": "describe"})[0]
        spaces = described.reply or {}
        if described.status == OK and "error" not in spaces:
            out(
                f"describe: observation_space={spaces.get('observation_space')} "
                f"action_space={spaces.get('action_space')}"
            )
        r = pool.call_envs({"op": "reset", "seed": 0})[0]
        failed = _failure_problem(r, "reset")
        problems += [failed] if failed else _problems_in_reset(r.reply or {})
        for t in range(steps):
            action = parsed[t % len(parsed)]
            r = pool.call_envs({"op": "step", "action": action})[0]
            failed = _failure_problem(r, "step")
            if failed:
                problems.append(f"step {t}: {failed}")
                break
            reply = r.reply or {}
            problems += [f"step {t}: {p}" for p in _problems_in_step(reply)]
            if reply.get("terminated") or reply.get("truncated") or reply.get("done"):
                out(f"step {t}: episode ended (reward {reply.get('reward')})")
                break
    for p in problems:
        out(f"PROBLEM: {p}")
    out("no problems found" if not problems else f"{len(problems)} problem(s) found")
    return problems


def _failure_problem(r: EnvResult, op: str) -> str | None:
    """The env's failure to answer ``op`` as a problem with a hint, or ``None`` if it answered."""
    failure = failure_of(r, op)
    if failure is None:
        return None
    if failure.kind is FailureKind.REFUSED:
        return f"{op} answered with an error: {(r.reply or {}).get('error')}"
    return f"the env {r.status}: {failure.reason}{_hint(failure.reason)}\n{failure.stderr}"
