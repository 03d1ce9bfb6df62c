"""The Gymnasium env host's request loops: one env's requests, or a sandbox's requests.

Each loop reads requests from the env's channel, has the :class:`~boltzlabs_gym.envside.gym_host.GymHost`
of the env named answer them and writes the replies: :func:`serve_one` (one env: the one-env
protocol, with a quick answer to a plain Discrete step's exact bytes) and :func:`serve_sandbox`
(the envs of a sandbox of several: sandbox requests, whose plain positions are rows of the reply's
arrays, :class:`~boltzlabs_gym.envside.sandbox_rows.SandboxRows`). Both run on
:mod:`~boltzlabs_gym.envside.serve_loop`; start-up (building the envs) is
:mod:`~boltzlabs_gym.envside.gym_start`.

This is every env step's path through its process: the hot paths are inlined where a call per
step would show.
"""

from __future__ import annotations

import math
import sys
from functools import partial
from math import isfinite
from typing import Any, cast

import numpy as np

from ..wire.codec import ArrayLeaf
from ..wire.protocol import array_step_line, parse_discrete_step
from . import obs_region
from .failures import error_transition, failed_transition
from .framing import FdReader, FdWriter, MessageWriter, encode_reply, write_all, write_message, writev_all
from .gym_host import GymHost, _traceback, region_reply
from .sandbox_rows import SandboxRows
from .sandbox_slots import Progress, SandboxRequest, sandbox_reply_parts
from .serve_loop import Answer, Ending, QuickAnswer, serve_requests, serve_sandbox_requests

__all__ = ["serve_one", "serve_sandbox", "close_all"]


def _write(stream: MessageWriter, reply: dict, payloads: list) -> None:
    try:
        write_message(stream, reply, payloads)
    except (TypeError, ValueError) as exc:  # nothing was written: the line is built first
        tb = f"reply is not JSON-serialisable: {exc}"
        sys.stderr.write(tb + "\n")
        if "obs" in reply:
            fallback = failed_transition("encode", tb)
        else:
            fallback = {"error": tb}
        write_message(stream, fallback)


def serve_one(host: GymHost, fd_in: int, fd_out: int) -> None:
    """Answer one env's requests from ``fd_in`` on ``fd_out`` until ``close`` or end of input.

    A plain Discrete step arrives as one short line, alone in one ``os.read``; it is
    recognised by its exact bytes (:func:`~boltzlabs_gym.wire.protocol.parse_discrete_step`) and
    answered without a JSON parser or buffered streams. Every env step is a context
    switch into this process, with cold caches: the less code a step runs here, the
    cheaper it is (about 20 us of CPU less per CartPole step with 64 envs on 2 cores).
    Anything else, or anything more in the buffer, takes the generic path. A line that is
    not a JSON object is answered ``{"error": ...}`` and the host serves on; a torn stream
    is answered and ends it. At end of input the env is closed.
    """
    writer = FdWriter(fd_out)
    if host._discrete is not None:
        quick = _discrete_step_answer(host, writer)
    elif host._action_leaf is not None:
        quick = _array_step_answer(host, writer)
    else:
        quick = None
    ending = serve_requests(FdReader(fd_in), writer, _answer(host, writer), serve_past_bad_lines=True, quick=quick)
    if ending is Ending.END_OF_INPUT:
        close_all([host])


# The two answers below write a result the same way, inline rather than through a shared
# function: they run once per env step, where every call counts.


def _answer(host: GymHost, writer: FdWriter) -> Answer:
    """Answer a request with :meth:`GymHost.handle` and write what it returns (``{}`` for a ``close``)."""
    handle, fd = host.handle, writer.fd

    def answer(msg: dict, payloads: list[bytes]) -> bool:
        result = handle(msg, payloads)
        if type(result) is bytes:  # a step's reply, already encoded
            write_all(fd, result)
        elif result is None:  # a close: the env is closed
            write_message(writer, {})
            return False
        else:
            _write(writer, *result)
        return True

    return answer


def _discrete_step_answer(host: GymHost, writer: FdWriter) -> QuickAnswer:
    """Answer the bytes of one plain Discrete step line (:meth:`GymHost.step_discrete`), written."""
    step_discrete, fd = host.step_discrete, writer.fd

    def quick(data: bytes) -> bool:
        request = parse_discrete_step(data)
        result = step_discrete(*request) if request is not None else None
        if result is None:
            return False
        if type(result) is bytes:  # a step's reply, already encoded
            write_all(fd, result)
        else:
            _write(writer, *result)
        return True

    return quick


