"""Memory snapshots, the env's side: a held fork of the env, and copies forked from it, each in a new sandbox.

Runs in the envs of the namespaces backend, both modes (installed by
:func:`~boltzlabs_gym.envside.forkserver._become_env` in a forked env, by the bootstrap at start in
a spawned one); the worker's side is :mod:`boltzlabs_gym.worker.memory_snapshots.launcher` and
:mod:`boltzlabs_gym.worker.memory_snapshots.holders`. Nothing is serialised: the snapshot *is* a process, and a
copy shares its memory copy-on-write.

Why the source is the one that moves
------------------------------------
A process can only be forked into its own PID namespace or one below it, and a namespace's
processes see (and may signal) everything below them. So a copy forked from a holder that sits
in the source's namespace would be visible to the source. At a snapshot the roles swap instead:

* the env process (PID 1 of its namespace, call it E) forks X, which makes a user namespace
  with PID, mount, IPC and UTS namespaces under it and forks S, PID 1 of the new PID namespace.
  S mounts its own ``/proc``, drops every capability and goes on serving the env's slot: the
  *source continues in S*, with the same pipes, workspace, cgroup and memory;
* E stops serving and becomes the snapshot's **holder**: from the start of the snapshot no env
  code runs in it (every signal is blocked, so no handler of the env's runs; the garbage collector
  is off, so no finaliser runs; its stack stays inside :func:`snapshot`), and it only forks copies
  when the worker asks. It stays in the slot's cgroup. The exception is code the env planted in
  the interpreter *before* the snapshot that runs at a fork (``os.register_at_fork`` hooks, a
  ``pthread_atfork`` callback through ctypes, a replaced ``os.fork``): it runs in E, the holder and
  the processes that make each copy, as at any fork of that state. Such a state is taken over,
  and the snapshot's copies carry it anyway.
* each copy is forked from the holder the same way (X', then C, PID 1 of its own namespaces,
  with a network namespace too), gets the target slot's pipes, a fresh ``/tmp`` and ``/dev/shm``,
  the snapshot's workspace (copied by the worker) at ``/workspace``, and the target slot's cgroup.

Copies and the continued source are siblings under the holder: none can see another, or the
holder. The holder is PID 1 of the old namespace, so it must outlive them all: after a release
it exits once its last copy has.

The user namespaces these steps make go to the worker first (the env's filter in default mode,
the template's in boltz mode, hand them over: see :data:`~boltzlabs_gym.envside.seccomp.COPY_SYSCALLS`);
the worker lets them through only for the processes it expects
(:mod:`~boltzlabs_gym.worker.memory_snapshots.gate`) and checks each continued source and copy is
confined before it uses it (:func:`~boltzlabs_gym.worker.memory_snapshots.launcher.unconfined`). Env code that
makes the same calls is refused, as before. Each copy keeps the env's seccomp filter (inherited:
it cannot be removed), its rlimits and uid.

A copy is exact: the same interpreter, heap, RNG states and open episode. What it does not
carry: other processes (the env must be alone in its namespace), open files other than its
pipes and shared writable memory (both refused: a copy would share them with the source),
pending timers (a fork clears them), ``/tmp``.
"""

from __future__ import annotations

import _signal  # type: ignore[import-not-found]  # (signal without its enum wrappers: see CowForks._hold)
import fcntl
import gc
import json
import os
import random
import select
import signal
import socket
import time
from typing import Any

from ..wire.limits import Limits
from . import obs_region, process_setup
from .confine import CONTROL_FD, SANDBOX_PRIVATE_DIRS, SANDBOX_WORKSPACE, mount_points, set_comm

HOLDER_COMM = "boltz-holder"
ENV_COMM = "boltz-env"  # as forkserver names a forked env
#: The deepest PID namespace an env may take a memory snapshot in: each generation of snapshots nests
#: one user and one PID namespace deeper, and Linux allows 32 of each (the host's and the sandbox's
#: take some). Deeper, the memory kind is refused (``"auto"`` takes a portable snapshot instead).
MAX_DEPTH = 28
#: How long an env waits for the worker's half of a snapshot (the new source's socket).
_SWAP_TIMEOUT_S = 10.0


