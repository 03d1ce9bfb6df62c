"""Memory snapshots, the launcher's side: swapping an env with its holder, forking copies from it.

A :class:`SnapshotLauncher` makes the memory snapshots of one env launcher's envs (boltz mode's
:class:`~boltzlabs_gym.worker.template.TemplateLauncher` owns one; the worker makes one for a
session of the namespaces backend in root mode): it arms the seccomp gate around each operation,
hands the env and the holder their sockets and descriptors, moves each copy into its slot's cgroup
and tracks the processes, which are not the worker's children (see
:mod:`boltzlabs_gym.envside.memory_snapshot` for the env's side, :mod:`.holders` for the handles).
What it needs of its env launcher is passed in: why that launcher's envs cannot be copied at all,
where their cgroups wait to be removed, and a count of its live envs.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import time
from collections.abc import Callable
from typing import Any

from ..sandbox.base import (
    MEMORY_SNAPSHOTS_ENV,
    SANDBOX_WORKSPACE,
    Launched,
    LaunchSpec,
    readable,
    recv_fds_passcred,
    recv_pid,
    sandboxed_environment,
)
from ..sandbox.cgroups import Graveyard
from .gate import Gate

#: seconds the holder and the copy may take until the copy's sandbox is ready.
COPY_TIMEOUT = 5.0


class CopyError(RuntimeError):
    """A memory snapshot's swap or copy could not be made; the message says why."""


def _no_count(delta: int) -> None:
    pass


