"""The ``bwrap`` backend: the same layout as ``namespaces``, built by bubblewrap when it is on PATH.

bubblewrap is "a toolkit, not a security policy": what it protects depends on the arguments,
so they are spelled out here. Run as root, bwrap keeps full capabilities and host uid 0 inside
unless told otherwise, so as root the launcher child joins the env's cgroup, opens every bind
source (``O_PATH``, as root, so a Python under ``/root`` stays reachable), switches to the env's
own unprivileged uid and only then execs bwrap, which binds those fds (``--ro-bind-fd``) inside
an unprivileged user namespace. Where unprivileged user namespaces are refused, root falls back
to bwrap as root with ``--unshare-user --uid/--gid <env uid> --cap-drop ALL`` (then the env is
host uid 0 without capabilities, and the report says so).

The seccomp deny-list of the ``namespaces`` backend is handed to bwrap (``--seccomp FD``).
"""

from __future__ import annotations

import os
import shutil
import signal
import time

from ...envside import seccomp
from ...envside import syscalls as L
from . import cgroups
from .base import (
    SANDBOX_WORKSPACE,
    IsolationReport,
    Launched,
    LaunchSpec,
    SandboxUnavailable,
    _max_fd,
    adopt_sched_and_cgroup,
    apply_rlimits,
    env_uid,
    launched_tree,
    sandbox_properties,
    sandboxed_environment,
    scheduling_policy,
    set_layout_randomization,
    wire_std_fds,
)
from .namespaces import HOSTNAME, LAUNCHER, HostLayout
from .probe import first_working_mode, probed_mode, working_mode
from .speculation import report_speculation


