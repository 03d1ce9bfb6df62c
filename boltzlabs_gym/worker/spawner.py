"""Starting, killing and reaping env processes, and saying why one died.

:class:`Spawner` is the part of the worker that owns env processes' lives: envs wait in its start
queue for one of ``max_starting`` slots (an interpreter boot and a first request each), are
launched through the session's isolation backend, and are killed, reaped and wiped here.
:meth:`Spawner.kill_and_explain` turns an env's death into the words a trainer sees (its exit
status, the OOM killer). A started env's first request is an env call like any other: the spawner
hands it to ``send_call`` (the scheduler's), and a launch that fails to ``start_failed``.
"""

from __future__ import annotations

import collections
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable

from ..wire.protocol import SANDBOX_OPS, SANDBOX_SLOTS
from .deadlines import Deadlines
from .envproc import DEAD, QUEUED, Call, EnvProcess, describe_exit
from .poller import Poller
from .sandbox import LaunchSpec
from .sandbox.base import wipe_workspace
from .session import Session
from .stats import WorkerStats

log = logging.getLogger("boltzlabs_gym.worker")

#: The first request of a started env that no caller is waiting on (a pool's start-up, a
#: respawn after a fault): proof that it is up and serving, without resetting it. The user's
#: first ``reset(seed=...)`` must be the env's first reset, or stateful wrappers inside it
#: (NormalizeObservation, NormalizeReward) see an extra, unseeded episode start and runs
#: with the same seed stop being reproducible. A hard reset's start sends its
#: seeded reset instead.
READY_OP = {"op": "describe"}


def ready_op(count: int, envs_per_sandbox: int) -> dict:
    """A started process's first request: :data:`READY_OP`, for each env of a multi-env sandbox.

    >>> ready_op(2, 4)
    {'op': 'describe', 'slots': [0, 1], 'ops': [{'op': 'describe'}, {'op': 'describe'}]}
    """
    if envs_per_sandbox == 1:
        return dict(READY_OP)
    return {"op": "describe", SANDBOX_SLOTS: list(range(count)), SANDBOX_OPS: [dict(READY_OP) for _ in range(count)]}


#: How many envs may be starting (interpreter boot + first request) at once per worker.
DEFAULT_MAX_STARTING = max(4, 4 * (os.cpu_count() or 1))
#: How long the worker waits for an env whose pipe closed to exit by itself.
EXIT_GRACE_S = 0.5

#: Run the env directory's env.py as __main__ with the env dir importable.
ENV_BOOTSTRAP = (
    "import os,runpy,sys\n"
    # memory snapshots (the namespaces backend left the control socket open: see envside.memory_snapshot)
    "if os.environ.get('BOLTZLABS_MEMORY_SNAPSHOTS')=='1':\n"
    " from boltzlabs_gym.envside.memory_snapshot import install;install(os.getuid())\n"
    "d=os.environ['BOLTZLABS_ENV_DIR']\n"
    "sys.path.insert(0,d)\n"
    "sys.argv=[os.path.join(d,'env.py')]\n"
    "runpy.run_path(sys.argv[0],run_name='__main__')\n"
)


def runtime_packages() -> dict[str, str]:
    """The library's own packages, which every env imports its helper from."""
    import boltzlabs
    import boltzlabs_gym

    return {
        "boltzlabs_gym": os.path.dirname(os.path.abspath(boltzlabs_gym.__file__)),
        "boltzlabs": os.path.dirname(os.path.abspath(boltzlabs.__file__)),
    }


def oom_killed(env: EnvProcess) -> bool:
    """Whether the kernel's OOM killer killed ``env`` (its cgroup says so)."""
    try:
        return env.launched is not None and bool(env.launched.oom_killed())
    except Exception:  # noqa: BLE001 - a missing cgroup file is not a verdict
        return False


