"""Per-env limits and the isolation report: what a pool asks a worker for, and what it is told.

Standard library only: the pool, the worker and the env side (which applies the limits to
itself) all read them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    """Per-env resource limits. ``None`` means no limit of that kind.

    Exceeding one kills that env alone; the worker reports it like a crash.
    """

    memory_bytes: int | None = 2 << 30
    pids: int | None = 128
    open_files: int | None = 1024
    file_size_bytes: int | None = 256 << 20
    #: CPU seconds the env may burn in one step beyond the wall deadline. The wall deadline is the
    #: worker's; backends only use this to size the RLIMIT_CPU backstop (see ``cpu_seconds_total``).
    cpu_seconds_per_step: float | None = 10.0
    #: size of each private tmpfs inside a namespace sandbox (/tmp and /dev/shm); charged to the
    #: env's memory cgroup where there is one.
    tmpfs_bytes: int = 64 << 20
    #: RLIMIT_CPU (soft = hard, so SIGKILL at the limit) for every process of the env, counted
    #: over the process's whole life, not per step. ``None``: ``max(3600, 360 * cpu_seconds_per_step)``
    #: seconds, a generous backstop behind the worker's per-step wall deadline. The worker can
    #: tighten it per step with :func:`extend_cpu_backstop`.
    cpu_seconds_total: float | None = None

    def cpu_backstop_seconds(self) -> int | None:
        if self.cpu_seconds_total is not None:
            return max(1, int(self.cpu_seconds_total))
        if self.cpu_seconds_per_step is None:
            return None
        return int(max(3600.0, 360.0 * self.cpu_seconds_per_step))

    def to_json(self) -> dict:
        return dict(self.__dict__)

    @classmethod
    def from_json(cls, data: Mapping | None) -> Limits:
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
    #: How many envs share each sandbox (a pool's ``envs_per_sandbox``): the properties hold
    #: between sandboxes, not between the envs of one.
    envs_per_sandbox: int = 1

    @property
    def missing(self) -> tuple[str, ...]:
        return tuple(k for k, v in self.properties.items() if v is False)

    def to_json(self) -> dict:
        return {
            "backend": self.backend,
            "properties": dict(self.properties),
            "notes": list(self.notes),
            "envs_per_sandbox": self.envs_per_sandbox,
        }

    @classmethod
    def from_json(cls, data: Mapping) -> IsolationReport:
        k = data.get("envs_per_sandbox", 1)
        return cls(data["backend"], dict(data["properties"]), tuple(data.get("notes", ())), k if type(k) is int else 1)

    def for_envs_per_sandbox(self, k: int) -> IsolationReport:
        """This report for sandboxes of ``k`` envs each."""
        return dataclasses.replace(self, envs_per_sandbox=k)

    def __str__(self) -> str:
        on = ",".join(k for k, v in self.properties.items() if v is True)
        off = ",".join(self.missing)
        shared = f"; {self.envs_per_sandbox} envs per sandbox" if self.envs_per_sandbox > 1 else ""
        return f"isolation={self.backend} (in force: {on or 'none'}; missing: {off or 'none'}{shared})"