class BwrapBackend:
    """Envs in sandboxes bubblewrap builds (see the module doc)."""

    name = "bwrap"

    def __init__(self, use_seccomp: bool = True) -> None:
        self.use_seccomp = use_seccomp
        self._prog = None
        self.bwrap = shutil.which("bwrap")

    # ---------------------------------------------------------------- probing
    def available(self) -> tuple[bool, str]:
        mode, why = self.mode()
        return mode is not None, why

    def mode(self) -> tuple[str | None, str]:
        """``"drop"`` (bwrap runs as the env's own unprivileged uid), ``"root"`` (bwrap as root, caps
        dropped, host uid 0 mapped), ``"user"`` (not root) or ``(None, reason)``. Probed once."""
        return probed_mode((self.name, self.use_seccomp), self._do_probe)

    def _do_probe(self) -> tuple[str | None, str]:
        if self.bwrap is None:
            return None, "bwrap is not on PATH (apt-get install bubblewrap)"
        return first_working_mode(
            ["drop", "root"] if os.geteuid() == 0 else ["user"],
            lambda spec, mode: self._launch(spec, mode, use_cgroup=False),
            works="bwrap probe ran (launch {ms:.1f} ms until bwrap exec)",
            failed="{mode} failed: {why}",
            keep_failures=True,
        )

    # ---------------------------------------------------------------- report
    def report(self) -> IsolationReport:
        mode, why = self.mode()
        if mode is None:
            return IsolationReport(self.name, {"available": False}, (why,))
        cg = cgroups.probe()[0] if os.geteuid() == 0 else None
        sec = self.use_seccomp and seccomp.supported()
        props = sandbox_properties(
            mode,
            cg,
            sec,
            process_limit="RLIMIT_NPROC" if mode != "root" else False,
            dedicated_uid=mode == "drop",
            tree_kill="bwrap --die-with-parent + pid namespace",
        )
        notes = [why]
        if mode == "root":
            notes.append(
                "bwrap could not run as the env's own uid (see above; e.g. the Python lives under a mode-700"
                " /root): bwrap runs as root and the env is host uid 0 mapped to the env uid, with no"
                " capabilities"
            )
        if mode == "user":
            notes.append("runs as the worker's own uid; limits by rlimits only")
        if sec:
            report_speculation(props, notes, passes_flag=False)
        return IsolationReport(self.name, props, tuple(notes))

    # ---------------------------------------------------------------- launch
    def launch(self, spec: LaunchSpec) -> Launched:
        return self._launch(spec, working_mode(self.name, self.mode()))

    def _seccomp_prog(self):
        if self._prog is None and self.use_seccomp:
            self._prog = seccomp.build_filter() or False
        return self._prog or None

    def _launch(self, spec: LaunchSpec, mode: str, use_cgroup: bool = True) -> Launched:
        start = time.perf_counter()
        bwrap = self.bwrap
        if bwrap is None:  # _do_probe finds no mode without bwrap, so nothing launches
            raise SandboxUnavailable("isolation='bwrap' is not available on this host: bwrap is not on PATH")
        root = os.geteuid() == 0
        uid = env_uid(spec) if root else os.getuid()
        host = HostLayout.read()
        binds = host.binds(spec)
        env = sandboxed_environment(spec)
        cg = None
        if root and use_cgroup:
            cg = cgroups.env_cgroup(spec.limits.memory_bytes, spec.limits.pids, tag=f"bw{spec.index}")
        if mode in ("drop", "root"):  # in "root" mode the env is host uid 0 (mapped), without capabilities
            owner = uid if mode == "drop" else 0
            os.chown(spec.workspace, owner, owner)
            os.chmod(spec.workspace, 0o700)
        prog = self._seccomp_prog()
        tmpfs = str(int(spec.limits.tmpfs_bytes))
        cap_last = L.cap_last_cap()
        sched = scheduling_policy()
        worker_pid = os.getpid()

        def child(status_w: int) -> None:
            adopt_sched_and_cgroup(sched, cg)
            args = [bwrap, "--unshare-all", "--die-with-parent", "--new-session", "--hostname", HOSTNAME]
            if mode == "root":
                args += ["--unshare-user", "--uid", str(uid), "--gid", str(uid), "--cap-drop", "ALL"]
            for link, target in host.symlinks.items():
                args += ["--symlink", target, link]
            # /tmp first: a bind below it (a venv in /tmp, say) must land on the tmpfs, not under it
            args += ["--perms", "1777", "--size", tmpfs, "--tmpfs", "/tmp"]
            keep = []
            for src, dst, ro in binds:
                if mode == "drop":
                    fd = os.open(src, os.O_PATH | os.O_CLOEXEC)
                    os.set_inheritable(fd, True)
                    keep.append(fd)
                    args += ["--ro-bind-fd" if ro else "--bind-fd", str(fd), dst]
                else:
                    args += ["--ro-bind" if ro else "--bind", src, dst]
            args += [
                "--proc",
                "/proc",
                "--dev",
                "/dev",
                "--perms",
                "1777",
                "--size",
                tmpfs,
                "--tmpfs",
                "/dev/shm",
                "--remount-ro",
                "/",
                "--chdir",
                SANDBOX_WORKSPACE,
            ]
            if prog is not None:
                r, w = os.pipe()
                os.write(w, prog[0])
                os.close(w)
                os.set_inheritable(r, True)
                keep.append(r)
                args += ["--seccomp", str(r)]
            args += ["--"] + list(spec.argv)
            if mode == "drop":
                L.drop_bounding_caps(cap_last)
                os.setgroups([])
                os.setresgid(uid, uid, uid)
                os.setresuid(uid, uid, uid)
            L.prctl(L.PR_SET_PDEATHSIG, signal.SIGKILL)
            if os.getppid() != worker_pid:
                os._exit(125)
            have_cg = cg is not None
            wire_std_fds(spec.stdin_fd, spec.stdout_fd, spec.stderr_fd)
            skip = sorted(set(keep) | {status_w})
            lo = 3
            for fd in skip:
                os.closerange(lo, fd)
                lo = fd + 1
            os.closerange(lo, _max_fd())
            # After closing the worker's fds: with them open, RLIMIT_NOFILE would be exceeded.
            apply_rlimits(spec.limits, memory_via_rlimit=not have_cg, pids_via_rlimit=not have_cg)
            signal.signal(signal.SIGPIPE, signal.SIG_DFL)
            set_layout_randomization(spec.aslr)  # kept through bwrap's own exec (unless it is setuid)
            os.execve(bwrap, args, env)

        def fork() -> tuple[int, str | None]:
            status_r, status_w = os.pipe()
            pid = os.fork()
            if pid == 0:
                try:
                    child(status_w)
                except BaseException as exc:  # noqa: BLE001 - never return into the worker
                    msg = f"boltzlabs bwrap setup failed: {type(exc).__name__}: {exc}\n"
                    for fd, text in ((status_w, "!" + msg), (spec.stderr_fd, msg)):
                        try:
                            os.write(fd, text.encode())
                        except OSError:
                            pass
                os._exit(127)
            os.close(status_w)
            data = b""
            try:
                while True:
                    chunk = os.read(status_r, 65536)
                    if not chunk:
                        break
                    data += chunk
            finally:
                os.close(status_r)
            err = data.split(b"!", 1)[1].decode("utf-8", "replace").strip() if b"!" in data else None
            return pid, err

        try:
            pid, error = LAUNCHER.call(fork)
        except BaseException:
            if cg is not None:
                cg.remove()
            raise

        # bwrap; --die-with-parent takes the namespace down with it
        return launched_tree(pid, cg, start, error)
