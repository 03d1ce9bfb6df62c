"""Memory snapshots, the worker's side: the held processes, and the workspace each one froze.

A memory snapshot is a process (the *holder*: the env as it was, see
:mod:`boltzlabs_gym.envside.memory_snapshot`) plus a copy of its workspace taken while the env was idle.
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

from ..pss import pid_pss
from ..sandbox.cgroups import Graveyard

__all__ = ["Holder", "SharedCgroup", "WorkspaceCopyError", "copy_workspace"]


class SharedCgroup:
    """A cgroup that two processes' owners share (a holder and the source that continued from it):
    removed when the last of them lets go, through the launcher's graveyard (which retries) or,
    without one, at once."""

    def __init__(self, cgroup: Any, graveyard: Graveyard | None, users: int) -> None:
        self.cgroup, self.graveyard, self.users = cgroup, graveyard, users

    def drop(self) -> None:
        self.users -= 1
        if self.users == 0:
            if self.graveyard is None:  # (waits, bounded, for the last processes to leave)
                self.cgroup.remove()
            else:
                self.graveyard.add(self.cgroup)

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
        return pid_pss(self.pid)

    def alive(self) -> bool:
        from ..sandbox.base import readable

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
            from ...envside import syscalls as L

            try:
                L.pidfd_send_signal(self.pidfd, signal.SIGKILL)
            except OSError:
                pass
        if self.cgroup is not None:
            self.cgroup.signal_all()
        self.release()
        self.gone()


class WorkspaceCopyError(Exception):
    """A workspace could not be copied (too big, too deep, or it changed under the copy)."""


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
#: The deepest directory nesting a memory snapshot copies (each level holds one fd while copying).
MAX_COPY_DEPTH = 128


def copy_workspace(src: str, dst: str, max_bytes: int = 1 << 40, max_entries: int = 100_000) -> int:
    """Copy the tree ``src`` into the empty directory ``dst``: files, directories and symlinks with
    their modes, owners and times; hard links stay links (other file types are skipped). Returns the
    bytes copied; :class:`WorkspaceCopyError` past ``max_bytes`` or ``max_entries``.

    The worker runs this as root on a tree an env wrote, so the source is only ever reached through
    directory fds opened with ``O_NOFOLLOW`` (a symlink swapped in for a directory or file mid-copy
    fails the copy; nothing is followed out of the tree). The destination is the worker's own (a
    fresh snapshot directory, or a slot's emptied workspace whose processes are dead), reached by path.
    """
    state: dict[str, Any] = {"bytes": 0, "entries": 0, "links": {}}
    top = os.open(src, _DIR_FLAGS)
    try:
        _copy_dir(top, dst, 0, state, max_bytes, max_entries)
        st = os.fstat(top)
    finally:
        os.close(top)
    os.chown(dst, st.st_uid, st.st_gid)
    os.chmod(dst, stat.S_IMODE(st.st_mode))
    os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns))
    return int(state["bytes"])


def _copy_dir(sfd: int, dst: str, depth: int, state: dict, max_bytes: int, max_entries: int) -> None:
    if depth > MAX_COPY_DEPTH:
        raise WorkspaceCopyError(f"the workspace is nested deeper than {MAX_COPY_DEPTH} directories")
    with os.scandir(sfd) as it:
        names = [entry.name for entry in it]
    for name in names:
        state["entries"] += 1
        if state["entries"] > max_entries:
            raise WorkspaceCopyError(f"the workspace has more than {max_entries} entries")
        out = os.path.join(dst, name)
        st = os.stat(name, dir_fd=sfd, follow_symlinks=False)
        if stat.S_ISLNK(st.st_mode):
            os.symlink(os.readlink(name, dir_fd=sfd), out)
        elif stat.S_ISDIR(st.st_mode):
            os.mkdir(out, 0o700)
            sub = os.open(name, _DIR_FLAGS, dir_fd=sfd)  # (ELOOP if it became a symlink meanwhile)
            try:
                _copy_dir(sub, out, depth + 1, state, max_bytes, max_entries)
                st = os.fstat(sub)
            finally:
                os.close(sub)
        elif stat.S_ISREG(st.st_mode):
            if not _copy_file(sfd, name, out, state, max_bytes):
                continue
        else:
            continue  # fifos, sockets, devices: not workspace content
        os.chown(out, st.st_uid, st.st_gid, follow_symlinks=False)
        if not stat.S_ISLNK(st.st_mode):
            os.chmod(out, stat.S_IMODE(st.st_mode))
        os.utime(out, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)


def _copy_file(sfd: int, name: str, out: str, state: dict, max_bytes: int) -> bool:
    fin = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=sfd)
    try:
        st = os.fstat(fin)
        if not stat.S_ISREG(st.st_mode):
            return False
        key = (st.st_dev, st.st_ino)
        if st.st_nlink > 1 and key in state["links"]:
            os.link(state["links"][key], out)  # a hard link stays one
            return False  # (its owner, mode and times are the first link's)
        fout = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            while True:
                chunk = os.read(fin, 1 << 20)
                if not chunk:
                    break
                state["bytes"] += len(chunk)
                if state["bytes"] > max_bytes:
                    raise WorkspaceCopyError(f"the workspace holds more than {max_bytes} bytes")
                view = memoryview(chunk)
                while view:
                    view = view[os.write(fout, view) :]
        finally:
            os.close(fout)
        if st.st_nlink > 1:
            state["links"][key] = out
        return True
    finally:
        os.close(fin)
