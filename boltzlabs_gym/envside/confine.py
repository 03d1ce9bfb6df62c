"""What a process does to confine itself before it runs env code: the sandbox's fixed paths,
rlimits, the standard fds, the control socket's fd, and the Python trees a sandbox must show.

Standard library only: it runs in freshly forked children of the worker, in the boltz
template and in memory-snapshot copies, before anything else is imported there.
"""

from __future__ import annotations

import os
import resource
import sys
from typing import TYPE_CHECKING

from .plain_files import write_text

if TYPE_CHECKING:
    from ..wire.limits import Limits

#: Inside a namespace sandbox the env directory and the workspace have fixed paths.
SANDBOX_ENV_DIR = "/env"


SANDBOX_WORKSPACE = "/workspace"


#: Writable places of a namespace sandbox besides ``/workspace``, ``/tmp`` and ``/dev/shm``: each a
#: small private tmpfs (``Limits.tmpfs_bytes``), because SandboxFusion's requests name files there
#: (``/mnt/data/x.csv``); an env forked from a boltz template gets fresh ones, as it gets a fresh /tmp.
SANDBOX_PRIVATE_DIRS = ("/mnt", "/data", "/home")


#: The library's own runtime (the env-side helper) is mounted here, read-only.
SANDBOX_RUNTIME = "/opt/boltzlabs"


#: Where an env process keeps its control socket to the worker (memory snapshots: see
#: :mod:`boltzlabs_gym.envside.memory_snapshot`); the worker's end has SO_PASSCRED.
CONTROL_FD = 200


def set_comm(name: str) -> None:
    """Name the calling process (its ``comm``, what ``ps`` and psutil show) by writing
    ``/proc/self/comm``: plain calls, where ``prctl(PR_SET_NAME)`` through ctypes cost every forked
    env a ``CDLL`` of its own (about 0.1 ms). Cosmetic: a failure is ignored."""
    try:
        write_text("/proc/self/comm", name[:15])
    except OSError:
        pass


def mount_points() -> list[str]:
    """This mount namespace's mount points, in ``/proc/self/mountinfo``'s order (its fifth field;
    the kernel writes a space, tab, newline or backslash in a path as an octal escape, undone here)."""
    import re

    with open("/proc/self/mountinfo") as f:
        fields = [line.split()[4] for line in f]
    return [re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), p) for p in fields]


def apply_rlimits(limits: Limits, *, memory_via_rlimit: bool, pids_via_rlimit: bool) -> None:
    """Set the rlimits of the calling (child) process: FSIZE, NOFILE, CORE=0, CPU backstop, and
    AS / NPROC when no cgroup carries the memory / process limit."""

    def cap(res: int, value: int | None) -> None:
        if value is not None:
            value = int(value)
            _, hard = resource.getrlimit(res)
            if hard != resource.RLIM_INFINITY and value > hard:
                value = hard  # never try to raise a hard limit the worker itself lives under
            resource.setrlimit(res, (value, value))

    if limits.file_size_bytes is not None:
        cap(resource.RLIMIT_FSIZE, int(limits.file_size_bytes))
    cap(resource.RLIMIT_NOFILE, limits.open_files)
    cap(resource.RLIMIT_CORE, 0)
    cap(resource.RLIMIT_CPU, limits.cpu_backstop_seconds())
    if memory_via_rlimit and limits.memory_bytes is not None:
        cap(resource.RLIMIT_AS, int(limits.memory_bytes))
    if pids_via_rlimit and limits.pids is not None:
        cap(resource.RLIMIT_NPROC, limits.pids)


def wire_std_fds(stdin_fd: int, stdout_fd: int, stderr_fd: int) -> None:
    """Make the three pipe ends fds 0, 1, 2 (safe when some of them already are 0..2)."""
    import fcntl

    high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3) for fd in (stdin_fd, stdout_fd, stderr_fd)]
    for target, fd in enumerate(high):
        os.dup2(fd, target)  # dup2 clears CLOEXEC on the target
    for fd in high:
        os.close(fd)


def vacate_fd(slot: int, fds: list[int]) -> list[int]:
    """``fds`` with each one that is ``slot`` moved to a free descriptor (close-on-exec), and
    ``slot`` closed, so that something can be dup2-ed onto ``slot`` without replacing one of them.

    A worker with a few hundred envs hands its children pipe ends numbered past
    :data:`CONTROL_FD`; one that sat there was replaced by the control socket, and the env's
    stdout became that socket.
    """
    if slot not in fds:
        return list(fds)
    import fcntl

    moved = fcntl.fcntl(slot, fcntl.F_DUPFD_CLOEXEC, 3)
    os.close(slot)
    return [moved if fd == slot else fd for fd in fds]


def readable(fds: list[int], timeout: float) -> set[int]:
    """The fds of ``fds`` that are readable (or hung up) within ``timeout`` s. poll, not select: a
    worker with a thousand envs has fds above select's limit of 1024."""
    import select

    p = select.poll()
    for fd in fds:
        p.register(fd, select.POLLIN)
    while True:
        try:
            return {fd for fd, _ev in p.poll(max(0, int(timeout * 1000)))}
        except InterruptedError:
            continue


def python_paths(argv0: str | None) -> list[str]:
    """The Python installation trees a sandbox must show (read-only) for ``argv0`` to run."""
    paths = {os.path.realpath(sys.base_prefix), os.path.realpath(sys.prefix), sys.base_prefix, sys.prefix}
    exe = os.path.realpath(sys.executable)
    paths.add(os.path.dirname(os.path.dirname(exe)))
    if argv0 and os.path.isabs(argv0):
        real = os.path.realpath(argv0)
        paths.add(os.path.dirname(os.path.dirname(real)))
        paths.add(os.path.dirname(os.path.dirname(argv0)))
    keep: list[str] = []
    for p in sorted(paths, key=len):
        if p in ("/", "") or p == "/usr" or p.startswith("/usr/") or not os.path.isdir(p):
            continue
        if any(p == k or p.startswith(k.rstrip("/") + "/") for k in keep):
            continue
        keep.append(p)
    return keep
