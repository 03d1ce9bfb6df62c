"""The HTTP face: SandboxFusion's ``POST /run_code`` and ``GET /v1/ping`` over a
:class:`~boltzlabs_gym.code.CodeRunner`.

Beside SandboxFusion's two endpoints: ``GET /v1/status`` (isolation in force, lanes, queue,
counts) and ``GET /metrics`` (Prometheus; see :mod:`boltzlabs_gym.code.server.metrics`).

* With ``tokens``, every path but ``/v1/ping`` needs one (:mod:`~boltzlabs_gym.code.server.auth`:
  a bearer token, basic auth in the URL or ``?token=``); without, ``401`` before the body is read.
  Each token is a client of the runner's fair queue; without tokens all requests are one client.
* A full queue (all clients', or the asking client's own bound) answers ``504`` with
  ``Retry-After``: the one status verl's ``call_sandbox_api`` retries (the ``sandbox-fusion``
  client retries any). Bad fields and malformed JSON ``422`` (FastAPI's shape); a
  ``run_timeout``/``compile_timeout`` over the server's maximum ``422``.
* A language SandboxFusion knows but this server does not run, or whose toolchain this host lacks:
  ``SandboxError`` saying why (SandboxFusion answers its own missing runners with a ``SandboxError``
  too); ``/v1/status`` ``languages`` lists each language and why it cannot run.
* A client that disconnects cancels its run (:meth:`~boltzlabs_gym.code.CodeRunner.cancel`):
  queued, it is dropped; running, its sandbox is killed with the program's whole process tree
  and reset for the next request (found within :data:`DISCONNECT_POLL_S`).
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterable, Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from ..fair_queue import DEFAULT_CLIENT, QueueFullError
from ..languages import canonical
from ..runner import CodeRunner
from ..runs import LANGUAGES, RunRequest, RunResult
from .auth import CLIENT_STATE_KEY, OPEN_PATHS, ClientTokens, TokenAuth
from .models import RunCodeRequest, RunCodeResponse, RunStatus

__all__ = ["create_app"]

#: Seconds a client told the queue is full is asked to wait.
RETRY_AFTER_S = 1
#: The status of a full queue: verl's ``call_sandbox_api`` retries a 504 and no other (the
#: ``sandbox-fusion`` client retries any status but 200), so a client told to come back does.
QUEUE_FULL_STATUS = 504
#: How often a pending request looks whether its client is still there (seconds).
DISCONNECT_POLL_S = 0.25


def create_app(
    runner: CodeRunner,
    *,
    metrics: bool = True,
    owns_runner: bool = False,
    tokens: ClientTokens | Mapping[str, str] | Iterable[str] | None = None,
) -> FastAPI:
    """A FastAPI app serving ``runner`` (closed with the app if ``owns_runner``).

    ``tokens`` (``{client name: token}``, tokens alone, or a :class:`ClientTokens`): when given,
    every path but ``/v1/ping`` needs one of them, and each token's requests are a client of their
    own in the runner's fair queue. ``None`` (or none): anyone who reaches the port may use it, as
    one client; serve a loopback address only then (the CLI refuses anything else).
    """
    app = FastAPI(title="boltzlabs_gym code server", description="SandboxFusion's /run_code on sandboxed pools")
    server_metrics = _metrics_for(runner) if metrics else None
    clients = tokens if isinstance(tokens, ClientTokens) else ClientTokens(tokens or ())
    unauthorized = 0
    if owns_runner:
        app.router.on_shutdown.append(runner.close)

    def count_unauthorized() -> None:
        nonlocal unauthorized
        unauthorized += 1
        if server_metrics is not None:
            server_metrics.rejected.labels("unauthorized").inc()

    if len(clients):
        app.add_middleware(TokenAuth, tokens=clients, on_reject=count_unauthorized)

    @app.get("/v1/ping")
    async def ping() -> str:
        return "pong"

    @app.get("/v1/status")
    async def status() -> dict[str, Any]:
        s = runner.stats()
        iso = runner.isolation
        return {
            "isolation": iso.to_json() if iso is not None else None,
            "per_request": (
                "a sandbox forked from a warm template; after every run it is wiped inside its sandbox and "
                "checked (where it is PID 1 of its own PID namespace) or hard-reset (killed, wiped, forked afresh)"
            ),
            "wipe": _wipe_report(runner),
            "memory_limit_per_request": _memory_limit_report(runner),
            "languages": _languages_report(runner),
            # the interpreter Python programs run under (the code runtime's venv; null: the worker's own)
            "python": runner.python,
            "lanes": runner.capacity // runner.envs_per_lane,
            "envs_per_lane": runner.envs_per_lane,
            "max_queue": runner.max_queue,
            "max_queue_per_client": runner.max_queue_per_client,
            "auth": {"required": bool(len(clients)), "clients": len(clients), "open_without_token": sorted(OPEN_PATHS)},
            "unauthorized": unauthorized,
            "max_run_timeout": runner.max_run_timeout,
            "max_output_bytes": runner.max_output_bytes,
            "queued": s.queued,
            "queued_by_client": s.queued_by_client,
            "running": s.running,
            "runs": {f"{lang}/{st}": n for (lang, st), n in sorted(s.runs.items())},
            "timeouts": s.timeouts,
            "oom_kills": s.oom_kills,
            "cancelled": s.cancelled,
            "wipes": s.wipes,
            "fresh": s.fresh,
            "hard_resets": s.hard_resets,
            "lanes_lost": s.lanes_lost,
            "lane_placement": [lane.to_json() for lane in runner.lanes()],  # where each lane runs
        }

    @app.get("/metrics")
    async def prometheus() -> Response:
        if server_metrics is None:
            return JSONResponse({"detail": "metrics are off (start without --no-metrics)"}, status_code=404)
        body, content_type = server_metrics.render()
        return Response(body, media_type=content_type)

    @app.post("/run_code", response_model=RunCodeResponse)
    async def run_code(body: RunCodeRequest, request: Request) -> Any:
        pod = os.environ.get("MY_POD_NAME")
        why_not = _why_not_runnable(runner, body.language)
        if why_not is not None:
            if server_metrics is not None:
                server_metrics.rejected.labels("language").inc()
            return RunCodeResponse(status=RunStatus.SandboxError, message=why_not, executor_pod_name=pod)
        too_long = _over_maximum(body, runner)
        if too_long is not None:
            return JSONResponse({"detail": [too_long]}, status_code=422)
        run = RunRequest(
            code=body.code,
            language=body.language,
            stdin=body.stdin,
            files=body.files,
            fetch_files=body.fetch_files,
            run_timeout=body.run_timeout,
            compile_timeout=body.compile_timeout,
            memory_limit_mb=body.memory_limit_MB,
        )
        try:
            future = runner.submit(run, client=getattr(request.state, CLIENT_STATE_KEY, DEFAULT_CLIENT))
        except QueueFullError as exc:
            if server_metrics is not None:
                server_metrics.rejected.labels("client_queue_full" if exc.per_client else "queue_full").inc()
            return JSONResponse(
                {"detail": str(exc)}, status_code=QUEUE_FULL_STATUS, headers={"Retry-After": str(RETRY_AFTER_S)}
            )
        waiting = asyncio.wrap_future(future)
        while True:
            done, _ = await asyncio.wait({waiting}, timeout=DISCONNECT_POLL_S)
            if done:
                break
            if await request.is_disconnected():
                await asyncio.get_running_loop().run_in_executor(None, runner.cancel, future)
                waiting.cancel()  # (its CancelledError, set by the lane, then goes unread without a warning)
                if server_metrics is not None:
                    server_metrics.cancelled.inc()
                return Response(status_code=499)
        if waiting.cancelled():
            return JSONResponse({"detail": "the server is shutting down"}, status_code=503)
        # (a Response: FastAPI then does not validate the answer again against RunCodeResponse,
        # whose shape our own result already has)
        return Response(json.dumps(_response(waiting.result(), pod)), media_type="application/json")

    return app


def _metrics_for(runner: CodeRunner):
    try:
        from .metrics import ServerMetrics
    except ImportError:  # pragma: no cover - prometheus-client missing
        return None
    try:
        m = ServerMetrics(
            lambda: (runner.stats().queued, runner.stats().running),
            wipe_in_force=lambda: runner.wipe_in_force,
        )
    except ImportError:
        return None
    earlier = runner.on_result

    def observe(req: RunRequest, result: RunResult, queue_wait_s: float, total_s: float) -> None:
        m.observe(req, result, queue_wait_s, total_s)
        if earlier is not None:
            earlier(req, result, queue_wait_s, total_s)

    runner.on_result = observe
    return m


def _languages_report(runner: CodeRunner) -> dict[str, dict[str, Any]]:
    """Each language SandboxFusion names -> whether this server runs it, and why not."""
    return {
        name: {"available": why is None, "why_not": why}
        for name, why in (runner.languages or {n: None for n in LANGUAGES}).items()
    }


def _why_not_runnable(runner: CodeRunner, language: str) -> str | None:
    """Why this server cannot run ``language`` (not served, or its toolchain missing), or None."""
    name = canonical(language)
    if name not in LANGUAGES:
        reason = runner.languages.get(name) or "no runner for it here"
        served = ", ".join(n for n in LANGUAGES if runner.languages.get(n) is None)
        return f"language {language!r} is not supported by this server ({reason}); supported: {served}"
    why = runner.languages.get(name)
    return None if why is None else f"language {language!r} cannot run on this server: {why}"


def _wipe_report(runner: CodeRunner) -> dict[str, Any]:
    """Whether programs are wiped away in place between runs, and why not where they are not."""
    if not runner.wipe and runner.fresh_in_force:
        return {
            "in_force": False,
            "why_not": "turned off (--no-wipe): each Python program runs in fresh namespaces of its own, every "
            "other program is followed by a hard reset",
            "fresh_namespaces": True,
        }
    if not runner.wipe:
        return {
            "in_force": False,
            "why_not": "turned off (--no-wipe): every run is followed by a hard reset "
            f"(no fresh namespaces per program here: {runner.fresh_unavailable})",
            "fresh_namespaces": False,
        }
    if not runner.wipe_in_force:
        return {"in_force": False, "why_not": runner.wipe_unavailable}
    return {"in_force": True}


def _memory_limit_report(runner: CodeRunner) -> dict[str, str]:
    """How ``memory_limit_MB`` is enforced here, and why."""
    if runner.memory_limit_by == "rlimit":
        return {
            "by": "rlimit",
            "how": "RLIMIT_AS and RLIMIT_DATA of the program, as SandboxFusion sets them (an allocation past it fails)",
            "why": "the sandboxes have no cgroup of their own here (the worker needs root and a cgroup hierarchy)",
        }
    return {
        "by": runner.memory_limit_by,
        "how": (
            "the sandbox's cgroup limit, lowered by the worker for the run to what the sandbox holds when it "
            "starts plus memory_limit_MB (never above the sandbox's own limit); the kernel's OOM killer ends a "
            "program past it (return_code -9)"
        ),
    }


def _over_maximum(body: RunCodeRequest, runner: CodeRunner) -> dict | None:
    """A FastAPI-shaped 422 entry for a timeout over the server's maximum, else ``None``."""
    for name, limit in (("run_timeout", runner.max_run_timeout), ("compile_timeout", runner.max_compile_timeout)):
        value = getattr(body, name)
        if value > limit:
            return {
                "type": "less_than_equal",
                "loc": ["body", name],
                "msg": f"Input should be less than or equal to {limit:g} (this server's maximum)",
                "input": value,
            }
    return None


def _response(result: RunResult, pod: str | None) -> dict:
    return {
        "status": result.status,
        "message": result.message,
        "compile_result": result.compile_result.to_json() if result.compile_result else None,
        "run_result": result.run_result.to_json() if result.run_result else None,
        "executor_pod_name": pod,
        "files": result.files,
    }
