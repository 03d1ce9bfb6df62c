"""The env side: what runs inside every sandboxed env process.

An env directory's ``env.py`` calls :func:`serve` with its ``reset`` and ``step``
functions; ``serve`` then speaks the worker's line protocol on stdin/stdout for the
life of the process::

    # envs/counter/env.py
    from boltzlabs_gym.env import serve
    state = {"t": 0}
    def reset(seed):
        state["t"] = 0
        return {"t": 0}
    def step(action):
        state["t"] += 1
        return {"t": state["t"]}, float(action), state["t"] >= 100, {}
    serve(reset=reset, step=step)

The protocol (one request line in, one reply line out, JSON, UTF-8)::

    {"op": "describe"}                           ->  {"observation_space": ..., "action_space": ...,
                                                      "metadata": {...}}
    {"op": "reset", "seed": 3, "options": {}}   ->  {"obs": ..., "info": {...}}
    {"op": "step", "action": ...}                ->  {"obs": ..., "reward": 1.0,
                                                      "terminated": false,
                                                      "truncated": false, "info": {...}}
    {"op": "close"}                              ->  {} and the process exits

A started env's first request is a ``describe`` (it proves the env is up without
resetting it: the trainer's first ``reset`` is the env's first reset); an env that
speaks the protocol itself may answer it with ``{}``, or any object, if it has nothing
to describe. A hard reset's start sends its seeded ``reset`` instead.

A line may announce raw binary payloads that follow it: ``"_bin": [n0, n1, ...]``
lists their byte lengths, and the bytes follow the newline back to back.  Anything
else (unknown op, malformed line) is answered with ``{"error": "..."}``.

This module is deliberately standard-library only: it is imported inside every
sandbox, possibly by an interpreter that has nothing else installed. What it shares
with the Gymnasium server and the boltz fork loop (the channel, framing, failure
transitions, the template hook) is in :mod:`boltzlabs_gym.envside`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

# Env code imports these from here; they live in the env side's shared module.
from .envside import (  # noqa: F401 - re-exported
    ENV_DIR,
    ENV_INDEX,
    MAX_LINE_BYTES,
    WORKSPACE,
    FdReader,
    FdWriter,
    ProtocolError,
    encode_json,
    error_transition,
    failed_transition,
    freeze_heap,
    protect_channel,
    read_message,
    template_fork,
    write_all,
    write_message,
)

__all__ = [
    "ENV_DIR",
    "WORKSPACE",
    "ENV_INDEX",
    "serve",
    "measurement",
    "read_message",
    "write_message",
    "ProtocolError",
]


@contextmanager
def measurement():
    """Mark a timing-sensitive section of a step.

    The worker's ``serialize_measurement=True`` gate already makes steps of one host
    run one at a time; this context manager records how long the section took so an
    env can report it (``with measurement() as m: ...; m.elapsed_s``).
    """

    class _Span:
        elapsed_s = 0.0

    span = _Span()
    start = time.perf_counter()
    try:
        yield span
    finally:
        span.elapsed_s = time.perf_counter() - start


def _normalise_step(result: Any) -> dict:
    """Accept the 4-tuple ``(obs, reward, done, info)`` or Gymnasium's 5-tuple."""
    if not isinstance(result, tuple) or len(result) not in (4, 5):
        raise TypeError(
            "step() must return (obs, reward, done, info) or "
            f"(obs, reward, terminated, truncated, info), got {type(result).__name__}"
            + (f" of length {len(result)}" if isinstance(result, tuple) else "")
        )
    if len(result) == 4:
        obs, reward, done, info = result
        terminated, truncated = bool(done), False
    else:
        obs, reward, terminated, truncated, info = result
    return {
        "obs": obs,
        "reward": float(reward),
        "terminated": bool(terminated),
        "truncated": bool(truncated),
        "info": dict(info or {}),
    }


def _normalise_reset(result: Any) -> dict:
    """``reset`` may return ``obs`` or Gymnasium's ``(obs, info)``."""
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], dict):
        return {"obs": result[0], "info": result[1]}
    return {"obs": result, "info": {}}


def _call_reset(reset: Callable, msg: dict) -> dict:
    seed = msg.get("seed")
    options = msg.get("options")
    try:
        if options:
            return _normalise_reset(reset(seed, options=options))
        return _normalise_reset(reset(seed))
    except Exception:
        out = error_transition("reset")
        return {"obs": None, "info": out["info"]}


def _call_step(step: Callable, reset: Callable, msg: dict) -> dict:
    try:
        out = _normalise_step(step(msg.get("action")))
    except Exception:
        out = error_transition("step")
    if msg.get("autoreset") and (out["terminated"] or out["truncated"]):
        # SAME_STEP autoreset: the env resets itself in this very reply.
        again = _call_reset(reset, {"seed": None})
        out["reset_obs"], out["reset_info"] = again["obs"], again["info"]
    return out


def _encode_reply(reply: dict) -> bytes:
    """Encode a reply line once; a reply that is not JSON becomes a terminal error transition."""
    try:
        return encode_json(reply).encode() + b"\n"
    except (TypeError, ValueError) as exc:
        failed = failed_transition("encode", f"reply is not JSON-serialisable: {exc}")
        return json.dumps(failed, separators=(",", ":")).encode() + b"\n"


def serve(
    reset: Callable[..., Any],
    step: Callable[[Any], Any],
    *,
    observation_space: dict | None = None,
    action_space: dict | None = None,
    metadata: dict | None = None,
) -> None:
    """Serve ``reset``/``step`` to the worker until it closes the channel.

    ``reset(seed)`` (or ``reset(seed, options=...)``) returns the first observation,
    or ``(obs, info)``. ``step(action)`` returns ``(obs, reward, done, info)`` or
    Gymnasium's ``(obs, reward, terminated, truncated, info)``. Observations, actions
    and infos are JSON values.

    ``observation_space``/``action_space`` optionally declare Gymnasium spaces in their
    JSON form (see :mod:`boltzlabs_gym.spaces`; ``{"type": "Discrete", "n": 2}``), so
    that the vector env can batch observations into arrays.

    A ``print()`` in user code goes to stderr, never into the channel. An exception
    in ``reset`` or ``step`` is turned into a terminal transition whose info carries
    the traceback (``info["boltzlabs_exception"]``); the process keeps serving.
    """
    template_fork()  # mode="boltz": a template forks envs here; each returns as an env
    proto_in, proto_out = protect_channel()
    describe = {
        "observation_space": observation_space,
        "action_space": action_space,
        "metadata": metadata or {},
    }
    freeze_heap()
    while True:
        try:
            got = read_message(proto_in)
        except ProtocolError as exc:
            write_message(proto_out, {"error": f"bad request: {exc}"})
            # A torn stream cannot be resynchronised: the worker will respawn us.
            return
        if got is None:
            return
        msg, _payloads = got
        op = msg.get("op")
        if op == "step":
            reply = _call_step(step, reset, msg)
        elif op == "reset":
            reply = _call_reset(reset, msg)
        elif op == "describe":
            reply = describe
        elif op == "close":
            write_message(proto_out, {})
            return
        else:
            reply = {"error": f"unknown op {op!r}"}
        proto_out.write(_encode_reply(reply))
        proto_out.flush()