class SnapshotLauncher:
    """The memory snapshots of one env launcher's envs (see the module doc).

    ``why_not()``: why that launcher's envs cannot take memory snapshots at all, or None;
    ``graveyard``: where the copies' cgroups wait when they cannot be removed at once, which the
    env launcher retries (None: removed at once, waiting if need be); ``count_live(+1 | -1)``: a
    copy started, or was cleaned up (the env launcher's count of its live envs).
    """

    def __init__(
        self,
        gate: Gate,
        why_not: Callable[[], str | None],
        graveyard: Graveyard | None = None,
        count_live: Callable[[int], None] = _no_count,
    ) -> None:
        self.gate = gate
        self._why_not = why_not
        self._graveyard = graveyard
        self._count_live = count_live

    def memory_snapshots_unavailable(self, launched: Launched | None, region_inode: int | None = None) -> str | None:
        """Why the env ``launched`` cannot take a memory snapshot, or None. ``region_inode``: its
        sealed observation region, the one shared writable mapping allowed (every copy drops it
        before it serves, and is checked for that)."""
        why = self._why_not()
        if why:
            return why
        if launched is None or launched.control is None:
            return "this env has no control socket (its sandbox has no seccomp filter to gate the copies' set-up)"
        from .gate import children_of

        kids = children_of(launched.pid)
        if kids is None:
            return "the kernel does not list the env's child processes (/proc/<pid>/task/*/children)"
        if kids:
            return (
                f"the env has {len(kids)} child process(es), which a fork would not copy (and which could "
                "reach the copies): end them first"
            )
        status = _status(launched.pid)
        if status.get("Threads") != "1":
            return (
                f"the env has {status.get('Threads', '?')} threads, and a fork keeps only one: set OMP_NUM_THREADS=1, "
                "OPENBLAS_NUM_THREADS=1 and MKL_NUM_THREADS=1 (before numpy is imported)"
            )
        shared = _shared_writable_mappings(launched.pid, region_inode)
        if shared:
            return (
                f"the env has shared writable memory ({', '.join(shared[:3])}), which its copies would share "
                "with it: unmap it before the snapshot"
            )
        return None

    def begin_swap(self, launched: Launched, nonce: str):
        """Before a memory snapshot request (whose ``swap`` key is ``nonce``): hand the env the
        continued source's socket and arm the gate for the env's forks. Returns the worker's
        end of that socket."""
        _drain(launched.control)  # whatever the env's own code queued on its control socket
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        try:
            # (never blocks: an env that filled its control socket's queue is refused, not waited for)
            socket.send_fds(launched.control, [b"swap" + nonce.encode()], [theirs.fileno()], socket.MSG_DONTWAIT)
        except OSError:
            ours.close()
            raise
        finally:
            theirs.close()
        self.gate.arm(launched.pid)
        return ours

    def end_swap(self, launched: Launched, ours, swapped: bool, workspace_copy: str):
        """After the env answered: ``(continued_source_launched, holder)`` when it swapped, else None.

        The holder stays in the slot's cgroup (moving a process between cgroups costs an RCU grace
        period, several ms): the continued source is signalled through its pidfd alone, and the
        cgroup is removed once both have let go of it (:class:`~.holders.SharedCgroup`)."""
        from ...envside import syscalls as L
        from .holders import Holder, SharedCgroup

        self.gate.disarm(launched.pid)
        if not swapped:
            ours.close()
            return None
        try:
            ours.settimeout(0.0)  # (it said so before it answered: no waiting here)
            msg, pid = recv_pid(ours)
            if msg != b"p" or not pid:
                raise CopyError(f"the continued source did not say who it is ({msg[:20]!r})")
            # both ran the env's own code while they swapped: check what they are before using them
            why = unconfined(pid)
            holder_status = _status(launched.pid)
            if why is None and holder_status.get("Threads") != "1":
                why = "the holder has more than one thread"
            if why:
                raise CopyError(f"the continued source is not confined as it must be ({why})")
        except BaseException:
            ours.close()
            raise
        try:  # the holder pins its copies' namespaces: an OOM kill must pick another process
            with open(f"/proc/{launched.pid}/oom_score_adj", "w") as f:
                f.write("-1000")
        except OSError:
            pass
        shared = None
        if launched.cgroup is not None:
            shared = SharedCgroup(launched.cgroup, self._graveyard, users=2)
        holder = Holder(
            pid=launched.pid,
            pidfd=L.pidfd_open(launched.pid),
            control=launched.control,
            cgroup=shared,
            workspace=workspace_copy,
            uid=int(holder_status["Uid"]),  # (the real ids: the first of each line)
            gid=int(holder_status["Gid"]),
        )
        source = self._foreign_launched(pid, ours, None, launched.paths, launched.oom_killed, shared=shared)
        return source, holder

    def start_copy(self, holder, spec: LaunchSpec, batch: list) -> Launched:
        """Ask ``holder`` to fork a copy for ``spec``'s env (its workspace already filled); returns a
        Launched that :meth:`finish_copies` completes. ``batch`` collects the copies started together."""
        from ...envside import syscalls as L
        from ..sandbox import cgroups
        from .gate import children_of

        start = time.perf_counter()
        if not batch:  # one arming for the whole batch: the holder's children before any of them
            if self._graveyard is not None:
                self._graveyard.retry()
            kids = children_of(holder.pid)
            if kids is None:
                raise CopyError("the kernel does not list the holder's child processes")
            known = frozenset(kids)
            self.gate.arm(holder.pid, known)
        else:
            known = batch[0].known
        os.chown(spec.workspace, holder.uid, holder.gid)  # a copy keeps its source's uid
        os.chmod(spec.workspace, 0o700)
        env = sandboxed_environment(spec)
        env[MEMORY_SNAPSHOTS_ENV] = "1"
        cg = cgroups.env_cgroup(spec.limits.memory_bytes, spec.limits.pids, tag=str(spec.index))
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        placeholder = Launched(pid=0, kill_tree=lambda: None)
        pending = _PendingCopy(placeholder, ours, cg, start, {"env_dir": env["BOLTZLABS_ENV_DIR"]}, known)
        batch.append(pending)
        tree = -1
        try:
            tree = L.open_tree_clone(spec.workspace)
            L.mount_setattr_fd(tree, L.MOUNT_ATTR_NOSUID | L.MOUNT_ATTR_NODEV)
            req = {
                "index": spec.index,
                "env": env,
                "workspace": SANDBOX_WORKSPACE,
                "limits": spec.limits.to_json(),
                "cgroup": cg is not None,
            }
            socket.send_fds(
                holder.control,
                [b"fork" + json.dumps(req).encode()],
                [spec.stdin_fd, spec.stdout_fd, spec.stderr_fd, theirs.fileno(), tree],
            )
        except OSError as exc:
            pending.error = f"the snapshot's holder is gone ({exc})"
        finally:
            theirs.close()
            if tree >= 0:
                os.close(tree)
        return placeholder

    def finish_copies(self, holder, batch: list) -> None:
        """Complete the copies :meth:`start_copy` asked for, all at once: each says who it is, is
        moved into its slot's cgroup (back to back: the moves after the first are cheap) and
        finishes its sandbox. A copy that fails gets ``setup_error`` on its Launched."""
        from ...envside import syscalls as L
        from .gate import parent_of

        deadline = time.monotonic() + COPY_TIMEOUT
        waiting = {p.ours.fileno(): p for p in batch if p.error is None}
        try:
            while waiting:
                ready = readable(list(waiting), max(0.0, deadline - time.monotonic()))
                if not ready:
                    for p in waiting.values():
                        p.error = f"the snapshot's holder did not fork a copy within {COPY_TIMEOUT:g} s"
                    break
                for fd in ready:
                    p = waiting[fd]
                    try:
                        p.ours.setblocking(False)
                        msg, pid = recv_pid(p.ours)
                    except OSError as exc:
                        msg, pid = b"!" + str(exc).encode(), None
                    # three words, each stamped with its sender's pid by the kernel: "p" from the
                    # holder's fork X (moved into the slot's cgroup, then "go": the copy is forked
                    # there), "p" from the copy (its pid), "ok" when its sandbox is finished; or "!why"
                    if msg.startswith(b"!") or not msg:
                        p.error = msg[1:].decode("utf-8", "replace") or "the copy died during set-up"
                    elif msg == b"p" and p.forker == 0:
                        if not pid or parent_of(pid) != holder.pid or pid in p.known:
                            p.error = f"the snapshot's holder reported an impossible fork pid {pid}"
                        else:
                            p.forker = pid
                            if p.cg is not None:
                                for path in p.cg.join_files:
                                    with open(path, "w") as f:
                                        f.write(str(pid))
                            p.ours.send(b"go")
                            continue
                    elif msg == b"p" and p.pid == 0:
                        parent = parent_of(pid) if pid else None
                        # the forker's child (or, once the forker is gone, the holder's), and new
                        if not pid or pid in p.known or pid == p.forker or parent not in (p.forker, holder.pid):
                            p.error = f"the snapshot's holder reported an impossible copy pid {pid}"
                        else:
                            p.pid = pid
                            p.pidfd = L.pidfd_open(pid)  # from here on the copy is named by its pidfd
                            continue
                    elif msg == b"ok" and p.pid:
                        why = unconfined(p.pid) or _still_shares(p.pid)
                        if why:
                            p.error = f"the copy is not confined as it must be ({why})"
                        else:
                            p.done = True
                    else:
                        why = msg[1:].decode("utf-8", "replace") if msg.startswith(b"!") else "it died during set-up"
                        p.error = f"the copy could not finish its sandbox: {why}"
                    del waiting[fd]
        except Exception as exc:  # noqa: BLE001 - every copy still waiting failed with it
            for p in waiting.values():
                p.error = f"{type(exc).__name__}: {exc}"
        finally:
            self.gate.disarm(holder.pid)
        for p in batch:
            self._settle_copy(p)

    def _settle_copy(self, p: _PendingCopy) -> None:
        from ...envside import syscalls as L

        if p.error is None and p.done:
            self._count_live(1)
            oom = p.cg.oom_killed if p.cg is not None else (lambda: False)
            real = self._foreign_launched(
                p.pid, p.ours, p.cg, {**p.paths, "workspace": SANDBOX_WORKSPACE}, oom, pidfd=p.pidfd
            )
            real.setup_ms = (time.perf_counter() - p.start) * 1e3
            p.launched.__dict__.update(real.__dict__)
            return
        if p.pidfd >= 0:
            try:
                L.pidfd_send_signal(p.pidfd, signal.SIGKILL)
            except OSError:
                pass
            os.close(p.pidfd)
        if p.cg is not None:
            p.cg.remove()
        p.ours.close()
        p.launched.setup_error = p.error or "the copy did not finish its set-up"

    def _foreign_launched(
        self, pid: int, control, cg, paths: dict, oom_killed, shared=None, pidfd: int = -1
    ) -> Launched:
        """A Launched for an env process that is not the worker's child (a memory snapshot's copy,
        or a source that continued in a nested sandbox): signalled through a pidfd, never by pid.
        ``cg``: its own cgroup (killed with it, removed after); ``shared``: a cgroup it shares with
        its holder (never signalled: the pidfd kill ends its whole PID namespace)."""
        from ...envside import syscalls as L

        if pidfd < 0:
            pidfd = L.pidfd_open(pid)
        done: list[bool] = []

        def kill_tree() -> None:
            try:
                L.pidfd_send_signal(pidfd, signal.SIGKILL)
            except OSError:
                pass
            if cg is not None:
                cg.signal_all()

        def cleanup() -> None:
            if done:
                return
            done.append(True)
            self._count_live(-1)
            control.close()
            os.close(pidfd)
            if cg is not None:
                if self._graveyard is None:
                    cg.remove()
                else:
                    self._graveyard.bury(cg)
            if shared is not None:
                shared.drop()

        return Launched(
            pid=pid,
            kill_tree=kill_tree,
            cleanup=cleanup,
            oom_killed=oom_killed,
            paths=paths,
            control=control,
            cgroup=cg,
            child=False,
        )


