"""What every isolation backend provides, and the per-env limits they enforce.

A backend turns a :class:`LaunchSpec` (the command, the env's two directories, the
three pipe ends, the limits) into a running, isolated process tree and returns a
:class:`Launched` handle that can kill that whole tree. The worker knows nothing
else about isolation.

Setup runs in a freshly forked child (``prepare_child``), so the same code serves a
process started by exec and, later, one forked from a warm template.
"""

from __future__ import annotations

import os
import resource
import signal
from dataclasses import dataclass, field
from typing import Mapping

#: Inside a namespace sandbox the env directory and the workspace have fixed paths.
SANDBOX_ENV_DIR = "/env"
SANDBOX_WORKSPACE = "/workspace"
#: The library's own runtime (the env-side helper) is mounted here, read-only.
SANDBOX_RUNTIME = "/opt/boltzlabs"


class SandboxUnavailable(RuntimeError):
    """The requested isolation cannot be had on this host; the message says why and how."""


@dataclass(frozen=True)
class Limits:
    """Per-env resource limits. ``None`` means no limit of that kind.

    Exceeding one kills that env alone; the worker reports it like a crash.
    """

    memory_bytes: int | None = 2 << 30
    pids: int | None = 128
    open_files: int | None = 1024
    file_size_bytes: int | None = 256 << 20
    #: CPU seconds the env may burn in one step beyond the wall deadline (RLIMIT_CPU backstop).
    cpu_seconds_per_step: float | None = 10.0
    tmpfs_bytes: int = 64 << 20

    def to_json(self) -> dict:
        return dict(self.__dict__)

    @classmethod
    def from_json(cls, data: Mapping | None) -> "Limits":
        if not data:
            return cls()
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown limit(s) {sorted(unknown)}; known: {sorted(cls.__dataclass_fields__)}")
        return cls(**data)


@dataclass(frozen=True)
class IsolationReport:
    """Which backend is in force and which properties it actually provides."""

    backend: str
    properties: Mapping[str, bool | str]
    notes: tuple[str, ...] = ()

    @property
    def missing(self) -> tuple[str, ...]:
        return tuple(k for k, v in self.properties.items() if v is False)

    def to_json(self) -> dict:
        return {"backend": self.backend, "properties": dict(self.properties), "notes": list(self.notes)}

    @classmethod
    def from_json(cls, data: Mapping) -> "IsolationReport":
        return cls(data["backend"], dict(data["properties"]), tuple(data.get("notes", ())))

    def __str__(self) -> str:
        on = ",".join(k for k, v in self.properties.items() if v is True)
        off = ",".join(self.missing)
        return f"isolation={self.backend} (in force: {on or 'none'}; missing: {off or 'none'})"


@dataclass
class LaunchSpec:
    """Everything a backend needs to start one env process."""

    argv: list[str]
    env_dir: str
    workspace: str
    stdin_fd: int
    stdout_fd: int
    stderr_fd: int
    env: dict[str, str] = field(default_factory=dict)
    limits: Limits = field(default_factory=Limits)
    #: host directory -> path inside the sandbox, mounted read-only (the runtime).
    ro_binds: dict[str, str] = field(default_factory=dict)
    index: int = 0


@dataclass
class Launched:
    """A running env process tree. ``pid`` is the worker's direct child."""

    pid: int
    kill_tree: "callable"
    #: extra pids the worker must reap (e.g. a pid-namespace init that is not its child).
    cleanup: "callable" = lambda: None
    setup_ms: float = 0.0

    def kill(self) -> None:
        self.kill_tree()


def apply_rlimits(limits: Limits, *, memory_via_rlimit: bool, pids_via_rlimit: bool) -> None:
    """Set the rlimits of the calling (child) process."""

    def cap(res: int, value: int | None) -> None:
        if value is not None:
            resource.setrlimit(res, (value, value))

    if limits.file_size_bytes is not None:
        cap(resource.RLIMIT_FSIZE, int(limits.file_size_bytes))
    cap(resource.RLIMIT_NOFILE, limits.open_files)
    cap(resource.RLIMIT_CORE, 0)
    if memory_via_rlimit and limits.memory_bytes is not None:
        cap(resource.RLIMIT_AS, int(limits.memory_bytes))
    if pids_via_rlimit and limits.pids is not None:
        cap(resource.RLIMIT_NPROC, limits.pids)


def child_exec(spec: LaunchSpec, workdir: str) -> None:
    """Last steps in the child: wire fds 0/1/2, close the rest, exec. Never returns."""
    os.dup2(spec.stdin_fd, 0)
    os.dup2(spec.stdout_fd, 1)
    os.dup2(spec.stderr_fd, 2)
    os.closerange(3, _max_fd())
    os.chdir(workdir)
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    os.execve(spec.argv[0], spec.argv, spec.env)


def _max_fd() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 65536


def fork_child(body) -> int:
    """Fork; in the child run ``body()`` (which must exec or raise); report failures on fd 2.

    The error text lands in the env's stderr pipe, so a failed start is reported
    with its reason like any other start-up crash.
    """
    pid = os.fork()
    if pid == 0:  # child
        try:
            body()
        except BaseException as exc:  # noqa: BLE001 - the child must never return into the worker
            try:
                os.write(2, f"boltzlabs sandbox setup failed: {type(exc).__name__}: {exc}\n".encode())
            finally:
                os._exit(127)
        os._exit(127)
    return pid


def kill_process_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