def _array_step_answer(host: GymHost, writer: FdWriter) -> QuickAnswer:
    """Answer the bytes of one step of an array action in the space's own dtype (its line,
    :func:`~boltzlabs_gym.wire.protocol.array_step_line`, and its payload, alone in one read), written."""
    leaf = cast(ArrayLeaf, host._action_leaf)
    dtype, shape, nbytes = leaf.dtype, leaf.shape, leaf.nbytes
    lines = {autoreset: array_step_line(dtype.str, shape, nbytes, autoreset) for autoreset in (False, True)}
    step_action, fd = host.step_action, writer.fd

    def quick(data: bytes) -> bool:
        for autoreset, line in lines.items():
            if len(data) == len(line) + nbytes and data.startswith(line):
                action = np.frombuffer(data, dtype, offset=len(line)).reshape(shape).copy()
                # SyncVectorEnv hands a Box(()) env an element of the batch: a numpy scalar.
                result = step_action(action[()] if not shape else action, autoreset)
                if type(result) is bytes:  # a step's reply, already encoded
                    write_all(fd, result)
                else:
                    _write(writer, *result)
                return True
        return False

    return quick


def serve_sandbox(hosts: list[GymHost], fd_in: int, fd_out: int, progress: Progress) -> None:
    """Answer sandbox requests for these slots' envs from ``fd_in`` on ``fd_out`` until ``close`` or end of input.

    A line that is not a sandbox request this process can serve is answered ``{"error": ...}``
    and the process serves on (the whole line was read); a torn stream as in :func:`serve_one`.
    At end of input every env is closed.
    """
    rows = SandboxRows.of(hosts)
    answer_sandbox = partial(_serve_sandbox_request, hosts, rows, progress, fd_out)
    ending = serve_sandbox_requests(
        FdReader(fd_in),
        FdWriter(fd_out),
        len(hosts),
        answer_sandbox,
        serve_past_bad_lines=True,
        sandbox_ops={"obs_region": partial(_sandbox_obs_region, rows)},
    )
    if ending is Ending.END_OF_INPUT:
        close_all(hosts)


def _serve_sandbox_request(
    hosts: list[GymHost], rows: SandboxRows | None, progress: Progress, fd_out: int, request: SandboxRequest
) -> bool:
    """Serve one sandbox request's positions in order and write its sandbox reply; ``False`` after a ``close``
    (every env closed, the reply written: the process ends)."""
    slots, ops, op_payloads, autoreset, actions = request
    batch = _action_batch(actions) if actions is not None else None
    n = len(ops)
    replies: list[tuple[int, Any, list]] = []
    closing = False
    set_progress = progress.set
    obs_rows = rows.obs if rows is not None else None  # one array's rows; None for a Dict/Tuple's
    if rows is not None:
        rewards, flags, dtype, shape, info_columns = rows.rewards, rows.flags, rows.dtype, rows.shape, rows.info
    for p in range(n):
        slot = slots[p]
        op = ops[p]
        set_progress(slot)
        host = hosts[slot]
        action: Any = _NO_ACTION
        if rows is not None:
            # The hot path: GymHost.sandbox_step and (for one array) SandboxRows.put for a Discrete
            # step or a row of a batch of array actions, inlined (a few microseconds of an ~8 us
            # step); anything unusual takes the general path.
            if type(op) is int and host._actions:
                i = op - host._discrete[0]  # type: ignore[index]  # _actions implies _discrete
                if 0 <= i < len(host._actions):
                    action = host._actions[i]
            elif op is None and type(batch) is np.ndarray and host.action_row_fits(batch.dtype, batch.shape[1:]):
                action = batch[p]
        if action is not _NO_ACTION:
            try:
                obs, reward, terminated, truncated, info = host.env.step(action)
                reward, terminated, truncated = float(reward), bool(terminated), bool(truncated)
            except Exception:
                replies.append((p, *host._autoreset(error_transition("step"), [], autoreset, False)))
                continue
            plain = type(info) is dict and not (autoreset and (terminated or truncated))
            if plain and obs_rows is None and rows is not None:  # a Dict/Tuple of arrays
                if rows.put(p, obs, reward, terminated, truncated, info):
                    continue
            elif (
                plain
                and obs_rows is not None
                and type(obs) is np.ndarray
                and (obs.dtype is dtype or obs.dtype == dtype)
                and obs.shape == shape
                and isfinite(reward)
                and (info_columns.put(p, info) if info else not info_columns.keys or info_columns.clear_has(p))
            ):
                obs_rows[p] = obs  # a copy: the env may reuse its buffer
                rewards[p] = reward
                flags[p] = terminated | truncated << 1
                continue
            transition = host._transition(obs, reward, terminated, truncated, info, autoreset, False, False)
            replies.append((p, *transition))
            continue
        if op is None:  # a step with its row of the request's batch of actions
            try:
                action = _action_row(host, batch, p)
            except Exception:
                replies.append((p, *host._autoreset(error_transition("action"), [], autoreset, False)))
                continue
            result = host.sandbox_step_decoded(action, autoreset, rows, p)
        elif type(op) is int:  # the shorthand of a step
            result = host.sandbox_step(op, (), autoreset, rows, p)
        else:
            own = op_payloads[p] if op_payloads is not None else ()
            name = op.get("op")
            if name == "step":
                result = host.sandbox_step(op.get("action"), own, bool(op.get("autoreset")), rows, p)
            elif name == "reset":
                result = host.sandbox_reset(op, rows, p)
            elif name == "close":
                closing, result = True, ({}, [])
            else:  # describe, call, get_attr, set_attr, render; an unknown op's error
                result = host.handle(op, own)  # type: ignore[assignment]  # (reply, payloads) for these ops
        if result is not None:
            replies.append((p, *result))
    progress.idle()
    if closing:
        close_all(hosts)
    if rows is None or len(replies) == n:  # no plain position (or none can be): no arrays
        parts = sandbox_reply_parts(n, [_encode_one(*reply) for reply in replies])
    elif not replies:
        parts = [rows.plain_line(n), *rows.payloads(n)]
    else:
        for p, _reply, _payloads in replies:
            rows.clear(p)
        parts = sandbox_reply_parts(n, [_encode_one(*reply) for reply in replies], rows.arrays(n), rows.payloads(n))
    writev_all(fd_out, parts)  # the rows' views go straight to the pipe, not joined into a copy first
    return not closing


