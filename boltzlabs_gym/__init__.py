"""boltzlabs_gym: Gymnasium vector environments over a pool of sandboxed, resident env processes.

Eight counter envs stepped in lockstep (skipped as a doctest: it starts a worker and
sandboxed env processes; the README's quickstart and ``tests/client/test_pool.py`` run it):

>>> from boltzlabs_gym import RLPool                      # doctest: +SKIP
>>> with RLPool("./envs/counter", n=8) as pool:           # doctest: +SKIP
...     obs = pool.reset(seed=0)
...     obs, rewards, dones, infos = pool.step([1] * 8)

Heavy parts (ZeroMQ, the vector env) load on first use, so the env side
(``boltzlabs_gym.env``) stays cheap to import inside every sandbox.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what a type checker sees of the lazy names below (a test holds them equal)
    from .client.options import PoolOptions
    from .client.pool import RLPool
    from .client.snapshot import Snapshot
    from .client.stats import PoolStats
    from .client.timing import Timing
    from .errors import (
        ArchiveError,
        AsyncStateError,
        AuthConfigError,
        BoltzLabsError,
        CapacityError,
        CodecError,
        EnvAttributeError,
        EnvCallError,
        EnvStartError,
        KeyFileError,
        MetricsPortError,
        MissingExtraError,
        PlacementTimeout,
        PoolClosedError,
        ProtocolError,
        SandboxUnavailable,
        SnapshotError,
        WorkerError,
        WorkerLost,
        WorkerTimeout,
    )
    from .vector import BoltzLabsVecEnv, make_vec
    from .wire.limits import IsolationReport, Limits

__version__ = "0.1.0"

_LAZY = {
    "RLPool": "boltzlabs_gym.client.pool",
    "PoolOptions": "boltzlabs_gym.client.options",
    "Timing": "boltzlabs_gym.client.timing",
    "BoltzLabsVecEnv": "boltzlabs_gym.vector",
    "make_vec": "boltzlabs_gym.vector",
    "Limits": "boltzlabs_gym.wire.limits",
    "IsolationReport": "boltzlabs_gym.wire.limits",
    # The exception tree (boltzlabs_gym.errors); NetnsUnavailable stays in boltzlabs_gym.testing.
    "BoltzLabsError": "boltzlabs_gym.errors",
    "EnvStartError": "boltzlabs_gym.errors",
    "EnvCallError": "boltzlabs_gym.errors",
    "EnvAttributeError": "boltzlabs_gym.errors",
    "WorkerError": "boltzlabs_gym.errors",
    "WorkerTimeout": "boltzlabs_gym.errors",
    "WorkerLost": "boltzlabs_gym.errors",
    "PoolClosedError": "boltzlabs_gym.errors",
    "AsyncStateError": "boltzlabs_gym.errors",
    "CapacityError": "boltzlabs_gym.errors",
    "SandboxUnavailable": "boltzlabs_gym.errors",
    "ArchiveError": "boltzlabs_gym.errors",
    "CodecError": "boltzlabs_gym.errors",
    "ProtocolError": "boltzlabs_gym.errors",
    "KeyFileError": "boltzlabs_gym.errors",
    "AuthConfigError": "boltzlabs_gym.errors",
    "MetricsPortError": "boltzlabs_gym.errors",
    "MissingExtraError": "boltzlabs_gym.errors",
    "SnapshotError": "boltzlabs_gym.errors",
    "Snapshot": "boltzlabs_gym.client.snapshot",
    "PlacementTimeout": "boltzlabs_gym.errors",
    "PoolStats": "boltzlabs_gym.client.stats",
}

__all__ = sorted(_LAZY) + ["__version__"]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'boltzlabs_gym' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__


def _register_gymnasium_envs() -> None:
    """Register the example envs with Gymnasium (1.x loads no plugin entry points).

    Skipped inside env processes (``BOLTZLABS_ENV_INDEX`` is set there): the env side
    must stay cheap to import and may run without Gymnasium. Skipped in a worker process
    (``python -m boltzlabs_gym.worker``, how every pool starts one, or ``boltzlabs-gym worker``,
    how remote ones start) too: it makes no env, and Gymnasium with NumPy would be most of its
    memory.
    """
    import os
    import sys

    if "BOLTZLABS_ENV_INDEX" in os.environ or _starts_a_worker(sys.orig_argv):
        return
    try:
        from .vector.make import register_envs
    except ImportError:  # gymnasium missing: nothing to register with
        return
    register_envs()


def _starts_a_worker(argv: list[str]) -> bool:
    """Whether the interpreter was started to run a worker: ``python -m boltzlabs_gym.worker``, the
    ``boltzlabs-gym worker`` command, or ``python -m boltzlabs_gym.cli worker``.

    >>> _starts_a_worker(["/venv/bin/python", "/venv/bin/boltzlabs-gym", "worker", "--bind", "tcp://*:5555"])
    True
    >>> _starts_a_worker(["python", "-m", "boltzlabs_gym.cli", "code-server"])
    False
    """
    kind, target, rest = _program_of(argv)
    if kind == "-m" and target == "boltzlabs_gym.worker":
        return True
    command = (kind == "-m" and target == "boltzlabs_gym.cli") or (
        kind == "script" and target.rsplit("/", 1)[-1] == "boltzlabs-gym"
    )
    return command and rest[:1] == ["worker"]


def _running_module(argv: list[str]) -> str | None:
    """The module the interpreter was started to run (``python [options] -m module``), or None.

    >>> _running_module(["python", "-X", "importtime", "-B", "-m", "boltzlabs_gym.worker", "--bind", "x"])
    'boltzlabs_gym.worker'
    >>> _running_module(["python", "train.py", "-m", "boltzlabs_gym.worker"]) is None
    True
    """
    kind, target, _ = _program_of(argv)
    return target if kind == "-m" else None


def _program_of(argv: list[str]) -> tuple[str, str, list[str]]:
    """What the interpreter of ``argv`` (``sys.orig_argv``) runs: ``("-m", module, args)``, ``("-c",
    command, args)``, ``("script", path, args)``, or ``("", "", [])`` (an interactive one)."""
    i = 1
    while i < len(argv):
        arg = argv[i]
        if arg in ("-m", "-c"):
            return (arg, argv[i + 1], argv[i + 2 :]) if i + 1 < len(argv) else ("", "", [])
        if arg in ("-X", "-W"):  # (the options whose value is the next argument)
            i += 2
            continue
        if arg == "-" or not arg.startswith("-"):
            return "script", arg, argv[i + 1 :]
        i += 1
    return "", "", []


_register_gymnasium_envs()
