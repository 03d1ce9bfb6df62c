"""Fresh namespaces per program: every program of an env in PID, mount, IPC and UTS namespaces made
for it alone, with fresh tmpfs mounts over every place it may write.

The code runner's ``wipe=False`` mode. Instead of killing the env after each program and forking a
new one from the template (a hard reset), the env keeps a zygote in a user namespace of its own,
made at every reset, before any request (the worker lets this pool's envs make one:
``PoolOptions.nested_user_namespaces``; the env then refuses them to itself and all it forks later),
and per program:

* the zygote clones **P**, PID 1 of a new PID namespace, which makes the program's mount, IPC and
  UTS namespaces (all owned by the zygote's user namespace, which owns nothing else), mounts a
  fresh tmpfs over ``/workspace``, ``/tmp``, ``/dev/shm``, ``/mnt``, ``/data`` and ``/home`` (the
  read-only trees the sandbox bound inside them, a venv under ``/tmp`` say, carried over) and its
  own ``/proc``; then drops every capability and installs the programs' seccomp filter (no
  ``unshare``, no ``mount``, nothing aimed at PID 1: :data:`PROGRAM_ARG_RULES`), copies in what the
  env staged for the program (its files, its source, its stdin), opens its report, and forks
  **Q**, the program, which runs as a program forked from the wipe path's zygote does
  (``env._zygote_program``); a program of any other language (bash, C++, a JVM's, ``pytest``) is
  compiled and run by P itself with its toolchain, as the env runs it where there are no fresh
  namespaces (``env._run_toolchain``: each command a child of P, its own session and deadline), and
  P hands back both results;
* when Q ends, or at the run's deadline, P kills and reaps every process left in its namespace,
  copies Q's status, the count of unix sockets left in the network namespace and the files the
  request fetches (resolved in the program's own mounts, read as its uid) to the env's staging
  directory, and exits; the namespaces and tmpfs mounts die with it.

So nothing a program can change outlives it: its processes, files, SysV and POSIX IPC objects and
hostname live in namespaces and mounts made for it, and its sockets die with its processes (the
network namespace is the sandbox's own, shared with the env as on the wipe path: a unix socket a
cycle of passed fds keeps past the program gets the env hard-reset, and no program has a
capability there). It never sees the env, the zygote or the staging directory (another PID
namespace; mounts over the places that hold them). Nothing is wiped. The zygote,
forked from the env before its first request, holds nothing of any request; the env only stages
each request's data and reads the results back.

Standard library and the env side's own modules only (it runs inside the sandbox).
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal

from boltzlabs_gym.envside import seccomp
from boltzlabs_gym.envside import syscalls as L
from boltzlabs_gym.envside.confine import SANDBOX_PRIVATE_DIRS, SANDBOX_WORKSPACE
from boltzlabs_gym.envside.memory_snapshot import map_own_ids, mount_private_tmp

#: The env's staging directory, on its own /tmp (hidden from programs by their fresh /tmp)
STAGE = "/tmp/.boltzlabs_fresh"
#: What the env stages for a program: ``in/<key>/...`` is copied into the place of that key
STAGE_IN = os.path.join(STAGE, "in")
#: What P hands back: ``report.json`` (the status, the fetched files)
STAGE_OUT = os.path.join(STAGE, "out")
REQUEST = os.path.join(STAGE, "request")
#: A toolchain program's request (JSON: its language, code, timeouts and limits; the files it
#: brings are staged under ``in/``), which P compiles and runs itself
TOOLCHAIN = os.path.join(STAGE, "toolchain")
#: What P hands back of a toolchain program: its compile and run results (JSON)
RESULTS = os.path.join(STAGE_OUT, "results")
#: Writable place -> its key under ``in/``
PLACES = {SANDBOX_WORKSPACE: "workspace", "/tmp": "tmp", "/dev/shm": "dev_shm"} | {
    d: d.strip("/") for d in SANDBOX_PRIVATE_DIRS
}
#: P's own: mount, IPC and UTS (PID: the clone that made P; net: the zygote's, see :func:`nest`)
_NS_FLAGS = L.CLONE_NEWNS | L.CLONE_NEWIPC | L.CLONE_NEWUTS
#: What a program may not do here on top of the sandbox's filter: make namespaces or mounts
PROGRAM_DENY = ("unshare", "mount", "umount2", "move_mount", "mount_setattr")
#: ... nor change its PID 1 (the same uid: it could): its limits, priority, scheduling and CPUs
#: (which could slow P past the program's deadline), through a process group or a user either
PROGRAM_ARG_RULES = (
    ("prlimit64", 0, "eq", 1),
    ("sched_setaffinity", 0, "eq", 1),
    ("sched_setscheduler", 0, "eq", 1),
    ("sched_setparam", 0, "eq", 1),
    ("sched_setattr", 0, "eq", 1),
    ("setpriority", 0, "ne", 0),  # (PRIO_PROCESS only)
    ("setpriority", 1, "eq", 1),
    ("ioprio_set", 0, "ne", 1),  # (IOPRIO_WHO_PROCESS only)
    ("ioprio_set", 1, "eq", 1),
)


def staged(path: str) -> str:
    """Where the env stages the file a program will find at ``path`` (inside one of :data:`PLACES`)."""
    for place, key in PLACES.items():
        if path.startswith(place + "/"):
            return os.path.join(STAGE_IN, key, path[len(place) + 1 :])
    raise ValueError(f"{path!r} is in none of the places a program may write")


def new_stage() -> None:
    """An empty staging directory for the next program."""
    clear_stage()
    os.makedirs(STAGE_IN, mode=0o700)
    os.makedirs(STAGE_OUT, mode=0o700)


def clear_stage() -> None:
    """Nothing left of the last program's request and report."""
    shutil.rmtree(STAGE, ignore_errors=True)


