"""The Ray actor that runs one ``boltzlabs-gym worker`` on its node (a plain class: made remote by
:mod:`.workers`, and importable without Ray).

The actor is a launcher and a watchman, never an env host: it starts the worker as its
child in a process group of its own, with Ray's variables taken out of its environment
(``RAY_*``, Ray's ``LD_PRELOAD``), and the worker starts its envs in its sandboxes with
environments of their own (scrubbed). Env code never runs in a Ray worker process.

Keys: the actor makes the worker's CURVE key pair and writes the secret key and the one
allowed client public key on the worker's **stdin** (``--keys-stdin``), which the worker
reads once and replaces with ``/dev/null``. Not a file (nothing to remove, no window where
another process of this user could read it), not the command line (``/proc/PID/cmdline`` is
world-readable) and not the environment (``/proc/PID/environ`` is readable by the same user,
and environments are what children inherit). The worker's secret key never leaves the node;
only public keys travel through Ray.

Lifetime: the worker gets ``--parent-pid`` (the actor): it arms ``PR_SET_PDEATHSIG`` and also
watches its parent, so when the actor dies (killed, its node lost, its owner - the trainer -
gone) the worker gets SIGTERM and closes every session, killing its envs. A worker killed
outright (SIGKILL) takes its sandboxed envs along: each env init has ``PR_SET_PDEATHSIG``
(SIGKILL) tied to the worker. :meth:`WorkerHost.stop` SIGTERMs the worker, then SIGKILLs its
process group.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time

__all__ = ["WorkerHost", "worker_environment"]

#: Environment variables a worker launched by Ray must not inherit.
RAY_PREFIXES = ("RAY_", "RAYLET_")
#: Set by Ray for its own workers (a memory allocator, say): not ours to pass on.
RAY_SET = ("LD_PRELOAD",)


def worker_environment(environ: dict[str, str] | None = None) -> dict[str, str]:
    """``environ`` (default: this process's) without Ray's variables.

    >>> worker_environment({"PATH": "/bin", "RAY_JOB_ID": "01", "RAYLET_PID": "7", "LD_PRELOAD": "x.so"})
    {'PATH': '/bin'}
    """
    environ = dict(os.environ if environ is None else environ)
    return {k: v for k, v in environ.items() if not k.startswith(RAY_PREFIXES) and k not in RAY_SET}


class WorkerHost:
    """One worker on this node: start it, say where it listens, stop it.

    Made a Ray actor by :class:`~boltzlabs_gym.ray.RayWorkers`; usable as a plain object
    (tests, other launchers)::

        host = WorkerHost(client_public=b"...", capacity=64)   # doctest: +SKIP
        info = host.start("127.0.0.1")                         # doctest: +SKIP
        info["address"], info["public_key"]                    # doctest: +SKIP
    """

    def __init__(self, client_public: bytes, capacity: int, log_level: str = "WARNING", worker_args=()):
        self.client_public = client_public
        self.capacity = int(capacity)
        self.log_level = log_level
        self.worker_args = list(worker_args)
        self.process: subprocess.Popen | None = None
        self.info: dict | None = None
        # The worker's stderr: a file unlinked at once, so that nothing is left on the node however
        # the actor ends (killed by Ray, a lost node); the open descriptor keeps it readable.
        self._log = tempfile.TemporaryFile(prefix="boltzlabs-ray-worker-")  # noqa: SIM115 - lives with the actor

    def start(self, host: str | None = None, start_timeout: float = 60.0) -> dict:
        """Start the worker bound to an ephemeral port of ``host`` (default: this node's IP);
        its address (as bound), CURVE public key, pid, node id and IP, and the start time."""
        import zmq

        t0 = time.monotonic()
        if host is None:
            host = _node_ip()
        public, secret = zmq.curve_keypair()
        argv = [sys.executable, "-m", "boltzlabs_gym.worker", "--bind", f"tcp://{host}:*"]
        argv += ["--capacity", str(self.capacity), "--keys-stdin", "--parent-pid", str(os.getpid())]
        argv += ["--log-level", self.log_level, *self.worker_args]
        self.process = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=worker_environment(),
            close_fds=True,
            **_own_process_group(),
        )
        stdin, stdout = self.process.stdin, self.process.stdout
        assert stdin is not None and stdout is not None  # both are pipes
        try:
            stdin.write(secret + b" " + self.client_public + b"\n")
            stdin.close()
        except BrokenPipeError:
            pass  # it died at once: the READY line will not come, and the log says why
        line = _read_line(stdout, start_timeout)
        if not line.startswith("READY "):
            tail = self.log_tail()  # before stop() removes the log
            self.stop()
            raise RuntimeError(f"boltzlabs worker did not start on {host}: {line!r}; log tail:\n{tail}")
        threading.Thread(target=_drain, args=(stdout,), daemon=True).start()
        self.info = {
            "address": line.split()[1],
            "public_key": public,
            "pid": self.process.pid,
            "actor_pid": os.getpid(),
            "node_id": _node_id(),
            "node_ip": host,
            "start_s": time.monotonic() - t0,
        }
        return self.info

    def alive(self) -> bool:
        """Whether the worker process still runs."""
        return self.process is not None and self.process.poll() is None

    def log_tail(self, size: int = 4000) -> str:
        """The end of the worker's stderr log."""
        try:
            end = os.fstat(self._log.fileno()).st_size
            return os.pread(self._log.fileno(), size, max(0, end - size)).decode("utf-8", "replace")
        except (OSError, ValueError):
            return ""

    def stop(self, grace: float = 10.0) -> int | None:
        """SIGTERM the worker (it closes its sessions: envs killed), then SIGKILL its process group;
        its exit code."""
        process = self.process
        if process is None:
            return None
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(grace)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(process.pid, signal.SIGKILL)  # anything left in its group
        except (ProcessLookupError, PermissionError):
            pass
        code = process.wait(5.0)
        if process.stdout is not None:
            process.stdout.close()
        return code

    def __del__(self):  # an actor torn down by Ray without stop(): the worker's PDEATHSIG covers a kill
        try:
            self.stop(grace=2.0)
        except Exception:  # noqa: BLE001 - best effort at interpreter exit
            pass


def _own_process_group() -> dict:
    """Popen arguments that give the worker a process group of its own (stop() kills the group).

    A group, not a session: with the kernel's scheduler autogroups (one per session, on by
    default on desktops and many VMs) a new session would put the worker and its envs in a CPU
    share of their own, against the trainer's, on a machine that hosts both.
    """
    if sys.version_info >= (3, 11):
        return {"process_group": 0}
    return {"preexec_fn": os.setpgrp}  # pragma: no cover - Python 3.10


def _node_ip() -> str:
    try:
        import ray.util

        return ray.util.get_node_ip_address()
    except ImportError:
        return "127.0.0.1"


def _node_id() -> str | None:
    try:
        import ray

        return ray.get_runtime_context().get_node_id()
    except Exception:  # noqa: BLE001 - outside Ray
        return None


def _read_line(stream, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    poller = select.poll()
    poller.register(stream.fileno(), select.POLLIN)
    buf = b""
    while not buf.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not poller.poll(int(left * 1000) + 1):
            break
        chunk = os.read(stream.fileno(), 4096)
        if not chunk:
            break
        buf += chunk
    return buf.decode("utf-8", "replace").strip()


def _drain(stream) -> None:
    """Read what the worker writes on stdout after READY, so that it never blocks on a full pipe."""
    try:
        while os.read(stream.fileno(), 65536):
            pass
    except (OSError, ValueError):
        pass
