"""Re-exports of the worker and test-host helpers shipped in boltzlabs_gym.testing."""

from boltzlabs_gym.testing import NetnsHost, NetnsUnavailable, WorkerProcess, alive, pids_gone, wait_until  # noqa: F401
