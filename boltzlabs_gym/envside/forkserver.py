"""The boltz template's own side: the fork loop it runs and the steps that turn a fork into an env.

This module runs inside the template process (a fresh interpreter started by
:class:`~boltzlabs_gym.worker.template.TemplateLauncher`), never in the worker. It is the
template's entry point: :data:`TEMPLATE_BOOTSTRAP` installs :func:`template_main` as the env
side's fork hook (:func:`boltzlabs_gym.envside.process_setup.install_template_hook`) and then runs the env's
``env.py``, whose :func:`boltzlabs_gym.env.serve` enters the hook once the env is imported. The
env side never imports this module: dependencies point from here to it. It imports nothing
of the worker's launcher, so the template and every env forked from it carry only what
serving needs. The protocol and the sandbox each fork builds are described in
:mod:`boltzlabs_gym.worker.template`.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys

from ..wire.limits import Limits
from . import fork_hooks, process_setup
from .confine import (
    CONTROL_FD,
    SANDBOX_ENV_DIR,
    SANDBOX_WORKSPACE,
    apply_rlimits,
    mount_points,
    readable,
    set_comm,
    vacate_fd,
)
from .memory_snapshot import mount_private_tmp

#: fds the template finds its control socket and the worker's lifeline on.
CTL_FD = 3
LIFELINE_FD = 4

#: process names (comm) of a template and of the envs forked from it.
TEMPLATE_COMM = "boltz-template"
ENV_COMM = "boltz-env"
SPARE_COMM = "boltz-spare"
#: inside the template's user namespace: the template is uid 0, its envs uid ENV_INSIDE_UID.
ENV_INSIDE_UID = 1000

#: The template's interpreter (``python -c``): install the fork loop as the env side's hook, then
#: run env.py as __main__ (like a spawned env); its serve() forks.
TEMPLATE_BOOTSTRAP = (
    "import os,runpy,sys\n"
    "from boltzlabs_gym.envside.forkserver import install\n"
    "install()\n"
    "d=os.environ['BOLTZLABS_ENV_DIR']\n"
    "sys.path.insert(0,d)\n"
    "sys.argv=[os.path.join(d,'env.py')]\n"
    "runpy.run_path(sys.argv[0],run_name='__main__')\n"
    "sys.stderr.write('boltzlabs boltz template: env.py returned without calling "
    'boltzlabs_gym.env.serve() or gym_start.serve_factories(); mode="boltz" needs one of them '
    '(use mode="default" for an env that speaks the line protocol itself)\\n\')\n'
    "sys.exit(3)\n"
)


def install() -> None:
    """Make :func:`template_main` the fork loop that ``serve()`` enters.

    See :mod:`~boltzlabs_gym.envside.process_setup`.
    """
    process_setup.install_template_hook(template_main)


def _threads() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Threads:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1


def _open_fds() -> set[int]:
    try:
        return {int(x) for x in os.listdir("/proc/self/fd")}
    except OSError:
        return set(range(3, 256))


def template_main() -> None:
    """The fork loop. Returns only in a forked env (with its channel on fds 0/1/2); the template
    process itself exits here when the worker closes the control socket."""
    import gc

    kind = os.environ.get("BOLTZLABS_TEMPLATE", "process")
    ctl = socket.socket(fileno=CTL_FD)
    set_comm(TEMPLATE_COMM)  # forks share the template's argv; the name tells them apart in ps
    ns = kind == "ns"
    filt = None
    if ns:
        from . import seccomp
        from . import syscalls as L  # noqa: F401 - loaded before the sandbox hides the package

        # the copies' calls are allowed here: the template's filter below hands every nested user
        # namespace to the worker, and without one an env process has no capability for them. A
        # clone into a new PID namespace is no more than the unshare and fork it allows (the code
        # runner's zygote makes each program's PID 1 so, in a user namespace of its own)
        filt = seccomp.build_filter(
            deny=tuple(n for n in seccomp.DENY if n not in seccomp.COPY_SYSCALLS), clone_allow_flags=L.CLONE_NEWPID
        )
    import_fds = _open_fds() - {0, 1, 2, CTL_FD, LIFELINE_FD}
    std_ids = {}
    for i in (0, 1, 2):
        st = os.fstat(i)
        std_ids[(st.st_dev, st.st_ino)] = i
    import_std = {}  # import-time copies of fds 0/1/2 (``os.dup(1)``): the env's own channel in a fork
    for fd in list(import_fds):
        try:
            st = os.fstat(fd)
        except OSError:
            import_fds.discard(fd)  # the listdir fd itself
            continue
        if (st.st_dev, st.st_ino) in std_ids:
            import_std[fd] = std_ids[(st.st_dev, st.st_ino)]
            import_fds.discard(fd)
    bindings = _per_env_bindings()
    global _MOUNT_POINTS
    # (every fork's mount namespace starts as a copy of this one: read its mount table once, here)
    _MOUNT_POINTS = mount_points() if ns else None
    gc.collect()
    gc.freeze()
    n = _threads()
    if n > 1:
        ctl.send(
            f"!the template has {n} threads after importing the env; a fork keeps only the calling "
            "thread, so forked envs would be broken. Do not start threads at import (set "
            "OMP/OPENBLAS/MKL_NUM_THREADS=1), or use mode='default'".encode()
        )
        os._exit(4)
    # one thread (checked here, and again before each launch's fork): the spares need no thread
    # bookkeeping from the standard library's at-fork hooks (each restores them first)
    fork_hooks.suspend()
    ctl.send(b"ready")
    spare: socket.socket | None = None
    want_spare = True
    while True:
        if spare is None and want_spare:
            # fork the next env ahead of its request (a "spare"), so a launch or hard reset does not
            # wait for two forks and the namespace set-up: only for the hand-over and the last steps.
            # The worker asks for it ("spare") once a launch is done, so that this CPU work does not
            # compete with the launch in flight.
            got = _fork_spare(ctl, ns)
            if isinstance(got, tuple):  # we are the spare, and now an env: back into serve()
                req, fds = got
                _become_env(req, fds, ns, filt, import_fds, import_std, bindings)
                return
            spare = got
        want_spare = False
        try:
            msg, fds, _flags, _addr = socket.recv_fds(ctl, 1 << 20, 8)
        except InterruptedError:
            continue
        if not msg:
            os._exit(0)
        if msg == b"spare":
            want_spare = True
            for fd in fds:
                os.close(fd)
            continue
        if len(fds) < 4:
            for fd in fds:
                os.close(fd)
            continue
        csock_fd = fds[3]
        n = _threads()
        if n > 1:
            _send_fd(
                csock_fd,
                f"!the template has {n} threads at fork time (something started a thread "
                "after import); refusing to fork a broken env. Use mode='default'".encode(),
            )
        else:
            for attempt in range(2):
                if spare is None:
                    got = _fork_spare(ctl, ns)
                    if isinstance(got, tuple):
                        req, sfds = got
                        _become_env(req, sfds, ns, filt, import_fds, import_std, bindings)
                        return
                    spare = got
                try:
                    socket.send_fds(spare, [msg], fds)
                    break
                except OSError as exc:  # the spare died (killed?): fork another one
                    spare.close()
                    spare = None
                    if attempt:
                        _send_fd(csock_fd, f"!could not hand the env to a forked process: {exc}".encode())
            if spare is not None:
                spare.close()
                spare = None
        for fd in fds:
            os.close(fd)


def _fork_spare(ctl: socket.socket, ns: bool):
    """Fork a spare env, a child of the worker (a subreaper) and, with namespaces, PID 1 of its own
    PID namespace. In the template: returns the socket that hands it its request. In the spare:
    waits for the request and returns ``(request, fds)``."""
    global _double_fork_cause
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    if _double_fork_cause is None:
        try:
            from . import syscalls as L

            pid = L.fork_sibling(L.CLONE_NEWPID if ns else 0)
        except OSError as exc:
            _double_fork_cause = f"{exc}"  # every env forked from now on tells the worker (see _become_env)
        else:
            if pid == 0:
                try:
                    os.close(ours.detach())
                    return _spare_wait(ctl, theirs, ns)
                except BaseException:  # noqa: BLE001 - the template sees a dead spare and forks another
                    os._exit(0)
            theirs.close()
            return ours
    return _double_fork_spare(ctl, ns, ours, theirs)


#: Why spares are double-forked (:func:`_double_fork_spare`), once a clone was refused; None before.
_double_fork_cause: str | None = None


def _double_fork_spare(ctl: socket.socket, ns: bool, ours: socket.socket, theirs: socket.socket):
    """:func:`_fork_spare` where a clone with ``CLONE_PARENT`` is refused: an intermediate child
    forks the spare (after ``unshare(CLONE_NEWPID)``, so the spare is PID 1 of its namespace) and
    exits at once, so the spare is re-parented to the worker."""
    pid = os.fork()
    if pid == 0:
        try:
            os.close(ours.detach())
            if ns:
                from . import syscalls as L

                L.unshare(L.CLONE_NEWPID)
            if os.fork() == 0:
                return _spare_wait(ctl, theirs, ns)
        except BaseException:  # noqa: BLE001 - the template sees a dead spare and forks another
            pass
        os._exit(0)
    theirs.close()
    while True:
        try:
            os.waitpid(pid, 0)
            break
        except InterruptedError:
            continue
        except ChildProcessError:
            break
    return ours


def _spare_wait(ctl: socket.socket, sock: socket.socket, ns: bool):
    """In the spare: the request-independent part of the sandbox, then block for a request."""
    fork_hooks.restore()
    fd = ctl.detach()
    os.close(fd)
    set_comm(SPARE_COMM)
    try:
        if ns:
            from . import syscalls as L

            L.unshare(L.CLONE_NEWNS | L.CLONE_NEWNET | L.CLONE_NEWIPC | L.CLONE_NEWUTS)
            L.sethostname("boltzlabs")
            L.mount("proc", "/proc", "proc", L.MS_NOSUID | L.MS_NODEV | L.MS_NOEXEC)
        while True:
            try:
                msg, fds, _flags, _addr = socket.recv_fds(sock, 1 << 20, 8)
                break
            except InterruptedError:
                continue
    except BaseException:  # noqa: BLE001
        os._exit(0)
    if not msg:
        os._exit(0)  # the template is gone (or closed us): nobody will ever need this spare
    sock.close()
    return json.loads(msg), fds


def _first_message() -> bytes:
    """A forked env's first message to the worker, which the kernel stamps with the env's host pid
    (``SO_PASSCRED`` on the worker's end): ``p``, or ``p:`` and why it took a double fork (the
    worker logs it once)."""
    cause = _double_fork_cause
    return b"p" if cause is None else b"p:" + cause.encode("utf-8", "replace")[:500]


def _send_fd(fd: int, data: bytes) -> None:
    try:
        os.write(fd, data)
    except OSError:
        pass


def _become_env(
    req: dict, fds: list[int], ns: bool, filt, import_fds: set[int], import_std: dict[int, int], bindings: list
) -> None:
    """In the forked env: finish its sandbox, then become an ordinary env process."""
    stdin_fd, stdout_fd, stderr_fd, csock_fd = fds[:4]
    tree = fds[4] if ns and len(fds) > 4 else -1
    set_comm(ENV_COMM)
    try:
        os.write(csock_fd, _first_message())
        if os.read(csock_fd, 16) != b"go":
            os._exit(0)
        limits = Limits.from_json(req.get("limits"))
        if ns:
            from . import syscalls as L

            # (the spare already has its own mount, net, IPC and UTS namespaces and /proc)
            if req.get("cgroup"):
                L.unshare(L.CLONE_NEWCGROUP)  # after the worker moved us: rooted at our own cgroup
            mount_private_tmp(int(limits.tmpfs_bytes), _MOUNT_POINTS)
            L.move_mount_fd(tree, SANDBOX_WORKSPACE)
            os.close(tree)
            tree = -1
            L.drop_bounding_caps(L.cap_last_cap())
            os.setgroups([])
            os.setresgid(ENV_INSIDE_UID, ENV_INSIDE_UID, ENV_INSIDE_UID)
            os.setresuid(ENV_INSIDE_UID, ENV_INSIDE_UID, ENV_INSIDE_UID)  # clears every capability
            L.capset_none()
            L.prctl(L.PR_SET_NO_NEW_PRIVS, 1)
            L.prctl(L.PR_SET_DUMPABLE, 1)
            L.prctl(L.PR_SET_PDEATHSIG, signal.SIGKILL)  # our parent is the worker now
        else:
            os.setsid()
            import ctypes

            ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
        if readable([LIFELINE_FD], 0):
            os._exit(125)  # the worker is gone (its lifeline closed) before PDEATHSIG was armed
        os.close(LIFELINE_FD)
        have_cg = bool(req.get("cgroup"))
        apply_rlimits(limits, memory_via_rlimit=not have_cg, pids_via_rlimit=not have_cg)
        os.chdir(req["workspace"])
        if filt is not None:  # (only built for the namespaces kind)
            from . import seccomp

            seccomp.install(filt)
        # the channel stays open as the env's control socket for memory snapshots (see cowfork)
        keep_control = ns and filt is not None and CONTROL_FD not in import_fds | set(import_std)
        if keep_control:  # (what the env's import opened keeps its number; the fds we were sent need not)
            stdin_fd, stdout_fd, stderr_fd, csock_fd = vacate_fd(CONTROL_FD, [stdin_fd, stdout_fd, stderr_fd, csock_fd])
        os.write(csock_fd, b"ok" if keep_control else b"ok-")
        if keep_control:
            os.dup2(csock_fd, CONTROL_FD, inheritable=False)
        os.close(csock_fd)
    except BaseException as exc:  # noqa: BLE001 - never fall back into the template's loop
        msg = f"boltzlabs boltz env setup failed: {type(exc).__name__}: {exc}"
        _send_fd(stderr_fd, (msg + "\n").encode())
        _send_fd(csock_fd, ("!" + msg).encode())
        os._exit(127)
    from .confine import wire_std_fds

    wire_std_fds(stdin_fd, stdout_fd, stderr_fd)
    for fd in (stdin_fd, stdout_fd, stderr_fd):
        if fd > 2:
            os.close(fd)
    # descriptors the env's import opened: point them at /dev/null (a shared offset or socket would
    # link siblings; closing them could let a stale file object close a later, unrelated fd)
    if import_fds:
        null = os.open(os.devnull, os.O_RDWR)
        for fd in import_fds:
            if fd != null:
                try:
                    os.dup2(null, fd, inheritable=False)
                except OSError:
                    pass
        if null not in import_fds:
            os.close(null)
    for fd, std in import_std.items():
        os.dup2(std, fd, inheritable=False)
    for fd in _open_fds() - {0, 1, 2, CONTROL_FD} - import_fds - set(import_std):
        try:
            os.close(fd)
        except OSError:
            pass
    _set_environment(req["env"])
    env = req["env"]
    _rebind(
        bindings,
        int(req["index"]),
        env.get("BOLTZLABS_ENV_DIR", SANDBOX_ENV_DIR),
        env.get("BOLTZLABS_WORKSPACE", SANDBOX_WORKSPACE),
    )
    _reseed()
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # as Python sets it at start-up
    if ns and _fd_open(CONTROL_FD):
        from . import memory_snapshot as cowfork

        cowfork.install(ENV_INSIDE_UID)


def _set_environment(env: dict[str, str]) -> None:
    """Make ``os.environ`` exactly ``env``, changing only what differs from the template's (most of
    it is the same): ``clear()`` then ``update()`` cost every env a few hundred microseconds."""
    environ = os.environ
    for key in [key for key in environ if key not in env]:
        del environ[key]
    for key, value in env.items():
        if environ.get(key) != value:
            environ[key] = value


#: The template's mount points (namespaces kind), read once before it forks (see template_main).
_MOUNT_POINTS: list[str] | None = None


def _fd_open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def _per_env_bindings() -> list[tuple[dict, str, int]]:
    """In the template, once: every module global bound to ``ENV_INDEX``/``ENV_DIR``/``WORKSPACE``.

    Scanning here rather than in each fork matters: touching every module global in a fork
    would copy the pages of all those objects (reference counts) into every env.
    """
    which = {id(process_setup.ENV_INDEX): 0, id(process_setup.ENV_DIR): 1, id(process_setup.WORKSPACE): 2}
    found = []
    for mod in list(sys.modules.values()):
        d = getattr(mod, "__dict__", None)
        if not isinstance(d, dict):
            continue
        for key, value in list(d.items()):
            if isinstance(value, (process_setup.PerEnvInt, process_setup.PerEnvStr)) and id(value) in which:
                found.append((d, key, which[id(value)]))
    return found


def _rebind(bindings: list[tuple[dict, str, int]], index: int, env_dir: str, workspace: str) -> None:
    """Point ``ENV_INDEX``/``ENV_DIR``/``WORKSPACE`` (every module global bound to them at import) at this env's values.

    The env side itself (:mod:`boltzlabs_gym.envside.process_setup`) is one of those modules; it leaves template mode
    when the fork loop returns into ``serve()``.
    """
    values = (index, env_dir, workspace)
    for d, key, which in bindings:
        d[key] = values[which]


def _reseed() -> None:
    import random

    random.seed()
    np = sys.modules.get("numpy")
    if np is not None:
        try:
            np.random.seed()
        except Exception:  # noqa: BLE001
            pass


__all__ = ["TEMPLATE_BOOTSTRAP", "install", "readable", "template_main"]
