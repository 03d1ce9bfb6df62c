"""``mode="boltz"``: a warm template process per env directory per session, every env forked from it.

The template imports the env once (``env.py``'s module-level code: imports, data loading,
simulator set-up) and then serves fork requests; each env of the pool is a fork of it, so the
interpreter, the libraries and whatever the env built at import are shared copy-on-write.
:class:`TemplateLauncher` has an isolation backend's ``launch()/report()`` shape, so the worker
starts, respawns and hard-resets forked envs exactly as it does spawned ones.

How an env gets served (both backends)
--------------------------------------
The template is a fresh interpreter (``exec``, scrubbed environment: no worker memory, keys or
descriptors are inherited) started with ``BOLTZLABS_TEMPLATE=<kind>`` and a control socket on
fd 3. Its bootstrap (:data:`~boltzlabs_gym.envside.forkserver.TEMPLATE_BOOTSTRAP`) installs the fork
loop as the env side's hook and runs the env directory's ``env.py`` as usual; when that calls
:func:`boltzlabs_gym.env.serve` (or :func:`~boltzlabs_gym.envside.gym_start.serve_factories`, which first
unpickles the factories so Gymnasium and the env classes are imported in the template), serve
does not serve: it enters :func:`~boltzlabs_gym.envside.forkserver.template_main`, the fork loop
(module ``forkserver``: the template's side; this module is the worker's). The template checks it is
single-threaded, ``gc.freeze()``-es its heap and says ``ready``. Per launch the worker sends one
``SOCK_SEQPACKET`` message carrying the env's JSON parameters and, with ``SCM_RIGHTS``, the
env's three pipe ends, a fresh socketpair end for this one env and (namespaces) its workspace.

The template forks each env *ahead of its request* (a "spare", named ``boltz-spare``; the
worker asks for the next one as soon as it has the current env's pid, so the template's next fork
overlaps this env's last set-up steps: see ``SPARE_EARLY``) as a child of the worker (a child
subreaper): one ``clone(CLONE_PARENT)``, in a new PID namespace with namespaces
(:func:`~boltzlabs_gym.envside.syscalls.fork_sibling`). Where the kernel refuses that clone, a
double fork does the same with one process more (an intermediate child that exits at once, so the
spare is re-parented to the worker), and the worker logs why once. The spare already makes its own
PID/mount/net/IPC/UTS namespaces and ``/proc``, then blocks. A launch hands the request to the
spare, so a start or hard reset waits for no fork. The worker ``waitpid``-s its envs, sees their
real exit status, and they outlive a dead template (a spare exits when its template's socket
closes). The env sends one message on its socketpair; the worker's end has ``SO_PASSCRED``, so the
kernel stamps it with the env's *host* pid (unforgeable: the sender can only name a process in its
own PID namespace). That pid is ``Launched.pid``: the env's top process. The worker checks it has
been re-parented, moves it into the env's own cgroup, answers ``go``; the env finishes its
sandbox, answers ``ok`` and returns from ``serve()``'s hook into the normal serving loop with fds
0/1/2 on the worker's pipes, its own environment, ``ENV_INDEX`` and RNG state. A hard reset or
straggler respawn is just another launch.

Nesting with the ``namespaces`` backend (root mode)
---------------------------------------------------
* Template: forked by the backend's launcher thread as real root (not PID 1 of a namespace, so
  the envs it forks can be re-parented out of it), joins a cgroup of its own (same limits as an
  env), unshares mount/net/IPC/UTS(/cgroup) namespaces and builds the same read-only root as a
  spawned env (``/env``, Python, runtime, a private ``/workspace``, tmpfs ``/tmp`` and
  ``/dev/shm``), with ``/proc`` mounted ``hidepid=invisible``. Then it unshares a **user
  namespace** whose maps the launcher writes: inside uid 0 -> a random per-session outer uid (the
  template), inside uid 1000 -> that uid + 1 (its envs). It keeps only CAP_SYS_ADMIN,
  CAP_SETUID, CAP_SETGID and CAP_SETPCAP, and only inside that user namespace (no host
  privilege: no devices, modules, host mounts or host processes), installs a seccomp filter
  (the env deny-list, except that mount/umount/move_mount/mount_setattr and ``unshare`` of
  non-user namespaces are allowed: no nested user namespace, no setns, ptrace, bpf, ...),
  arms PDEATHSIG and execs Python, which imports the env.
* Each forked env: cloned with ``CLONE_NEWPID`` (which the template's filter allows in ``clone``
  as it allows it in ``unshare``; the double fork's intermediate child ``unshare``-s instead), so the
  env is PID 1 of its own PID namespace (SIGKILL to ``Launched.pid`` kills its whole tree; the worker also kills its
  cgroup). The spare unshares mount (a copy owned by the template's user namespace, so every
  inherited mount is locked: it cannot be unmounted or made writable), net (only ``lo``), IPC
  and UTS namespaces and mounts its own ``/proc``; once launched and moved into its cgroup it
  unshares a cgroup namespace, mounts fresh size-limited ``/tmp`` and
  ``/dev/shm``; attaches its workspace over ``/workspace``: a detached bind mount the worker made
  with ``open_tree(OPEN_TREE_CLONE)`` of that env's host directory and passed as an fd, so the
  template never sees any env's workspace. It drops the bounding set, switches to uid/gid 1000
  (clearing all capabilities), sets no_new_privs, re-arms PDEATHSIG (checked against a lifeline
  pipe only the worker can close), sets the rlimits and stacks the full env seccomp filter.
  Limits: its own cgroup (memory, pids) joined by the worker before it runs any env code, plus
  the same rlimits as a spawned env.

What a forked env gets, compared with a spawned one (``report()`` says the same)
* the same: read-only ``/env`` and runtime, hidden host files, private ``/workspace`` (not
  shared with siblings, wiped by a hard reset), own PID/mount/net/IPC/UTS namespaces, no
  network, cgroup limits, rlimits, seccomp, no capabilities, no_new_privs, scrubbed environment;
* different: the uid is per session (shared by the pool's envs and distinct from the
  template's), not per env (siblings cannot see or signal each other: separate PID namespaces);
  the template runs the env's import-time code with namespace-admin capabilities confined to
  its own user namespace and can see the envs it forked (they cannot see it): a boundary
  between envs and against a compromised env, not against a malicious env *directory*, whose
  code (from the trusted trainer) also builds its envs' sandboxes inside the template;
* semantics: module-level state is the template's (that is the point). ``ENV_INDEX`` (and
  ``ENV_DIR``/``WORKSPACE``) bound at import are rebound per env; other per-env values computed
  at import are not. Python ``random`` and numpy's global RNG are re-seeded from the OS in every
  env; ``os.urandom`` is the kernel's. ``random.Random()`` instances made at import, the string
  hash seed and ``/proc/self/environ`` are the template's. Descriptors opened at import are
  pointed at ``/dev/null`` in envs (shared offsets or sockets would link siblings), except copies
  of the template's stdin/stdout/stderr, which become copies of the env's own. Files the
  import wrote under ``/workspace`` or ``/tmp`` are not seen by envs (they get fresh ones).

With the ``process`` backend boltz mode is just fork from a template process (own session and
process group, rlimits, scrubbed environment, private working directory); no sandbox, as the
report says. The ``bwrap`` backend can only exec, so boltz mode refuses it, and the namespaces
backend in unprivileged ``userns`` mode is refused too (the worker cannot hand a workspace to a
nested namespace without root); there is no automatic fallback to ``mode="default"``.

A dead template (killed, crashed) is noticed at the next ``launch()`` (a pidfd) and restarted;
its envs live on. While a template imports the env (the first launch of a session, or after a
restart) the worker waits for it: a slow import stalls the worker for that long.
``launcher.pss()`` is the template's own PSS (its one idle spare, ~1-2 MiB, is not counted).
``close()`` kills it and removes its cgroup; its directories live in the session root, which the
worker removes.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import socket
import time
from dataclasses import replace

from ..envside.forkserver import ENV_INSIDE_UID, TEMPLATE_BOOTSTRAP
from ..envside.plain_files import write_text
from .memory_snapshots.gate import Gate, parent_of, shared_gate
from .memory_snapshots.launcher import SnapshotLauncher
from .sandbox.base import (
    MEMORY_SNAPSHOTS_ENV,
    SANDBOX_WORKSPACE,
    IsolationReport,
    Launched,
    LaunchSpec,
    Limits,
    SandboxUnavailable,
    apply_rlimits,
    child_environment,
    kill_pid_and_cgroup,
    kill_process_group,
    readable,
    recv_pid,
    sandboxed_environment,
    set_layout_randomization,
)
from .sandbox.cgroups import Graveyard

log = logging.getLogger("boltzlabs_gym.worker.template")

#: seconds the template may take to import the env and say ready.
TEMPLATE_START_TIMEOUT = 120.0
#: bytes the template cgroup's memory limit grows per live env (what a spare touched before it joined
#: its own cgroup stays charged to the template's: ~1.7 MiB user + ~0.3 MiB kernel measured here).
TEMPLATE_HEADROOM_PER_ENV = 4 << 20
#: ask for the next spare as soon as the current one has been handed over (True: the template's fork
#: overlaps this env's last set-up steps and first request; faster pool start-up on 2+ cores) or once the
#: launch is complete (False: nothing competes with a launch in flight; lower latency on a busy host).
#: Measured (1024 envs, 2 cores, load ~2): 7.6 s start-up with True, 9.6 s with False.
SPARE_EARLY = True
#: seconds one fork may take until the env's sandbox is ready.
FORK_TIMEOUT = 20.0
#: after a template failed to start, launches within this many seconds fail with its error at once.
FAILED_TEMPLATE_RETRY_S = 5.0
_TEMPLATE_UID_LO, _TEMPLATE_UID_SPAN = 1_000_000_000, 1_000_000_000

# capability numbers the template keeps (inside its own user namespace only)
_CAP_SETGID, _CAP_SETUID, _CAP_SETPCAP, _CAP_SYS_ADMIN = 6, 7, 8, 21
_KEEP_CAPS = (_CAP_SETGID, _CAP_SETUID, _CAP_SETPCAP, _CAP_SYS_ADMIN)


# ============================================================================================ worker side
class _Template:
    """One running template process as the worker sees it."""

    def __init__(self, pid: int, pidfd: int, ctl: socket.socket, cgroup, log_path: str, outer_uid: int):
        self.pid = pid
        self.pidfd = pidfd
        self.ctl = ctl
        self.cgroup = cgroup
        self.log_path = log_path
        self.outer_uid = outer_uid
        self.mem_limit = 0

    def alive(self) -> bool:
        if self.pidfd < 0:
            return False
        return not readable([self.pidfd], 0)

    def log_tail(self, limit: int = 4000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                size = f.tell()
                f.seek(max(0, size - limit))
                return f.read().decode("utf-8", "replace")
        except OSError:
            return ""

    def kill(self, wait: float = 2.0) -> None:
        if self.pidfd >= 0:
            try:
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
            except (ProcessLookupError, OSError):
                pass
            readable([self.pidfd], wait)
            try:
                os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                pass  # the worker's reaper got it
            os.close(self.pidfd)
            self.pidfd = -1
        try:
            self.ctl.close()
        except OSError:
            pass
        if self.cgroup is not None:
            try:
                self.cgroup.remove()
            except OSError:
                log.exception("removing the template cgroup")
            self.cgroup = None


class TemplateError(RuntimeError):
    """The template could not import the env or fork it; the message says why."""


class TemplateLauncher:
    """The boltz-mode launcher of one session: a backend-shaped wrapper around a warm template.

    ``gate`` answers the gated syscalls of the template's filter (the worker's, by default);
    :attr:`copies` makes its envs' memory snapshots.
    """

    def __init__(self, backend, *, env_dir: str, root: str, runtime: dict[str, str], gate: Gate | None = None):
        self.backend = backend
        self.env_dir = env_dir
        self.root = root
        self.runtime = runtime
        self.name = getattr(backend, "name", "?")
        if self.name == "namespaces":
            mode, why = backend.mode()
            if mode != "root":
                raise SandboxUnavailable(
                    "mode='boltz' with isolation='namespaces' needs the worker to run as root (it hands each forked "
                    f"env its workspace as a mount and its own cgroup); this worker runs in {mode!r} mode ({why}). "
                    "Use mode='default', or isolation='process' for boltz mode without a sandbox."
                )
            self.kind = "ns"
        elif self.name == "process":
            self.kind = "process"
        else:
            raise SandboxUnavailable(
                f"mode='boltz' cannot run with isolation={self.name!r}: that backend can only exec a new "
                "process, not fork one from a warm template. Use isolation='namespaces' (root) or 'process', "
                "or mode='default'."
            )
        self._tpl: _Template | None = None
        self._failed: tuple[str, float] | None = None
        self._graveyard = Graveyard()  # cgroups of killed envs whose processes were still exiting
        self._live = 0  # envs launched and not yet cleaned up
        self.gate = gate if gate is not None else shared_gate()
        #: its envs' memory snapshots (their copies are its envs too: counted live, cgroups buried here)
        self.copies = SnapshotLauncher(self.gate, self.copies_unavailable, self._graveyard, self._count_live)
        #: where the last launch spent its time (ms): prepare, fork, reparent, sandbox
        self.last_phases_ms: dict[str, float] = {}
        self._life_r, self._life_w = os.pipe2(os.O_CLOEXEC)
        self._closed = False
        self.template_starts = 0
        self.template_start_ms: list[float] = []
        #: why its envs are double-forked (the kernel refused ``clone(CLONE_PARENT)``); "" while they are not
        self.double_fork_cause = ""
        #: whether its template lets the envs make user namespaces (``LaunchSpec.nested_user_namespaces``)
        self.nested_user_namespaces = False
        self._dir = os.path.join(root, "template")
        os.makedirs(self._dir, exist_ok=True)
        self._outer_uid = _TEMPLATE_UID_LO + 2 * secrets.randbelow(_TEMPLATE_UID_SPAN // 2)

    # ---------------------------------------------------------------- introspection
    @property
    def template_pid(self) -> int | None:
        return self._tpl.pid if self._tpl is not None and self._tpl.alive() else None

    def copies_unavailable(self) -> str | None:
        """Why this launcher's envs cannot take memory snapshots at all, or None."""
        if self.kind != "ns":
            return "memory snapshots need isolation='namespaces' (boltz mode forks them in a nested sandbox)"
        return None

    def pss(self) -> int:
        """PSS in bytes of the template process itself (its envs are counted per env)."""
        from .pss import pid_pss

        pid = self.template_pid
        return pid_pss(pid) if pid else 0

    def available(self) -> tuple[bool, str]:
        return self.backend.available()

    def report(self) -> IsolationReport:
        base = self.backend.report()
        props = dict(base.properties)
        props["boltz_template"] = True
        # how its envs are forked, once one was (see _note_double_fork)
        props["boltz_env_fork"] = f"double fork ({self.double_fork_cause})" if self.double_fork_cause else "clone"
        notes = list(base.notes)
        if self.nested_user_namespaces:
            props["nested_user_namespaces"] = True
            notes.append(
                "nested_user_namespaces: envs may create user namespaces of their own (with PID, mount, IPC, net "
                "and UTS namespaces under them); the worker's gate does not see those calls"
            )
        if self.kind == "ns":
            props["dedicated_uid"] = "per session (envs share one uid, distinct from the template's)"
            props["template_sandbox"] = (
                "same root, no network, own cgroup, seccomp; keeps SYS_ADMIN/SETUID/SETGID/SETPCAP inside "
                "its own user namespace only"
            )
            notes.append(
                "mode=boltz: each env is forked from a warm template and gets its own PID, mount, net, IPC, UTS "
                "and cgroup namespaces, private /workspace, /tmp and /dev/shm, cgroup, rlimits and seccomp; "
                "the template (which ran the env's import-time code) can see the envs it forked, they cannot "
                "see it or each other"
            )
        else:
            notes.append(
                "mode=boltz with the process backend: envs are plain forks of a template process (own session, "
                "rlimits, private cwd); no sandbox"
            )
        return IsolationReport(base.backend, props, tuple(notes))

    # ---------------------------------------------------------------- template life
    def _template_spec(self, spec: LaunchSpec) -> LaunchSpec:
        ws = os.path.join(self._dir, "ws")
        os.makedirs(ws, exist_ok=True)
        env = dict(spec.env)
        env.update(
            {
                "BOLTZLABS_TEMPLATE": self.kind,
                "BOLTZLABS_ENV_INDEX": "-1",
                "BOLTZLABS_WORKSPACE": ws,
                "HOME": ws,
                "OPENBLAS_NUM_THREADS": "1",
                "OMP_NUM_THREADS": "1",
                "MKL_NUM_THREADS": "1",
                "NUMEXPR_NUM_THREADS": "1",
                "VECLIB_MAXIMUM_THREADS": "1",
            }
        )
        argv = [spec.argv[0], "-B", "-s", "-c", TEMPLATE_BOOTSTRAP, "boltzlabs-template"]  # (the session's Python)
        return replace(spec, argv=argv, env=env, workspace=ws, uid=ENV_INSIDE_UID, index=-1)

    def _start_template(self, spec: LaunchSpec) -> _Template:
        start = time.perf_counter()
        tspec = self._template_spec(spec)
        self.nested_user_namespaces = spec.nested_user_namespaces and self.kind == "ns"
        log_path = os.path.join(self._dir, "log")
        # distinct files for the template's fds 0/1/2, so that copies the env's import makes of them
        # (``os.dup(1)``) can be recognised and pointed at each forked env's own channel
        log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND | os.O_CLOEXEC, 0o600)
        out_fd = os.open(
            os.path.join(self._dir, "stdout"), os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600
        )
        null_fd, w = os.pipe2(os.O_CLOEXEC)  # an empty stdin of its own
        os.close(w)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            if self.kind == "ns":
                pid, cgroup = self._start_ns(tspec, null_fd, out_fd, log_fd, theirs.fileno())
            else:
                pid, cgroup = self._start_process(tspec, null_fd, out_fd, log_fd, theirs.fileno()), None
        finally:
            theirs.close()
            for fd in (log_fd, out_fd, null_fd):
                os.close(fd)
        from ..envside import syscalls as L  # noqa: F401 - loaded before the sandbox hides the package

        try:
            pidfd = L.pidfd_open(pid)
        except OSError:
            pidfd = -1
        tpl = _Template(pid, pidfd, ours, cgroup, log_path, self._outer_uid)
        ours.settimeout(TEMPLATE_START_TIMEOUT)
        try:
            msg, fds, _flags, _addr = socket.recv_fds(ours, 4096, 1)
            if msg == b"listener" and len(fds) == 1:  # the template's filter's (namespaces kind)
                self.gate.watch(fds[0])
                msg = ours.recv(4096)
            else:
                for fd in fds:
                    os.close(fd)
        except (TimeoutError, OSError) as exc:
            msg = b"!" + f"no answer ({exc})".encode()
        if msg != b"ready":
            tpl.kill()
            why = msg[1:].decode("utf-8", "replace") if msg.startswith(b"!") else "it exited"
            raise TemplateError(f"the boltz template could not import the env ({why}); its output:\n{tpl.log_tail()}")
        ours.settimeout(None)
        self.template_starts += 1
        self.template_start_ms.append((time.perf_counter() - start) * 1e3)
        return tpl

    def _start_process(self, tspec: LaunchSpec, null_fd: int, out_fd: int, log_fd: int, ctl_fd: int) -> int:
        from .sandbox.process import runtime_pythonpath

        env = child_environment(
            tspec, env_dir=tspec.env_dir, workspace=tspec.workspace, pythonpath=runtime_pythonpath(tspec.runtime)
        )
        life_r = self._life_r

        def body() -> None:
            os.setsid()
            _place_fds([null_fd, out_fd, log_fd, ctl_fd, life_r])
            apply_rlimits(tspec.limits, memory_via_rlimit=True, pids_via_rlimit=True)
            os.chdir(tspec.workspace)
            signal.signal(signal.SIGPIPE, signal.SIG_DFL)
            set_layout_randomization(tspec.aslr)
            os.execve(tspec.argv[0], tspec.argv, env)

        from .sandbox.namespaces import LAUNCHER

        def fork() -> int:
            pid = os.fork()
            if pid == 0:
                try:
                    body()
                except BaseException as exc:  # noqa: BLE001
                    try:
                        os.write(log_fd, f"boltzlabs template setup failed: {exc}\n".encode())
                    finally:
                        os._exit(127)
                os._exit(127)
            return pid

        return LAUNCHER.call(fork)

    def _start_ns(self, tspec: LaunchSpec, null_fd: int, out_fd: int, log_fd: int, ctl_fd: int):
        from ..envside import seccomp
        from ..envside import syscalls as L  # noqa: F401 - loaded before the sandbox hides the package
        from .sandbox import cgroups
        from .sandbox.namespaces import LAUNCHER

        backend = self.backend
        plan = backend.plan(tspec, "root", use_cgroup=False)
        plan.proc_data = "hidepid=invisible"
        plan.fds = (null_fd, out_fd, log_fd)
        plan.seccomp_prog = (
            seccomp.build_filter(
                # a nested user namespace goes to the worker (whose gate lets only a memory
                # snapshot's copies through, see envside.memory_snapshot): whatever the env's
                # import code does in the template, nothing forked from it makes one otherwise;
                # unless the session lets its envs make their own (nested_user_namespaces)
                deny=tuple(
                    n for n in seccomp.DENY if n not in ("mount", "umount2", "unshare", "move_mount", "mount_setattr")
                ),
                unshare_notify_flags=0 if tspec.nested_user_namespaces else L.CLONE_NEWUSER,
                clone_allow_flags=L.CLONE_NEWPID,  # a spare: PID 1 of its own PID namespace
            )
            if backend.use_seccomp
            else None
        )
        kind = cgroups.probe()[0]
        if kind is not None:
            # the pages a forked env touches before the worker moves it into its own cgroup (its
            # spare's fork and namespace set-up: ~2 MiB, user and kernel) stay charged to the
            # template's group: its limit grows by TEMPLATE_HEADROOM_PER_ENV per live env
            plan.cgroup = cgroups.EnvCgroup(kind, tspec.limits.memory_bytes, tspec.limits.pids, tag="template")
        os.chown(tspec.workspace, self._outer_uid, self._outer_uid)
        os.chmod(tspec.workspace, 0o700)
        outer = self._outer_uid
        maps = f"0 {outer} 1\n{ENV_INSIDE_UID} {outer + 1} 1\n"
        life_r = self._life_r

        def run() -> int:
            status_r, status_w = os.pipe()
            sync_r, sync_w = os.pipe()
            try:
                pid = os.fork()
                if pid == 0:
                    _template_child_ns(plan, status_w, sync_r, ctl_fd, life_r)  # never returns
            except BaseException:
                for fd in (status_r, status_w, sync_r, sync_w):
                    os.close(fd)
                raise
            os.close(status_w)
            os.close(sync_r)
            data = b""
            try:
                deadline = time.monotonic() + 30
                while True:
                    left = deadline - time.monotonic()
                    if left <= 0 or not readable([status_r], left):
                        data += b"!template sandbox setup timed out"
                        os.kill(pid, signal.SIGKILL)
                        break
                    chunk = os.read(status_r, 65536)
                    if not chunk:
                        break
                    data += chunk
                    if data == b"U":
                        for name in ("uid_map", "gid_map"):
                            with open(f"/proc/{pid}/{name}", "w") as f:
                                f.write(maps)
                        os.write(sync_w, b"M")
                        data = b""
            finally:
                os.close(status_r)
                os.close(sync_w)
            if b"!" in data:
                raise TemplateError(data.split(b"!", 1)[1].decode("utf-8", "replace").strip())
            return pid

        try:
            pid = LAUNCHER.call(run)
        except BaseException:
            if plan.cgroup is not None:
                plan.cgroup.remove()
            raise
        return pid, plan.cgroup

    def _ensure_template(self, spec: LaunchSpec) -> _Template:
        if self._closed:
            raise TemplateError("the session's template launcher is closed")
        tpl = self._tpl
        if tpl is not None and not tpl.alive():
            log.warning("boltz template %s of %s died; restarting it", tpl.pid, self.env_dir)
            tpl.kill(wait=0)
            tpl = self._tpl = None
        if tpl is None:
            failed = self._failed
            if failed is not None and time.monotonic() - failed[1] < FAILED_TEMPLATE_RETRY_S:
                raise TemplateError(failed[0])  # the pool's other envs: do not import it again at once
            try:
                tpl = self._tpl = self._start_template(spec)
            except TemplateError as exc:
                self._failed = (str(exc), time.monotonic())
                raise
            self._failed = None
        return tpl

    # ---------------------------------------------------------------- launching envs
    def launch(self, spec: LaunchSpec) -> Launched:
        start = time.perf_counter()
        try:
            try:
                return self._fork(self._ensure_template(spec), spec, start)
            except _TemplateGone:
                # died between the liveness check and the fork (or was killed mid-fork): once more
                return self._fork(self._ensure_template(spec), spec, start)
        except (TemplateError, _TemplateGone) as exc:
            return _failed_launch(spec, str(exc), start)

    def _note_double_fork(self, cause: str) -> None:
        """Warn once that this template's envs take two forks each: the kernel refused to clone them
        as the worker's children (``cause``). They work as before, at one more fork's CPU per env."""
        if not self.double_fork_cause:
            log.warning(
                "boltz template: the kernel refused to clone envs as the worker's children (%s); each "
                "env is forked through a process that exits instead (one fork more per start or hard reset)",
                cause,
            )
        self.double_fork_cause = cause

    def _fork(self, tpl: _Template, spec: LaunchSpec, start: float) -> Launched:
        from ..envside import syscalls as L  # noqa: F401 - loaded before the sandbox hides the package
        from .sandbox import cgroups

        self._graveyard.retry()

        if self.kind == "ns":
            os.chown(spec.workspace, tpl.outer_uid + 1, tpl.outer_uid + 1)
            os.chmod(spec.workspace, 0o700)
            env = sandboxed_environment(spec)
            env[MEMORY_SNAPSHOTS_ENV] = "1"  # (as a spawned namespaces env has it)
            workspace = SANDBOX_WORKSPACE
        else:
            from .sandbox.process import runtime_pythonpath

            env = child_environment(
                spec, env_dir=spec.env_dir, workspace=spec.workspace, pythonpath=runtime_pythonpath(spec.runtime)
            )
            workspace = spec.workspace
        cg = None
        if self.kind == "ns":
            cg = cgroups.env_cgroup(spec.limits.memory_bytes, spec.limits.pids, tag=str(spec.index))
            if cg is not None:
                self._grow_template_limit(tpl, spec.limits)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        tree = -1
        pid = None
        try:
            fds = [spec.stdin_fd, spec.stdout_fd, spec.stderr_fd, theirs.fileno()]
            if self.kind == "ns":
                tree = L.open_tree_clone(spec.workspace)
                L.mount_setattr_fd(tree, L.MOUNT_ATTR_NOSUID | L.MOUNT_ATTR_NODEV)
                fds.append(tree)
            req = {
                "index": spec.index,
                "env": env,
                "workspace": workspace,
                "limits": spec.limits.to_json(),
                "cgroup": cg is not None,
            }
            try:
                socket.send_fds(tpl.ctl, [json.dumps(req).encode()], fds)
            except OSError as exc:
                raise _TemplateGone(f"could not reach the template: {exc}") from None
            finally:
                theirs.close()
                if tree >= 0:
                    os.close(tree)
            ours.settimeout(FORK_TIMEOUT)
            t_sent = time.perf_counter()
            msg, pid = _recv_with_pid(ours, tpl)
            t_forked = time.perf_counter()
            if msg.startswith(b"!"):
                raise TemplateError(msg[1:].decode("utf-8", "replace"))
            if msg.startswith(b"p:"):
                self._note_double_fork(msg[2:].decode("utf-8", "replace"))
            if pid is None or pid <= 0 or pid == tpl.pid or pid == os.getpid():
                raise TemplateError(f"the template reported an impossible env pid {pid}")
            if SPARE_EARLY:
                try:
                    tpl.ctl.send(b"spare")  # the template forks the next env while this one finishes
                except OSError:
                    pass
            _wait_reparented(pid)
            t_reparented = time.perf_counter()
            if cg is not None:
                for path in cg.join_files:
                    write_text(path, pid)
            ours.send(b"go")
            msg = ours.recv(65536)
            keep_control = msg == b"ok"  # ("ok-": no control socket kept, so no memory snapshots)
            msg = b"ok" if msg == b"ok-" else msg
            t_ok = time.perf_counter()
            self.last_phases_ms = {
                "prepare": (t_sent - start) * 1e3,
                "fork": (t_forked - t_sent) * 1e3,
                "reparent": (t_reparented - t_forked) * 1e3,
                "sandbox": (t_ok - t_reparented) * 1e3,
            }
            if msg != b"ok":
                why = msg[1:].decode("utf-8", "replace") if msg.startswith(b"!") else "the env died during set-up"
                raise TemplateError(f"forked env could not finish its sandbox: {why}")
            if not SPARE_EARLY:
                try:
                    tpl.ctl.send(b"spare")  # now the template may fork the next env ahead of time
                except OSError:
                    pass
        except BaseException as exc:
            if pid:
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            if cg is not None:
                cg.remove()
            ours.close()
            if isinstance(exc, socket.timeout):
                raise TemplateError(f"the template did not fork the env within {FORK_TIMEOUT:g} s") from None
            raise
        control = None
        if keep_control:
            control = ours  # the env's control socket (memory snapshots)
        else:
            ours.close()
        kind = self.kind
        self._live += 1

        def kill_tree() -> None:
            if kind == "process":
                kill_process_group(pid)
            kill_pid_and_cgroup(pid, cg)

        done: list[bool] = []

        def cleanup() -> None:
            if not done:
                done.append(True)
                self._live -= 1
                if control is not None:
                    control.close()
            # no waiting here for a dying PID namespace to empty its cgroup (a hard reset would
            # wait for the old env's teardown): try once, finish later (next launch, or close)
            if cg is not None:
                self._graveyard.bury(cg)

        return Launched(
            control=control,
            cgroup=cg,
            pid=pid,
            kill_tree=kill_tree,
            cleanup=cleanup,
            setup_ms=(time.perf_counter() - start) * 1e3,
            oom_killed=(cg.oom_killed if cg is not None else (lambda: False)),
            paths={"env_dir": env["BOLTZLABS_ENV_DIR"], "workspace": workspace},
        )

    def _count_live(self, delta: int) -> None:
        self._live += delta

    def _grow_template_limit(self, tpl: _Template, limits: Limits) -> None:
        """Raise the template cgroup's memory limit to cover what its live envs left charged there."""
        cg = tpl.cgroup
        if cg is None or not cg.paths or limits.memory_bytes is None:
            return
        want = int(limits.memory_bytes) + TEMPLATE_HEADROOM_PER_ENV * (self._live + 1)
        if want <= tpl.mem_limit:
            return
        tpl.mem_limit = want + 64 * TEMPLATE_HEADROOM_PER_ENV  # in steps: not one write per launch
        files = ["memory.memsw.limit_in_bytes", "memory.limit_in_bytes"] if cg.kind == "v1" else ["memory.max"]
        for name in files:  # v1: memsw >= limit at all times, so raise memsw first
            try:
                with open(os.path.join(cg.paths[0], name), "w") as f:
                    f.write(str(tpl.mem_limit))
            except OSError:
                pass

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._tpl is not None:
            self._tpl.kill()
            self._tpl = None
        for cg in self._graveyard.take_all():
            try:
                cg.remove()
            except OSError:
                log.exception("removing an env cgroup")
        for fd in (self._life_r, self._life_w):
            try:
                os.close(fd)
            except OSError:
                pass