class MemorySnapshotRefused(Exception):
    """This env cannot take a memory snapshot now (the message says why); nothing changed."""


class CowForks:
    """The env side's memory-snapshot maker.

    What :func:`~boltzlabs_gym.envside.process_setup.memory_snapshots` returns.
    """

    def __init__(self, uid: int) -> None:
        self.uid = uid
        self._fresh_copy = False
        #: at the snapshot: every fd on one of the env's channel pipes, and which (0 requests,
        #: 1 replies, 2 stderr); a copy points the same fds at its own slot's pipes
        self._roles: dict[int, int] = {}
        self._random_state: Any = None
        self._comm = ENV_COMM
        self._sigmask: set = set()  # the env's signal mask when the snapshot began
        self._gc_was_enabled = True
        self._sigchld: Any = None
        from . import syscalls as L

        self._cap_last = L.cap_last_cap()  # (read here, not on a snapshot's path: see _hold)

    # ------------------------------------------------------------------ checks
    def refusal(self, ignore: int | None = None) -> str | None:
        """Why a memory snapshot cannot be taken now, or None (``ignore``: the worker's socket fd)."""
        return self._check(ignore)[0]

    def _check(self, ignore: int | None) -> tuple[str | None, dict[int, int]]:
        """:meth:`refusal`'s answer, and the fds on the env's channel pipes (see :meth:`_classify_fds`)."""
        why = self._refusal_before_fds()
        if why:
            return why, {}
        roles, extra = self._classify_fds(ignore)
        if roles is None:
            return "the env is not serving requests yet", {}
        if extra:
            return (
                f"the env has {len(extra)} open file(s) ({', '.join(extra[:3])}), whose offsets a copy "
                "would share with the source: close them before the snapshot, or take kind='portable'"
            ), {}
        return None, roles

    def _refusal_before_fds(self) -> str | None:
        from . import syscalls as L

        n = L.num_threads()
        if n != 1:
            return (
                f"the env has {n} threads, and a fork keeps only one: set OMP_NUM_THREADS=1, "
                "OPENBLAS_NUM_THREADS=1 and MKL_NUM_THREADS=1 (before numpy is imported), or take kind='portable'"
            )
        depth = _pid_namespace_depth()
        if depth >= MAX_DEPTH:
            return (
                f"the env is {depth} namespaces deep (each memory snapshot nests its continuation one "
                "namespace deeper, and Linux nests at most 32): hard-reset it to start afresh, or take "
                "kind='portable'"
            )
        others = sorted(int(p) for p in os.listdir("/proc") if p.isdigit() and p != "1")
        if others:
            return (
                f"the env has {len(others)} other process(es) in its sandbox, which a fork would not copy "
                "(and which could reach the copies): end them first, or take kind='portable'"
            )
        return None

    def _classify_fds(self, ignore: int | None = None) -> tuple[dict[int, int] | None, list[str]]:
        """``(roles, unexpected)``: the fds on the env's channel pipes (fd -> 0 requests, 1 replies,
        2 stderr), and the open fds that are neither those, ``/dev/null`` nor the control socket."""
        channel = process_setup.channel_fds()
        if channel is None:
            return None, []
        ids = {}
        for role, fd in enumerate((*channel, 2)):
            st = os.fstat(fd)
            ids[(st.st_dev, st.st_ino)] = role
        null = os.stat(os.devnull)
        roles, extra = {}, []
        for name in os.listdir("/proc/self/fd"):
            fd = int(name)
            if fd in (CONTROL_FD, ignore):
                continue
            try:
                st = os.fstat(fd)
            except OSError:
                continue  # the listdir's own descriptor, closed by now
            key = (st.st_dev, st.st_ino)
            if key in ids:
                roles[fd] = ids[key]
            elif (st.st_rdev, st.st_ino) != (null.st_rdev, null.st_ino) or not _is_chr(st):
                try:
                    extra.append(f"fd {fd} -> {os.readlink(f'/proc/self/fd/{fd}')}")
                except OSError:
                    extra.append(f"fd {fd}")
        return roles, extra

    # ------------------------------------------------------------------ the snapshot (in E)
    def snapshot(self, nonce: str = "") -> str:
        """Swap roles with a new process (see the module doc). Returns ``"source"`` in the process
        that now serves the env; in the holder it never returns, except in each copy forked from
        it, where it returns ``"copy"``. :class:`MemorySnapshotRefused` leaves the env as it was.
        ``nonce``: the request's, which the worker's ``swap`` message on the control socket repeats."""
        # From here on no code of the env's runs in this process, which becomes the holder: no
        # signal handler (every signal is blocked; the continued source and the copies get the
        # env's mask back) and no finaliser (the collector is off). So what the check below finds
        # is what the holder has.
        # (signals first: a handler whose signal came just before runs as the call returns, with
        # the collector still on, as anywhere in the env)
        self._sigmask = _signal.pthread_sigmask(_signal.SIG_BLOCK, _signal.valid_signals())
        self._gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            got = _take_swap(nonce.encode())  # (also drops what refused snapshots left queued)
            why, roles = self._check(ignore=got)
            if why or got is None:
                if got is not None:
                    os.close(got)
                raise MemorySnapshotRefused(why or "the worker did not send its half of the snapshot in time")
            self._roles = roles
            self._comm = _comm()
            # Python reseeds its global generator in every fork child (random's at-fork hook): the
            # copies and the continued source put back the state it had here, so they replay it exactly
            self._random_state = random.getstate()
            new_ctl = got
            done_r, done_w = os.pipe()
            x = os.fork()
            if x == 0:  # X: make the namespaces, fork S, exit
                os.close(done_r)
                try:
                    _nest(self.uid, net=False)
                    if os.fork() == 0:
                        self._become_source(new_ctl, done_w)
                        return "source"
                except BaseException as exc:  # noqa: BLE001 - reported to E, which serves on
                    _write(done_w, f"!{type(exc).__name__}: {exc}".encode())
                    os._exit(1)
                os._exit(0)
            os.close(done_w)
            os.close(new_ctl)
            answer = os.read(done_r, 4096)  # each side answers in one write; b"" if both died silent
            os.close(done_r)
            if answer != b"1":
                _wait(x)
                why = answer[1:].decode("utf-8", "replace") if answer.startswith(b"!") else "it died"
                raise MemorySnapshotRefused(f"could not start the env's continuation: {why}")
        except BaseException:  # refused, or failed before the swap: the env serves on as it was
            self._resume_env()
            raise
        return self._hold()

    def _resume_env(self) -> None:
        """Give the env back what :meth:`snapshot` took for the swap: its collector, its signal mask
        (in that order: a signal that waited runs its handler as the env would)."""
        if self._gc_was_enabled:
            gc.enable()
        _signal.pthread_sigmask(_signal.SIG_SETMASK, self._sigmask)

    def _become_source(self, new_ctl: int, done_w: int) -> None:
        """In S: finish the nested sandbox, take the new control socket, say so."""
        from . import syscalls as L

        try:
            L.mount("proc", "/proc", "proc", L.MS_NOSUID | L.MS_NODEV | L.MS_NOEXEC)
            _drop_privileges(self.uid, self._cap_last)
            os.dup2(new_ctl, CONTROL_FD, inheritable=False)
            os.close(new_ctl)
            _announce(CONTROL_FD)
        except BaseException as exc:  # noqa: BLE001
            _write(done_w, f"!{type(exc).__name__}: {exc}".encode())
            os._exit(1)
        random.setstate(self._random_state)
        _write(done_w, b"1")
        os.close(done_w)
        self._resume_env()

    # ------------------------------------------------------------------ the holder (E, from now on)
    # What the holder and the continued source run after the fork writes as few heap pages as it
    # can: every page either side writes becomes a copy the holder keeps (a held snapshot's cost,
    # measured with benchmarks/snapshot.py). So they make os-level calls (no buffered file objects,
    # no enum conversions) and what they need to read (cap_last_cap) is read at install.
    def _hold(self) -> str:
        """Serve the worker's fork requests until released; returns only in a copy."""
        set_comm(HOLDER_COMM)
        null = os.open(os.devnull, os.O_RDWR)
        for name in os.listdir("/proc/self/fd"):  # the slot's pipes are the continued source's now:
            fd = int(name)  # every fd but the control socket goes to /dev/null (its number stays valid)
            if fd not in (CONTROL_FD, null):
                try:
                    os.dup2(null, fd)
                except OSError:
                    pass
        os.close(null)
        # No env code may run here: every signal but SIGCHLD stays blocked (as it has been since the
        # snapshot began: no handler of the env's runs; the copies get the env's mask back) and the
        # env's timers are cancelled. The handlers themselves are left as they are: the copies are
        # forked with them. (The C module's calls, in plain ints: signal's wrappers use enums.)
        for which in (_signal.ITIMER_REAL, _signal.ITIMER_VIRTUAL, _signal.ITIMER_PROF):
            _signal.setitimer(which, 0)
        self._sigchld = _signal.getsignal(_signal.SIGCHLD)
        _signal.signal(_signal.SIGCHLD, _reap_children)
        _signal.pthread_sigmask(_signal.SIG_UNBLOCK, {_signal.SIGCHLD})  # (even if the env had it blocked)
        _reap_children(None, None)  # the swap's helper, if it exited before the handler was set
        try:
            return self._serve_forks()
        except BaseException:  # noqa: BLE001 - whatever it is, it never reaches the env's code
            os._exit(1)

    def _serve_forks(self) -> str:
        ctl = socket.socket(fileno=CONTROL_FD)
        ctl.setblocking(True)
        while True:
            try:
                msg, fds, _flags, _addr = socket.recv_fds(ctl, 1 << 20, 8)
            except OSError:
                break
            if not msg:
                break  # released (the worker closed its end) or the worker is gone
            if not msg.startswith(b"fork") or len(fds) != 5:
                for fd in fds:
                    os.close(fd)
                continue
            x = os.fork()
            if x == 0:
                ctl.detach()
                return self._make_copy(json.loads(msg[4:]), fds)
            for fd in fds:
                os.close(fd)
        ctl.close()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        while True:  # the copies live in namespaces under ours: they end before the holder does
            try:
                os.wait()
            except ChildProcessError:
                break
        os._exit(0)

    def _make_copy(self, req: dict, fds: list[int]) -> str:
        """In X' (forked by the holder): say who we are, make the copy's namespaces, wait until the
        worker has moved us into the slot's cgroup, and fork the copy (born in that cgroup)."""
        stdin_fd, stdout_fd, stderr_fd, csock, tree = fds
        os.close(CONTROL_FD)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        try:
            _announce(csock)  # the worker moves us into the slot's cgroup while we make the namespaces
            _nest(self.uid, net=True)
            if os.read(csock, 16) != b"go":  # moved: the copy is forked into the slot's cgroup
                os._exit(0)
            if os.fork() == 0:
                self._become_copy(req, stdin_fd, stdout_fd, stderr_fd, csock, tree)
                return "copy"
        except BaseException as exc:  # noqa: BLE001
            _write(csock, f"!could not make the copy's namespaces: {type(exc).__name__}: {exc}".encode())
            os._exit(1)
        os._exit(0)

    def _become_copy(self, req: dict, stdin_fd: int, stdout_fd: int, stderr_fd: int, csock: int, tree: int) -> None:
        """In C, PID 1 of its own namespaces: the spare's last steps, then an env of the target slot."""
        from . import syscalls as L

        set_comm(self._comm)  # (forked from the holder, whose name it had)
        try:
            _announce(csock)  # who the copy is (its pid, stamped by the kernel)
            L.mount("proc", "/proc", "proc", L.MS_NOSUID | L.MS_NODEV | L.MS_NOEXEC)
            if req.get("cgroup"):
                L.unshare(L.CLONE_NEWCGROUP)
            mount_private_tmp(int(Limits.from_json(req.get("limits")).tmpfs_bytes))
            L.move_mount_fd(tree, SANDBOX_WORKSPACE)
            os.close(tree)
            os.chdir(req.get("workspace") or SANDBOX_WORKSPACE)
            _drop_privileges(self.uid, self._cap_last)
            # a copy shares its source's memory, never its observation region (the pool reads that
            # as the source's; the worker checks it is gone): bytes until the pool asks for its own
            obs_region.forget()
            os.write(csock, b"ok")
        except BaseException as exc:  # noqa: BLE001
            _write(csock, f"!copy set-up failed: {type(exc).__name__}: {exc}".encode())
            os._exit(127)
        # the fds that were on the source's channel pipes now go to this slot's (the rest of what the
        # holder has is /dev/null); then the descriptors of the hand-over are closed
        new = {0: stdin_fd, 1: stdout_fd, 2: stderr_fd}
        moved = {role: fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 256) for role, fd in new.items()}
        for fd in new.values():
            os.close(fd)
        for fd, role in self._roles.items():
            os.dup2(moved[role], fd, inheritable=fd <= 2)
        os.dup2(csock, CONTROL_FD, inheritable=False)
        os.close(csock)
        for fd in moved.values():
            os.close(fd)
        env = req.get("env") or {}
        os.environ.clear()
        os.environ.update(env)
        random.setstate(self._random_state)
        # the signals as the env had them (the holder blocked them and took SIGCHLD)
        chld = self._sigchld if callable(self._sigchld) or self._sigchld in (signal.SIG_IGN, signal.SIG_DFL) else None
        signal.signal(signal.SIGCHLD, chld if chld is not None else signal.SIG_DFL)
        self._fresh_copy = True
        self._resume_env()

    def take_copy(self) -> bool:
        """Whether this process is a copy that has not answered its restore yet (then it has)."""
        fresh, self._fresh_copy = self._fresh_copy, False
        return fresh


