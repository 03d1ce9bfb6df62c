"""A dependency-free seccomp-BPF deny-list, defence in depth behind the namespaces.

Default action ALLOW; the listed syscalls fail with EPERM, ``socket()`` is limited to
the allowed address families (AF_UNIX by default, EAFNOSUPPORT otherwise), ``clone()``
with any namespace flag fails with EPERM and ``clone3`` with ENOSYS (so libc falls back
to ``clone``, whose flags a filter can see). A foreign-architecture syscall entry (the
32-bit ``int 0x80`` path) kills the process, and x32 numbers are refused.

x86_64 only: :func:`build_filter` returns ``None`` elsewhere and the backend reports
``seccomp: False``.
"""

from __future__ import annotations

import errno
import struct

from . import syscalls as _linux

AUDIT_ARCH_X86_64 = 0xC000003E
X32_SYSCALL_BIT = 0x40000000

_LD_W_ABS = 0x20
_JEQ_K = 0x15
_JGE_K = 0x35
_JSET_K = 0x45
_RET_K = 0x06

_RET_ALLOW = 0x7FFF0000
_RET_KILL_PROCESS = 0x80000000
_RET_ERRNO = 0x00050000
_RET_USER_NOTIF = 0x7FC00000

_OFF_NR, _OFF_ARCH, _OFF_ARG0_LO = 0, 4, 16

#: x86_64 syscall numbers.
NR_X86_64 = dict(
    socket=41,
    clone=56,
    clone3=435,
    ptrace=101,
    syslog=103,
    uselib=134,
    personality=135,
    vhangup=153,
    pivot_root=155,
    acct=163,
    settimeofday=164,
    mount=165,
    umount2=166,
    swapon=167,
    swapoff=168,
    reboot=169,
    iopl=172,
    ioperm=173,
    init_module=175,
    delete_module=176,
    quotactl=179,
    lookup_dcookie=212,
    clock_settime=227,
    kexec_load=246,
    add_key=248,
    request_key=249,
    keyctl=250,
    unshare=272,
    perf_event_open=298,
    fanotify_init=300,
    name_to_handle_at=303,
    open_by_handle_at=304,
    setns=308,
    process_vm_readv=310,
    process_vm_writev=311,
    kcmp=312,
    finit_module=313,
    kexec_file_load=320,
    bpf=321,
    userfaultfd=323,
    io_uring_setup=425,
    io_uring_enter=426,
    io_uring_register=427,
    open_tree=428,
    move_mount=429,
    fsopen=430,
    fsconfig=431,
    fsmount=432,
    fspick=433,
    mount_setattr=442,
    chroot=161,
    mq_open=240,
    setpriority=141,
    sched_setparam=142,
    sched_setscheduler=144,
    sched_setaffinity=203,
    ioprio_set=251,
    prlimit64=302,
    sched_setattr=314,
)

DENY = (
    "ptrace",
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "unshare",
    "setns",
    "keyctl",
    "add_key",
    "request_key",
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "kexec_load",
    "kexec_file_load",
    "init_module",
    "finit_module",
    "delete_module",
    "open_by_handle_at",
    "name_to_handle_at",
    "process_vm_readv",
    "process_vm_writev",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "open_tree",
    "move_mount",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "mount_setattr",
    "swapon",
    "swapoff",
    "reboot",
    "acct",
    "syslog",
    "quotactl",
    "settimeofday",
    "clock_settime",
    "iopl",
    "ioperm",
    "uselib",
    "fanotify_init",
    "kcmp",
    "lookup_dcookie",
    "vhangup",
)

_CLONE_NS_FLAGS = (
    _linux.CLONE_NEWUSER
    | _linux.CLONE_NEWPID
    | _linux.CLONE_NEWNET
    | _linux.CLONE_NEWIPC
    | _linux.CLONE_NEWUTS
    | _linux.CLONE_NEWCGROUP
    | _linux.CLONE_NEWNS
)

AF_UNIX = 1


def supported() -> bool:
    return _linux.MACHINE == "x86_64"


#: What a memory snapshot's copy needs to build its own nested sandbox (a user namespace with
#: the others, then ``/proc``, ``/tmp``, ``/dev/shm`` and its workspace). A spawned env's filter
#: built with ``notify=COPY_SYSCALLS`` hands these to the worker (``SECCOMP_RET_USER_NOTIF``)
#: instead of refusing them in the kernel; a boltz env's filter allows them, and the template's
#: own filter below it hands every nested user namespace to the worker
#: (``unshare_notify_flags=CLONE_NEWUSER``): without one, a process of the env has no capability
#: for the other two. The worker refuses them (EPERM, as the plain filter does) except for the
#: processes it is making copies with; see :mod:`.notify`.
COPY_SYSCALLS = ("unshare", "mount", "move_mount")