@dataclasses.dataclass(eq=False)
class _PendingCopy:
    """A memory snapshot's copy between its fork request and its finished sandbox."""

    launched: Launched
    ours: socket.socket
    cg: Any  # the copy's EnvCgroup, or None
    start: float
    paths: dict
    known: frozenset = frozenset()  # the holder's children before the batch (its live copies)
    forker: int = 0  # the holder's fork that makes the copy's namespaces
    pid: int = 0
    pidfd: int = -1
    done: bool = False
    error: str | None = None


def _drain(sock: socket.socket) -> None:
    """Discard whatever is queued on ``sock`` (closing any descriptors it carried)."""
    timeout = sock.gettimeout()
    sock.settimeout(0.0)  # (a socket with a timeout waits for input before a MSG_DONTWAIT read)
    try:
        for _ in range(1000):
            try:
                msg, fds = recv_fds_passcred(sock, 8)
            except OSError:  # nothing queued (BlockingIOError), or the env closed its end
                return
            for fd in fds:
                os.close(fd)
            if not msg and not fds:
                return
    finally:
        sock.settimeout(timeout)


def _status(pid: int) -> dict[str, str]:
    """``/proc/<pid>/status`` as a dict of its first fields ({} when the process is gone)."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                out[key] = value.strip().split()[0] if value.strip() else ""
    except OSError:
        return {}
    return out


def _shared_writable_mappings(pid: int, except_inode: int | None = None) -> list[str]:
    """The process's shared writable mappings (MAP_SHARED memory, SysV shm): a fork shares them;
    but for those of the file ``except_inode`` (its observation region)."""
    found = []
    skip = str(except_inode) if except_inode is not None else None
    try:
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                if len(fields) >= 2 and fields[1][1] == "w" and fields[1][3] == "s":
                    if skip is not None and len(fields) > 4 and fields[4] == skip:
                        continue
                    found.append(fields[5].strip() if len(fields) > 5 else fields[0])
    except OSError:
        return ["(unreadable)"]
    return found


def _still_shares(pid: int) -> str | None:
    """A copy must map no shared writable memory (the only kind its source could have had is its
    observation region, which the copy drops before it says it is ready)."""
    shared = _shared_writable_mappings(pid)
    return f"it still maps shared writable memory ({', '.join(shared[:3])})" if shared else None


_NO_CAPS = "0000000000000000"


def unconfined(pid: int) -> str | None:
    """What is wrong with a continued source or copy before it is used (it ran the env's own code
    while it built its sandbox): any capability, no no_new_privs, no seccomp filter, a thread; None if fine."""
    st = _status(pid)
    if not st:
        return "it is gone"
    wrong = [
        f"{key} {st.get(key)!r}"
        for key, want in (("CapEff", _NO_CAPS), ("CapBnd", _NO_CAPS), ("CapPrm", _NO_CAPS),
                          ("NoNewPrivs", "1"), ("Seccomp", "2"), ("Threads", "1"))
        if st.get(key) != want
    ]  # fmt: skip
    return ", ".join(wrong) or None
