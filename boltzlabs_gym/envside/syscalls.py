"""Thin ctypes wrappers for the Linux calls the sandbox needs (Python 3.11 has no ``os.unshare``).

Only syscalls and constants; no policy. Every wrapper raises :class:`OSError` with the
errno and the call that failed. Syscall numbers are known for x86_64 and aarch64; on other
architectures :data:`SUPPORTED` is false and the namespace backend reports itself
unavailable.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import signal

MACHINE = os.uname().machine  # (what platform.machine() reads, without importing platform)

_SYSCALLS = {
    "x86_64": {
        "pivot_root": 155,
        "unshare": 272,
        "setns": 308,
        "capset": 126,
        "mount_setattr": 442,
        "pidfd_open": 434,
        "seccomp": 317,
        "open_tree": 428,
        "move_mount": 429,
        "clone": 56,
    },
    "aarch64": {
        "pivot_root": 41,
        "unshare": 97,
        "setns": 268,
        "capset": 91,
        "mount_setattr": 442,
        "pidfd_open": 434,
        "seccomp": 277,
        "open_tree": 428,
        "move_mount": 429,
        "clone": 220,
    },
}
SUPPORTED = MACHINE in _SYSCALLS
_NR = _SYSCALLS.get(MACHINE, {})

CLONE_PARENT = 0x00008000
CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_NOATIME = 1024
MS_NODIRATIME = 2048
MS_BIND = 4096
MS_MOVE = 8192
MS_REC = 16384
MS_PRIVATE = 1 << 18
MS_RELATIME = 1 << 21
MS_STRICTATIME = 1 << 24
MNT_DETACH = 2

ST_NOSUID, ST_NODEV, ST_NOEXEC = 2, 4, 8
ST_NOATIME, ST_NODIRATIME, ST_RELATIME = 1024, 2048, 4096

AT_FDCWD = -100
AT_RECURSIVE = 0x8000
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID, MOUNT_ATTR_NODEV = 0x1, 0x2, 0x4

PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_CAPBSET_DROP = 24
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4


def _load_libc() -> ctypes.CDLL:
    # The usual name first: ctypes.util.find_library runs `ldconfig -p` in a subprocess (about 4 ms,
    # paid by every env that imports this module on a memory snapshot's path).
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


_libc = _load_libc()
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_libc.unshare.argtypes = [ctypes.c_int]
_libc.sethostname.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
_libc.syscall.restype = ctypes.c_long


# The same libc, called with the GIL held (a PyDLL): a clone must not let another thread run Python
# between Python's fork bookkeeping and the fork itself (the template is single-threaded; this keeps it so).
_libc_gil = ctypes.PyDLL(_libc._name, use_errno=True)
_libc_gil.syscall.restype = ctypes.c_long
_libc_gil.syscall.argtypes = [ctypes.c_long, ctypes.c_ulong] + [ctypes.c_void_p] * 4


def _err(what: str) -> OSError:
    e = ctypes.get_errno()
    return OSError(e, f"{what}: {os.strerror(e)}")


def _b(s: str | None) -> bytes | None:
    return None if s is None else os.fsencode(s)


def unshare(flags: int) -> None:
    if _libc.unshare(flags) != 0:
        raise _err(f"unshare({flags:#x})")


def _glibc() -> bool:
    try:
        return bool(os.confstr("CS_GNU_LIBC_VERSION"))
    except (ValueError, OSError):
        return False


_GLIBC = _glibc()


def fork_sibling(flags: int = 0) -> int:
    """``os.fork()`` whose child is a child of this process's parent (``CLONE_PARENT``), with
    ``flags`` added (``CLONE_NEWPID``: the child is PID 1 of a new PID namespace); returns 0 in the
    child and its pid in this process, as ``os.fork`` does (:func:`fork_with`, ``CLONE_PARENT`` added).

    One process instead of two: without it a child of the parent takes a fork that forks again
    and exits (a double fork), and a new PID namespace takes ``unshare`` in that middle process.
    Python's own fork bookkeeping runs around the clone as ``os.fork`` runs it (the at-fork hooks,
    the import lock, the runtime's re-initialisation in the child). glibc's is skipped: the caller
    must be single-threaded (no lock another thread holds can be copied), and in the child glibc's
    cached thread id stays the parent's (glibc >= 2.25 asks the kernel for pids and, to signal
    itself, for the thread id). Raises :class:`OSError` where the kernel refuses (``EINVAL`` for
    the init of a PID namespace, ``EPERM`` without ``CAP_SYS_ADMIN`` for a namespace flag) or
    the architecture or the libc is not one this was checked with (``ENOSYS``); the caller falls
    back to the double fork."""
    return fork_with(flags | CLONE_PARENT)


def fork_with(flags: int) -> int:
    """``os.fork()`` with clone ``flags`` added (``CLONE_NEWPID``: the child is PID 1 of a new PID
    namespace, and this process's own child); the caller must be single-threaded (see
    :func:`fork_sibling`, which is this with ``CLONE_PARENT``)."""
    nr = _NR.get("clone")
    if nr is None:
        raise OSError(errno.ENOSYS, f"clone: no syscall number known for {MACHINE}")
    if not _GLIBC:
        # musl signals itself with the cached thread id, which would name the parent in the child
        raise OSError(errno.ENOSYS, "clone: only with glibc (this libc's raise() uses a cached thread id)")
    api = ctypes.pythonapi
    api.PyOS_BeforeFork()
    # x86_64 and aarch64 take (flags, stack, parent_tid, child_tid or tls, tls or child_tid): stack
    # 0 is "this stack, copied", as fork's; no tid is written anywhere
    pid = _libc_gil.syscall(nr, flags | signal.SIGCHLD, None, None, None, None)
    if pid == 0:
        api.PyOS_AfterFork_Child()
        return 0
    err = ctypes.get_errno()
    api.PyOS_AfterFork_Parent()
    if pid < 0:
        named = f"CLONE_PARENT | {flags & ~CLONE_PARENT:#x}" if flags & CLONE_PARENT else f"{flags:#x}"
        raise OSError(err, f"clone({named}): {os.strerror(err)}")
    return int(pid)


def setns(fd: int, nstype: int) -> None:
    if _libc.setns(fd, nstype) != 0:
        raise _err(f"setns({fd}, {nstype:#x})")


def mount(source: str | None, target: str, fstype: str | None, flags: int = 0, data: str | None = None) -> None:
    if _libc.mount(_b(source), _b(target), _b(fstype), flags, _b(data)) != 0:
        raise _err(f"mount({source!r}, {target!r}, {fstype!r}, {flags:#x})")


def umount2(target: str, flags: int = 0) -> None:
    if _libc.umount2(_b(target), flags) != 0:
        raise _err(f"umount2({target!r})")


def pivot_root(new_root: str, put_old: str) -> None:
    if _libc.syscall(_NR["pivot_root"], _b(new_root), _b(put_old)) != 0:
        raise _err("pivot_root")


def sethostname(name: str) -> None:
    raw = name.encode()
    if _libc.sethostname(raw, len(raw)) != 0:
        raise _err("sethostname")


def prctl(option: int, a2: int = 0, a3: int = 0, a4: int = 0, a5: int = 0) -> int:
    rc = _libc.prctl(option, a2, a3, a4, a5)
    if rc < 0:
        raise _err(f"prctl({option})")
    return rc


def drop_bounding_caps(cap_last: int, keep: frozenset[int] | set[int] = frozenset()) -> None:
    """Drop every capability but ``keep`` from the bounding set (so no exec can regain them)."""
    for cap in range(cap_last + 1):
        if cap in keep:
            continue
        try:
            prctl(PR_CAPBSET_DROP, cap)
        except OSError:  # unknown to this kernel, or already gone
            pass


class _MountAttr(ctypes.Structure):
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


def mount_setattr_recursive_ro(path: str) -> bool:
    """Make ``path`` and every mount below it read-only, nosuid, nodev (Linux >= 5.12).

    Returns False when the call is not available (ENOSYS/EINVAL); raises on other errors.
    """
    attr = _MountAttr(MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV, 0, 0, 0)
    rc = _libc.syscall(_NR["mount_setattr"], AT_FDCWD, _b(path), AT_RECURSIVE, ctypes.byref(attr), ctypes.sizeof(attr))
    if rc == 0:
        return True
    e = ctypes.get_errno()
    if e in (38, 22):  # ENOSYS, EINVAL
        return False
    raise OSError(e, f"mount_setattr({path!r}): {os.strerror(e)}")


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def capset_none() -> None:
    """Clear the effective, permitted and inheritable capability sets of the calling thread."""
    hdr = _CapHeader(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3
    data = (_CapData * 2)()
    if _libc.syscall(_NR["capset"], ctypes.byref(hdr), data) != 0:
        raise _err("capset")


def capset(mask: int) -> None:
    """Set the effective and permitted capability sets of the calling thread to ``mask`` (inheritable: none)."""
    hdr = _CapHeader(0x20080522, 0)
    data = (_CapData * 2)()
    for i in range(2):
        word = (mask >> (32 * i)) & 0xFFFFFFFF
        data[i].effective = data[i].permitted = word
    if _libc.syscall(_NR["capset"], ctypes.byref(hdr), data) != 0:
        raise _err("capset")


OPEN_TREE_CLONE = 1
OPEN_TREE_CLOEXEC = 0o2000000
MOVE_MOUNT_F_EMPTY_PATH = 0x4
AT_EMPTY_PATH = 0x1000


def open_tree_clone(path: str) -> int:
    """A detached copy of the mount at ``path`` (``open_tree(OPEN_TREE_CLONE)``), as an fd (Linux >= 5.2)."""
    fd = _libc.syscall(_NR["open_tree"], AT_FDCWD, _b(path), OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC)
    if fd < 0:
        raise _err(f"open_tree({path!r})")
    return int(fd)


def move_mount_fd(fd: int, target: str) -> None:
    """Attach the detached mount ``fd`` (from :func:`open_tree_clone`) at ``target``."""
    if _libc.syscall(_NR["move_mount"], fd, b"", AT_FDCWD, _b(target), MOVE_MOUNT_F_EMPTY_PATH) != 0:
        raise _err(f"move_mount(-> {target!r})")


def mount_setattr_fd(fd: int, attr_set: int) -> None:
    """Set mount attributes (``MOUNT_ATTR_*``) on the (detached) mount ``fd``, recursively."""
    attr = _MountAttr(attr_set, 0, 0, 0)
    if (
        _libc.syscall(
            _NR["mount_setattr"], fd, b"", AT_EMPTY_PATH | AT_RECURSIVE, ctypes.byref(attr), ctypes.sizeof(attr)
        )
        != 0
    ):
        raise _err("mount_setattr(fd)")


class _Fprog(ctypes.Structure):
    """``struct sock_fprog``: a seccomp filter's length and instructions. (At module level: a ctypes
    class made anew in each call cost every forked env about 0.1 ms.)"""

    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


SECCOMP_SET_MODE_FILTER = 1
SECCOMP_FILTER_FLAG_TSYNC = 1
#: (Linux 4.17) installing the filter does not make the kernel force its speculation mitigations
#: (Speculative Store Bypass Disable, and STIBP/IBPB) on the process. Kernels before 5.16 force them
#: on every process with a filter by default (``spec_store_bypass_disable=seccomp``,
#: ``spectre_v2_user=seccomp``), which can make CPU-bound Python run up to twice as slow; runc and
#: crun pass this flag by default for the same reason. A host that wants the mitigations everywhere
#: sets them ``=on`` on the kernel command line, which this flag does not override.
SECCOMP_FILTER_FLAG_SPEC_ALLOW = 4
SECCOMP_FILTER_FLAG_NEW_LISTENER = 8
PR_GET_SPECULATION_CTRL = 52
PR_SPEC_STORE_BYPASS = 0
#: Set once a kernel refused :data:`SECCOMP_FILTER_FLAG_SPEC_ALLOW` (older than 4.17): later filters
#: in this process go without it.
spec_allow_refused = False


def _seccomp_filter(flags: int, fprog: _Fprog) -> int:
    """``seccomp(SECCOMP_SET_MODE_FILTER, flags | SPEC_ALLOW, fprog)``; without SPEC_ALLOW where the
    kernel does not know it. The call's result (-1 with errno set on failure)."""
    global spec_allow_refused
    if not spec_allow_refused:
        with_spec_allow = flags | SECCOMP_FILTER_FLAG_SPEC_ALLOW
        r = _libc.syscall(_NR["seccomp"], SECCOMP_SET_MODE_FILTER, with_spec_allow, ctypes.byref(fprog))
        if r >= 0 or ctypes.get_errno() != errno.EINVAL:
            return int(r)
        # EINVAL: an unknown flag (or a bad filter, which the retry below refuses again)
    r = _libc.syscall(_NR["seccomp"], SECCOMP_SET_MODE_FILTER, flags, ctypes.byref(fprog))
    if r >= 0:
        spec_allow_refused = True
    return int(r)