class Spawner:
    """The worker's env processes: start queue, launch, kill, reap, wipe.

    ``send_call(session, env, call)`` sends a started env its first request and
    ``start_failed(session, env, call, reason)`` answers a start that could not happen (the
    scheduler's); ``drain_clients()`` answers the clients meanwhile during long start-ups (the
    worker's). ``sessions`` is the worker's, read to tell a live env's exit from an orphan's.
    """

    def __init__(
        self,
        poller: Poller,
        deadlines: Deadlines,
        stats: WorkerStats,
        sessions: dict[str, Session],
        *,
        send_call: Callable[[Session, EnvProcess, Call], None],
        start_failed: Callable[[Session, EnvProcess, Call, str], None],
        drain_clients: Callable[[], None],
        max_starting: int = DEFAULT_MAX_STARTING,
    ) -> None:
        self.poller = poller
        self.deadlines = deadlines
        self.stats = stats
        self.sessions = sessions
        self.max_starting = max_starting
        #: the library's packages every env imports its helper from (see :func:`runtime_packages`)
        self.runtime = runtime_packages()
        self._send_call = send_call
        self._start_failed = start_failed
        self._drain_clients = drain_clients
        self._start_queue: collections.deque[tuple[Session, EnvProcess]] = collections.deque()
        #: envs spawned whose first request is not answered yet (at most ``max_starting``)
        self._starting = 0
        self._in_start_more = False
        self._to_reap: set[int] = set()
        #: exit statuses of live envs' processes that the orphan sweep reaped before their fault was handled
        self._exit_status: dict[int, int] = {}

    @property
    def reaping(self) -> bool:
        """Whether killed processes wait to be reaped (the worker's loop then wakes up sooner)."""
        return bool(self._to_reap)

    # ================================================================== starting envs
    def queue_start(self, session: Session, env: EnvProcess, call: Call | None, reset_op: dict | None = None) -> None:
        """Spawn ``env`` when a start slot is free; ``call`` gets the answer to its first request:
        ``reset_op`` (a hard reset's seeded reset) or, by default, :data:`READY_OP`."""
        env.state = QUEUED
        env.pending_start = (call, reset_op or ready_op(env.count, session.cfg.envs_per_sandbox))
        self._start_queue.append((session, env))
        self.start_more()

    def start_more(self) -> None:
        # Iterative and not re-entrant: a launch that fails calls back into here
        # (through start_failed), which must not recurse once per queued env.
        if self._in_start_more:
            return
        self._in_start_more = True
        try:
            answered = time.monotonic()
            while self._start_queue and self._starting < self.max_starting:
                session, env = self._start_queue.popleft()
                if session.closed or env.state is not QUEUED:
                    continue
                self._spawn(session, env)
                if time.monotonic() - answered > 0.2:
                    # Long start-ups (hundreds of envs, a template importing the env) must
                    # not starve other clients' requests and heartbeats.
                    self._drain_clients()
                    answered = time.monotonic()
        finally:
            self._in_start_more = False

    def started(self, env: EnvProcess) -> None:
        """``env`` answered its first request: its start slot is free for the next env."""
        env.starting = False
        self._starting -= 1
        self.start_more()

    def _spawn(self, session: Session, env: EnvProcess) -> None:
        user_call, reset_op = env.pending_start
        start_call = Call(op=reset_op, timeout=session.cfg.start_timeout, kind="start", user_call=user_call)
        try:
            env.spawn(session.backend, lambda e, i, o, r: self.launch_spec(session, e, i, o, r))
        except Exception as exc:  # noqa: BLE001 - a failed launch is that env's failure
            env.state = DEAD
            reason = f"could not launch: {type(exc).__name__}: {exc}"
            stats = self.stats.sessions.get(session.sid)
            if stats is not None:
                stats.fault("launch", reason, env.count)
            self._start_failed(session, env, start_call, reason)
            return
        self._starting += 1
        env.starting = True
        self.poller.watch_env(env)
        env.restarts += 1
        self._send_call(session, env, start_call)
        self.deadlines.seal(time.monotonic())  # a long start-up must not delay its deadline

    def fresh_workspace_if_pinned(self, env: EnvProcess) -> None:
        """A slot whose last process was snapshotted (memory kind) gets a new workspace directory: the
        holder, which is that process, keeps the old one mounted, and must not reach what the slot's
        next process writes. The old directory is emptied; it goes with the session's directory."""
        if not env.workspace_pinned:
            return
        old = env.workspace
        env.workspace = tempfile.mkdtemp(prefix="ws-", dir=os.path.dirname(old))
        env.workspace_pinned = False
        self.wipe(old)

    def launch_spec(
        self, session: Session, env: EnvProcess, stdin_fd: int, stdout_fd: int, stderr_fd: int
    ) -> LaunchSpec:
        self.fresh_workspace_if_pinned(env)
        python = session.cfg.env_python or sys.executable
        python_bin = os.path.dirname(python)
        return LaunchSpec(
            argv=[python, "-B", "-s", "-c", ENV_BOOTSTRAP],
            env_dir=session.env_dir,
            workspace=env.workspace,
            stdin_fd=stdin_fd,
            stdout_fd=stdout_fd,
            stderr_fd=stderr_fd,
            env={
                "PATH": f"{python_bin}:/usr/local/bin:/usr/bin:/bin",
                "LANG": "C.UTF-8",
                "PYTHONDONTWRITEBYTECODE": "1",
                "PYTHONUNBUFFERED": "1",
                "OPENBLAS_NUM_THREADS": "1",
                "OMP_NUM_THREADS": "1",
                "MKL_NUM_THREADS": "1",
                "BOLTZLABS_ENV_INDEX": str(env.global_index),
                # Several envs per sandbox: this process serves envs ENV_INDEX .. ENV_INDEX + ENV_COUNT - 1.
                "BOLTZLABS_ENVS_PER_SANDBOX": str(session.cfg.envs_per_sandbox),
                "BOLTZLABS_ENV_COUNT": str(env.count),
                # Host paths; a namespace backend replaces them with /env, /workspace, /opt/boltzlabs.
                "BOLTZLABS_ENV_DIR": session.env_dir,
                "BOLTZLABS_WORKSPACE": env.workspace,
                "HOME": env.workspace,
                "PYTHONPATH": os.path.dirname(self.runtime["boltzlabs_gym"]),
                **session.cfg.env_vars,
            },
            limits=session.cfg.limits,
            ro_binds={},
            index=env.global_index,
            aslr=session.cfg.env_aslr,
            nested_user_namespaces=session.cfg.nested_user_namespaces,
            runtime=self.runtime,
        )

    # ================================================================== killing and reaping
    def kill_and_explain(self, session: Session, env: EnvProcess, reason: str, straggler: bool) -> str:
        """Kill and reap ``env``, which failed for ``reason``; the reason to report, in the
        words of its own death where the kernel has them (an exit status, the OOM killer)."""
        # An env whose pipe closed is usually exiting: let it finish (bounded, without reaping, so
        # its pid cannot be reused before the kill) so that its own exit status is reported, not
        # our SIGKILL, even on a loaded host. Read the OOM flag before the cgroup goes away.
        exited = not straggler and ("closed its stdout" in reason or "closed its stdin" in reason)
        oom = not straggler and oom_killed(env)
        natural = exited and self._await_exit(env.pid, EXIT_GRACE_S)
        pid = self.kill_env(session, env)
        status = self.reap_now(pid)
        if oom:
            limit = session.cfg.limits.memory_bytes
            reason = (
                "the env exceeded its memory limit"
                + (f" of {limit >> 20} MiB" if limit else "")
                + (f" and was killed by the kernel's OOM killer ({describe_exit(status)})")
            )
        elif natural and status is not None:
            reason = f"the env {describe_exit(status)}"
        elif natural:  # a memory snapshot's copy: its exit status goes to the holder, its parent
            reason = f"{reason.split(' (')[0]}: the env exited"
        elif exited:
            reason = f"{reason.split(' (')[0]} but did not exit within {EXIT_GRACE_S:g} s; killed"
        return reason

    def kill_env(self, session: Session, env: EnvProcess) -> int | None:
        for fd in (env.stdin_w, env.stdout_r, env.stderr_r):
            if fd >= 0:
                self.poller.drop_pipe(fd)
        if env.starting:
            env.starting = False
            self._starting -= 1
        pid = env.kill()
        if pid:
            self._to_reap.add(pid)
        env.state = DEAD
        env.current = None
        self._cleanup_launch(env)
        return pid

    def _cleanup_launch(self, env: EnvProcess) -> None:
        try:
            env.cleanup()
        except Exception:  # noqa: BLE001
            log.exception("cleanup of env %s failed", env.global_index)

    def reap_now(self, pid: int | None) -> int | None:
        if not pid:
            return None
        if pid in self._exit_status:
            self._to_reap.discard(pid)
            return self._exit_status.pop(pid)
        for _ in range(20):
            try:
                got, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                self._to_reap.discard(pid)
                return None
            if got:
                self._to_reap.discard(pid)
                return status
            time.sleep(0.001)
        return None

    def reap(self) -> None:
        for pid in list(self._to_reap):
            try:
                got, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                got = pid
            if got:
                self._to_reap.discard(pid)
        # Orphans re-parented to us (we are a subreaper): reap whatever is left.
        while True:
            try:
                got, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if not got:
                break
            self._to_reap.discard(got)
            if any(env.pid == got for s in self.sessions.values() for env in s.envs):
                # A live env died and its pipe's EOF is not handled yet: keep its status for its fault.
                # (A lent env's EOF reaches the pool, which hands it back with a call in flight
                # or with its next request; the worker cannot tell which, so it waits for that.)
                self._exit_status[got] = status

    def _await_exit(self, pid: int | None, timeout: float) -> bool:
        """Whether our child ``pid`` exits within ``timeout``; it is left unreaped (WNOWAIT)."""
        if not pid:
            return False
        deadline = time.monotonic() + timeout
        while pid not in self._exit_status:
            try:
                if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                    return True
            except ChildProcessError:  # not ours to wait for (a memory snapshot's copy): watch /proc
                if _exited(pid):
                    return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.002)
        return True

    def wipe(self, path: str) -> None:
        try:
            wipe_workspace(path)
        except Exception:  # noqa: BLE001
            log.exception("could not wipe workspace %s", path)


def _exited(pid: int) -> bool:
    """Whether ``pid`` has exited (gone, or a zombie its parent has not reaped)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X")
    except (OSError, IndexError):
        return True
