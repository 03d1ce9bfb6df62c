"""What every isolation backend provides, and the per-env limits they enforce.

A backend turns a :class:`LaunchSpec` (the command, the env's two directories, the
three pipe ends, the limits) into a running, isolated process tree and returns a
:class:`Launched` handle that can kill that whole tree. The worker knows nothing
else about isolation.

Setup runs in a freshly forked child (``prepare_child``), so the same code serves a
process started by exec and, later, one forked from a warm template.
"""

from __future__ import annotations

import ctypes
import os
import resource
import signal
import socket
import stat
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from ...envside.confine import (  # re-exported: the backends and the worker import them here
    CONTROL_FD as CONTROL_FD,
)
from ...envside.confine import (
    SANDBOX_ENV_DIR as SANDBOX_ENV_DIR,
)
from ...envside.confine import (
    SANDBOX_RUNTIME as SANDBOX_RUNTIME,
)
from ...envside.confine import (
    SANDBOX_WORKSPACE as SANDBOX_WORKSPACE,
)
from ...envside.confine import (
    apply_rlimits as apply_rlimits,
)
from ...envside.confine import (
    python_paths as python_paths,
)
from ...envside.confine import (
    readable as readable,
)
from ...envside.confine import (
    vacate_fd as vacate_fd,
)
from ...envside.confine import (
    wire_std_fds as wire_std_fds,
)
from ...errors import SandboxUnavailable as SandboxUnavailable  # re-exported: backends and worker import it here
from ...wire.limits import IsolationReport as IsolationReport
from ...wire.limits import Limits as Limits

#: personality(2) flag: the next execve lays the process out without randomization.
ADDR_NO_RANDOMIZE = 0x0040000
_personality: Callable[[int], int] | None
try:  # resolved here, not in a forked child: no ctypes lookups between fork and exec
    _libc_personality = ctypes.CDLL(None, use_errno=True).personality
    _libc_personality.argtypes = [ctypes.c_ulong]
    _libc_personality.restype = ctypes.c_int
    _personality = _libc_personality
except (OSError, AttributeError):  # not Linux
    _personality = None


@dataclass
class LaunchSpec:
    """Everything a backend needs to start one env process."""

    argv: list[str]
    env_dir: str
    workspace: str
    stdin_fd: int
    stdout_fd: int
    stderr_fd: int
    env: dict[str, str] = field(default_factory=dict)
    limits: Limits = field(default_factory=Limits)
    #: host directory -> path inside the sandbox, mounted read-only (extra runtime paths).
    ro_binds: dict[str, str] = field(default_factory=dict)
    index: int = 0
    #: package name -> host package dir, e.g. ``{"boltzlabs_gym": ".../boltzlabs_gym"}``. Inside a
    #: sandbox each is mounted read-only at ``/opt/boltzlabs/<name>`` and ``PYTHONPATH=/opt/boltzlabs``;
    #: the process backend puts the packages' parent dirs on ``PYTHONPATH``.
    runtime: dict[str, str] = field(default_factory=dict)
    #: when the worker runs as root: the unprivileged uid (and gid) this env runs as; ``None`` picks
    #: ``ENV_UID_BASE + index``. Ignored when not root.
    uid: int | None = None
    #: whether the env's interpreter gets a randomized address-space layout (see
    #: :func:`set_layout_randomization`).
    aslr: bool = True
    #: boltz mode: whether the template's seccomp filter lets its envs create user namespaces
    #: (``PoolOptions.nested_user_namespaces``) rather than hand each to the worker's gate
    nested_user_namespaces: bool = False


@dataclass
class Launched:
    """A running env process tree. ``pid`` is the worker's direct child.

    * ``kill_tree()`` sends SIGKILL to the whole tree (idempotent, never blocks for long); the
      worker still ``waitpid``s ``pid``.
    * ``cleanup()`` releases the rest (the env's cgroup) once the tree is dead; call it after
      ``kill_tree()`` (it kills again and waits, bounded, for the group to empty). Idempotent.
    * ``setup_error``: set when the sandbox could not be built; the child has then already exited
      with status 127 and wrote the same text on its stderr pipe.
    * ``oom_killed()``: whether the kernel's memory-limit OOM killer hit this env (cgroup only).
    """

    pid: int
    kill_tree: Callable[[], object]
    cleanup: Callable[[], object] = lambda: None
    setup_ms: float = 0.0
    setup_error: str | None = None
    oom_killed: Callable[[], bool] = lambda: False
    #: paths as the env sees them: {"env_dir": ..., "workspace": ...}
    paths: dict = field(default_factory=dict)
    #: boltz namespaces envs: the worker's end of the env's control socket (memory snapshots) and
    #: the env's cgroup; ``None`` elsewhere
    control: Any = None
    cgroup: Any = None
    #: whether ``pid`` is the worker's child (a memory snapshot's copy is its holder's)
    child: bool = True

    def kill(self) -> None:
        self.kill_tree()


