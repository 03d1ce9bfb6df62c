"""Helpers to run real worker processes for the remote-worker tests."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time


class WorkerProcess:
    """A ``python -m boltzlabs_gym.worker`` child; ``address`` is the endpoint it bound."""

    def __init__(self, bind: str = "tcp://127.0.0.1:*", *, keys: str | None = None, capacity: int = 64,
                 prefix: list[str] | None = None, insecure: bool = False):
        argv = [*(prefix or []), sys.executable, "-m", "boltzlabs_gym.worker", "--bind", bind, "--capacity", str(capacity)]
        if keys:
            argv += ["--keys", keys]
        if insecure:
            argv.append("--insecure")
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        ready, _, _ = select.select([self.proc.stdout], [], [], 30)
        line = self.proc.stdout.readline() if ready else ""
        if not line.startswith("READY "):
            self.stop()
            raise RuntimeError(f"worker did not start: {line!r} {self.proc.stderr.read()[-2000:]}")
        self.address = line.split()[1]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream:
                stream.close()


def wait_until(predicate, timeout: float, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
