"""Re-exports of the worker and test-host helpers shipped in boltzlabs_gym.testing, and what the
tests ask a worker through its command line."""

import json
import subprocess
import sys

from boltzlabs_gym.testing import NetnsHost, NetnsUnavailable, WorkerProcess, alive, pids_gone, wait_until  # noqa: F401


def worker_status(address: str) -> dict:
    """``boltzlabs-gym status ADDRESS`` (an insecure worker), parsed: sessions, envs, snapshots."""
    out = subprocess.run(
        [sys.executable, "-m", "boltzlabs_gym.cli", "status", address],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return json.loads(out.stdout)