class _TemplateGone(Exception):
    pass


def _recv_with_pid(sock: socket.socket, tpl: _Template) -> tuple[bytes, int | None]:
    """One message and the kernel-stamped pid of its sender (SO_PASSCRED)."""
    deadline = time.monotonic() + FORK_TIMEOUT
    while True:
        ready = readable(
            [sock.fileno(), tpl.pidfd] if tpl.pidfd >= 0 else [sock.fileno()], max(0.0, deadline - time.monotonic())
        )
        if sock.fileno() in ready:
            break
        if not ready:
            raise TimeoutError()
        # the template died; an env it already forked may still have answered
        if not readable([sock.fileno()], 0.05):
            raise _TemplateGone("the template died while forking")
        break
    msg, pid = recv_pid(sock)
    if not msg and pid is None:
        raise _TemplateGone("the template closed the env's channel")
    return msg, pid


def _wait_reparented(pid: int, timeout: float = 5.0) -> None:
    """``pid`` is our child from its clone, or, double-forked, once the intermediate child exited
    (at once); wait until it is."""
    me = os.getpid()
    deadline = time.monotonic() + timeout
    while True:
        ppid = parent_of(pid)
        if ppid is None:
            raise TemplateError(f"forked env {pid} vanished during set-up")
        if ppid == me:
            return
        if time.monotonic() > deadline:
            raise TemplateError(f"forked env {pid} was not re-parented to the worker (parent {ppid})")
        time.sleep(0.0002)