class Backend(Protocol):
    """What the worker needs of an isolation backend (a boltz-mode ``TemplateLauncher`` has it too)."""

    name: str

    def available(self) -> tuple[bool, str]: ...

    def report(self) -> IsolationReport: ...

    def launch(self, spec: LaunchSpec) -> Launched: ...


class ListenerGate(Protocol):
    """Who answers the syscalls an env's seccomp filter hands to the worker instead of refusing them
    in the kernel (seccomp user notification): the namespaces backend, as root, hands each env's
    listener to its gate (the worker's memory snapshots let a snapshot's copies through there)."""

    def watch(self, listener_fd: int) -> None: ...


#: The variable that tells an env process it can take memory snapshots (its control socket is open at
#: :data:`CONTROL_FD`); every env of a launcher that can make them has it.
MEMORY_SNAPSHOTS_ENV = "BOLTZLABS_MEMORY_SNAPSHOTS"

#: first uid handed to envs when the worker runs as root (uid = ENV_UID_BASE + index).
ENV_UID_BASE = 960000
_DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"


def env_uid(spec: LaunchSpec) -> int:
    return spec.uid if spec.uid is not None else ENV_UID_BASE + (spec.index % 1_000_000)


def child_environment(
    spec: LaunchSpec, *, env_dir: str, workspace: str, pythonpath: str, tmpdir: str | None = None
) -> dict[str, str]:
    """The env's environment: the worker's scrubbed ``spec.env`` plus what every backend sets itself.

    ``BOLTZLABS_ENV_DIR``, ``BOLTZLABS_WORKSPACE`` and ``PYTHONPATH`` always win over ``spec.env``;
    ``PATH``, ``HOME``, ``TMPDIR`` and ``LANG`` get defaults when the worker passed none.
    """
    env = {"PATH": _DEFAULT_PATH, "HOME": workspace, "LANG": "C.UTF-8"}
    if tmpdir:
        env["TMPDIR"] = tmpdir
    env.update({str(k): str(v) for k, v in spec.env.items()})
    if env.get("HOME") == spec.workspace:
        env["HOME"] = workspace  # the worker's host path -> the path the env sees
    env["BOLTZLABS_ENV_DIR"] = env_dir
    env["BOLTZLABS_WORKSPACE"] = workspace
    env["PYTHONPATH"] = pythonpath
    return env


def sandboxed_environment(spec: LaunchSpec) -> dict[str, str]:
    """The environment of an env inside a sandbox: :func:`child_environment` with the paths it sees there."""
    return child_environment(
        spec, env_dir=SANDBOX_ENV_DIR, workspace=SANDBOX_WORKSPACE, pythonpath=SANDBOX_RUNTIME, tmpdir="/tmp"
    )


def scheduling_policy() -> tuple[int, int] | None:
    """This thread's scheduling policy and priority, for an env's child to take (None where unknown)."""
    try:
        policy = os.sched_getscheduler(0)
        return policy, os.sched_getparam(0).sched_priority
    except (AttributeError, OSError):
        return None


def adopt_sched_and_cgroup(sched: tuple[int, int] | None, cgroup: Any) -> None:
    """In the fresh child: take the launcher's scheduling policy ``sched`` and join the env's ``cgroup``."""
    if sched is not None:
        try:
            os.sched_setscheduler(0, sched[0], os.sched_param(sched[1]))
        except OSError:
            pass
    if cgroup is not None:
        cgroup.join()


def kill_pid_and_cgroup(pid: int, cgroup: Any) -> None:
    """SIGKILL ``pid``, and one pass over what is left in its ``cgroup`` (if any); never waits."""
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if cgroup is not None:
        cgroup.signal_all()


