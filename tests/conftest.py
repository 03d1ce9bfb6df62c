"""Shared fixtures: env directories, the isolation to test with, leak checks."""

from __future__ import annotations

import glob
import os
import tempfile
import time

import psutil
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
ENVS = os.path.join(HERE, "envs")
COUNTER = os.path.join(ROOT, "envs", "counter")
CODE_ENV = os.path.join(ROOT, "envs", "code_env")
FAULTY = os.path.join(ENVS, "faulty")

# The env directories are programs a worker runs, not test modules: importing one (as
# --doctest-modules would, to look for doctests) may start serving, and their env.py
# names clash.
collect_ignore = ["envs"]

# Every pool, worker and temp file of this test run lives under one private TMPDIR, so
# the leak check sees only what this run made (not other processes on the machine).
_RUN_TMP = tempfile.mkdtemp(prefix="bltests-")
os.environ["TMPDIR"] = _RUN_TMP
tempfile.tempdir = None


def pytest_sessionfinish(session, exitstatus):
    import shutil

    shutil.rmtree(_RUN_TMP, ignore_errors=True)


#: The isolation every pool test runs with; CI (root) gets the namespace sandbox via "auto".
ISOLATION = os.environ.get("BOLTZLABS_TEST_ISOLATION", "auto")


def _descendants() -> set[tuple[int, float]]:
    """Our live descendants as (pid, start time): a reused pid is not the process seen before.

    One that exits or is reaped while we look is left out; it must not empty the whole set
    (an empty "before" would count every module-scoped fixture's process as leaked).
    """
    found = set()
    for proc in psutil.Process().children(recursive=True):
        try:
            if proc.status() != psutil.STATUS_ZOMBIE:
                found.add((proc.pid, proc.create_time()))
        except psutil.NoSuchProcess:
            pass
    return found


def _our_temp_dirs() -> set[str]:
    return set(glob.glob(os.path.join(_RUN_TMP, "boltzlabs-*")))


def our_cgroups() -> set[str]:
    """Per-env cgroups made by a worker running inside this test process (they carry its pid)."""
    found = glob.glob(f"/sys/fs/cgroup/*/**/boltzlabs-{os.getpid()}-*", recursive=True)
    return set(found + glob.glob(f"/sys/fs/cgroup/boltzlabs-{os.getpid()}-*"))


@pytest.fixture
def no_leaks():
    """Fail the test if it leaves processes or boltzlabs temp dirs behind."""
    before_procs, before_dirs = _descendants(), _our_temp_dirs()
    yield
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        leaked = _descendants() - before_procs
        dirs = _our_temp_dirs() - before_dirs
        if not leaked and not dirs:
            return
        time.sleep(0.1)
    details = []
    for pid, _started in leaked:
        try:
            details.append(f"{pid}: {' '.join(psutil.Process(pid).cmdline())[:120]}")
        except psutil.Error:
            pass
    assert not leaked and not dirs, f"leaked processes {details} and temp dirs {sorted(dirs)}"


# ---------------------------------------------------------------- the framework integrations (tests/integrations)
# Here, not in a tests/integrations/conftest.py: a second conftest module would shadow this one for
# every ``from conftest import ...`` in the suite.
ADD = "def add(a, b):\n    return a + b\n"
ADD_TESTS = {"assert_case": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 4"]}
LOOP = "def add(a, b):\n    while True:\n        pass\n"


# Module scope, not session: a pool left alive for the rest of the session shows up in the tests
# that count the host's boltz templates and envs (tests/worker/test_boltz.py, test_memory_snapshots.py).
@pytest.fixture(scope="module")
def grader():
    """One grader (a CodeRunner) shared by an integration test module."""
    from boltzlabs_gym.integrations.grading import Grader

    with Grader(run_timeout=1.0, envs_per_lane=4, lanes=2) as g:
        yield g


@pytest.fixture(scope="module")
def leases():
    """One EnvLeases pool shared by an integration test module."""
    from boltzlabs_gym.integrations.leases import EnvLeases

    with EnvLeases(2) as lease_pool:
        yield lease_pool
