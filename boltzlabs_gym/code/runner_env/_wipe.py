"""The light wipe between two programs of one env: everything a program could leave, removed and checked.

Only sound where the env is PID 1 of its own PID namespace (:func:`unavailable` says why not): then every
process a program started, however it detached itself, is in that namespace and nowhere else,
the env can see and kill each one, and no process outside is within a program's reach. That is
the namespaces backend's boltz env; on the ``process`` backend an env shares the host's PID
space (and uid), so it is never wiped there, only hard-reset.

:func:`protect` and :func:`record` (once, before the env's first request) make the env itself
safe from its programs and record what the checks compare with; :func:`wipe` (after every program) returns
``None`` when nothing is left, else the reason, and the runner then hard-resets the env. What
the wipe covers and why nothing else can persist: ``docs/code-server.md``. Standard library and
the env side's own :mod:`boltzlabs_gym.envside.confine` (the sandbox's mount points) only.
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

from boltzlabs_gym.envside.confine import mount_points
from boltzlabs_gym.envside.plain_files import read_bytes

#: the writable places of a boltz env's sandbox (the root, /dev, /env, /usr, ... are read-only mounts):
#: the workspace and the sandbox's own tmpfs mounts, ``/mnt``, ``/data`` and ``/home`` among them
#: (``envside.confine.SANDBOX_PRIVATE_DIRS``: SandboxFusion's requests name files there). A request's
#: files may be written to and fetched from these places only (``env._file_path``)
ROOTS = ("/workspace", "/tmp", "/dev/shm", "/mnt", "/data", "/home")
_RLIMITS = tuple(getattr(resource, n) for n in sorted(dir(resource)) if n.startswith("RLIMIT_"))
_PR_SET_DUMPABLE = 4
_IPC_RMID = 0
_NR_IOPRIO_GET = 252  # x86_64
_KILL_WINDOW_S = 1.0

_libc = ctypes.CDLL(None, use_errno=True)


def unavailable() -> str | None:
    """Why programs cannot be wiped away here, or ``None``: they can where this env is PID 1 of its
    own PID namespace (its /proc then shows that namespace) on x86_64 (the I/O-priority check's
    syscall number)."""
    if os.getpid() != 1:
        return (
            "the env is not PID 1 of its own PID namespace (only the namespaces isolation backend "
            "gives a boltz env one), so it cannot find every process a program left"
        )
    if platform.machine() != "x86_64":
        return f"the wipe's checks are written for x86_64, not {platform.machine()}"
    return None


@dataclass
class Baseline:
    """What the checks after each program compare with (:func:`record`)."""

    processes: dict[int, tuple] = field(default_factory=dict)  # pid -> process_state(pid)
    roots: dict[str, tuple] = field(default_factory=dict)  # path -> root_state(path)
    #: read-only mounts inside the writable places (an interpreter's tree: a venv under /tmp), left
    #: alone by the wipe: mount point -> (st_dev, st_ino) of what is mounted there
    mounts: dict[str, tuple[int, int]] = field(default_factory=dict)
    #: the directories that lead from a writable place down to those mounts: kept (their contents
    #: but the way on are removed), path -> root_state(path)
    passages: dict[str, tuple] = field(default_factory=dict)

    def kept_below(self, path: str) -> set[str]:
        """The names directly in ``path`` that the wipe keeps (the first step towards each mount)."""
        prefix = path.rstrip("/") + "/"
        return {p[len(prefix) :].split("/", 1)[0] for p in (*self.mounts, *self.passages) if p.startswith(prefix)}


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
        if not _read_only(path):  # (a read-only bind over a whole place: nothing a program can write)
            base.roots[path] = root_state(path)
    for mount in mounts_below(tuple(base.roots)):
        st = os.lstat(mount)
        base.mounts[mount] = (st.st_dev, st.st_ino)
        for passage in _passages(mount):
            base.passages[passage] = root_state(passage)
    return base


def mounts_below(roots: tuple[str, ...]) -> list[str]:
    """Mount points strictly inside ``roots``: the sandbox binds an interpreter that lives in a
    writable place (a venv under ``/tmp``) read-only at its own path."""
    return [p for p in dict.fromkeys(mount_points()) if any(p.startswith(root + "/") for root in roots)]


def _read_only(path: str) -> bool:
    return bool(os.statvfs(path).f_flag & os.ST_RDONLY)


def _passages(mount: str) -> list[str]:
    """The directories between the writable place that holds ``mount`` and ``mount`` itself."""
    root = next(r for r in ROOTS if mount.startswith(r + "/"))
    parts = mount[len(root) + 1 :].split("/")[:-1]
    return [os.path.join(root, *parts[: i + 1]) for i in range(len(parts))]


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
    for path in base.roots:
        _restore_mode(path, base.roots[path])  # a program chmod-ed the workspace itself
        _empty(path, base)
        left = set(os.listdir(path)) - base.kept_below(path)
        if left:
            return f"{path} is not empty after the wipe: {sorted(left)[:4]}"
    return _check_mounts(base)


def _restore_mode(path: str, state: tuple) -> None:
    mode, uid = state[:2]
    if uid == os.getuid() and stat.S_IMODE(os.lstat(path).st_mode) != stat.S_IMODE(mode):
        os.chmod(path, stat.S_IMODE(mode))


def _empty(path: str, base: Baseline) -> None:
    """Remove everything below ``path`` (not following links; directories made removable first)
    but the read-only mounts of ``base`` and the directories that lead to them."""
    with os.scandir(path) as entries:
        for entry in entries:
            if entry.path in base.mounts:
                continue  # read-only: nothing a program could write
            if entry.path in base.passages and entry.is_dir(follow_symlinks=False):
                _restore_mode(entry.path, base.passages[entry.path])
                _empty(entry.path, base)
            elif entry.is_dir(follow_symlinks=False):
                os.chmod(entry.path, 0o700)
                _empty(entry.path, base)
                os.rmdir(entry.path)
            else:
                os.unlink(entry.path)
    left = set(os.listdir(path)) - base.kept_below(path) if path in base.passages else set()
    if left:
        raise OSError(f"{path} still holds {sorted(left)[:4]}")


def _check_mounts(base: Baseline) -> str | None:
    """Each kept mount still where it was (a program could have renamed the way to it)."""
    for mount, (dev, ino) in base.mounts.items():
        try:
            st = os.lstat(mount)
        except OSError as exc:
            return f"the read-only mount {mount} is gone: {exc}"
        if (st.st_dev, st.st_ino) != (dev, ino):
            return f"the read-only mount {mount} was moved"
    return None


def _remove_sysv_ipc() -> str | None:
    """Remove the SysV shared memory, message queues and semaphores of this env's IPC namespace."""
    removers = {
        "shm": lambda i: _libc.shmctl(i, _IPC_RMID, None),
        "msg": lambda i: _libc.msgctl(i, _IPC_RMID, None),
        "sem": lambda i: _libc.semctl(i, 0, _IPC_RMID),
    }
    for kind, remove in removers.items():
        found = _sysv_ids(kind)
        if not found:
            continue  # (the common case: one read of the list, not two)
        for ident in found:
            remove(ident)
        if _sysv_ids(kind):
            return f"SysV {kind} objects {_sysv_ids(kind)[:8]} could not be removed"
    return None


def _sysv_ids(kind: str) -> list[int]:
    return [int(line.split()[1]) for line in read_bytes(f"/proc/sysvipc/{kind}").splitlines()[1:] if line.strip()]


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
    for path, state in (*base.roots.items(), *base.passages.items()):
        if root_state(path) != state:
            return f"{path} was changed by a program: {state} -> {root_state(path)}"
    named = _named_unix_sockets()
    if named:
        return f"unix sockets still bound: {named[:4]}"
    return None


def _named_unix_sockets() -> list[str]:
    """Bound unix socket names (paths and abstract ones) in this env's network namespace."""
    rows = read_bytes("/proc/net/unix").splitlines()[1:]
    return [os.fsdecode(row.split()[7]) for row in rows if len(row.split()) > 7]


def _read(path: str) -> str:
    return read_bytes(path).decode().strip()  # (plain calls: every wipe reads six /proc files)
