"""The JSON env host: what :func:`boltzlabs_gym.env.serve` runs, an env's ``reset``/``step`` (or the
objects a factory builds) answering the env line protocol inside its sandbox.

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

Sandboxes of several envs: with ``BOLTZLABS_ENVS_PER_SANDBOX`` (K) above 1 in its
environment, the process hosts ``BOLTZLABS_ENV_COUNT`` envs (its slots) and every request
is a sandbox request: per-env ops as above, one per slot named, answered with one sandbox
reply that carries each slot's reply (see "Sandboxes of several envs" in
:mod:`boltzlabs_gym.wire.protocol`; ``describe``, ``reset``, ``step`` and ``close`` per slot,
and a ``close`` closes them all). Only the factory form can do this: the function form's
functions share their module's state, so it refuses to start with K > 1.

Standard library only, like :mod:`boltzlabs_gym.env`: it is imported inside every sandbox,
possibly by an interpreter that has nothing else installed. What it shares with the Gymnasium env
host (:mod:`~boltzlabs_gym.envside.gym_host`) is the request loop
(:mod:`~boltzlabs_gym.envside.serve_loop`), the channel's framing
(:mod:`~boltzlabs_gym.envside.framing`), failure transitions
(:mod:`~boltzlabs_gym.envside.failures`), sandboxes of several envs
(:mod:`~boltzlabs_gym.envside.sandbox_slots`) and the process's set-up and boltz template hook
(:mod:`~boltzlabs_gym.envside.process_setup`).
"""

from __future__ import annotations

import inspect
import json
import os
import sys
from collections.abc import Callable
from functools import partial
from typing import Any, BinaryIO

from .failures import error_transition, failed_transition
from .framing import encode_json, write_message
from .process_setup import freeze_heap, memory_snapshots, protect_channel, template_fork, workspace_now
from .sandbox_slots import Progress, SandboxRequest, sandbox_config, spelled_out, write_sandbox_reply
from .serve_loop import Answer, serve_requests, serve_sandbox_requests
from .state import AUTO, MEMORY, SnapshotRefused, restore_request, snapshot_reply

__all__ = ["serve_json"]


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


def serve_json(
    reset: Callable[..., Any] | None = None,
    step: Callable[[Any], Any] | None = None,
    factory: Callable[[], Any] | None = None,
    observation_space: dict | None = None,
    action_space: dict | None = None,
    metadata: dict | None = None,
    get_state: Callable[[], Any] | None = None,
    set_state: Callable[[Any], Any] | None = None,
    reseed: Callable[[int], Any] | None = None,
) -> None:
    """:func:`boltzlabs_gym.env.serve`, whose arguments these are in its order (see there): build
    the env, or one per slot of a sandbox of several, and answer its requests until a ``close`` or
    the end of input."""
    if factory is not None and (reset is not None or step is not None):
        raise TypeError("serve() takes either factory=make_env or reset= and step=, not both")
    if factory is None and (reset is None or step is None):
        raise TypeError("serve() needs factory=make_env, or both reset= and step=")
    if factory is not None and not callable(factory):
        raise TypeError(f"serve(factory=...) must be a callable returning an env object, got {type(factory).__name__}")
    template_fork()  # mode="boltz": a template forks envs here; each returns as an env
    config = sandbox_config()  # after the fork: a forked env's environment is the worker's
    if factory is None and config.envs_per_sandbox > 1:
        _refuse_shared_functions(config.envs_per_sandbox)
    proto_in, proto_out = protect_channel()
    describe = {
        "observation_space": observation_space,
        "action_space": action_space,
        "metadata": metadata or {},
    }
    if factory is None:
        assert reset is not None and step is not None
        freeze_heap()
        hooks = _StateHooks(reset, step, get_state, set_state, reseed)
        _serve_one(hooks, describe, proto_in, proto_out)
        return
    first = max(int(os.environ.get("BOLTZLABS_ENV_INDEX") or -1), 0)  # -1: run by hand
    build = _builder(factory)
    envs = [build(first + slot) for slot in range(config.env_count)]
    freeze_heap()
    try:
        if config.envs_per_sandbox == 1:
            _serve_one(envs[0], describe, proto_in, proto_out, on_restore=lambda env: envs.__setitem__(0, env))
        else:
            _serve_sandbox(envs, describe, proto_in, proto_out, Progress(workspace_now()))
    finally:
        _close_envs(envs)


