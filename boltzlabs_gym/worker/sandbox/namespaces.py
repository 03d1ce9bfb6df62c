"""The ``namespaces`` backend: a sandbox the library builds itself with Linux namespaces (ctypes).

Per env: its own mount, PID, network, IPC and UTS namespaces; a fresh tmpfs root holding
read-only ``/usr`` (+ the ``bin``/``lib`` links), the Python prefix(es) at their host paths,
the runtime packages at ``/opt/boltzlabs/<name>``, the env dir read-only at ``/env``, the
workspace writable at ``/workspace``, size-limited tmpfs ``/tmp``, ``/dev/shm``, ``/mnt``,
``/data`` and ``/home`` (SandboxFusion's requests write files there), a minimal ``/dev``, a few
``/etc`` files and its own ``/proc``; ``pivot_root`` into it (``MS_MOVE`` + ``chroot`` where
``pivot_root`` is refused); no capabilities, ``no_new_privs``, a seccomp deny-list; limits by
cgroup (root) or rlimits.

Two modes, probed once per process:

``root`` (euid 0 with CAP_SYS_ADMIN)
    No user namespace. The worker's launcher thread does ``unshare(CLONE_NEWPID)``, forks and
    restores its PID namespace with ``setns``, so the worker's direct child *is* PID 1 of the
    env's namespace: killing it makes the kernel kill the whole tree, and ``waitpid`` on it
    gives the env's own exit status. The mounts are made as real root (so a Python under
    ``/root``, mode 700, is reachable), then the child joins its cgroup, drops the capability
    bounding set and switches to an unprivileged uid of its own (``ENV_UID_BASE + index``;
    the workspace is chowned to it).
``userns`` (unprivileged, user namespaces allowed)
    The child ("keeper", the worker's direct child) does ``unshare(CLONE_NEWUSER|...)``, maps
    its own uid and forks PID 1 of the new namespace, then waits for it and exits with its
    status. Capabilities are dropped; memory and processes are bounded by RLIMIT_AS and
    RLIMIT_NPROC (no cgroup delegation).

Every fork is done by one long-lived launcher thread owned by this module, because
``PR_SET_PDEATHSIG`` fires when the *thread* that forked a process exits; a launch from a
short-lived worker thread would otherwise kill its env when that thread ends.

For a template process that forks envs (``mode="boltz"``), :func:`spawn` takes a ``body``
callable instead of an argv: everything up to the exec runs in the forked child, and
``body()`` then runs inside the finished sandbox.
"""

from __future__ import annotations

import glob
import os
import queue
import select
import signal
import socket
import stat
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NoReturn

from ...envside import seccomp
from ...envside import syscalls as L
from ...envside.confine import SANDBOX_PRIVATE_DIRS, mount_points
from . import cgroups
from .base import (
    CONTROL_FD,
    MEMORY_SNAPSHOTS_ENV,
    SANDBOX_ENV_DIR,
    SANDBOX_RUNTIME,
    SANDBOX_WORKSPACE,
    IsolationReport,
    Launched,
    LaunchSpec,
    Limits,
    ListenerGate,
    SandboxUnavailable,
    _max_fd,
    adopt_sched_and_cgroup,
    apply_rlimits,
    env_uid,
    launched_tree,
    recv_fds_passcred,
    sandbox_properties,
    sandboxed_environment,
    scheduling_policy,
    set_layout_randomization,
    vacate_fd,
    wire_std_fds,
)
from .base import (
    python_paths as _python_paths,
)
from .probe import first_working_mode, probed_mode, working_mode
from .speculation import report_speculation

_NS_FLAGS = L.CLONE_NEWNS | L.CLONE_NEWNET | L.CLONE_NEWIPC | L.CLONE_NEWUTS
HOSTNAME = "boltzlabs"
_ETC_BINDS = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "nsswitch.conf", "alternatives")
#: Toolchains' own configuration under /etc (glob patterns), read-only where the host has it: Debian
#: keeps the JVM's ``conf``, R's ``etc``, Mono's, PHP's, Racket's and LDC's configuration there, and
#: the code runner's languages do not start without it. Configuration only: no keys, no passwords.
_ETC_TOOLCHAINS = ("java-*-openjdk", "R", "mono", "php", "racket", "ldc2.conf")
#: The top-level directories of the host's root a sandbox shows (a read-only bind, or the symlink it is).
_ROOT_DIRS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
#: The host device nodes a sandbox shows in its /dev (bound, read-only: see _build_root)
_DEV_NODES = ("null", "zero", "full", "random", "urandom")
_SETUP_TIMEOUT_S = 30.0