# ---------------------------------------------------------------------------------------------- helpers
def mount_private_tmp(size: int, points: list[str] | None = None) -> None:
    """Fresh size-limited tmpfs ``/tmp``, ``/dev/shm`` and :data:`SANDBOX_PRIVATE_DIRS` (``/mnt``,
    ``/data``, ``/home``): a forked env's, and a memory snapshot copy's.

    A fresh tmpfs would hide what the sandbox binds under its place (an interpreter's tree: a venv
    in /tmp or /home/u, read-only at its own path): those mounts are carried over onto the new tmpfs.
    A place the sandbox bound something over read-only (``LaunchSpec.ro_binds`` onto ``/data``) is
    left as it is: nothing can be written there. ``points``: this mount namespace's mount points
    (:func:`~boltzlabs_gym.envside.confine.mount_points`), where the caller has them already.
    """
    from . import syscalls as L

    plain, no_exec = L.MS_NOSUID | L.MS_NODEV, L.MS_NOSUID | L.MS_NODEV | L.MS_NOEXEC
    if points is None:
        points = mount_points()
    for place, flags in (("/tmp", plain), ("/dev/shm", no_exec), *((d, plain) for d in SANDBOX_PRIVATE_DIRS)):
        if os.statvfs(place).f_flag & os.ST_RDONLY:
            continue  # a read-only bind over the whole place (a data set at /data): the env's, as it is
        under = [(p, os.open(p, os.O_PATH | os.O_CLOEXEC)) for p in _outermost_below(points, place)]
        L.mount("tmpfs", place, "tmpfs", flags, f"size={size},mode=1777")
        for path, held in under:  # bind the hidden tree back from the fd that still reaches it
            os.makedirs(path, exist_ok=True)
            L.mount(f"/proc/self/fd/{held}", path, None, L.MS_BIND | L.MS_REC)
            os.close(held)