def _builder(factory: Callable[..., Any]) -> Callable[[int], Any]:
    """``factory`` as a callable of the env's pool index: passed on when it takes an argument."""
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: call it as it is
        return lambda index: factory()
    takes_index = any(
        p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL) and p.default is p.empty
        for p in params
    )
    return factory if takes_index else (lambda index: factory())


def _refuse_shared_functions(k: int) -> None:
    sys.stderr.write(
        f"boltzlabs: envs_per_sandbox={k} needs independent env instances, but env.py calls "
        f"serve(reset=..., step=...), whose functions share the module's state between the {k} envs of "
        "a sandbox; write serve(factory=make_env) with make_env() returning an object with "
        "reset(seed, options=None) and step(action) (or use envs_per_sandbox=1)\n"
    )
    sys.stderr.flush()
    sys.exit(2)


def _close_envs(envs: list) -> None:
    """Close each env object that has a ``close()``; a failure goes to stderr and the next is closed."""
    for env in envs:
        close = getattr(env, "close", None)
        if callable(close):
            try:
                close()
            except Exception:
                error_transition("close")  # writes the traceback to stderr


class _StateHooks:
    """The function form as an env object: its ``reset``/``step`` and, when given, the state hooks
    that make it snapshottable (:mod:`~boltzlabs_gym.envside.state` pickles what ``get_state`` returns)."""

    def __init__(self, reset, step, get_state, set_state, reseed) -> None:
        self.reset, self.step = reset, step
        if get_state is not None:
            self.get_state = get_state
        if set_state is not None:
            self.set_state = set_state
        if reseed is not None:
            self.reseed = reseed


def _one_env_answer(env: Any, describe: dict, out: BinaryIO, on_restore: Callable[[Any], Any] | None) -> Answer:
    """The one-env protocol's answer (see the module doc) for :func:`serve_requests`: one reply line a
    request, written to ``out``; ``False`` after a ``close``.

    ``env`` has ``reset``/``step``; a restore may replace it (``on_restore`` is told the new one).
    The state lives in this closure's cells rather than on an object: every step reads them, and an
    object's attributes cost each step a tenth to three tenths of a microsecond more (a counter env, 2 cores)."""
    reset, step = env.reset, env.step
    last_obs = None  # what the env last returned: a snapshot keeps it, a restore answers with it
    started = False  # a reset or restore started an episode in this process (see state.NOT_STARTED)

    def answer(msg: dict, payloads: list) -> bool:
        nonlocal env, reset, step, last_obs, started
        op = msg.get("op")
        if op == "step":
            reply = _call_step(step, reset, msg)
            last_obs = reply["reset_obs"] if "reset_obs" in reply else reply["obs"]
        elif op == "reset":
            reply = _call_reset(reset, msg)
            last_obs, started = reply["obs"], True
        elif op == "describe":
            reply = describe
        elif op == "close":
            write_message(out, {})
            return False
        elif op == "snapshot":
            snapshot = _snapshot(env, last_obs, started, msg.get("kind"), msg.get("swap"))
            if snapshot is not None:  # None: a memory snapshot's copy, which answers its restore instead
                write_message(out, *snapshot)
            return True
        elif op == "restore":
            old, (env, reply) = env, _restore(env, msg, payloads, last_obs)
            if "error" not in reply:
                reset, step, last_obs, started = env.reset, env.step, reply["obs"], True
                if on_restore is not None:
                    on_restore(env)
                if old is not env:
                    _close_envs([old])  # the env it replaced lets go of what it holds now, not at exit
        else:
            reply = {"error": f"unknown op {op!r}"}
        out.write(_encode_reply(reply))
        out.flush()
        return True

    return answer