# The request and the report are NUL-separated fields, not JSON: P is a fork of the zygote, and every
# object it touches copies a page (a request's paths never hold a NUL: env._file_path refuses one).
def write_request(timeout: float, fetch: list[str], max_file_bytes: int, staged_paths: list[str]) -> None:
    """The staged program's request, as P reads it (:func:`read_request`): its deadline, the names
    it fetches, and the paths (as the program sees them) of the files staged for it, to copy in."""
    fields = [repr(float(timeout)), str(int(max_file_bytes)), str(len(staged_paths)), *staged_paths, *fetch]
    with open(REQUEST, "wb") as f:
        f.write(b"\0".join(os.fsencode(x) for x in fields))


def write_toolchain(action: dict) -> None:
    """Stage a toolchain program's request for P (:attr:`Run.toolchain`): the action without the
    contents of its files (they are staged apart; their names stay, a Java program's jars say)."""
    files = {name: "" for name, content in (action.get("files") or {}).items() if isinstance(content, str)}
    with open(TOOLCHAIN, "w", encoding="utf-8") as f:
        json.dump({**action, "files": files, "stdin": ""}, f)


def results() -> dict | None:
    """The compile and run results P handed back of a toolchain program, or None where it did not."""
    try:
        with open(RESULTS, encoding="utf-8") as f:
            out = json.load(f)
    except (OSError, ValueError):
        return None
    return out if isinstance(out, dict) else None


def read_request() -> tuple[float, int, list[str], list[str]]:
    """``(timeout, max_file_bytes, staged paths, fetched names)``, as :func:`write_request` wrote them."""
    fd = os.open(REQUEST, os.O_RDONLY | os.O_CLOEXEC)
    try:
        data = b"".join(iter(lambda: os.read(fd, 1 << 16), b""))
    finally:
        os.close(fd)
    timeout, max_bytes, count, *rest = [os.fsdecode(x) for x in data.split(b"\0")]
    return float(timeout), int(max_bytes), rest[: int(count)], rest[int(count) :]


def report() -> dict | None:
    """What P reported of the last program, or None where it said nothing (P failed before the
    program could start): ``started`` (the program was forked), and once it ended ``status`` (its
    wait status; None where it timed out), ``timed_out``, ``elapsed``, ``sockets`` (the unix
    sockets of the network namespace once the program's processes are gone), ``files`` (the fetched
    ones, name -> base64; ``files_lost`` where they did not fit the env's /tmp); the last five
    missing where P could not write them."""
    try:
        with open(os.path.join(STAGE_OUT, "report"), "rb") as f:
            data = f.read()
    except OSError:
        return None
    if not data.startswith(b"q"):
        return None
    out: dict = {"started": True}
    try:
        _, status, timed_out, elapsed, sockets, *files = data.split(b"\0", 5)
        out.update(
            status=int(status) if status else None,
            timed_out=timed_out == b"1",
            elapsed=float(elapsed),
            sockets=int(sockets),
            files={},
        )
    except ValueError:
        return out
    if files:
        try:
            out["files"] = json.loads(files[0])
        except ValueError:  # (cut short: the env's /tmp had no room for them)
            out["files_lost"] = True
    return out


