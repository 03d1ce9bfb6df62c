"""One grader (a CodeRunner) and one EnvLeases pool shared by every integration test."""

from __future__ import annotations

import pytest

from boltzlabs_gym.integrations.grading import Grader
from boltzlabs_gym.integrations.leases import EnvLeases

ADD = "def add(a, b):\n    return a + b\n"
ADD_TESTS = {"assert_case": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 4"]}
LOOP = "def add(a, b):\n    while True:\n        pass\n"


@pytest.fixture(scope="session")
def grader():
    with Grader(run_timeout=1.0, envs_per_lane=4, lanes=2) as g:
        yield g


@pytest.fixture(scope="session")
def leases():
    with EnvLeases(2) as lease_pool:
        yield lease_pool