def _outermost_below(points: list[str], place: str) -> list[str]:
    """The mount points strictly below ``place`` that no other such point holds (a recursive bind of
    each carries what is mounted inside it): every mount the sandbox made there, not only the
    interpreter's trees (a read-only bind of data under /mnt, say)."""
    below = [p for p in dict.fromkeys(points) if p.startswith(place + "/")]
    return [p for p in below if not any(p.startswith(q + "/") for q in below)]


def _take_swap(nonce: bytes) -> int | None:
    """The continued source's socket from the worker's ``swap`` message for this request (waiting
    for it a while); every other message queued on the control socket is dropped with its fds."""
    ctl = socket.socket(fileno=os.dup(CONTROL_FD))
    found = None
    try:
        ctl.setblocking(False)  # (the file description is shared with CONTROL_FD: reset below)
        p = select.poll()
        p.register(ctl.fileno(), select.POLLIN)
        deadline = time.monotonic() + _SWAP_TIMEOUT_S
        while True:
            try:
                msg, fds, _flags, _addr = socket.recv_fds(ctl, 64, 2)
            except BlockingIOError:
                if found is not None or not nonce or not p.poll(max(0, int((deadline - time.monotonic()) * 1000))):
                    return found
                continue
            except OSError:
                return found
            if not msg and not fds:
                return found  # the worker closed its end
            if found is None and msg == b"swap" + nonce and len(fds) == 1:
                found = fds[0]
                continue
            for fd in fds:
                os.close(fd)
    finally:
        ctl.setblocking(True)
        ctl.close()