# --------------------------------------------------------------------------------------------- launcher thread
class _LauncherThread:
    """Runs every fork on one long-lived daemon thread (PDEATHSIG follows the forking thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        self._lock = threading.Lock()
        self._thread = None
        self._q = queue.SimpleQueue()

    def _run(self) -> None:
        while True:
            fn, done, box = self._q.get()
            try:
                box["value"] = fn()
            except BaseException as exc:  # noqa: BLE001 - handed back to the caller
                box["error"] = exc
            done.set()

    def call(self, fn: Callable):
        if threading.current_thread() is self._thread:
            return fn()
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="boltzlabs-sandbox-launcher", daemon=True)
                self._thread.start()
        done = threading.Event()
        box: dict[str, Any] = {}  # "value" or "error", filled by the launcher thread
        self._q.put((fn, done, box))
        done.wait()
        if "error" in box:
            raise box["error"]
        return box["value"]


LAUNCHER = _LauncherThread()


# --------------------------------------------------------------------------------------------- the plan
#: A bind mount: (host source, path inside, read-only).
Bind = tuple[str, str, bool]


@dataclass(frozen=True)
class HostLayout:
    """What of the host every sandbox shows (this module's and bwrap's alike): ``/usr`` and the
    top-level ``bin``/``lib`` directories read-only (or the symlinks they are), and a few ``/etc`` files."""

    symlinks: dict[str, str]
    root_binds: list[Bind]
    etc_binds: list[Bind]

    @classmethod
    def read(cls) -> HostLayout:
        symlinks, root_binds = {}, []
        for name in _ROOT_DIRS:
            p = "/" + name
            if os.path.islink(p):
                symlinks[p] = os.readlink(p)
            elif os.path.isdir(p):
                root_binds.append((p, p, True))
        etc = []
        for name in _ETC_BINDS:
            p = "/etc/" + name
            if os.path.exists(p):
                etc.append((os.path.realpath(p), p, True))
        for pattern in _ETC_TOOLCHAINS:
            for p in sorted(glob.glob("/etc/" + pattern)):
                etc.append((os.path.realpath(p), p, True))
        return cls(symlinks, [("/usr", "/usr", True)] + root_binds, etc)

    def binds(self, spec: LaunchSpec) -> list[Bind]:
        """Every bind ``spec``'s env gets, in mount order: the host's, Python, the runtime packages,
        the extra read-only binds, ``/etc`` files, the env dir (read-only) and the workspace (writable)."""
        binds = list(self.root_binds)
        binds += [(p, p, True) for p in _python_paths(spec.argv[0] if spec.argv else None)]
        for name, pkg_dir in spec.runtime.items():
            binds.append((os.path.realpath(pkg_dir), f"{SANDBOX_RUNTIME}/{name}", True))
        for host, inside in spec.ro_binds.items():
            binds.append((os.path.realpath(host), inside, True))
        binds += self.etc_binds
        binds.append((os.path.realpath(spec.env_dir), SANDBOX_ENV_DIR, True))
        binds.append((os.path.realpath(spec.workspace), SANDBOX_WORKSPACE, False))
        return binds


@dataclass
class SandboxPlan:
    """Everything the child needs, computed in the parent (the child only makes syscalls)."""

    mode: str  # "root" | "userns"
    newroot: str
    binds: list[Bind]
    files: dict[str, str]
    symlinks: dict[str, str]
    uid: int  # uid inside (root: the env uid; userns: our own uid mapped onto itself)
    gid: int
    outer_uid: int
    outer_gid: int
    limits: Limits
    env: dict[str, str]
    argv: list[str]
    fds: tuple[int, int, int]
    cgroup: cgroups.EnvCgroup | None = None
    seccomp_prog: tuple[bytes, int] | None = None
    #: root mode, an exec'd env: the child's end of its control socket (memory snapshots). The env's
    #: filter then hands the copies' calls to a listener, sent to the worker over it before the exec;
    #: the socket stays open in the env at envside.confine.CONTROL_FD.
    control_fd: int = -1
    seccomp_notify_prog: tuple[bytes, int] | None = None
    cap_last: int = 40
    sched: tuple[int, int] | None = None
    worker_pid: int = 0
    extra_mkdirs: list[str] = field(default_factory=list)
    #: mount options of the sandbox's /proc (the boltz template mounts it ``hidepid=invisible``)
    proc_data: str | None = None
    #: randomize the exec'd program's address-space layout (``LaunchSpec.aslr``)
    aslr: bool = True


def _ensure_newroot() -> str:
    """An empty host directory the private tmpfs root is mounted on (only inside each env's mount ns)."""
    path = os.path.join(tempfile.gettempdir(), f".boltzlabs-sandbox-root-{os.geteuid()}")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise SandboxUnavailable(f"{path} is not a directory owned by uid {os.geteuid()} (someone squatted it?)")
    return path


# --------------------------------------------------------------------------------------------- child side
def _mkdirs(path: str) -> None:
    os.makedirs(path, mode=0o755, exist_ok=True)


def _make_ro(path: str) -> None:
    if L.mount_setattr_recursive_ro(path):
        return
    targets = [mp for mp in mount_points() if mp == path or mp.startswith(path.rstrip("/") + "/")]
    for mp in targets:
        L.mount(None, mp, None, L.MS_BIND | L.MS_REMOUNT | L.MS_NOSUID | L.MS_NODEV | L.locked_mount_flags(mp))


def _bind(src: str, dst: str, ro: bool) -> None:
    if os.path.isdir(src):
        _mkdirs(dst)
    else:
        _mkdirs(os.path.dirname(dst))
        if not os.path.lexists(dst):
            os.close(os.open(dst, os.O_WRONLY | os.O_CREAT, 0o644))
    L.mount(src, dst, None, L.MS_BIND | L.MS_REC)
    if ro:
        _make_ro(dst)
    else:
        L.mount(None, dst, None, L.MS_BIND | L.MS_REMOUNT | L.MS_NOSUID | L.MS_NODEV | L.locked_mount_flags(dst))


def _build_root(plan: SandboxPlan) -> None:
    """In PID 1 of the new PID namespace, after unshare(NEWNS): build the root and pivot into it."""
    R = plan.newroot
    tmpfs_size = int(plan.limits.tmpfs_bytes)
    L.mount(None, "/", None, L.MS_REC | L.MS_PRIVATE)  # no propagation to or from the host
    L.mount("tmpfs", R, "tmpfs", L.MS_NOSUID | L.MS_NODEV, "size=4m,mode=755")
    places = ("/tmp", *SANDBOX_PRIVATE_DIRS)
    for d in ("usr", "etc", "proc", "dev", "env", "workspace", ".old", *places, *plan.extra_mkdirs):
        _mkdirs(R + "/" + d.lstrip("/"))
    for name, target in plan.symlinks.items():
        os.symlink(target, R + name)
    # /tmp, /mnt, /data, /home first: a bind below one (a venv in /tmp or /home/u, say) must land on
    # its tmpfs, not under it; binds below /dev (a venv in /dev/shm) wait for /dev and /dev/shm's own
    # tmpfs mounts, which would hide them
    for place in places:
        L.mount("tmpfs", R + place, "tmpfs", L.MS_NOSUID | L.MS_NODEV, f"size={tmpfs_size},mode=1777")
    under_dev = [b for b in plan.binds if b[1] == "/dev" or b[1].startswith("/dev/")]
    for src, dst, ro in plan.binds:
        if (src, dst, ro) not in under_dev:
            _bind(src, R + dst, ro)
    for path, content in plan.files.items():
        with open(R + path, "w") as f:
            f.write(content)
    # /dev: a small tmpfs with bind-mounted host nodes (mknod is impossible in a user namespace),
    # read-only: a device is read and written as on a writable mount, but the node's times are the
    # host's, which a program could otherwise set (`touch /dev/null`), for every sandbox to read
    dev = f"{R}/dev"
    L.mount("tmpfs", dev, "tmpfs", L.MS_NOSUID | L.MS_NOEXEC, "size=64k,mode=755")
    for node in _DEV_NODES:
        if not os.path.exists(f"/dev/{node}"):
            continue
        os.close(os.open(f"{dev}/{node}", os.O_WRONLY | os.O_CREAT, 0o666))
        L.mount(f"/dev/{node}", f"{dev}/{node}", None, L.MS_BIND)
        L.mount(
            None,
            f"{dev}/{node}",
            None,
            L.MS_BIND | L.MS_REMOUNT | L.MS_RDONLY | L.MS_NOSUID | L.MS_NOEXEC | L.locked_mount_flags(f"{dev}/{node}"),
        )
    os.mkdir(f"{dev}/shm", 0o1777)
    L.mount("tmpfs", f"{dev}/shm", "tmpfs", L.MS_NOSUID | L.MS_NODEV | L.MS_NOEXEC, f"size={tmpfs_size},mode=1777")
    for src, dst, ro in under_dev:
        _bind(src, R + dst, ro)
    for name, target in (
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ):
        os.symlink(target, f"{dev}/{name}")
    # /proc must be mounted by a process inside the new PID namespace and, in a user namespace,
    # while a fully visible /proc is still mounted here (the kernel's mount_too_revealing rule).
    L.mount("proc", f"{R}/proc", "proc", L.MS_NOSUID | L.MS_NODEV | L.MS_NOEXEC, plan.proc_data)
    os.chdir(R)
    try:
        L.pivot_root(".", ".old")
        L.umount2("/.old", L.MNT_DETACH)
        os.rmdir("/.old")
    except PermissionError:
        # pivot_root refused (e.g. Docker's seccomp profile): switch_root-style fallback. The old
        # root stays underneath, reachable only by a chroot escape, which needs CAP_SYS_CHROOT
        # (dropped below) and the chroot syscall (denied by the seccomp filter).
        os.rmdir(f"{R}/.old")
        L.mount(R, "/", None, L.MS_MOVE)
        os.chroot(".")
    os.chdir("/")
    # the root tmpfs itself read-only (not recursive: /workspace and the tmpfs places stay writable)
    L.mount(None, "/", None, L.MS_BIND | L.MS_REMOUNT | L.MS_NOSUID | L.MS_NODEV | L.locked_mount_flags("/"))


def _drop_privileges(plan: SandboxPlan) -> None:
    L.drop_bounding_caps(plan.cap_last)
    try:
        L.prctl(L.PR_CAP_AMBIENT, L.PR_CAP_AMBIENT_CLEAR_ALL)
    except OSError:
        pass
    if plan.mode == "root":
        os.setgroups([])
        os.setresgid(plan.gid, plan.gid, plan.gid)
        os.setresuid(plan.uid, plan.uid, plan.uid)  # clears the permitted and effective sets
    L.capset_none()
    L.prctl(L.PR_SET_NO_NEW_PRIVS, 1)
    L.prctl(L.PR_SET_DUMPABLE, 1)  # the uid change made us non-dumpable: /proc/self/* would be root's


def enter_sandbox(plan: SandboxPlan, status_fd: int | None = None, lifeline_fd: int | None = None) -> None:
    """Run in PID 1 of a fresh PID namespace (a freshly forked child): build the sandbox around it.

    Afterwards the process is in its new root with cwd ``/workspace``, no capabilities, its
    limits and seccomp filter in force and PDEATHSIG armed. ``status_fd`` (root mode: the pipe the
    launcher reads) gets one byte to prove the launcher is still alive after PDEATHSIG was armed;
    ``lifeline_fd`` (userns mode: read end of a pipe the keeper holds) serves the same purpose.
    """
    adopt_sched_and_cgroup(plan.sched, plan.cgroup)
    flags = _NS_FLAGS | (L.CLONE_NEWCGROUP if plan.cgroup is not None else 0)
    if plan.mode == "root":
        L.unshare(flags)  # userns mode: the keeper already unshared everything
    L.sethostname(HOSTNAME)
    _build_root(plan)
    _drop_privileges(plan)
    L.prctl(L.PR_SET_PDEATHSIG, signal.SIGKILL)  # after the uid change, which clears it
    if status_fd is not None:
        try:
            os.write(status_fd, b".")
        except BrokenPipeError:
            os._exit(125)  # the launcher died before PDEATHSIG was armed
    if lifeline_fd is not None:
        ready, _, _ = select.select([lifeline_fd], [], [], 0)
        if ready:
            os._exit(125)  # the keeper is gone
        os.close(lifeline_fd)
    have_cg = plan.cgroup is not None
    apply_rlimits(plan.limits, memory_via_rlimit=not have_cg, pids_via_rlimit=not have_cg)
    os.chdir(SANDBOX_WORKSPACE)
    if plan.control_fd >= 0 and plan.seccomp_notify_prog is not None:
        _install_with_listener(plan)
    elif plan.seccomp_prog is not None:
        seccomp.install(plan.seccomp_prog)


def _install_with_listener(plan: SandboxPlan) -> None:
    """The env filter whose gated calls go to the worker (memory snapshots: see envside.memory_snapshot): its listener
    goes to the worker over the control socket, which stays open at ``CONTROL_FD`` across the exec."""
    import socket

    listener = seccomp.install_with_listener(plan.seccomp_notify_prog)
    sock = socket.socket(fileno=os.dup(plan.control_fd))
    try:
        socket.send_fds(sock, [b"ok"], [listener])
    finally:
        sock.close()
        os.close(listener)  # (this process must not keep it: it could approve its children's calls)
    os.dup2(plan.control_fd, CONTROL_FD, inheritable=True)
    os.close(plan.control_fd)


def _exec(plan: SandboxPlan, status_fd: int | None) -> NoReturn:
    wire_std_fds(*plan.fds)
    top = _max_fd()
    keep = sorted({fd for fd in (status_fd, _control_fd(plan)) if fd is not None and fd > 2})
    start = 3
    for fd in keep:  # status_fd is CLOEXEC: EOF for the launcher at exec; the control socket stays
        os.closerange(start, fd)
        start = fd + 1
    os.closerange(start, top)
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    set_layout_randomization(plan.aslr)
    os.execve(plan.argv[0], plan.argv, plan.env)


def _control_fd(plan: SandboxPlan) -> int | None:
    if plan.control_fd < 0 or plan.seccomp_notify_prog is None:
        return None
    return CONTROL_FD


def _report_failure(status_fd: int | None, stderr_fd: int, exc: BaseException) -> None:
    msg = f"boltzlabs sandbox setup failed: {type(exc).__name__}: {exc}"
    for fd in (status_fd, stderr_fd):
        if fd is None or fd < 0:
            continue
        try:
            os.write(fd, (("!" if fd == status_fd else "") + msg + "\n").encode())
        except OSError:
            pass


def _close_fds_except(keep: set[int]) -> None:
    try:
        fds = [int(x) for x in os.listdir("/proc/self/fd")]
    except OSError:
        fds = list(range(3, 1024))
    for fd in fds:
        if fd > 2 and fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass


def _run_as_pid1(
    plan: SandboxPlan,
    status_w: int,
    body: Callable[[], None] | None,
    status_fd: int | None = None,
    lifeline_fd: int | None = None,
) -> NoReturn:
    """PID 1 of the env's namespace: build the sandbox around itself (:func:`enter_sandbox`), then
    exec the env, or run ``body`` inside it and exit."""
    enter_sandbox(plan, status_fd=status_fd, lifeline_fd=lifeline_fd)
    if body is None:
        _exec(plan, status_w)
    os.close(status_w)
    body()
    os._exit(0)


def _child_root(plan: SandboxPlan, status_w: int, body: Callable[[], None] | None) -> None:
    """The worker's direct child, already PID 1 of its own PID namespace (root mode)."""
    try:
        _close_fds_except({status_w, *plan.fds, plan.control_fd})
        status_w = _high_fd(status_w)
        if _control_fd(plan) is not None:  # the control socket goes to CONTROL_FD before the exec
            *fds, status_w, plan.control_fd = vacate_fd(CONTROL_FD, [*plan.fds, status_w, plan.control_fd])
            plan.fds = (fds[0], fds[1], fds[2])
        _run_as_pid1(plan, status_w, body, status_fd=status_w)
    except BaseException as exc:  # noqa: BLE001 - never return into the worker
        _report_failure(status_w, plan.fds[2], exc)
    os._exit(127)


def _child_userns(plan: SandboxPlan, status_w: int, body: Callable[[], None] | None) -> None:
    """The worker's direct child in userns mode: unshare, map ids, fork PID 1, wait for it."""
    try:
        _close_fds_except({status_w, *plan.fds})
        status_w = _high_fd(status_w)
        L.unshare(L.CLONE_NEWUSER | L.CLONE_NEWPID | _NS_FLAGS)
        with open("/proc/self/setgroups", "w") as f:
            f.write("deny")
        with open("/proc/self/uid_map", "w") as f:
            f.write(f"{plan.uid} {plan.outer_uid} 1\n")
        with open("/proc/self/gid_map", "w") as f:
            f.write(f"{plan.gid} {plan.outer_gid} 1\n")
        L.prctl(L.PR_SET_PDEATHSIG, signal.SIGKILL)  # the keeper dies with the launcher thread
        if os.getppid() != plan.worker_pid:
            os._exit(125)
        life_r, life_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                os.close(life_w)
                _run_as_pid1(plan, status_w, body, lifeline_fd=life_r)
            except BaseException as exc:  # noqa: BLE001
                _report_failure(status_w, plan.fds[2], exc)
            os._exit(127)
        os.close(life_r)
        os.close(status_w)
        status_w = -1
        for fd in set(plan.fds):
            os.close(fd)
        try:  # only a tiny python loop from here on: become a cheap keeper
            L.capset_none()
        except OSError:
            pass
        while True:
            try:
                _, status = os.waitpid(pid, 0)
                break
            except ChildProcessError:
                os._exit(127)
            except InterruptedError:
                continue
        if os.WIFSIGNALED(status):
            os._exit(128 + os.WTERMSIG(status))
        os._exit(os.waitstatus_to_exitcode(status) & 0xFF)
    except BaseException as exc:  # noqa: BLE001
        _report_failure(status_w, plan.fds[2], exc)
    os._exit(127)


def _high_fd(fd: int) -> int:
    """Move ``fd`` above 2 (it must survive the dup2s onto 0..2); keeps CLOEXEC."""
    if fd > 2:
        return fd
    import fcntl

    new = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3)
    os.close(fd)
    return new