def build_filter(
    socket_families: tuple[int, ...] = (AF_UNIX,),
    deny: tuple[str, ...] = DENY,
    unshare_deny_flags: int = 0,
    notify: tuple[str, ...] = (),
    unshare_notify_flags: int = 0,
    clone_allow_flags: int = 0,
    arg_rules: tuple[tuple[str, int, str, int], ...] = (),
):
    """Return ``(program_bytes, n_instructions)``, or ``None`` on an unsupported architecture.

    ``arg_rules``: ``(syscall, i, "eq" or "ne", value)``: the call fails with EPERM where the low 32
    bits of its argument ``i`` equal (``"eq"``) or differ from (``"ne"``) ``value`` (the kernel
    reads a pid or a ``which`` as a 32-bit int): the code runner's programs may not aim
    ``prlimit64`` and the scheduling calls at their PID 1.

    ``notify``: syscalls the filter hands to its listener (``SECCOMP_RET_USER_NOTIF``; install it
    with :func:`install_with_listener`) instead of refusing them; the rest of ``deny`` still fails
    with EPERM in the kernel. ``unshare_notify_flags``: likewise for an ``unshare`` whose flags
    include any of these (the boltz template: a nested user namespace), when ``unshare`` is allowed.

    ``unshare_deny_flags``: when ``unshare`` is not in ``deny``, an ``unshare`` whose flags
    (arg0) include any of these fails with EPERM (the boltz template may create PID, mount,
    net, IPC and UTS namespaces for the envs it forks, but no nested user namespace).

    ``clone_allow_flags``: namespace flags a ``clone`` may carry (the boltz template clones each
    spare env into a new PID namespace, which it could make with ``unshare`` and a fork as well);
    any other namespace flag fails with EPERM.
    """
    if not supported():
        return None
    ins: list[tuple[int, int, int, int]] = []  # (code, jt, jf, k); jumps relative to the next one
    ins += [
        (_LD_W_ABS, 0, 0, _OFF_ARCH),
        (_JEQ_K, 1, 0, AUDIT_ARCH_X86_64),
        (_RET_K, 0, 0, _RET_KILL_PROCESS),
        (_LD_W_ABS, 0, 0, _OFF_NR),
        (_JGE_K, 0, 1, X32_SYSCALL_BIT),
        (_RET_K, 0, 0, _RET_ERRNO | errno.ENOSYS),
    ]
    for name in notify:
        ins += [(_JEQ_K, 0, 1, NR_X86_64[name]), (_RET_K, 0, 0, _RET_USER_NOTIF)]
    for name in deny:
        if name not in notify:
            ins += [(_JEQ_K, 0, 1, NR_X86_64[name]), (_RET_K, 0, 0, _RET_ERRNO | errno.EPERM)]
    for name, i, how, value in arg_rules:
        if how not in ("eq", "ne") or not 0 <= i < 6:
            raise ValueError(f"arg rule {(name, i, how, value)!r}: want (syscall, 0-5, 'eq' or 'ne', value)")
        ins += [
            (_JEQ_K, 0, 3, NR_X86_64[name]),  # not this call: on to the number's reload
            (_LD_W_ABS, 0, 0, _OFF_ARG0_LO + 8 * i),
            (_JEQ_K, 0, 1, value) if how == "eq" else (_JEQ_K, 1, 0, value),
            (_RET_K, 0, 0, _RET_ERRNO | errno.EPERM),
            (_LD_W_ABS, 0, 0, _OFF_NR),
        ]
    ins += [(_JEQ_K, 0, 1, NR_X86_64["clone3"]), (_RET_K, 0, 0, _RET_ERRNO | errno.ENOSYS)]
    unshare_flags = unshare_deny_flags or unshare_notify_flags
    if unshare_flags and "unshare" not in deny:
        action = _RET_ERRNO | errno.EPERM if unshare_deny_flags else _RET_USER_NOTIF
        ins += [
            (_JEQ_K, 0, 4, NR_X86_64["unshare"]),
            (_LD_W_ABS, 0, 0, _OFF_ARG0_LO),
            (_JSET_K, 0, 1, unshare_flags),
            (_RET_K, 0, 0, action),
            (_RET_K, 0, 0, _RET_ALLOW),
        ]
    # clone: refuse namespace flags (arg0, low 32 bits)
    ins += [
        (_JEQ_K, 0, 4, NR_X86_64["clone"]),
        (_LD_W_ABS, 0, 0, _OFF_ARG0_LO),
        (_JSET_K, 0, 1, _CLONE_NS_FLAGS & ~clone_allow_flags),
        (_RET_K, 0, 0, _RET_ERRNO | errno.EPERM),
        (_RET_K, 0, 0, _RET_ALLOW),
    ]
    # socket: only the listed families
    n = len(socket_families)
    ins.append((_JEQ_K, 0, n + 3, NR_X86_64["socket"]))
    ins.append((_LD_W_ABS, 0, 0, _OFF_ARG0_LO))
    for i, fam in enumerate(socket_families):
        ins.append((_JEQ_K, n - i, 0, fam))  # -> the ALLOW after the errno return
    ins.append((_RET_K, 0, 0, _RET_ERRNO | errno.EAFNOSUPPORT))
    ins.append((_RET_K, 0, 0, _RET_ALLOW))
    ins.append((_RET_K, 0, 0, _RET_ALLOW))
    return b"".join(struct.pack("HBBI", c, jt, jf, k) for c, jt, jf, k in ins), len(ins)


def install(prog) -> None:
    """Install a filter built by :func:`build_filter` on the calling process (sets no_new_privs)."""
    _linux.prctl(_linux.PR_SET_NO_NEW_PRIVS, 1)
    _linux.seccomp_set_filter(*prog)


def install_with_listener(prog) -> int:
    """Install a ``notify=`` filter on the calling (single-threaded) process; return its listener fd.

    The caller must hand the fd to the worker and close it before any env code runs: a process
    that holds its own listener could approve its own children's calls.
    """
    _linux.prctl(_linux.PR_SET_NO_NEW_PRIVS, 1)
    return _linux.seccomp_set_filter_listener(*prog)