def _comm() -> str:
    try:
        with open("/proc/self/comm") as f:
            return f.read().strip() or ENV_COMM
    except OSError:
        return ENV_COMM


def _pid_namespace_depth() -> int:
    """How many PID namespaces deep this process is (0: the host's)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    return len(line.split()) - 2
    except OSError:
        pass
    return 0


def _nest(uid: int, net: bool) -> None:
    """A user namespace (our uid and gid mapped to themselves) with PID, mount, IPC, UTS (and net)
    namespaces owned by it."""
    from . import syscalls as L

    gid = os.getgid()  # (read before: unmapped ids read as the overflow id in the new namespace)
    flags = L.CLONE_NEWUSER | L.CLONE_NEWNS | L.CLONE_NEWPID | L.CLONE_NEWIPC | L.CLONE_NEWUTS
    L.unshare(flags | (L.CLONE_NEWNET if net else 0))
    map_own_ids(uid, gid)


def map_own_ids(uid: int, gid: int) -> None:
    """In a user namespace this process just made: ``uid`` and ``gid`` (read before it was made:
    unmapped ids read as the overflow id in it) mapped to themselves, ``setgroups`` denied."""
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        fd = os.open(f"/proc/self/{name}", os.O_WRONLY)  # (no file object: see CowForks._hold)
        try:
            os.write(fd, text.encode())
        finally:
            os.close(fd)


def _drop_privileges(uid: int, cap_last: int) -> None:
    """Drop what the new user namespace gave (a full capability and bounding set); stay dumpable so
    that a later snapshot can write its own id maps."""
    from . import syscalls as L

    L.drop_bounding_caps(cap_last)
    os.setresgid(os.getgid(), os.getgid(), os.getgid())
    os.setresuid(uid, uid, uid)
    L.capset_none()
    L.prctl(L.PR_SET_DUMPABLE, 1)


def _announce(fd: int) -> None:
    """One byte on the worker's SO_PASSCRED socket: the kernel stamps our pid (as the worker sees it)."""
    os.write(fd, b"p")


def _reap_children(_sig, _frame) -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if not pid:
            return


def _wait(pid: int) -> None:
    try:
        os.waitpid(pid, 0)  # (Python retries it when a signal interrupts it)
    except ChildProcessError:
        pass


def _write(fd: int, data: bytes) -> None:
    try:
        os.write(fd, data)
    except OSError:
        pass


def _is_chr(st: os.stat_result) -> bool:
    import stat

    return stat.S_ISCHR(st.st_mode)


def install(uid: int) -> None:
    """In a freshly started env of the namespaces backend (either mode): memory snapshots from now on."""
    # The syscall helpers a snapshot uses, loaded now (about 2 ms, in a default-mode env; a boltz
    # env has them from its template) rather than on the first snapshot's path.
    from . import syscalls as _linux  # noqa: F401

    process_setup.install_memory_snapshots(CowForks(uid))


__all__ = ["CONTROL_FD", "CowForks", "MemorySnapshotRefused", "install"]
