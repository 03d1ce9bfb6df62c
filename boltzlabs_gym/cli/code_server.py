"""``boltzlabs-gym code-server``: SandboxFusion's API on a code runner (needs the ``server`` extra).

Beyond loopback the server needs tokens (``--token``, ``--token-file``, ``$BOLTZLABS_CODE_TOKEN``),
one per client, or an explicit ``--insecure-no-auth``; see :mod:`boltzlabs_gym.code.server.auth`.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from ..errors import AuthConfigError, MissingExtraError
from .code_server_lanes import add_lane_flags, describe_lanes, start_runner
from .pool_flags import add_pool_flags, pool_settings_from

__all__ = ["POOL_SETTINGS", "add_code_server_flags", "run_code_server"]

#: The pool settings the code server takes as flags (``--reset-timeout``, ``--no-direct``...: see
#: :mod:`boltzlabs_gym.cli.pool_flags`), for every lane's pool. The runner sets ``mode`` and
#: ``step_timeout`` itself (``--max-run-timeout``); ``limits`` come from ``--memory-mb``.
POOL_SETTINGS = (
    "isolation",
    "keys",
    "start_timeout",
    "reset_timeout",
    "heartbeat_interval",
    "heartbeat_timeout",
    "lease",
    "busy_poll_us",
    "env_aslr",
    "direct",
)


def add_code_server_flags(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1); anything but loopback needs a token or --insecure-no-auth",
    )
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--lanes", type=int, default=4, help="pools, each with one batch in flight (default 4)")
    p.add_argument("--envs-per-lane", type=int, default=4, help="sandboxes per pool (default 4)")
    p.add_argument(
        "--max-queue",
        type=int,
        default=1024,
        help="waiting runs, all clients together, past which 504 with Retry-After is answered (default 1024)",
    )
    p.add_argument(
        "--max-queue-per-client",
        type=int,
        default=None,
        help="waiting runs of one client past which that client gets 504 with Retry-After "
        "(default: --max-queue divided evenly among the tokens; all of it without tokens)",
    )
    p.add_argument(
        "--token",
        action="append",
        default=[],
        metavar="TOKEN",
        help="a token a client must send (repeat for several clients, one token each); on the command line it is "
        "visible to this host's other users: prefer --token-file or $BOLTZLABS_CODE_TOKEN",
    )
    p.add_argument(
        "--token-file",
        action="append",
        default=[],
        metavar="PATH",
        help="a file of tokens, one per line: TOKEN or NAME TOKEN (# comments); repeatable",
    )
    p.add_argument(
        "--insecure-no-auth",
        action="store_true",
        help="serve an address beyond loopback without a token (a trusted network only: anyone who reaches the "
        "port can run code)",
    )
    p.add_argument(
        "--workers",
        nargs="*",
        default=None,
        help="remote worker addresses (tcp://host:port), --lanes-per-worker lanes on each; default: a local worker",
    )
    p.add_argument("--memory-mb", type=int, default=2048, help="each sandbox's memory limit (MiB)")
    p.add_argument("--max-run-timeout", type=float, default=60.0, help="largest run_timeout accepted (s)")
    p.add_argument("--max-output-bytes", type=int, default=1 << 20, help="stdout/stderr kept per command")
    p.add_argument("--no-metrics", action="store_true", help="do not serve /metrics")
    p.add_argument(
        "--no-wipe",
        action="store_true",
        help="no in-sandbox wipe: each program runs in namespaces and places made for it alone (where the "
        "sandbox allows it; else each is followed by a hard reset)",
    )
    p.add_argument(
        "--python",
        default="auto",
        metavar="auto|worker|PATH",
        help="the interpreter Python programs run under: the code runtime's venv where installed (auto, the "
        "default), the worker's own (worker), or an interpreter under /usr",
    )
    add_pool_flags(p, POOL_SETTINGS)
    add_lane_flags(p)
    return p


def run_code_server(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from ..code.server import create_app
        from ..code.server.auth import TOKEN_ENV, ClientTokens, check_bind, collect_tokens
    except ImportError as exc:
        raise MissingExtraError(
            f"boltzlabs-gym code-server needs the server extra ({exc}): pip install 'boltzlabs-gym[server]'", "server"
        ) from exc
    from ..wire.limits import Limits

    try:  # before any sandbox starts: a server that must not run does not start one
        tokens = ClientTokens(collect_tokens(args.token, os.environ.get(TOKEN_ENV), args.token_file))
        check_bind(args.host, tokens=len(tokens), insecure=args.insecure_no_auth)
    except AuthConfigError as exc:
        print(f"boltzlabs-gym code-server: {exc}", file=sys.stderr)
        return 2
    settings = pool_settings_from(args, POOL_SETTINGS)
    settings["limits"] = Limits(memory_bytes=args.memory_mb << 20)
    runner_settings: dict[str, Any] = dict(settings)
    runner_settings["max_queue_per_client"] = _per_client_bound(args.max_queue_per_client, args.max_queue, len(tokens))
    runner, close = start_runner(args, runner_settings)  # local, --workers or --ray
    auth = f"{len(tokens)} client token(s)" if len(tokens) else "no token"
    print(f"code server: {runner!r}; {runner.isolation}; {auth}\n{describe_lanes(runner)}", flush=True)
    app = create_app(runner, metrics=not args.no_metrics, owns_runner=True, tokens=tokens)
    loop, http = _fast_http()
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning", loop=loop, http=http)
    finally:
        close()
    return 0


def _fast_http() -> tuple[str, str]:
    """uvicorn's uvloop event loop and httptools parser where installed (the server extra brings
    them); where one is missing, the pure-Python one with a warning naming it."""
    import importlib.util
    import logging

    chosen = {}
    for setting, module, fallback in (("loop", "uvloop", "asyncio"), ("http", "httptools", "h11")):
        if importlib.util.find_spec(module) is not None:
            chosen[setting] = module
        else:
            chosen[setting] = fallback
            logging.getLogger("boltzlabs_gym.code").warning(
                "code server: %s is not installed, so HTTP runs on %s (slower per request): "
                "pip install 'boltzlabs-gym[server]'",
                module,
                fallback,
            )
    return chosen["loop"], chosen["http"]


def _per_client_bound(given: int | None, max_queue: int, clients: int) -> int | None:
    """``--max-queue-per-client``, or by default an even share of ``--max-queue`` per token: then no
    client's burst can fill the queue and keep the others out (``None``, no bound of its own, with
    one client or none)."""
    if given is not None:
        return given
    return max(1, max_queue // clients) if clients > 1 else None