def seccomp_set_filter(prog: bytes, n_instructions: int) -> None:
    """Install the filter on every thread of the process (TSYNC), forcing no speculation mitigation."""
    buf = ctypes.create_string_buffer(prog, len(prog))
    fprog = _Fprog(n_instructions, ctypes.cast(buf, ctypes.c_void_p))
    if _seccomp_filter(SECCOMP_FILTER_FLAG_TSYNC, fprog) != 0:
        raise _err("seccomp(SET_MODE_FILTER)")


def seccomp_set_filter_listener(prog: bytes, n_instructions: int) -> int:
    """Install a filter with ``SECCOMP_FILTER_FLAG_NEW_LISTENER``; return the listener fd (CLOEXEC)."""
    buf = ctypes.create_string_buffer(prog, len(prog))
    fprog = _Fprog(n_instructions, ctypes.cast(buf, ctypes.c_void_p))
    # (no TSYNC: the caller is single-threaded, and TSYNC with a listener needs TSYNC_ESRCH)
    fd = _seccomp_filter(SECCOMP_FILTER_FLAG_NEW_LISTENER, fprog)
    if fd < 0:
        raise _err("seccomp(SET_MODE_FILTER, NEW_LISTENER)")
    return fd


def store_bypass_control() -> int:
    """``prctl(PR_GET_SPECULATION_CTRL, PR_SPEC_STORE_BYPASS)``: this process's Speculative Store
    Bypass state (``PR_SPEC_*`` bits; ``PR_SPEC_FORCE_DISABLE`` = 8), or -1 where the kernel has no
    such control."""
    r = _libc.prctl(PR_GET_SPECULATION_CTRL, PR_SPEC_STORE_BYPASS, 0, 0, 0)
    return int(r) if r >= 0 else -1


