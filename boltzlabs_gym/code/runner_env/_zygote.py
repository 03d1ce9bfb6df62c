"""A pristine forker: the process every Python program of an env is forked from.

The runner's env handles requests (their code, stdin, files and outputs pass through its heap),
so a program forked from the env itself would inherit a copy of what earlier requests left in
freed memory. The zygote is forked from the env before its first request and never sees one:
per program it receives three integers (which ``main<N>`` to run, the memory limit, the
program's kind: a Python script or a warm language's module, ``env.WARM``) and the
program's stdout/stderr pipes, forks the program, hands the env a pidfd of it, reaps it and
reports its wait status. Whatever a program does, its memory starts as the zygote's, and the
zygote's heap holds nothing of any request. (``fork``, if given, forks each program instead of
``os.fork``: the fresh-namespaces zygote's clone, whose child is PID 1 of a new PID namespace; see
``_fresh``.)

The zygote is protected from the programs it forks (they share its uid): it is not dumpable
(no ``/proc/<pid>/mem``, ``process_vm_writev``, ``pidfd_getfd``; ``ptrace`` is denied by the
sandbox's seccomp filter too), it blocks every signal but SIGKILL and SIGSTOP, and the env checks after each
program that it is alive, not stopped, and that its rlimits, nice value, CPU affinity,
scheduling policy, I/O priority and OOM score are as they were (see ``_wipe``).

A zygote can also fork a **warm zygote** for one kind of program (:meth:`Zygote.fork_warm`): a
child that first runs ``warm(kind)`` (pytest and its plugins imported, say) and then forks that
kind's programs the same way. Python programs keep forking from the lean zygote, so what a warm
zygote imports never weighs on their fork and exit; and since the warm zygote comes from the
zygote, not the env, it has seen no request either: it receives integers, like its parent.

Standard library only; runs inside the sandbox.
"""

from __future__ import annotations

import _signal  # type: ignore[import-not-found]  # (typeshed has no stub; CPython has had it since 3.0)
import os
import select
import signal
import socket
import struct
from collections.abc import Callable

_REQUEST = struct.Struct("!iii")  # main<N>, memory limit in MiB (-1: none), the program's kind
_STATUS = struct.Struct("!i")  # the program's wait status
_ADJUST = -(1 << 30)  # the kind of a request to adjust the zygote itself (Zygote.adjust)
#: signals the zygote blocks (SIGKILL and SIGSTOP cannot be): a program that signals it leaves a
#: pending signal that is never delivered, and each program unblocks them with one call (where
#: ignoring them would cost each program a call per signal to restore its handlers)
_BLOCKED = signal.valid_signals()


class ZygoteGone(RuntimeError):
    """The zygote died or stopped answering; the env must not run another program in place."""


