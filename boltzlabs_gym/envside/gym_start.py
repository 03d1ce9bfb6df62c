"""The Gymnasium env host's start-up: build the envs of this process and serve them.

:func:`serve_env` serves the env one factory builds; :func:`serve_factories` (the ``env.py`` of a
factory env directory, and ``python -m boltzlabs_gym.envside.gym_start``) those built by the
factories in the directory's ``factories.pkl``, a cloudpickled list of zero-arg env factories
that the trainer writes (:func:`boltzlabs_gym.vector.factory_env_dir.write_factory_env_dir`). The pickle
comes from the trusted trainer and is only ever unpickled here, inside the sandbox.

Each env is a :class:`~boltzlabs_gym.envside.gym_host.GymHost`, served by the loops of
:mod:`~boltzlabs_gym.envside.gym_loops`: one env, or one per slot of a sandbox of several. An env
that cannot be built is reported as data (:mod:`boltzlabs_gym.wire.start_failure`) and ends the process.
"""

from __future__ import annotations

import os
import pickle
import select
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from ..wire.start_failure import describe_start_failure
from . import prebuilt, process_setup
from .framing import write_all
from .gym_host import GymHost
from .gym_loops import serve_one, serve_sandbox
from .process_setup import freeze_heap, protect_channel_fds
from .sandbox_slots import Progress, sandbox_config

__all__ = ["serve_env", "serve_factories", "FACTORIES_FILE"]

#: The pickle of env factories in a factory env directory.
FACTORIES_FILE = "factories.pkl"
#: How long a sandbox whose env could not be built waits to be killed after saying why.
START_FAILURE_LINGER_S = 30.0
_T = TypeVar("_T")


def _serve_built(factories: Sequence[Callable[[], Any]], index: int, fd_in: int, fd_out: int) -> None:
    """Build this process's envs and serve them: one (the one-env protocol) or, in a sandbox of
    several envs, one per slot (sandbox requests), slot ``s`` from ``factories[(index + s) % len]``."""
    config = sandbox_config()
    base = max(index, 0)  # -1: run by hand
    if config.envs_per_sandbox == 1:
        host = _started(lambda: GymHost(prebuilt.build_env(factories[base % len(factories)])), fd_in, fd_out)
        freeze_heap()
        serve_one(host, fd_in, fd_out)
        return
    hosts = _started(
        lambda: [GymHost(prebuilt.build_env(factories[(base + s) % len(factories)])) for s in range(config.env_count)],
        fd_in,
        fd_out,
    )
    progress = Progress(process_setup.workspace_now())
    freeze_heap()
    serve_sandbox(hosts, fd_in, fd_out, progress)


def _started(build: Callable[[], _T], fd_in: int, fd_out: int) -> _T:
    """``build()``; if it raises, say what it raised as data and end this process.

    The exception's class names and message go out as this env's answer to its first
    request (:mod:`boltzlabs_gym.wire.start_failure`), so the trainer can raise a matching
    type; its traceback goes to stderr, the tail the trainer's error shows. The worker kills
    the process when it reads the line; an end of input or :data:`START_FAILURE_LINGER_S`
    ends it otherwise, with status 1.
    """
    try:
        return build()
    except Exception as exc:
        traceback.print_exc()
        sys.stderr.flush()
        write_all(fd_out, describe_start_failure(exc))
        if not os.isatty(fd_in):  # run by hand at a terminal, nobody is coming to kill it
            _await_end_of_input(fd_in, START_FAILURE_LINGER_S)
        raise SystemExit(1) from None


def _await_end_of_input(fd: int, limit_s: float) -> None:
    deadline = time.monotonic() + limit_s
    while (left := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select([fd], [], [], left)
        if ready and not os.read(fd, 1 << 16):
            return


def serve_env(env_factory: Callable[[], Any]) -> None:
    """Build ``env_factory()`` and serve it on stdin/stdout until ``close`` or end of input.

    The protocol channel is protected first (``print()`` and fd 1 go to stderr), so
    output from building the env never corrupts replies. An exception while building
    the env is reported to the trainer by its class names and message (its traceback goes
    to stderr) and the process exits with status 1. In a
    sandbox of several envs (``BOLTZLABS_ENVS_PER_SANDBOX`` > 1) it builds one per slot.
    """
    proto_in, proto_out = protect_channel_fds()
    _serve_built([env_factory], 0, proto_in, proto_out)


def serve_factories(env_dir: str | None = None, index: int | None = None) -> None:
    """Serve the env built by the factory for this env's index, from ``factories.pkl``.

    ``env_dir`` defaults to ``$BOLTZLABS_ENV_DIR`` (else :data:`boltzlabs_gym.env.ENV_DIR`),
    ``index`` to ``$BOLTZLABS_ENV_INDEX`` (``-1`` when run by hand, meaning 0); the
    factory used is ``factories[index % len(factories)]``. In a sandbox of several envs
    (``BOLTZLABS_ENVS_PER_SANDBOX`` K > 1, ``BOLTZLABS_ENV_COUNT`` m) the process hosts m
    envs, slot ``s`` built by ``factories[(index + s) % len(factories)]`` (``index`` is then
    the pool index of slot 0), and answers sandbox requests. Unpickling happens here,
    inside the sandbox, after the channel is protected.
    """
    preloaded = None
    if process_setup.in_template():
        # boltz template: unpickle once (imports Gymnasium and the env classes), then fork envs
        with open(
            os.path.join(env_dir or os.environ.get("BOLTZLABS_ENV_DIR", process_setup.ENV_DIR), FACTORIES_FILE), "rb"
        ) as f:
            preloaded = pickle.load(f)
        _warm_up(preloaded)
        prebuilt.build(preloaded)  # one env per factory, inherited by the forks (envside/prebuilt.py)
        process_setup.template_fork()  # returns in each forked env
    proto_in, proto_out = protect_channel_fds()
    if env_dir is None:
        env_dir = os.environ.get("BOLTZLABS_ENV_DIR", process_setup.ENV_DIR)
    if index is None:
        index = int(os.environ.get("BOLTZLABS_ENV_INDEX", "-1"))
    if preloaded is not None:
        factories = preloaded
    else:
        with open(os.path.join(env_dir, FACTORIES_FILE), "rb") as f:
            factories = pickle.load(f)
    if callable(factories):
        factories = [factories]
    if not isinstance(factories, (list, tuple)) or not factories:
        raise TypeError(f"{FACTORIES_FILE} must hold a non-empty list of env factories")
    _serve_built(factories, index, proto_in, proto_out)


def _warm_up(factories: Any) -> None:
    """boltz template: build (and close) one env per distinct factory, as AsyncVectorEnv does in its
    parent, so lazily imported modules (Gymnasium entry points, env checkers, codecs) are loaded once
    here and shared by every fork instead of imported again, privately, in each env. The envs the
    pool serves are still built in the forks. A factory that fails here is left to fail there."""
    seen: list[Any] = []
    for factory in factories if isinstance(factories, (list, tuple)) else [factories]:
        if not callable(factory) or any(factory is f for f in seen):
            continue
        seen.append(factory)
        try:
            env = factory()
            try:
                host = GymHost(env)
                host.describe({}, [])
                host.reset({"op": "reset", "seed": 0}, [])
            finally:
                env.close()
        except Exception:  # noqa: BLE001
            pass


def main() -> None:
    """Entry point for ``python -m boltzlabs_gym.envside.gym_start``: :func:`serve_factories`."""
    serve_factories()


if __name__ == "__main__":
    main()
