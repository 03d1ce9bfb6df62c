"""Memory snapshots, the worker's side: the held processes, and the workspace each one froze.

A memory snapshot is a process (the *holder*: the env as it was, see
:mod:`boltzlabs_gym.worker.cowfork`) plus a copy of its workspace taken while the env was idle.
:class:`Holder` is the worker's handle on one: its pid (a pidfd, so a later process that reuses
the pid is never signalled), its control socket (a fork request goes there; closing it releases
the holder), its own cgroup, and the workspace copy. The holder is PID 1 of the namespace its
copies live under, so a release only closes the socket: the holder exits after its last copy.
"""

from __future__ import annotations

import os
import shutil
import signal
import stat
from dataclasses import dataclass
from typing import Any

from . import memory

__all__ = ["Holder", "copy_workspace"]


class SharedCgroup:
    """A cgroup that two processes' owners share (a holder and the source that continued from it):
    removed (through the launcher's graveyard, which retries) when the last of them lets go."""

    def __init__(self, cgroup: Any, graveyard: list, users: int, remove_now: bool = False) -> None:
        self.cgroup, self.graveyard, self.users, self.remove_now = cgroup, graveyard, users, remove_now

    def drop(self) -> None:
        self.users -= 1
        if self.users == 0:
            if self.remove_now:  # (waits, bounded, for the last processes to leave)
                self.cgroup.remove()
            else:
                self.graveyard.append(self.cgroup)

    def signal_all(self) -> None:
        self.cgroup.signal_all()


@dataclass(eq=False)
class Holder:
    """One held memory snapshot on this worker."""

    pid: int
    pidfd: int
    control: Any  # socket.socket
    cgroup: Any  # SharedCgroup (the source slot's, shared with the continued source) or None
    workspace: str  # the frozen copy of the env's workspace (host path)
    uid: int = 0  # the env's (host) uid and gid: its copies keep them
    gid: int = 0
    released: bool = False
    nbytes: int = 0  # what it counts against the worker's snapshot budget (set when held)
    _cgroup_dropped: bool = False

    def pss(self) -> int:
        """Bytes of memory the holder alone accounts for (its proportional share of shared pages)."""
        return memory.pid_pss(self.pid)

    def alive(self) -> bool:
        from .forkserver import readable

        if self.pidfd >= 0 and not readable([self.pidfd], 0):
            return True
        self.gone()
        return False

    def release(self) -> None:
        """Let the holder go: it exits once its last copy has (copies live in namespaces under its)."""
        if self.released:
            return
        self.released = True
        try:
            self.control.close()
        except OSError:
            pass
        shutil.rmtree(self.workspace, ignore_errors=True)

    def gone(self) -> None:
        """The holder has exited (or was killed): let go of its share of the cgroup and its pidfd."""
        if not self._cgroup_dropped and self.cgroup is not None:
            self._cgroup_dropped = True
            self.cgroup.drop()
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1

    def kill(self) -> None:
        """Kill the holder now, and with it every copy made from it (its session is ending)."""
        if self.pidfd >= 0:
            from .sandbox import _linux as L

            try:
                L.pidfd_send_signal(self.pidfd, signal.SIGKILL)
            except OSError:
                pass
        if self.cgroup is not None:
            self.cgroup.signal_all()
        self.release()
        self.gone()


def copy_workspace(src: str, dst: str) -> int:
    """Copy the tree ``src`` into the empty directory ``dst``: files, directories and symlinks with
    their modes, owners and times (hard links become separate files; other file types are skipped).
    Returns the bytes copied. Runs as the worker (root), on a tree only the env wrote: symlinks are
    copied as links, never followed."""
    total = 0
    for root, dirs, files in os.walk(src):
        rel = os.path.relpath(root, src)
        out = dst if rel == "." else os.path.join(dst, rel)
        for name in dirs + files:
            s = os.path.join(root, name)
            d = os.path.join(out, name)
            st = os.lstat(s)
            if stat.S_ISLNK(st.st_mode):
                os.symlink(os.readlink(s), d)
            elif stat.S_ISDIR(st.st_mode):
                os.mkdir(d, 0o700)
            elif stat.S_ISREG(st.st_mode):
                shutil.copyfile(s, d, follow_symlinks=False)
                total += st.st_size
            else:
                continue
            os.chown(d, st.st_uid, st.st_gid, follow_symlinks=False)
            if not stat.S_ISLNK(st.st_mode):
                os.chmod(d, stat.S_IMODE(st.st_mode))
        dirs[:] = [n for n in dirs if not os.path.islink(os.path.join(root, n))]
    for root, dirs, _files in os.walk(dst, topdown=False):  # times last: writing into a directory changes its mtime
        for name in dirs:
            _copy_times(os.path.join(src, os.path.relpath(os.path.join(root, name), dst)), os.path.join(root, name))
    for root, _dirs, files in os.walk(dst):
        for name in files:
            _copy_times(os.path.join(src, os.path.relpath(os.path.join(root, name), dst)), os.path.join(root, name))
    st = os.stat(src)
    os.chown(dst, st.st_uid, st.st_gid)
    os.chmod(dst, stat.S_IMODE(st.st_mode))
    return total


def _copy_times(src: str, dst: str) -> None:
    try:
        st = os.lstat(src)
        os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)
    except OSError:
        pass
