"""The worker's command-line flags: one parser, one set of defaults, for both ways to start one.

``boltzlabs-gym worker`` (:mod:`boltzlabs_gym.cli`) and ``python -m boltzlabs_gym.worker`` (how a
local pool, :mod:`boltzlabs_gym.ray` and :mod:`boltzlabs_gym.testing` start theirs) take the same
flags, added by :func:`add_worker_flags`; those a local pool sets from its own settings are named
in :data:`~boltzlabs_gym.wire.protocol.WORKER_FLAGS`. Standard library and :mod:`boltzlabs_gym.wire.protocol`
only: the ``boltzlabs-gym`` command builds its parser with these before it knows which command runs.

>>> parser = worker_parser()
>>> args = parser.parse_args(["--bind", "ipc:///tmp/w.sock"])
>>> args.capacity, args.log_level
(4096, 'WARNING')
"""

from __future__ import annotations

import argparse

from ..wire.protocol import DEFAULT_BUSY_POLL_US, DEFAULT_SNAPSHOT_BUDGET, WORKER_FLAGS, poll_us_argument

#: Most sandboxes (env processes) a worker hosts at once, unless ``--capacity`` says otherwise.
DEFAULT_CAPACITY = 4096
#: The worker's log level unless ``--log-level`` says otherwise (a local pool's worker logs to the
#: trainer's stderr: warnings only).
DEFAULT_LOG_LEVEL = "WARNING"


def add_worker_flags(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the worker's flags to ``parser`` (a program's, or the ``worker`` command's); returns it."""
    parser.add_argument(
        "--bind", action="append", required=True, help="endpoint, e.g. ipc:///tmp/w.sock or tcp://127.0.0.1:5555"
    )
    parser.add_argument(
        "--capacity",
        type=int,
        default=DEFAULT_CAPACITY,
        help="most sandboxes (env processes) this worker hosts at once; "
        "a sandbox of envs_per_sandbox=K envs counts once",
    )
    parser.add_argument("--log-level", default=DEFAULT_LOG_LEVEL)
    parser.add_argument("--keys", default=None, help="CURVE key directory from `boltzlabs-gym keygen`")
    parser.add_argument(
        "--keys-stdin",
        action="store_true",
        help="read CURVE keys from stdin (one line: z85 worker secret key, then allowed client public keys)",
    )
    parser.add_argument("--insecure", action="store_true", help="bind a non-loopback address without authentication")
    parser.add_argument(
        WORKER_FLAGS["metrics_port"],
        type=int,
        default=None,
        help="serve Prometheus /metrics on this port (0: a free one; needs the metrics extra)",
    )
    parser.add_argument(
        "--metrics-host", default="127.0.0.1", help="address /metrics listens on (0.0.0.0: every interface)"
    )
    parser.add_argument(
        WORKER_FLAGS["snapshot_budget"],
        type=int,
        default=DEFAULT_SNAPSHOT_BUDGET,
        help="bytes of env snapshots this worker holds for all its clients together",
    )
    parser.add_argument(
        WORKER_FLAGS["busy_poll_us"],
        type=poll_us_argument,
        default=DEFAULT_BUSY_POLL_US,
        help="busy-poll this long for the local pool's next request (0: always sleep)",
    )
    parser.add_argument("--parent-pid", type=int, default=None, help="exit when this parent process dies")
    parser.add_argument("--workdir", default=None, help="where the worker keeps its archives and sessions")
    parser.add_argument("--remove-on-exit", default=None, help="directory to delete at exit (the pool's socket dir)")
    parser.add_argument(
        "--local-fd",
        type=int,
        default=None,
        help="an inherited socketpair end: the starting pool's channel (boltzlabs_gym.wire.channel)",
    )
    return parser


def worker_parser(prog: str = "python -m boltzlabs_gym.worker") -> argparse.ArgumentParser:
    """A parser of the worker's flags alone."""
    return add_worker_flags(argparse.ArgumentParser(prog=prog, description="Run a boltzlabs_gym worker."))