# ---------------------------------------------------------------------------------- in the zygote
def nest() -> int:
    """In the zygote, once: a user namespace of its own (its uid and gid mapped to themselves), in
    which it holds the capabilities to make each program's namespaces. Returns ``cap_last_cap``."""
    cap_last = L.cap_last_cap()
    uid, gid = os.getuid(), os.getgid()
    L.unshare(L.CLONE_NEWUSER)
    # (a process that is not dumpable has its /proc/self files owned by root: it could not write its maps)
    L.prctl(L.PR_SET_DUMPABLE, 1)
    map_own_ids(uid, gid)
    L.prctl(L.PR_SET_DUMPABLE, 0)
    return cap_last


def program_filter():
    return seccomp.build_filter(deny=PROGRAM_DENY, arg_rules=PROGRAM_ARG_RULES)


# ---------------------------------------------------------------------------------- in P
def fork_program_init() -> int:
    """The zygote's fork: P is PID 1 of a new PID namespace (and the zygote's own child)."""
    return L.fork_with(L.CLONE_NEWPID)


class Run:
    """P's side of one program (see the module's docstring)."""

    def __init__(self, tmpfs_bytes: int, points: list[str]) -> None:
        self.tmpfs_bytes = tmpfs_bytes
        self.points = points  # (the sandbox's mount points: the zygote read them once)
        self.timeout, self.max_file_bytes, self.files, self.fetch = read_request()
        #: a toolchain program's request (:func:`write_toolchain`), or None for a Python program
        self.toolchain: dict | None = None
        if os.path.exists(TOOLCHAIN):
            with open(TOOLCHAIN, encoding="utf-8") as f:
                self.toolchain = json.load(f)
        self.stage = self.report = -1

    def enter(self, cap_last: int, prog) -> None:
        """The program's namespaces and fresh places; then no capability left and the programs'
        filter (what P does from here on needs neither: it runs beside the program); then what the
        env staged, copied in. The report is opened now, with a first field saying the program is
        about to start: a program that lowers P's limits (same uid) cannot keep it from reporting."""
        os.setsid()  # (the env's last resort at its own deadline: killpg of P ends the namespace)
        L.unshare(_NS_FLAGS)
        L.mount(None, "/", None, L.MS_REC | L.MS_PRIVATE)
        self.stage = os.open(STAGE, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        mount_private_tmp(self.tmpfs_bytes, self.points)
        L.mount("tmpfs", SANDBOX_WORKSPACE, "tmpfs", L.MS_NOSUID | L.MS_NODEV, f"size={self.tmpfs_bytes},mode=0700")
        L.mount("proc", "/proc", "proc", L.MS_NOSUID | L.MS_NODEV | L.MS_NOEXEC)
        L.drop_bounding_caps(cap_last)
        L.capset_none()
        if prog is not None:
            seccomp.install(prog)
        for path in self.files:
            _copy_file(f"{STAGE_IN}/{staged(path)[len(STAGE_IN) + 1 :]}", path, self.stage)
        _remove_tree("in", self.stage)  # (the room they took on the env's /tmp is the report's)
        os.chdir(SANDBOX_WORKSPACE)  # (the zygote's working directory is the one the tmpfs now covers)
        self.report = os.open(
            "out/report", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600, dir_fd=self.stage
        )
        _write_all(self.report, b"q")  # (the program runs from here on)

    def run(self, start_program) -> tuple[int | None, bool, float]:
        """Fork the program (``start_program()`` returns its exit status) and wait for it until the
        request's deadline; then kill every process left in the namespace and reap them all. The
        program's wait status (None: it timed out), whether it timed out, its seconds."""
        import time

        t0 = time.monotonic()
        pid = os.fork()
        if pid == 0:  # Q, the program
            code = 1
            try:
                os.close(self.stage)
                os.close(self.report)
                code = start_program()
            finally:
                os._exit(code)
        pidfd = os.pidfd_open(pid)
        ended = select.select([pidfd], [], [], self.timeout)[0]
        os.close(pidfd)
        elapsed = time.monotonic() - t0
        timed_out = not ended or elapsed >= self.timeout  # (a P woken late must not pass a late program)
        status = _end_all(pid)
        return (None if timed_out else status), timed_out, elapsed

    def run_here(self, compile_and_run) -> float:
        """A toolchain program: ``compile_and_run()`` (which forks each command and keeps to its
        deadlines) returns its results, written for the env (:func:`results`); then every process
        left in the namespace is killed and reaped. Its seconds."""
        import time

        t0 = time.monotonic()
        try:
            outcome = compile_and_run()
        finally:
            _end_all(-1)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        fd = os.open(os.path.relpath(RESULTS, STAGE), flags, 0o600, dir_fd=self.stage)
        try:
            _write_all(fd, json.dumps(outcome).encode())
        finally:
            os.close(fd)
        return time.monotonic() - t0

    def hand_back(self, files: dict, status: int | None, timed_out: bool, elapsed: float) -> None:
        """The fetched files, the status, and whether a named unix socket outlived the program
        (held by a reference cycle of passed fds, which only the kernel's collector frees, in the
        network namespace the next program shares), after the report's first field."""
        head = b"\0%s\0%d\0%r\0%d" % (
            b"" if status is None else b"%d" % status,
            timed_out,
            elapsed,
            unix_sockets(),
        )
        _write_all(self.report, head)
        if files:  # (past the head: where they do not fit the env's /tmp, the run keeps its status)
            _write_all(self.report, b"\0" + json.dumps(files).encode())
        os.close(self.report)


def _end_all(pid: int) -> int | None:
    """As PID 1: kill every other process of the namespace (the program's daemons too) and reap
    them all, so that none is mid-way through a rename, say, when P fetches; ``pid``'s wait status."""
    try:
        os.kill(-1, signal.SIGKILL)
    except ProcessLookupError:  # (none left: every command ended, and was reaped, before)
        pass
    status = None
    while True:
        try:
            done, st = os.waitpid(-1, 0)
        except ChildProcessError:
            break
        except InterruptedError:
            continue
        if done == pid:
            status = st
    return status


def unix_sockets() -> int:
    """How many unix sockets this network namespace holds: the env's own (its sandbox's namespace,
    which its programs share: a new one per program would cost about 0.5 ms of CPU, most of it in
    the kernel's deferred clean-up), and, with no process of the program left, none of the
    program's unless a cycle of passed fds keeps one (its name, or its mere existence, would reach
    the next program: :meth:`Run.hand_back` reports the count, the env compares it)."""
    try:
        with open("/proc/net/unix", "rb") as f:
            return len(f.read().splitlines()) - 1
    except OSError:
        return 1  # (unknown: not clean)


def _remove_tree(name: str, parent: int) -> None:
    """Remove the directory ``name`` in ``parent`` (an fd) and all it holds (the env staged it: plain
    files and directories, no link). (``shutil.rmtree`` takes a ``dir_fd`` only from Python 3.11.)"""
    fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
    try:
        for entry in os.scandir(fd):
            if entry.is_dir(follow_symlinks=False):
                _remove_tree(entry.name, fd)
            else:
                os.unlink(entry.name, dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=parent)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _copy_file(src: str, dst: str, stage: int) -> None:
    """Copy the staged file ``src`` (a path under :data:`STAGE_IN`, opened through the staging
    directory's fd: the program's /tmp covers it now) to ``dst`` in a fresh place, making its
    directories; no symlink followed at the end (an interpreter's tree carried over may hold some)."""
    parent = os.path.dirname(dst)
    if not os.path.isdir(parent):
        os.makedirs(parent)
    fin = os.open(src[len(STAGE) + 1 :], os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW, dir_fd=stage)
    try:
        fout = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        try:
            while os.sendfile(fout, fin, None, 1 << 30):
                pass
        finally:
            os.close(fout)
    finally:
        os.close(fin)
