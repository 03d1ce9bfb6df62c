"""The worker's answer to its envs' gated syscalls (seccomp user notification).

A spawned env's seccomp filter hands ``unshare``, ``mount`` and ``move_mount``
(:data:`~.seccomp.COPY_SYSCALLS`) to a listener the worker holds, and a boltz template's filter
(below every env it forks) hands it every nested user namespace, instead of failing them in the
kernel. :class:`Gate` answers every such call on one thread: **EPERM**, exactly what a
plain filter returns, unless the caller is a process the worker is making a memory snapshot's
copy with at that moment (see :mod:`boltzlabs_gym.envside.memory_snapshot`). So an env that never forks
is refused the same calls as before; the only difference is who says no.

Who is let through, and why user code cannot be
----------------------------------------------
The worker *arms* one process at a time, around one operation it asked for: the env it is
snapshotting (which is then alone in its PID namespace: the worker checked it has no child
process) or the snapshot's holder (which runs no env code from the snapshot on, see
:mod:`boltzlabs_gym.envside.memory_snapshot`). While armed, a call is let through only from a process
whose parent, or grandparent, is the armed process, which did not exist when it was armed
(``known``: the holder's earlier children, that is its live copies, which run env code and are
refused like any env) and which started since the arming (so a copy re-parented to the holder
when its forker exits is refused too). Those are the two processes the armed one forks for the
copy: the one that makes the user namespace and the one that becomes the copy's PID 1. The
worker disarms before it sends the copy (or the continued source) any request, so no env code
runs while a process of its is let through. The parent is read from ``/proc/<pid>/stat`` and
the notification is checked still pending afterwards (``SECCOMP_IOCTL_NOTIF_ID_VALID``), so a
caller that died meanwhile cannot lend its pid to another process. A parent that is gone by the
time its own parent is read (the copy's forker exits right after its fork, and the holder reaps it
at once) is read past: the caller is then the holder's child, and is judged as one.

What a let-through process can do: create a user namespace with PID, mount, net, IPC and UTS
namespaces under it (what any unprivileged user can do on a stock distribution), and mount
inside its own mount namespace. The filter's other refusals stay in force (the filter is
inherited and cannot be removed), and the copy drops every capability before it answers.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import select
import struct
import threading
import time

log = logging.getLogger(__name__)

# ioctls on a seccomp listener (x86_64; the structures are fixed-size there)
_NOTIF_RECV = 0xC0502100  # _IOWR('!', 0, struct seccomp_notif)        (80 bytes)
_NOTIF_SEND = 0xC0182101  # _IOWR('!', 1, struct seccomp_notif_resp)   (24 bytes)
_NOTIF_ID_VALID = 0x40082102  # _IOW('!', 2, __u64)
_NOTIF_SIZE = 80
_FLAG_CONTINUE = 1
#: how often a caller's parentage is read when its parent vanishes between the reads (once re-parented,
#: a second look settles it; the third is for a reaper that was itself exiting)
_LOOKS = 3


def parent_of(pid: int) -> int | None:
    """The parent pid of ``pid`` (from /proc), or None when it is gone."""
    got = _parent_and_start(pid)
    return None if got is None else got[0]


def _parent_and_start(pid: int) -> tuple[int, int] | None:
    """``pid``'s parent and start time (clock ticks since boot), from /proc; None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return int(fields[1]), int(fields[19])
    except (OSError, ValueError, IndexError):
        return None


def _ticks_now() -> int:
    """Now, in the unit of /proc/<pid>/stat's start time (clock ticks since boot)."""
    return int(time.clock_gettime(time.CLOCK_BOOTTIME) * os.sysconf("SC_CLK_TCK"))


def children_of(pid: int) -> set[int] | None:
    """The live children of ``pid``'s threads, or None when the kernel does not say (no
    ``CONFIG_PROC_CHILDREN``, or the process is gone): callers refuse then, never assume none."""
    found: set[int] = set()
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                found.update(int(x) for x in f.read().split())
    except (OSError, ValueError):
        return None
    return found


