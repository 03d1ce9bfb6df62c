"""``python -m boltzlabs_gym.worker``: run a worker (the local pool starts one this way).

``boltzlabs-gym worker`` runs :func:`run` too, with the same flags (:mod:`.flags`).
"""

from __future__ import annotations

import argparse
import logging
import os
import resource
import shutil
import signal
import socket
import sys

from .flags import worker_parser
from .host import set_parent_death_signal, set_subreaper
from .router import Worker


def _local_channel(fd: int | None) -> socket.socket | None:
    if fd is None:
        return None
    # Never inherited by env processes: a sandboxed env must not reach the trainer's channel.
    os.set_inheritable(fd, False)
    return socket.socket(fileno=fd)


def _raise_fd_limit() -> None:
    """Lift the soft descriptor limit to the hard one (at most 2**16), as servers do.

    The worker holds three pipes per env (with the namespaces backend as root, also the env's
    control socket and its seccomp listener, and a pidfd per memory-snapshot copy or holder)
    and, while lending a local pool its idle envs, a duplicate of two of them per env in flight:
    under a stock soft limit of 1024 a few hundred envs would exhaust it. Envs get their own
    limit (``Limits.open_files``).
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # At most 2**16: every env launch closes the inherited range up to the soft limit.
    want = min(hard if hard != resource.RLIM_INFINITY else 1 << 16, 1 << 16)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError):
            pass


def _read_keys_line() -> str:
    """One line of keys from stdin, then stdin becomes /dev/null (nothing later inherits the pipe)."""
    line = sys.stdin.readline()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    return line


def main(argv: list[str] | None = None) -> int:
    """``python -m boltzlabs_gym.worker [flags]`` (see :mod:`.flags`); the exit status."""
    return run(worker_parser().parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """Run a worker with the flags :func:`~.flags.add_worker_flags` parsed, until it is stopped;
    the exit status (2: it could not start)."""
    logging.basicConfig(level=args.log_level, format="%(asctime)s worker %(levelname)s %(message)s")
    if args.parent_pid is not None:
        set_parent_death_signal(signal.SIGTERM)
    set_subreaper()
    _raise_fd_limit()
    keys = None
    if args.keys and args.keys_stdin:
        print("boltzlabs worker: --keys and --keys-stdin exclude each other", file=sys.stderr)
        return 2
    if args.keys or args.keys_stdin:
        from ..wire.keys import KeyFileError, load_worker_keys, parse_worker_keys_line

        try:
            keys = parse_worker_keys_line(_read_keys_line()) if args.keys_stdin else load_worker_keys(args.keys)
        except KeyFileError as exc:
            print(f"boltzlabs worker: {exc}", file=sys.stderr)
            return 2
    try:
        worker = Worker(
            args.bind,
            capacity=args.capacity,
            workdir=args.workdir,
            parent_pid=args.parent_pid,
            keys=keys,
            insecure=args.insecure,
            local_channel=_local_channel(args.local_fd),
            busy_poll_us=args.busy_poll_us,
            snapshot_budget=args.snapshot_budget,
        )
    except (ValueError, OSError) as exc:  # zmq.ZMQError is an OSError: address in use, bad endpoint
        print(f"boltzlabs worker: {exc}", file=sys.stderr)
        return 2
    if args.metrics_port is not None:
        from ..errors import MetricsPortError, MissingExtraError
        from .prometheus import serve_metrics

        try:
            worker.metrics_url = serve_metrics(worker, args.metrics_port, args.metrics_host)
        except (MetricsPortError, MissingExtraError) as exc:
            worker.shutdown()
            # On stdout too: a local pool reads it there in place of the READY line.
            print(f"ERROR {exc}", flush=True)
            print(f"boltzlabs worker: {exc}", file=sys.stderr)
            return 2
    if args.insecure and keys is None:
        logging.getLogger("boltzlabs_gym.worker").warning(
            "running WITHOUT authentication on %s: anyone who can reach it can run code here", args.bind
        )
    worker.install_signal_handlers()
    # The pool waits for this line before connecting.
    sys.stdout.write("READY " + " ".join(worker.endpoints) + "\n")
    sys.stdout.flush()
    profile_to = os.environ.get("BOLTZLABS_WORKER_PROFILE")  # developer aid: cProfile the loop
    try:
        if profile_to:
            import cProfile
            import time

            # CPU time, not wall time: a loop that mostly waits in poll() would show little else.
            profiler = cProfile.Profile(time.process_time)
            try:
                profiler.runcall(worker.serve_forever)
            finally:
                profiler.dump_stats(profile_to)
        else:
            worker.serve_forever()
    finally:
        if args.remove_on_exit:
            shutil.rmtree(args.remove_on_exit, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
