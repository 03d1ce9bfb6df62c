"""The light wipe between two programs of one env: everything a program could leave, removed and checked.

Only sound where the env is PID 1 of its own PID namespace (:func:`available`): then every
process a program started, however it detached itself, is in that namespace and nowhere else,
the env can see and kill each one, and no process outside is within a program's reach. That is
the namespaces backend's boltz env; on the ``process`` backend an env shares the host's PID
space (and uid), so it is never wiped there, only hard-reset.

:func:`protect` and :func:`record` (once, before the env's first request) make the env itself
safe from its programs and record what the checks compare with; :func:`wipe` (after every program) returns
``None`` when nothing is left, else the reason, and the runner then hard-resets the env. What
the wipe covers and why nothing else can persist: ``docs/code-server.md``. Standard library only.
"""

from __future__ import annotations

import ctypes
import os
import platform
import resource
import signal
import stat
import time
from dataclasses import dataclass, field

#: the writable places of a boltz env's sandbox (the root, /dev, /env, /usr, ... are read-only mounts)
ROOTS = ("/workspace", "/tmp", "/dev/shm")
_RLIMITS = tuple(getattr(resource, n) for n in sorted(dir(resource)) if n.startswith("RLIMIT_"))
_PR_SET_DUMPABLE = 4
_IPC_RMID = 0
_NR_IOPRIO_GET = 252  # x86_64
_KILL_WINDOW_S = 1.0

_libc = ctypes.CDLL(None, use_errno=True)


def available() -> bool:
    """Whether programs can be wiped away here: this env is PID 1 of its own PID namespace (its
    /proc then shows that namespace) on x86_64 (the I/O-priority check's syscall number)."""
    return os.getpid() == 1 and platform.machine() == "x86_64"


@dataclass
class Baseline:
    """What the checks after each program compare with (:func:`record`)."""

    processes: dict[int, tuple] = field(default_factory=dict)  # pid -> process_state(pid)
    roots: dict[str, tuple] = field(default_factory=dict)  # path -> root_state(path)


def protect() -> None:
    """Make this env process safe from its programs (before it forks its zygote, which inherits it).

    Not dumpable: its ``/proc/1/*`` belong to the namespace's root, so a program (same uid, no
    capabilities) can neither open ``/proc/1/mem`` nor its fds nor write its OOM score. SIGINT
    ignored: as PID 1 the env gets only the signals it handles from inside its namespace, and
    SIGINT is the one Python handles.
    """
    set_dumpable(False)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def record(keep: list[int]) -> Baseline:
    """What the checks compare with: this process's and ``keep``'s state, the writable places'."""
    base = Baseline()
    for pid in [os.getpid(), *keep]:
        base.processes[pid] = process_state(pid)
    for path in ROOTS:
        base.roots[path] = root_state(path)
    return base


def set_dumpable(on: bool) -> None:
    """``prctl(PR_SET_DUMPABLE)``: whether processes of the same uid may open this one's memory and fds."""
    if _libc.prctl(_PR_SET_DUMPABLE, int(on), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE)")


def process_state(pid: int) -> tuple:
    """What a program could change of another process of its uid, and a fork would inherit."""
    return (
        tuple(resource.prlimit(pid, r) for r in _RLIMITS),
        os.getpriority(os.PRIO_PROCESS, pid),
        frozenset(os.sched_getaffinity(pid)),
        os.sched_getscheduler(pid),
        os.sched_getparam(pid).sched_priority,
        _libc.syscall(_NR_IOPRIO_GET, 1, pid),  # IOPRIO_WHO_PROCESS
        _read(f"/proc/{pid}/oom_score_adj"),
    )


def stopped(pid: int) -> bool:
    """Whether ``pid`` is stopped (T) or traced (t) (its state in ``/proc/<pid>/stat``)."""
    return _read(f"/proc/{pid}/stat").rsplit(")", 1)[-1].split()[0] in ("T", "t")