PIDFD_SIGNAL_NR = {"x86_64": 424, "aarch64": 424}


def pidfd_send_signal(pidfd: int, sig: int) -> None:
    """Signal the process ``pidfd`` refers to (never a later process that reuses its pid)."""
    if _libc.syscall(PIDFD_SIGNAL_NR.get(MACHINE, 424), pidfd, sig, None, 0) != 0:
        raise _err("pidfd_send_signal")


def pidfd_open(pid: int) -> int:
    fd = _libc.syscall(_NR["pidfd_open"], pid, 0)
    if fd < 0:
        raise _err(f"pidfd_open({pid})")
    return int(fd)


def locked_mount_flags(path: str) -> int:
    """Per-mount flags a bind remount must repeat (inside a user namespace they are locked)."""
    f = os.statvfs(path).f_flag
    flags = 0
    if f & ST_NOSUID:
        flags |= MS_NOSUID
    if f & ST_NODEV:
        flags |= MS_NODEV
    if f & ST_NOEXEC:
        flags |= MS_NOEXEC
    if f & ST_NOATIME:
        flags |= MS_NOATIME
    elif f & ST_RELATIME:
        flags |= MS_RELATIME
    else:
        flags |= MS_STRICTATIME
    if f & ST_NODIRATIME:
        flags |= MS_NODIRATIME
    return flags


def cap_last_cap() -> int:
    try:
        with open("/proc/sys/kernel/cap_last_cap") as f:
            return int(f.read())
    except OSError:
        return 40


def num_threads() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("Threads:"):
                return int(line.split()[1])
    return -1