def launched_tree(pid: int, cgroup, started: float, setup_error: str | None = None) -> Launched:
    """The handle for an env whose whole tree dies with ``pid`` (a pid-namespace init or bwrap).

    ``kill_tree`` SIGKILLs ``pid`` and signals what is left in the env's ``cgroup`` (if
    any); ``cleanup`` removes the cgroup.
    """

    def kill_tree() -> None:
        kill_pid_and_cgroup(pid, cgroup)

    def cleanup() -> None:
        if cgroup is not None:
            cgroup.remove()

    return Launched(
        pid=pid,
        kill_tree=kill_tree,
        cleanup=cleanup,
        setup_ms=(time.perf_counter() - started) * 1e3,
        setup_error=setup_error,
        oom_killed=(cgroup.oom_killed if cgroup is not None else (lambda: False)),
        paths={"env_dir": SANDBOX_ENV_DIR, "workspace": SANDBOX_WORKSPACE},
    )


def sandbox_properties(
    mode: str, cgroup: str | None, seccomp_on: bool, *, process_limit: str | bool, dedicated_uid: bool, tree_kill: str
) -> dict[str, bool | str]:
    """What a namespaced sandbox (``namespaces`` or ``bwrap``) gives an env in ``mode``, for its report:
    ``cgroup`` the per-env cgroup kind (None: limits by rlimits, ``process_limit`` then), ``tree_kill``
    how its process tree dies (a cgroup adds to it)."""
    return {
        "mode": mode,
        "readonly_env_dir": True,
        "private_workspace": True,
        "no_network": True,
        "pid_namespace": True,
        "ipc_namespace": True,
        "uts_namespace": True,
        "hidden_host_files": True,
        "scrubbed_environment": True,
        "memory_limit": f"cgroup {cgroup}" if cgroup else "RLIMIT_AS",
        "process_limit": f"cgroup {cgroup}" if cgroup else process_limit,
        "file_size_limit": "RLIMIT_FSIZE",
        "open_files_limit": "RLIMIT_NOFILE",
        "cpu_limit": "RLIMIT_CPU (total backstop)",
        "seccomp": "deny-list, AF_UNIX sockets only" if seccomp_on else False,
        "no_capabilities": True,
        "dedicated_uid": dedicated_uid,
        "tree_kill": tree_kill + (" + cgroup" if cgroup else ""),
    }


def recv_pid(sock: socket.socket) -> tuple[bytes, int | None]:
    """One message and the kernel-stamped pid of its sender (SO_PASSCRED), within the socket's timeout."""
    msg, anc, _flags, _addr = sock.recvmsg(65536, socket.CMSG_SPACE(struct.calcsize("iII")))
    pid = None
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
            pid = struct.unpack("iII", data[: struct.calcsize("iII")])[0]
    return msg, pid


def recv_fds_passcred(sock: socket.socket, maxfds: int = 1) -> tuple[bytes, list[int]]:
    """One message and its descriptors on a socket with SO_PASSCRED (whose credentials take room
    in the ancillary buffer too: socket.recv_fds would lose the descriptors)."""
    size = socket.CMSG_SPACE(maxfds * 4) + socket.CMSG_SPACE(struct.calcsize("iII"))
    msg, anc, _flags, _addr = sock.recvmsg(65536, size)
    fds: list[int] = []
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds += list(struct.unpack(f"{len(data) // 4}i", data[: len(data) - len(data) % 4]))
    return msg, fds