_GLOBALS_UNSEEN = (
    "cannot snapshot: serve(reset=, step=) keeps its state in module globals, which a portable "
    "snapshot cannot see; pass get_state= and set_state= to serve(), use serve(factory=make_env), or take "
    "kind='memory' (boltz mode, namespaces backend: it copies the whole process, globals included)"
)


def _snapshot(env: Any, last_obs: Any, started: bool, kind: Any = None, nonce: Any = None) -> tuple[dict, list] | None:
    if isinstance(env, _StateHooks) and not hasattr(env, "get_state"):
        return _snapshot_globals(last_obs, started, kind, nonce)
    return snapshot_reply(env, last_obs, started, workspace_now(), kind, nonce, memory_snapshots())


def _snapshot_globals(last_obs: Any, started: bool, kind: Any, nonce: Any) -> tuple[dict, list] | None:
    """The function form without state hooks: only a memory snapshot, a copy of the whole process,
    carries its module globals, so ``"memory"`` and ``"auto"`` take that kind and nothing falls back
    to a blob that would leave the globals out."""
    if kind not in (MEMORY, AUTO):
        return {"error": _GLOBALS_UNSEEN}, []
    reply = snapshot_reply(None, last_obs, started, workspace_now(), MEMORY, nonce, memory_snapshots())
    if reply is not None and "error" in reply[0] and kind == AUTO and started:
        reply[0]["error"] = f"{_GLOBALS_UNSEEN} ({reply[0]['error'].removeprefix('cannot take ')})"
    return reply


def _restore(env: Any, msg: dict, payloads: list, last_obs: Any = None) -> tuple[Any, dict]:
    """The env to serve from now on and the reply (as a reset's) after restoring ``payloads[0]``."""
    try:
        env, restored = restore_request(env, msg, payloads, workspace_now(), last_obs, memory_snapshots())
    except SnapshotRefused as exc:
        return env, {"error": str(exc)}
    return env, {"obs": restored["obs"], "info": {}}


def _serve_one(
    env: Any, describe: dict, proto_in: BinaryIO, proto_out: BinaryIO, on_restore: Callable[[Any], Any] | None = None
) -> None:
    """The one-env protocol: one request line, one reply line, until ``close`` or end of input
    (a torn stream is answered and ends it too: the worker will respawn us)."""
    serve_requests(proto_in, proto_out, _one_env_answer(env, describe, proto_out, on_restore))


def _serve_sandbox(envs: list, describe: dict, proto_in: BinaryIO, proto_out: BinaryIO, progress: Progress) -> None:
    """Several envs: sandbox requests in, sandbox replies out (every position in ``replies``), until a
    ``close`` or end of input. A sandbox request that cannot be served is answered ``{"error"}``."""
    serve_sandbox_requests(
        proto_in, proto_out, len(envs), partial(_answer_sandbox, envs, describe, proto_out, progress)
    )


def _answer_sandbox(envs: list, describe: dict, out: BinaryIO, progress: Progress, request: SandboxRequest) -> bool:
    """Serve a sandbox request's positions in order and write its sandbox reply; ``False`` after a
    ``close`` (every env closed)."""
    positions = spelled_out(request)
    replies = []
    closing = False
    for p, (slot, op, _op_payloads) in enumerate(positions):
        progress.set(slot)
        reply = _serve_op(envs[slot], op, describe)
        closing = closing or reply is None
        replies.append((p, _encode_reply({} if reply is None else reply)[:-1], ()))
    progress.idle()
    if closing:
        _close_envs(envs)
        envs.clear()  # closed once: the caller's close finds nothing left
    write_sandbox_reply(out, len(positions), replies)
    return not closing


def _serve_op(env: Any, op: dict, describe: dict) -> dict | None:
    """One slot's op of a sandbox request: its reply, or ``None`` for ``close``."""
    name = op.get("op")
    if name == "step":
        return _call_step(env.step, env.reset, op)
    if name == "reset":
        return _call_reset(env.reset, op)
    if name == "describe":
        return describe
    if name == "close":
        return None
    return {"error": f"unknown op {name!r}"}