class Gate:
    """Answers the gated syscalls of every env whose listener it watches, on one daemon thread
    (started when it is given its first listener).

    >>> gate = shared_gate()                                              # doctest: +SKIP
    >>> gate.watch(listener_fd)                  # takes ownership of the fd  # doctest: +SKIP
    >>> gate.arm(holder_pid, known=children_of(holder_pid))  # its new forks pass  # doctest: +SKIP
    >>> gate.disarm(holder_pid)                  # before the copy runs env code  # doctest: +SKIP
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: armed pid -> (its children when armed, when it was armed in /proc start-time ticks)
        self._armed: dict[int, tuple[frozenset[int], int]] = {}
        self._poll = select.poll()
        self._fds: set[int] = set()
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._poll.register(self._wake_r, select.POLLIN)
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ the worker's side
    def watch(self, listener_fd: int) -> None:
        """Answer ``listener_fd``'s notifications from now on; closed once no process uses its filter."""
        with self._lock:
            self._fds.add(listener_fd)
            self._poll.register(listener_fd, select.POLLIN)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="boltzlabs-seccomp-supervisor", daemon=True)
                self._thread.start()
        self._wake()

    def arm(self, pid: int, known: set[int] | frozenset[int] = frozenset()) -> None:
        """Let through the calls of processes ``pid`` forks from now on (not those in ``known``)."""
        with self._lock:
            self._armed[pid] = (frozenset(known), _ticks_now())

    def disarm(self, pid: int) -> None:
        with self._lock:
            self._armed.pop(pid, None)

    # ------------------------------------------------------------------ the thread
    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"w")
        except BlockingIOError:
            pass

    def _run(self) -> None:
        while True:
            try:
                events = self._poll.poll()
            except InterruptedError:
                continue
            for fd, ev in events:
                if fd == self._wake_r:
                    try:
                        os.read(self._wake_r, 4096)
                    except BlockingIOError:
                        pass
                    continue
                if ev & select.POLLIN:
                    self._answer_one(fd)
                elif ev & (select.POLLHUP | select.POLLERR | select.POLLNVAL):
                    self._forget(fd)  # no process uses this filter any more

    def _forget(self, fd: int) -> None:
        with self._lock:
            if fd not in self._fds:
                return
            self._fds.discard(fd)
            self._poll.unregister(fd)
        os.close(fd)

    def _answer_one(self, fd: int) -> None:
        buf = bytearray(_NOTIF_SIZE)
        try:
            fcntl.ioctl(fd, _NOTIF_RECV, buf, True)
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.EINTR):  # the caller died (or was interrupted) first
                return
            log.warning("seccomp listener %d: %s; no longer watched", fd, exc)
            self._forget(fd)
            return
        nid, pid = struct.unpack_from("QI", buf, 0)
        ok = self._may_pass(pid)
        if ok:
            try:  # the caller is still the one that asked: its pid was not reused meanwhile
                fcntl.ioctl(fd, _NOTIF_ID_VALID, bytearray(struct.pack("Q", nid)), True)
            except OSError:
                return
        resp = struct.pack("QqiI", nid, 0, 0 if ok else -errno.EPERM, _FLAG_CONTINUE if ok else 0)
        try:
            fcntl.ioctl(fd, _NOTIF_SEND, bytearray(resp), True)
        except OSError:
            return  # the caller died meanwhile

    def _may_pass(self, pid: int) -> bool:
        with self._lock:
            armed = dict(self._armed)
        if not armed:
            return False
        # The copy's forker exits as soon as it has forked the copy, which may be mid-call: a parent
        # that is gone by the second read was reaped, and the caller is its reaper's child now (the
        # holder's, as PID 1 of their namespace): look again. Each look applies the same rules.
        for _ in range(_LOOKS):
            caller = _parent_and_start(pid)
            if caller is None:
                return False
            parent, started = caller
            # Only a process born after the arming (to the tick) passes: a copy (env code) whose forker
            # exited is re-parented to the holder and is not in ``known`` if that happened since.
            if parent in armed:
                known, armed_at = armed[parent]
                return pid not in known and started >= armed_at - 1
            above = _parent_and_start(parent)
            if above is None:
                continue
            if above[0] not in armed:
                return False
            known, armed_at = armed[above[0]]
            return parent not in known and min(started, above[1]) >= armed_at - 1
        return False


_shared: Gate | None = None
_shared_lock = threading.Lock()


def shared_gate() -> Gate:
    """The worker's one gate (its thread starts with the first listener and ends with the process)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = Gate()
        return _shared


__all__ = ["Gate", "children_of", "parent_of", "shared_gate"]
