"""The ``boltzlabs-gym`` command.

Commands, by example::

    boltzlabs-gym keygen ./keys                       CURVE key pairs for a worker and a client
    boltzlabs-gym worker --bind tcp://0.0.0.0:5555 --keys ./keys   run a worker
    boltzlabs-gym check ./my_env                      run an env dir through reset and steps, explain problems
    boltzlabs-gym status tcp://host:5555 --keys ./keys   sessions, envs, PSS, envs/GiB, isolation
    boltzlabs-gym top tcp://a:5555 tcp://b:5555 --keys ./keys   live table: calls/s, latency, faults
    boltzlabs-gym worker --bind tcp://0.0.0.0:5555 --keys ./keys --metrics-port 9100   with /metrics
    boltzlabs-gym isolation                           which sandbox this host gives, and why
    boltzlabs-gym code-server --port 8080             SandboxFusion's POST /run_code on sandboxed pools
    boltzlabs-gym code-languages                      which of SandboxFusion's languages this host runs, and why not
    boltzlabs-gym code-runtime install                what programs expect beyond toolchains (tsx, jest, a Python venv)
"""

from __future__ import annotations

import argparse
import json
import sys

from ..worker.flags import add_worker_flags

__all__ = ["main"]


def _cmd_worker(args: argparse.Namespace) -> int:
    from ..worker.__main__ import run

    return run(args)


def _cmd_keygen(args: argparse.Namespace) -> int:
    from ..wire.keys import KeyFileError, generate_keys

    try:
        written = generate_keys(args.directory)
    except KeyFileError as exc:
        print(exc, file=sys.stderr)
        return 2
    for name, path in written.items():
        print(f"{name:14s} {path}")
    print(
        "copy worker.key_secret and client.key to each worker host; "
        "keep client.key_secret and worker.key with the trainer"
    )
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    import zmq

    from ..wire.protocol import decode_header, encode_header

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        if args.keys:
            from ..wire.keys import load_client_keys

            keys = load_client_keys(args.keys)
            sock.curve_secretkey = keys.secret
            sock.curve_publickey = keys.public
            sock.curve_serverkey = keys.server_public
        sock.connect(args.address)
        sock.send_multipart([encode_header({"op": "status", "seq": 1})])
        if not sock.poll(args.timeout * 1000):
            print(f"no answer from {args.address} within {args.timeout} s", file=sys.stderr)
            return 1
        header = decode_header(sock.recv_multipart()[0])
    finally:
        sock.close(0)
        ctx.term()
    print(json.dumps(header, indent=2))
    return 0 if header.get("ok") else 1


def _cmd_top(args: argparse.Namespace) -> int:
    from ..errors import MissingExtraError
    from .top import run_top

    try:
        return run_top(args.address, args.keys, args.once, args.interval, args.timeout)
    except MissingExtraError as exc:
        print(exc, file=sys.stderr)
        return 2


def _cmd_isolation(args: argparse.Namespace) -> int:
    from ..worker.sandbox import _backends

    for name, backend in _backends().items():
        ok, why = backend.available()
        print(f"{name:11s} {'available' if ok else 'unavailable'}: {why}")
        if ok:
            report = backend.report()
            print(f"            {report}")
            if "speculation" in report.properties:  # (what the kernel does to the envs' seccomp filters)
                print(f"            speculation mitigations: {report.properties['speculation']}")
    return 0


def _cmd_check(args: argparse.Namespace) -> int:
    from .check import check_env_dir

    problems = check_env_dir(args.env_dir, steps=args.steps, isolation=args.isolation, actions=args.action)
    return 1 if problems else 0


def _cmd_code_server(args: argparse.Namespace) -> int:
    from .code_server import run_code_server

    return run_code_server(args)


def build_parser(worker_only: bool = False) -> argparse.ArgumentParser:
    """The command's parser; ``worker_only``: with the ``worker`` command alone, whose process then
    imports none of the others' flags (the code server's pool settings import NumPy and Gymnasium,
    most of a worker's memory)."""
    parser = argparse.ArgumentParser(
        prog="boltzlabs-gym", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = add_worker_flags(sub.add_parser("worker", help="run a worker"))
    p.set_defaults(func=_cmd_worker)
    if worker_only:
        return parser

    p = sub.add_parser("keygen", help="create CURVE key pairs for a worker and a client")
    p.add_argument("directory")
    p.set_defaults(func=_cmd_keygen)

    p = sub.add_parser("status", help="show a running worker's sessions and isolation")
    p.add_argument("address")
    p.add_argument("--keys", default=None, help="CURVE key directory, for an authenticated worker")
    p.add_argument("--timeout", type=float, default=5.0)
    p.set_defaults(func=_cmd_status)

    p = sub.add_parser("top", help="a live table of the sessions on one or more workers (needs the metrics extra)")
    p.add_argument("address", nargs="+")
    p.add_argument("--keys", default=None, help="CURVE key directory, for authenticated workers")
    p.add_argument("--once", action="store_true", help="print one frame and exit")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between frames")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for each worker")
    p.set_defaults(func=_cmd_top)

    p = sub.add_parser("isolation", help="which isolation backends this host offers")
    p.set_defaults(func=_cmd_isolation)

    p = sub.add_parser("check", help="run an env directory through reset and a few steps and explain problems")
    p.add_argument("env_dir")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--isolation", default="auto")
    p.add_argument("--action", action="append", default=None, help="JSON action to send (repeatable); default 0")
    p.set_defaults(func=_cmd_check)

    from .code_server import add_code_server_flags

    p = add_code_server_flags(
        sub.add_parser("code-server", help="serve SandboxFusion's /run_code API on sandboxed pools")
    )
    p.set_defaults(func=_cmd_code_server)

    from .code_languages import add_code_languages_flags, add_code_runtime_flags, run_code_languages, run_code_runtime

    p = add_code_languages_flags(
        sub.add_parser("code-languages", help="which of SandboxFusion's languages this host can run, and why not")
    )
    p.set_defaults(func=run_code_languages)
    p = add_code_runtime_flags(
        sub.add_parser("code-runtime", help="install what programs expect beyond toolchains (tsx, jest, a Python venv)")
    )
    p.set_defaults(func=run_code_runtime)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(worker_only=argv[:1] == ["worker"]).parse_args(argv)
    if args.command != "worker":
        # `boltzlabs-gym status ... | head` should end quietly, as other CLI tools do. Not for
        # the worker: it must see EPIPE from a dead env's pipe as an error, not die of it.
        import signal

        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