class Zygote:
    """Fork the zygote now (call before the env's first request); ``body(n, memory_mb, out_w, err_w,
    kind)`` runs in each forked program and returns its exit status. ``prepare()``, if given, runs once in
    the zygote before its first program: the state every program shares (set there once, inherited
    by each fork, rather than set up again by every program)."""

    def __init__(
        self,
        body: Callable[[int, int, int, int, int], int],
        prepare: Callable[[], None] | None = None,
        warm: Callable[[int], None] | None = None,
        adjust: Callable[[int], None] | None = None,
        fork: Callable[[], int] | None = None,
    ):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the zygote process
            try:
                ours.close()
                _serve(theirs, body, prepare, warm, adjust, fork or os.fork)
            finally:
                os._exit(0)
        theirs.close()
        self.pid = pid
        self.pidfd = os.pidfd_open(pid)
        self._sock = ours

    @classmethod
    def _adopt(cls, pid: int, pidfd: int, sock: socket.socket) -> Zygote:
        zygote = cls.__new__(cls)
        zygote.pid, zygote.pidfd, zygote._sock = pid, pidfd, sock
        return zygote

    def fork_warm(self, kind: int, timeout: float = 60.0) -> Zygote:
        """A warm zygote for programs of ``kind`` (> 0), forked by this one: it runs the ``warm``
        this zygote was made with, then forks ``kind``'s programs (:meth:`start`)."""
        socket.send_fds(self._sock, [_REQUEST.pack(0, -1, -kind)], [])
        msg, fds = self._recv(timeout, max_fds=2)
        if len(msg) != 1 + _STATUS.size or msg[:1] != b"z" or len(fds) != 2:
            for fd in fds:
                os.close(fd)
            raise ZygoteGone(f"the zygote could not fork a warm zygote ({msg!r})")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET, fileno=fds[0])
        warm = Zygote._adopt(_STATUS.unpack(msg[1:])[0], fds[1], sock)
        msg, fds = warm._recv(timeout)  # (its warm-up done: it is ready for programs)
        if msg != b"r":
            warm.close()
            raise ZygoteGone(f"the warm zygote did not get ready ({msg!r})")
        return warm

    def adjust(self, value: int, timeout: float = 5.0) -> None:
        """Have the zygote run the ``adjust`` it was made with on ``value``, in itself: what every
        program it forks from now on inherits (an integer, like its other requests)."""
        self._sock.send(_REQUEST.pack(value, -1, _ADJUST))
        msg, fds = self._recv(timeout)
        for fd in fds:
            os.close(fd)
        if msg != b"a":
            raise ZygoteGone(f"the zygote did not adjust ({msg!r})")

    def alive(self) -> bool:
        """Whether the zygote still runs (its pidfd is readable once it exits)."""
        return not select.select([self.pidfd], [], [], 0)[0]

    def start(
        self, n: int, memory_mb: int, out_w: int, err_w: int, kind: int = 0, timeout: float = 5.0
    ) -> tuple[int, int]:
        """Fork a program; its pid and a pidfd of it (the caller closes it)."""
        socket.send_fds(self._sock, [_REQUEST.pack(n, memory_mb, kind)], [out_w, err_w])
        msg, fds = self._recv(timeout)
        if len(msg) != 1 + _STATUS.size or msg[:1] != b"p" or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            raise ZygoteGone(f"the zygote could not fork a program ({msg!r})")
        return _STATUS.unpack(msg[1:])[0], fds[0]

    def status(self, timeout: float) -> int:
        """The last program's wait status, once the zygote has reaped it."""
        msg, fds = self._recv(timeout)
        for fd in fds:
            os.close(fd)
        if len(msg) != _STATUS.size:
            raise ZygoteGone("the zygote did not report the program's exit status")
        return _STATUS.unpack(msg)[0]

    def _recv(self, timeout: float, max_fds: int = 1) -> tuple[bytes, list[int]]:
        if not select.select([self._sock], [], [], timeout)[0]:
            raise ZygoteGone(f"the zygote did not answer in {timeout:g} s")
        msg, fds, _flags, _addr = socket.recv_fds(self._sock, 64, max_fds)
        if not msg:
            raise ZygoteGone("the zygote closed its socket")
        return msg, fds

    def close(self) -> None:
        """Kill the zygote (the env is giving up on it)."""
        try:
            os.kill(self.pid, signal.SIGKILL)
        except OSError:
            pass
        self._sock.close()
        os.close(self.pidfd)


def _serve(  # pragma: no cover
    sock: socket.socket,
    body: Callable[[int, int, int, int, int], int],
    prepare: Callable[[], None] | None,
    warm: Callable[[int], None] | None,
    adjust: Callable[[int], None] | None = None,
    fork: Callable[[], int] = os.fork,
) -> None:
    """The zygote: nothing but the socket open, every signal blocked; then its loop."""
    # (_signal's own call: signal's wrapper makes an enum of each signal of the mask it returns,
    # which in a forked program would copy the pages of some sixty enum members)
    unblocked = tuple(_signal.pthread_sigmask(signal.SIG_BLOCK, _BLOCKED))
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    keep = {0, 1, 2, sock.fileno()}
    for name in os.listdir("/proc/self/fd"):
        if int(name) not in keep:
            try:
                os.close(int(name))
            except OSError:
                pass
    if prepare is not None:
        prepare()
    _serve_programs(sock, body, unblocked, warm, adjust, fork)