def extend_cpu_backstop(pid: int, seconds: float) -> bool:
    """Set RLIMIT_CPU of env process ``pid`` to its CPU time so far plus ``seconds`` (soft = hard).

    For a per-step backstop: call before sending a step. Only the env's main process is covered
    (its children keep the total backstop). Needs the same uid or root; returns False when the
    process is gone or the limit cannot be set.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        used = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
        limit = int(used + seconds) + 1
        _, hard = resource.prlimit(pid, resource.RLIMIT_CPU)
        if hard != resource.RLIM_INFINITY and limit > hard and os.geteuid() != 0:
            limit = hard
        resource.prlimit(pid, resource.RLIMIT_CPU, (limit, limit))
        return True
    except (OSError, IndexError, ValueError):
        return False


def child_exec(
    spec: LaunchSpec,
    workdir: str,
    env: dict[str, str] | None = None,
    *,
    memory_via_rlimit: bool = True,
    pids_via_rlimit: bool = True,
) -> None:
    """Last steps in the child: wire fds 0/1/2, close the rest, set rlimits, exec. Never returns.

    The rlimits come after the fds are closed: a worker hosting hundreds of envs holds
    more fds than an env's RLIMIT_NOFILE, and with those still open any new fd in the
    child (even the dup that wires stdin) fails with EMFILE.
    """
    wire_std_fds(spec.stdin_fd, spec.stdout_fd, spec.stderr_fd)
    os.closerange(3, _max_fd())
    apply_rlimits(spec.limits, memory_via_rlimit=memory_via_rlimit, pids_via_rlimit=pids_via_rlimit)
    os.chdir(workdir)
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    set_layout_randomization(spec.aslr)
    os.execve(spec.argv[0], spec.argv, spec.env if env is None else env)


def set_layout_randomization(randomize: bool) -> None:
    """Choose, in a child about to ``execve``, whether the program it runs gets a randomized layout.

    With ``randomize=False`` the child sets ``ADDR_NO_RANDOMIZE`` (``personality(2)``, what
    ``setarch -R`` does), so every env interpreter maps libpython, its heap and its stack
    at the same addresses, as forked envs (boltz mode, AsyncVectorEnv, SubprocVecEnv) do
    anyway. The CPU's branch predictors and TLB-indexed caches then carry over from one
    env to the next on a core: on a 2-vCPU VM, 64 fresh interpreters stepping CartPole used
    30% less CPU per step (README; ``benchmarks/paired.py --impls async,default,default+aslr``
    compares the two). Inside a sandbox that already runs untrusted code
    the randomization protects nothing outside it; processes outside (the worker, the
    trainer) keep theirs. Best effort: nothing happens where ``personality`` is missing.
    """
    if _personality is None:
        return
    current = _personality(0xFFFFFFFF)  # query
    if current == -1:
        return
    # randomize=True also clears a flag inherited from the worker (one started under setarch -R)
    wanted = current & ~ADDR_NO_RANDOMIZE if randomize else current | ADDR_NO_RANDOMIZE
    if wanted != current:
        _personality(wanted)


def wipe_workspace(path: str, owner: tuple[int, int] | None = None) -> None:
    """Empty ``path`` of everything an env left there, and leave it an empty ``0700`` directory.

    Read-only files and directories the env made unreadable or unwritable to itself are chmod-ed
    as needed; symlinks are removed, never followed; depth is not limited by Python's recursion.
    ``owner`` (uid, gid), when given and running as root, is applied to the emptied directory;
    otherwise its ownership is kept. Call it only when no process of the env is alive.
    """
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    top_st = os.lstat(path)
    if not stat.S_ISDIR(top_st.st_mode):
        raise NotADirectoryError(path)
    os.chmod(path, 0o700)
    dfd = os.open(path, flags)
    names: list[str] = []  # path from the top down to dfd; only one fd is open at a time
    try:
        while True:
            sub = None
            with os.scandir(dfd) as it:
                for entry in it:
                    try:
                        is_dir = entry.is_dir(follow_symlinks=False)
                    except OSError:
                        is_dir = False
                    if is_dir:
                        sub = entry.name
                        break
                    try:
                        os.unlink(entry.name, dir_fd=dfd)
                    except FileNotFoundError:
                        pass
            if sub is not None:
                os.chmod(sub, 0o700, dir_fd=dfd)  # an lstat-checked real directory
                child = os.open(sub, flags, dir_fd=dfd)
                os.close(dfd)
                dfd = child
                names.append(sub)
                continue
            if not names:
                break
            parent = os.open("..", flags, dir_fd=dfd)
            os.close(dfd)
            dfd = parent
            os.rmdir(names.pop(), dir_fd=dfd)
    finally:
        os.close(dfd)
    if owner is not None and os.geteuid() == 0:
        os.chown(path, owner[0], owner[1])


def _max_fd() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 65536


def fork_child(body) -> int:
    """Fork; in the child run ``body()`` (which must exec or raise); report failures on fd 2.

    The error text lands in the env's stderr pipe, so a failed start is reported
    with its reason like any other start-up crash.
    """
    pid = os.fork()
    if pid == 0:  # child
        try:
            body()
        except BaseException as exc:  # noqa: BLE001 - the child must never return into the worker
            try:
                os.write(2, f"boltzlabs sandbox setup failed: {type(exc).__name__}: {exc}\n".encode())
            finally:
                os._exit(127)
        os._exit(127)
    return pid


def kill_process_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