def _failed_launch(spec: LaunchSpec, message: str, start: float) -> Launched:
    """A start that cannot happen: a short-lived process writes why on the env's stderr and exits 3,
    so the worker reports it like any failed start (naming the env, with this text as its stderr)."""
    text = f"boltzlabs boltz template: {message}\n".encode("utf-8", "replace")
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        try:
            os.write(spec.stderr_fd, text[-60000:])
        finally:
            os._exit(3)
    return Launched(pid=pid, kill_tree=lambda: None, setup_ms=(time.perf_counter() - start) * 1e3, setup_error=message)


def _place_fds(fds: list[int]) -> None:
    """Make ``fds[i]`` fd ``i`` (inheritable), close every other fd but CLOEXEC ones above them."""
    import fcntl

    high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 64) for fd in fds]
    for target, fd in enumerate(high):
        os.dup2(fd, target)
    for fd in high:
        os.close(fd)
    keep = set(range(len(fds)))
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd not in keep:
            try:
                flags = fcntl.fcntl(fd, fcntl.F_GETFD)
            except OSError:
                continue
            if not flags & fcntl.FD_CLOEXEC:
                os.close(fd)


def _template_child_ns(plan, status_w: int, sync_r: int, ctl_fd: int, life_r: int) -> None:
    """Forked by the backend's launcher thread as real root: build the template's sandbox, exec Python."""
    from ..envside import seccomp
    from ..envside import syscalls as L
    from .sandbox.base import adopt_sched_and_cgroup
    from .sandbox.namespaces import _NS_FLAGS, HOSTNAME, _build_root

    try:
        import fcntl

        status_w = fcntl.fcntl(status_w, fcntl.F_DUPFD_CLOEXEC, 64)
        sync_r = fcntl.fcntl(sync_r, fcntl.F_DUPFD_CLOEXEC, 64)
        _place_fds([plan.fds[0], plan.fds[1], plan.fds[2], ctl_fd, life_r])
        adopt_sched_and_cgroup(plan.sched, plan.cgroup)
        L.unshare(_NS_FLAGS | (L.CLONE_NEWCGROUP if plan.cgroup is not None else 0))
        L.sethostname(HOSTNAME)
        _build_root(plan)
        L.unshare(L.CLONE_NEWUSER)
        os.write(status_w, b"U")
        if os.read(sync_r, 1) != b"M":
            os._exit(125)
        os.close(sync_r)
        os.setgroups([])
        os.setresgid(0, 0, 0)
        os.setresuid(0, 0, 0)
        L.drop_bounding_caps(plan.cap_last, keep=set(_KEEP_CAPS))
        try:
            L.prctl(L.PR_CAP_AMBIENT, L.PR_CAP_AMBIENT_CLEAR_ALL)
        except OSError:
            pass
        L.capset(sum(1 << c for c in _KEEP_CAPS))
        L.prctl(L.PR_SET_PDEATHSIG, signal.SIGKILL)
        have_cg = plan.cgroup is not None
        apply_rlimits(plan.limits, memory_via_rlimit=not have_cg, pids_via_rlimit=not have_cg)
        os.chdir(SANDBOX_WORKSPACE)
        if plan.seccomp_prog is not None:
            listener = seccomp.install_with_listener(plan.seccomp_prog)
            sock = socket.socket(fileno=os.dup(3))  # (the control socket: _place_fds put it at 3)
            try:  # the worker answers it; the template never keeps it (nor does anything it forks)
                socket.send_fds(sock, [b"listener"], [listener])
            finally:
                sock.close()
                os.close(listener)
        else:
            L.prctl(L.PR_SET_NO_NEW_PRIVS, 1)
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        set_layout_randomization(plan.aslr)
        os.execve(plan.argv[0], plan.argv, plan.env)
    except BaseException as exc:  # noqa: BLE001 - never return into the worker
        try:
            os.write(status_w, f"!boltz template sandbox setup failed: {type(exc).__name__}: {exc}\n".encode())
        except OSError:
            pass
    os._exit(127)


__all__ = ["TemplateLauncher", "TemplateError", "TEMPLATE_BOOTSTRAP"]