def _serve_programs(  # pragma: no cover
    sock: socket.socket,
    body: Callable,
    unblocked: tuple[int, ...],
    warm: Callable[[int], None] | None,
    adjust: Callable[[int], None] | None = None,
    fork: Callable[[], int] = os.fork,
) -> None:
    """Fork one program at a time (or, asked with a negative kind, a warm zygote), as asked on ``sock``.

    What a program runs before its body is kept to plain calls: in a forked CPython each object it
    touches copies its page (reference counts), so ``socket.close`` (a Python method) or
    ``signal.pthread_sigmask`` (which turns the old mask into enum members) cost a program tens of
    copied pages where ``os.close`` and ``_signal.pthread_sigmask`` cost one or two."""
    sock_fd = sock.fileno()
    while True:
        msg, fds, _flags, _addr = socket.recv_fds(sock, 64, 2)
        if not msg:
            os._exit(0)
        n, memory_mb, kind = _REQUEST.unpack(msg) if len(msg) == _REQUEST.size else (0, 0, 0)
        if kind == _ADJUST and not fds:
            if adjust is not None:
                adjust(n)
            sock.send(b"a" if adjust is not None else b"!")
            continue
        if kind < 0 and warm is not None and not fds:
            _fork_warm(sock, body, unblocked, warm, -kind, adjust, fork)
            continue
        if len(msg) != _REQUEST.size or len(fds) != 2 or kind < 0:
            for fd in fds:
                os.close(fd)
            sock.send(b"!")
            continue
        out_w, err_w = fds
        pid = fork()
        if pid == 0:
            code = 1
            try:
                os.close(sock_fd)  # (the socket object is never used again: the child ends in _exit)
                _signal.pthread_sigmask(signal.SIG_SETMASK, unblocked)
                code = body(n, memory_mb, out_w, err_w, kind)
            except BaseException:
                pass
            os._exit(code)
        os.close(out_w)
        os.close(err_w)
        pidfd = os.pidfd_open(pid)
        socket.send_fds(sock, [b"p" + _STATUS.pack(pid)], [pidfd])
        os.close(pidfd)
        sock.send(_STATUS.pack(_wait(pid)))


def _fork_warm(  # pragma: no cover
    sock: socket.socket,
    body: Callable,
    unblocked: tuple[int, ...],
    warm: Callable[[int], None],
    kind: int,
    adjust: Callable[[int], None] | None,
    fork: Callable[[], int] = os.fork,
) -> None:
    """Fork a warm zygote for ``kind`` through an intermediate that exits at once, so that it is the
    env's child (PID 1 of the namespace adopts it), which reaps it should it die: this zygote
    waits for its programs only. The intermediate hands the env the warm zygote's socket and a
    pidfd; the warm zygote warms up, says it is ready, and serves programs, forking each as this
    zygote does (``fork``)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    middle = os.fork()
    if middle == 0:
        try:
            pid = os.fork()
            if pid == 0:
                sock.close()
                ours.close()
                warm(kind)
                theirs.send(b"r")
                _serve_programs(theirs, body, unblocked, None, adjust, fork)
            else:
                pidfd = os.pidfd_open(pid)
                socket.send_fds(sock, [b"z" + _STATUS.pack(pid)], [ours.fileno(), pidfd])
        finally:
            os._exit(0)
    ours.close()
    theirs.close()
    _wait(middle)


def _wait(pid: int) -> int:  # pragma: no cover
    """The wait status of this process's child ``pid``, once it has ended."""
    while True:
        try:
            return os.waitpid(pid, 0)[1]
        except InterruptedError:
            continue
