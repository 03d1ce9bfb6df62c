"""The env side's request loop: read a request, answer it, until ``close`` or end of input.

Both env hosts run this one loop: :mod:`~boltzlabs_gym.envside.json_host` (behind
:func:`boltzlabs_gym.env.serve`) and :mod:`~boltzlabs_gym.envside.gym_loops` (Gymnasium envs),
each for one env or for the envs of a sandbox of several (sandbox requests). What differs between
them is passed in: how a request is answered (dispatched to the env, and its reply framed and
written), whether a line that was read whole but is no request is answered and served past, and a
host's quick answer to the bytes of one ``os.read``. What does not differ lives here: a torn stream is answered and ends
the loop (it cannot be resynchronised: the worker respawns the env), end of input ends it
quietly, and a sandbox request is checked before it is served.

This is every env step's path through its process, where tens of microseconds a step count: the
loop is the few lines of :func:`serve_requests`, and a request costs it one call into the host.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Callable

from ..errors import ProtocolError
from .framing import STILL_IN_SYNC, FdReader, MessageReader, MessageWriter, read_message, write_message
from .sandbox_slots import SandboxRequest, check_sandbox_request
from .steady_requests import SteadyRequests

__all__ = ["Ending", "Answer", "QuickAnswer", "serve_requests", "serve_sandbox_requests"]

#: Answers one request ``(msg, payloads)``, writing its reply; ``False`` once the process must end
#: (a ``close`` was answered).
Answer = Callable[[dict, list[bytes]], bool]
#: Answers the bytes of one ``os.read`` when they are a request it recognises whole (writing the
#: reply, ``True``); ``False`` leaves them to :func:`read_message`.
QuickAnswer = Callable[[bytes], bool]


class Ending(enum.Enum):
    """Why :func:`serve_requests` returned."""

    #: A request was answered as the last (a ``close``).
    CLOSED = "closed"
    #: The worker closed the channel: nothing more will come.
    END_OF_INPUT = "end of input"
    #: The stream broke off mid-message or cannot be read past (answered ``{"error": ...}``).
    TORN = "torn"


def serve_requests(
    reader: MessageReader,
    writer: MessageWriter,
    answer: Answer,
    *,
    serve_past_bad_lines: bool = False,
    quick: QuickAnswer | None = None,
) -> Ending:
    """Answer requests read from ``reader`` with ``answer`` until it returns ``False`` or input ends.

    A request :func:`read_message` cannot read is answered ``{"error": "bad request: ..."}`` on
    ``writer``; then the loop ends (:attr:`Ending.TORN`), unless ``serve_past_bad_lines`` and the
    whole line was read (it is no JSON object: :data:`~.framing.STILL_IN_SYNC`), when it reads the
    next request. ``quick`` (``reader`` must then be an :class:`FdReader`) is offered every
    ``os.read`` made while nothing is buffered, before any parsing: a host's hot path for a
    request that arrives alone and that it knows by its bytes.
    """
    raw: FdReader | None = None  # the reader ``quick`` reads around, when there is one
    if quick is None:
        quick = _recognises_nothing
    elif isinstance(reader, FdReader):
        raw = reader
    else:
        raise TypeError(f"serve_requests(quick=...) reads the fd itself: reader must be an FdReader, got {reader!r}")
    fd = raw.fd if raw is not None else -1
    while True:
        if raw is not None and not raw.buf:
            data = os.read(fd, 1 << 16)
            if quick(data):
                continue
            raw.push(data)
        try:
            got = read_message(reader)
        except ProtocolError as exc:
            write_message(writer, {"error": f"bad request: {exc}"})
            if serve_past_bad_lines and str(exc).startswith(STILL_IN_SYNC):
                continue
            return Ending.TORN  # a torn stream cannot be resynchronised: the worker will respawn us
        if got is None:
            return Ending.END_OF_INPUT
        msg, payloads = got
        if not answer(msg, payloads):  # (not answer(*got): a call with * is not inlined by the interpreter)
            return Ending.CLOSED


def _recognises_nothing(data: bytes) -> bool:
    return False


def serve_sandbox_requests(
    reader: MessageReader,
    writer: MessageWriter,
    count: int,
    answer_sandbox: Callable[[SandboxRequest], bool],
    *,
    serve_past_bad_lines: bool = False,
    sandbox_ops: dict[str, Callable[[dict], dict]] | None = None,
) -> Ending:
    """:func:`serve_requests` for a process hosting ``count`` envs: every request is a sandbox request,
    but for the ops in ``sandbox_ops`` (about the process, not one env: ``{"op": name}`` answered with
    ``sandbox_ops[name](msg)``'s reply, which carries no payloads).

    ``answer_sandbox`` gets each checked request (:func:`~.sandbox_slots.check_sandbox_request`), writes its sandbox
    reply and returns ``False`` after a ``close``. A request that is not a sandbox request this
    process can serve is answered ``{"error": "bad group request: ..."}`` and the loop serves on:
    the whole line was read.
    """

    def answer(msg: dict, payloads: list[bytes]) -> bool:
        if sandbox_ops and type(msg.get("op")) is str and msg["op"] in sandbox_ops:
            try:
                reply = sandbox_ops[msg["op"]](msg)
            except Exception as exc:  # noqa: BLE001 - said in the reply; the envs serve on
                reply = {"error": f"{msg['op']} failed: {type(exc).__name__}: {exc}"}
            write_message(writer, reply)
            return True
        try:
            request = check_sandbox_request(msg, payloads, count)
        except ProtocolError as exc:
            write_message(writer, {"error": f"bad group request: {exc}"})
            return True
        return answer_sandbox(request)

    if not isinstance(reader, FdReader):
        return serve_requests(reader, writer, answer, serve_past_bad_lines=serve_past_bad_lines)
    steady = SteadyRequests(count)

    def quick(data: bytes) -> bool:
        # The request of a steady step batch, known by its bytes: no JSON to parse, nothing to check
        # again (every op steps, so it never closes the process).
        request = steady.match(data)
        if request is None:
            return False
        answer_sandbox(request)
        return True

    return serve_requests(reader, writer, answer, serve_past_bad_lines=serve_past_bad_lines, quick=quick)