#: No action decoded on the hot path (``None`` is no sentinel: a None op is a row of the batch).
_NO_ACTION = object()


def _action_batch(actions: tuple[str, list, bytes]) -> np.ndarray | str:
    """A request's batch of actions as one writable array (each env steps with a view of its row,
    as SyncVectorEnv hands its envs rows of the batch), or why it is not one."""
    dtype_str, shape, data = actions
    dtype = _ACTION_DTYPES.get(dtype_str)
    if dtype is None:
        try:
            dtype = np.dtype(dtype_str)
        except (TypeError, ValueError):
            return f"the batch of actions has the dtype {dtype_str[:40]!r}"
        if len(_ACTION_DTYPES) < 64:
            _ACTION_DTYPES[dtype_str] = dtype
    # (shape: ints checked by check_sandbox_request; math.prod of Python ints cannot wrap around)
    if dtype.kind not in "biuf" or dtype.itemsize * math.prod(shape) != len(data):
        return f"the batch of actions is not {shape} of {dtype} in {len(data)} bytes"
    return np.frombuffer(data, dtype=dtype).reshape(shape).copy()


#: Action batch dtypes by their wire spelling, parsed once.
_ACTION_DTYPES: dict[str, np.dtype] = {}


def _action_row(host: GymHost, batch: np.ndarray | str | None, p: int) -> Any:
    """Position ``p``'s action from the request's batch, checked against the env's action space."""
    if not isinstance(batch, np.ndarray):
        raise ValueError(batch or "a step of a row of the batch of actions, in a request without one")
    if not host.action_row_fits(batch.dtype, batch.shape[1:]):
        raise ValueError(f"a row of {batch.dtype} {batch.shape[1:]} is not an action of {host.action_space}")
    return batch[p]


def _sandbox_obs_region(rows: SandboxRows | None, msg: dict) -> dict:
    """A sandbox of several envs answers ``{"op": "obs_region"}`` for all of them: one region, a slot
    per env (for a Dict/Tuple, each array's rows back to back), which its sandbox replies' rows live
    in once told to ``"use"`` it (:meth:`SandboxRows.share`)."""
    if rows is None:
        return {
            "error": "no shared observation region: the envs' observations are neither one array space "
            "nor a Dict/Tuple of arrays only, the same for all"
        }
    sizes = (rows.m, rows.row_bytes)
    if msg.get("use") is not True:
        return region_reply(obs_region.create(*sizes), rows.describe(), rows.skeleton)
    region = obs_region.current()
    if region is None or (region.slots, region.slot_bytes) != sizes:
        return {"error": "no shared observation region to use: ask for one first"}
    if not rows.shared:
        rows.share(region)
    region.close_fd()  # the worker has its own now
    return {"obs_region": {"in_use": True}}


def _encode_one(p: int, reply: dict, payloads: list) -> tuple[int, bytes, list]:
    """A position's reply for :func:`~boltzlabs_gym.envside.sandbox_slots.sandbox_reply`; one that is not JSON becomes
    what the one-env host writes instead (:func:`_write`)."""
    try:
        return p, encode_reply(reply, payloads), payloads
    except (TypeError, ValueError) as exc:
        tb = f"reply is not JSON-serialisable: {exc}"
        sys.stderr.write(tb + "\n")
        fallback = failed_transition("encode", tb) if "obs" in reply else {"error": tb}
        return p, encode_reply(fallback), []


def close_all(hosts: list[GymHost]) -> None:
    for host in hosts:
        try:
            host.env.close()
        except Exception:
            _traceback()
