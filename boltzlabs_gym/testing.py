"""Helpers for testing and benchmarking with real workers: worker processes and test hosts.

A worker on ``tcp://127.0.0.1:<free port>`` serving a pool (skipped as a doctest: it
starts a worker process and sandboxed envs; ``tests/project/test_remote.py`` runs it for real):

>>> from boltzlabs_gym import RLPool                                   # doctest: +SKIP
>>> from boltzlabs_gym.testing import WorkerProcess                    # doctest: +SKIP
>>> w = WorkerProcess()                                                # doctest: +SKIP
>>> pool = RLPool("envs/counter", n=8, workers=[w.address])            # doctest: +SKIP
>>> pool.close(); w.stop()                                             # doctest: +SKIP

``NetnsHost`` makes a network namespace joined to this host by a veth pair, so a
worker started in it is reached across a real network device. Its addresses come
from 198.18.0.0/15, the range set aside for network benchmark tests.
"""

from __future__ import annotations

import collections
import os
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid

from .errors import NetnsUnavailable, WorkerError

__all__ = [
    "WorkerProcess",
    "NetnsHost",
    "NetnsUnavailable",
    "wait_until",
    "alive",
    "pids_gone",
    "CODE_ENV_GOOD",
    "CODE_ENV_WRONG",
    "CODE_ENV_BROKEN",
]

#: Programs for the example code-grading env (``envs/code_env``): one that passes its
#: tests, one that runs but fails them, one that does not even parse.
CODE_ENV_GOOD = """def add(a, b):
    return a + b


def fizzbuzz(n):
    if n % 15 == 0:
        return "FizzBuzz"
    if n % 3 == 0:
        return "Fizz"
    if n % 5 == 0:
        return "Buzz"
    return str(n)
"""
CODE_ENV_WRONG = CODE_ENV_GOOD.replace("a + b", "a - b")
CODE_ENV_BROKEN = "def add(a, b) return a + b\n"


class WorkerProcess:
    """A ``python -m boltzlabs_gym.worker`` child; ``address`` is the endpoint it bound.

    ``command``: the argv that starts it instead (``["boltzlabs-gym", "worker"]``, say), before the
    flags this class adds."""

    def __init__(
        self,
        bind: str = "tcp://127.0.0.1:*",
        *,
        keys: str | None = None,
        capacity: int = 64,
        prefix: list[str] | None = None,
        insecure: bool = False,
        start_timeout: float = 30.0,
        extra_args: list[str] | None = None,
        command: list[str] | None = None,
    ):
        argv = [*(prefix or []), *(command or [sys.executable, "-m", "boltzlabs_gym.worker"])]
        argv += ["--bind", bind, "--capacity", str(capacity), *(extra_args or [])]
        if keys:
            argv += ["--keys", keys]
        if insecure:
            argv.append("--insecure")
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        stdout, stderr = self.proc.stdout, self.proc.stderr
        assert stdout is not None and stderr is not None  # both are pipes: tells the type checker
        poller = select.poll()
        poller.register(stdout, select.POLLIN)
        line = stdout.readline() if poller.poll(start_timeout * 1000) else ""
        if not line.startswith("READY "):
            self._terminate()
            tail = stderr.read()[-2000:]  # before stop() closes the pipe (read after close raised ValueError)
            self.stop()
            raise WorkerError(f"worker did not start: {line!r} {tail}")
        self.address = line.split()[1]
        # The worker logs for as long as it runs (a warning per env fault): its output is read all
        # along, keeping the tail, or a long-lived worker would block once a pipe's 64 KiB filled.
        self._tail: collections.deque[str] = collections.deque(maxlen=200)
        self._drains = [threading.Thread(target=self._drain, args=(s,), daemon=True) for s in (stdout, stderr)]
        for t in self._drains:
            t.start()

    def _drain(self, stream) -> None:
        try:
            for line in stream:
                self._tail.append(line)
        except (OSError, ValueError):
            pass

    def log_tail(self) -> str:
        """The last lines the worker wrote (stdout and stderr, as they came)."""
        return "".join(self._tail)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def kill(self) -> None:
        """SIGKILL: the worker gets no chance to clean up."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        """SIGTERM and wait: the worker closes every session first."""
        self._terminate()
        for t in getattr(self, "_drains", []):
            t.join(5)  # (they end at the pipes' EOF, now that the worker has exited)
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream:
                stream.close()


class NetnsHost:
    """A network namespace joined to this one by a veth pair: a test host on a real link.

    ``NetnsHost(k)`` uses 198.18.k.1 (this side) and 198.18.k.2 (inside). ``prefix``
    is the command prefix that runs a program inside (``ip netns exec NAME``).
    """

    def __init__(self, k: int):
        if os.geteuid() != 0 or shutil.which("ip") is None:
            raise NetnsUnavailable("needs root and iproute2 (apt-get install iproute2)")
        tag = uuid.uuid4().hex[:6]
        self.name = f"blns{tag}"
        self.outside, self.inside = f"198.18.{k}.1", f"198.18.{k}.2"
        _remove_stale_hosts(k)
        host_if, ns_if = f"blh{tag}", f"bln{tag}"
        steps = [
            ["ip", "netns", "add", self.name],
            ["ip", "link", "add", host_if, "type", "veth", "peer", "name", ns_if],
            ["ip", "link", "set", ns_if, "netns", self.name],
            ["ip", "addr", "add", f"{self.outside}/24", "dev", host_if],
            ["ip", "link", "set", host_if, "up"],
            ["ip", "-n", self.name, "addr", "add", f"{self.inside}/24", "dev", ns_if],
            ["ip", "-n", self.name, "link", "set", ns_if, "up"],
            ["ip", "-n", self.name, "link", "set", "lo", "up"],
        ]
        self._host_if = host_if
        for step in steps:
            out = subprocess.run(step, capture_output=True, text=True)
            if out.returncode != 0:
                self.close()
                raise NetnsUnavailable(f"{' '.join(step)}: {out.stderr.strip()}")

    @property
    def prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.name]

    def close(self) -> None:
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True)
        subprocess.run(["ip", "link", "del", self._host_if], capture_output=True)


def _remove_stale_hosts(k: int) -> None:
    """Remove test hosts on 198.18.k.0/24 left by a run that was killed before closing them:
    their interface would keep the subnet's route and send this run's packets to a dead end."""
    out = subprocess.run(["ip", "-o", "addr", "show", "to", f"198.18.{k}.0/24"], capture_output=True, text=True)
    for line in out.stdout.splitlines():
        dev = line.split()[1].split("@")[0]
        if dev.startswith("blh"):
            subprocess.run(["ip", "link", "del", dev], capture_output=True)
            subprocess.run(["ip", "netns", "del", f"blns{dev[3:]}"], capture_output=True)


def alive(procs) -> list:
    """The ``psutil.Process`` objects of ``procs`` still running (zombies count as gone)."""
    import psutil

    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.Error:
            pass
    return out


def pids_gone(pids) -> bool:
    """Whether none of ``pids`` runs any more (gone, or a zombie): :func:`alive` for bare pids."""
    import psutil

    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    return not alive(procs)


def wait_until(predicate, timeout: float, interval: float = 0.1) -> bool:
    """Poll ``predicate`` until it is true or ``timeout`` seconds pass; return its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