def root_state(path: str) -> tuple:
    st = os.lstat(path)
    return (st.st_mode, st.st_uid, st.st_gid, tuple(sorted(os.listxattr(path, follow_symlinks=False))))


def wipe(base: Baseline, keep: list[int]) -> str | None:
    """Kill every process but this one and ``keep``, empty the writable places, remove SysV IPC
    objects, then check that nothing is left and nothing of ``base`` changed; the reason if not."""
    try:
        return _kill_others(set(keep)) or _empty_roots(base) or _remove_sysv_ipc() or _check(base)
    except (OSError, RecursionError, ValueError) as exc:
        return f"the wipe failed: {type(exc).__name__}: {exc}"


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _kill_others(keep: set[int]) -> str | None:
    """SIGKILL (stopped, traced, detached or not) and reap until only this env and ``keep`` are left."""
    me = os.getpid()
    deadline = time.monotonic() + _KILL_WINDOW_S
    while True:
        others = [p for p in _pids() if p != me and p not in keep]
        if not others:
            return None
        for pid in others:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _reap()
        if time.monotonic() > deadline:
            return f"processes {others[:8]} survived SIGKILL for {_KILL_WINDOW_S:g} s"
        time.sleep(0.0005)


def _reap() -> None:
    """Reap every dead child (orphans are re-parented to this env, PID 1)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _empty_roots(base: Baseline) -> str | None:
    for path in ROOTS:
        mode, uid = base.roots[path][:2]
        if uid == os.getuid() and stat.S_IMODE(os.lstat(path).st_mode) != stat.S_IMODE(mode):
            os.chmod(path, stat.S_IMODE(mode))  # a program chmod-ed the workspace itself
        _empty(path)
        if os.listdir(path):
            return f"{path} is not empty after the wipe"
    return None


def _empty(path: str) -> None:
    """Remove everything below ``path`` (not following links; directories made removable first)."""
    with os.scandir(path) as entries:
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                os.chmod(entry.path, 0o700)
                _empty(entry.path)
                os.rmdir(entry.path)
            else:
                os.unlink(entry.path)


def _remove_sysv_ipc() -> str | None:
    """Remove the SysV shared memory, message queues and semaphores of this env's IPC namespace."""
    removers = {
        "shm": lambda i: _libc.shmctl(i, _IPC_RMID, None),
        "msg": lambda i: _libc.msgctl(i, _IPC_RMID, None),
        "sem": lambda i: _libc.semctl(i, 0, _IPC_RMID),
    }
    for kind, remove in removers.items():
        for ident in _sysv_ids(kind):
            remove(ident)
        if _sysv_ids(kind):
            return f"SysV {kind} objects {_sysv_ids(kind)[:8]} could not be removed"
    return None


def _sysv_ids(kind: str) -> list[int]:
    with open(f"/proc/sysvipc/{kind}") as f:
        return [int(line.split()[1]) for line in f.read().splitlines()[1:] if line.strip()]


def _check(base: Baseline) -> str | None:
    for pid, state in base.processes.items():
        try:
            now = process_state(pid)
        except OSError as exc:
            return f"process {pid} cannot be checked: {exc}"
        if now != state:
            return f"process {pid} was changed by a program: {state} -> {now}"
        if stopped(pid):
            return f"process {pid} was stopped by a program"
    for path, state in base.roots.items():
        if root_state(path) != state:
            return f"{path} was changed by a program: {state} -> {root_state(path)}"
    named = _named_unix_sockets()
    if named:
        return f"unix sockets still bound: {named[:4]}"
    return None


def _named_unix_sockets() -> list[str]:
    """Bound unix socket names (paths and abstract ones) in this env's network namespace."""
    with open("/proc/net/unix") as f:
        rows = f.read().splitlines()[1:]
    return [row.split()[7] for row in rows if len(row.split()) > 7]


def _read(path: str) -> str:
    with open(path) as f:
        return f.read().strip()