# --------------------------------------------------------------------------------------------- parent side
_own_pidns_fd: int | None = None


def spawn(plan: SandboxPlan, body: Callable[[], None] | None = None) -> tuple[int, float, str | None]:
    """Fork the env per ``plan``; return ``(pid, setup_ms, error)``. Call on the launcher thread.

    ``body=None`` execs ``plan.argv``; otherwise ``body()`` runs inside the finished sandbox
    (template/fork mode). Waits until the child has exec'd (or ``body`` is about to run) or failed.
    """
    start = time.perf_counter()
    status_r, status_w = os.pipe()
    try:
        if plan.mode == "root":
            global _own_pidns_fd
            if _own_pidns_fd is None:
                _own_pidns_fd = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
            L.unshare(L.CLONE_NEWPID)  # this thread's next child is PID 1 of a new namespace
            try:
                pid = os.fork()
            except BaseException:
                L.setns(_own_pidns_fd, L.CLONE_NEWPID)
                raise
            if pid == 0:
                _child_root(plan, status_w, body)  # never returns
            L.setns(_own_pidns_fd, L.CLONE_NEWPID)
        else:
            pid = os.fork()
            if pid == 0:
                _child_userns(plan, status_w, body)  # never returns
    except BaseException:
        os.close(status_r)
        os.close(status_w)
        raise
    os.close(status_w)
    data = b""
    deadline = time.monotonic() + _SETUP_TIMEOUT_S
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                data += b"!sandbox setup did not finish in time"
                os.kill(pid, signal.SIGKILL)
                break
            poller = select.poll()  # not select(): a worker with many envs has fds above 1024
            poller.register(status_r, select.POLLIN)
            ready = poller.poll(int(left * 1000) + 1)
            if not ready:
                continue
            chunk = os.read(status_r, 65536)
            if not chunk:
                break
            data += chunk
    finally:
        os.close(status_r)
    error = None
    if b"!" in data:
        error = data.split(b"!", 1)[1].decode("utf-8", "replace").strip() or "sandbox setup failed"
    return pid, (time.perf_counter() - start) * 1e3, error


