"""The class SB3's vec-env tests build here, where upstream builds ``DummyVecEnv`` or ``SubprocVecEnv``.

Each SB3 test module that conftest.py adapts (README.md) imports :class:`BoltzLabsSB3VecEnv`
from here in place of SB3's classes, and the fixture that gives the module one worker: the
class is ``boltzlabs_gym.sb3.BoltzLabsSB3VecEnv`` with two pool options, the test run's
isolation and that worker, whose start (about 1 s here) each pool would otherwise pay.
Everything else runs as upstream wrote it.
"""

from __future__ import annotations

import os

import pytest

from boltzlabs_gym import sb3
from boltzlabs_gym.testing import WorkerProcess

#: The isolation every pool test runs with (tests/conftest.py's).
ISOLATION = os.environ.get("BOLTZLABS_TEST_ISOLATION", "auto")

#: The running module's worker (set by :func:`one_worker_per_module`).
_worker_address: str | None = None


class BoltzLabsSB3VecEnv(sb3.BoltzLabsSB3VecEnv):
    """``boltzlabs_gym.sb3.BoltzLabsSB3VecEnv`` with the test run's isolation, on the module's worker."""

    def __init__(self, env_fns, start_method=None, **options):
        options.setdefault("isolation", ISOLATION)
        if _worker_address is not None:
            options.setdefault("workers", [_worker_address])
        super().__init__(env_fns, start_method, **options)


@pytest.fixture(scope="module", autouse=True)
def one_worker_per_module():
    """A worker on loopback for the module's pools (upstream leaves some unclosed: room for them)."""
    global _worker_address
    worker = WorkerProcess("tcp://127.0.0.1:*", capacity=512)
    _worker_address = worker.address
    try:
        yield worker
    finally:
        _worker_address = None
        worker.stop()