# --------------------------------------------------------------------------------------------- the backend
class NamespaceBackend:
    """Envs in sandboxes of Linux namespaces this module builds (see the module doc).

    ``gate``: who answers the syscalls an env's filter hands to the worker (as root; see
    :class:`~.base.ListenerGate`). With one, each env gets a control socket (memory snapshots) and a
    filter that hands the copies' set-up calls to the gate; without one, the plain deny-list.
    """

    name = "namespaces"

    def __init__(self, use_seccomp: bool = True, gate: ListenerGate | None = None) -> None:
        self.use_seccomp = use_seccomp
        self.gate = gate
        self._static: dict | None = None

    # ---------------------------------------------------------------- probing
    def available(self) -> tuple[bool, str]:
        mode, why = self.mode()
        return (mode is not None), why

    def mode(self) -> tuple[str | None, str]:
        """``("root" | "userns", detail)`` or ``(None, reason)``; probed once, by a real sandboxed launch."""
        return probed_mode((self.name, self.use_seccomp, self.gate is not None), self._do_probe)

    def _do_probe(self) -> tuple[str | None, str]:
        if not sys.platform.startswith("linux"):
            return None, "not Linux"
        if not L.SUPPORTED:
            return None, f"no syscall table for {L.MACHINE}"
        candidates = (["root"] if os.geteuid() == 0 else []) + ["userns"]
        return first_working_mode(
            candidates,
            lambda spec, mode: self._launch(spec, mode, use_cgroup=False),
            works="probe sandbox started in {ms:.1f} ms",
        )

    # ---------------------------------------------------------------- report
    def report(self) -> IsolationReport:
        mode, why = self.mode()
        if mode is None:
            return IsolationReport(self.name, {"available": False}, (why,))
        cg, cg_why = cgroups.probe() if mode == "root" else (None, "no cgroup delegation without root")
        sec = self.use_seccomp and seccomp.supported()
        props = sandbox_properties(
            mode, cg, sec, process_limit="RLIMIT_NPROC", dedicated_uid=mode == "root", tree_kill="pid namespace"
        )
        notes = [why]
        if mode == "userns":
            notes.append("runs as the worker's own uid (mapped); limits by rlimits only")
        if not cg and mode == "root":
            notes.append(f"no per-env cgroup: {cg_why}")
        if not sec:
            notes.append(
                "seccomp filter off"
                + ("" if self.use_seccomp else " (disabled)")
                + ("" if seccomp.supported() else f" (no filter for {L.MACHINE})")
            )
        else:
            report_speculation(props, notes, passes_flag=True)
        return IsolationReport(self.name, props, tuple(notes))

    # ---------------------------------------------------------------- launch
    def _static_parts(self) -> dict:
        if self._static is None:
            self._static = {
                "host": HostLayout.read(),
                "newroot": _ensure_newroot(),
                "seccomp": seccomp.build_filter() if self.use_seccomp else None,
                # (only with a gate to answer the calls it hands to the worker)
                "seccomp_notify": (
                    seccomp.build_filter(notify=seccomp.COPY_SYSCALLS)
                    if self.use_seccomp and self.gate is not None
                    else None
                ),
                "cap_last": L.cap_last_cap(),
            }
        return self._static

    def plan(self, spec: LaunchSpec, mode: str, use_cgroup: bool = True) -> SandboxPlan:
        st = self._static_parts()
        if mode == "root":
            uid = gid = env_uid(spec)
        else:
            uid, gid = os.getuid(), os.getgid()
        host: HostLayout = st["host"]
        files = {
            "/etc/passwd": f"root:x:0:0:root:/root:/usr/sbin/nologin\n"
            f"env:x:{uid}:{gid}:boltzlabs env:{SANDBOX_WORKSPACE}:/usr/sbin/nologin\n",
            "/etc/group": f"root:x:0:\nenv:x:{gid}:\n",
            "/etc/hosts": f"127.0.0.1 localhost {HOSTNAME}\n::1 localhost\n",
            "/etc/hostname": HOSTNAME + "\n",
        }
        cg = None
        if mode == "root" and use_cgroup:
            cg = cgroups.env_cgroup(spec.limits.memory_bytes, spec.limits.pids, tag=str(spec.index))
        return SandboxPlan(
            mode=mode,
            newroot=st["newroot"],
            binds=host.binds(spec),
            files=files,
            symlinks=host.symlinks,
            uid=uid,
            gid=gid,
            outer_uid=os.getuid(),
            outer_gid=os.getgid(),
            limits=spec.limits,
            env=sandboxed_environment(spec),
            argv=list(spec.argv),
            fds=(spec.stdin_fd, spec.stdout_fd, spec.stderr_fd),
            cgroup=cg,
            seccomp_prog=st["seccomp"],
            seccomp_notify_prog=st["seccomp_notify"],
            cap_last=st["cap_last"],
            sched=scheduling_policy(),
            worker_pid=os.getpid(),
            extra_mkdirs=[SANDBOX_RUNTIME],
            aslr=spec.aslr,
        )

    def launch(self, spec: LaunchSpec) -> Launched:
        return self._launch(spec, working_mode(self.name, self.mode()))

    def _launch(self, spec: LaunchSpec, mode: str, use_cgroup: bool = True) -> Launched:
        start = time.perf_counter()
        plan = self.plan(spec, mode, use_cgroup=use_cgroup)
        ours = None
        if mode == "root":
            os.chown(spec.workspace, plan.uid, plan.gid)
            os.chmod(spec.workspace, 0o700)
            if plan.seccomp_notify_prog is not None:  # a control socket: memory snapshots (see envside.memory_snapshot)
                ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                ours.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
                plan.control_fd = theirs.detach()
                plan.env[MEMORY_SNAPSHOTS_ENV] = "1"
        try:
            pid, _, error = LAUNCHER.call(lambda: spawn(plan))
        except BaseException:
            if plan.cgroup is not None:
                plan.cgroup.remove()
            if ours is not None:
                ours.close()
            raise
        finally:
            if plan.control_fd >= 0:
                os.close(plan.control_fd)
        cg = plan.cgroup

        # PID 1 of the namespace (root) or the keeper (userns)
        launched = launched_tree(pid, cg, start, error)
        if ours is not None:
            self._take_listener(launched, ours, cg)
        return launched

    def _take_listener(self, launched: Launched, ours: socket.socket, cg) -> None:
        """The env sent its filter's listener before its exec: the worker answers it from now on, and
        keeps the socket as the env's control socket."""
        ours.settimeout(0.0)
        try:
            msg, fds = recv_fds_passcred(ours)
        except OSError:
            msg, fds = b"", []
        if msg != b"ok" or len(fds) != 1 or self.gate is None:
            for fd in fds:
                os.close(fd)
            ours.close()
            return
        self.gate.watch(fds[0])
        ours.settimeout(None)
        plain_cleanup = launched.cleanup

        def cleanup() -> None:
            ours.close()
            plain_cleanup()

        launched.control, launched.cgroup, launched.cleanup = ours, cg, cleanup

    # ---------------------------------------------------------------- memory snapshots (see envside.memory_snapshot)
    def copies_unavailable(self) -> str | None:
        """Why this backend's envs cannot take memory snapshots at all, or None."""
        if self.mode()[0] != "root" or not self.use_seccomp or not seccomp.supported() or self.gate is None:
            return (
                "memory snapshots need the namespaces backend running as root with its seccomp filter "
                "(the filter hands the copies' set-up to the worker)"
            )
        return None


__all__ = ["NamespaceBackend", "SandboxPlan", "enter_sandbox", "spawn", "LAUNCHER"]
