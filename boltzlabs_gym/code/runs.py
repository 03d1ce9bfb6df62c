"""What a code run is asked to do and what comes back, shaped as SandboxFusion shapes them.

A :class:`RunRequest` becomes one step's action of the runner's env; its observation becomes a
:class:`RunResult` with a :class:`CommandResult` for the compile step (C++ only) and the run.
:func:`run_status` applies SandboxFusion's rules (``parse_run_status``) for the overall status:

* a step with status ``Error`` (the sandbox's own failure) -> ``SandboxError``, its stderr the message;
* else a ``TimeLimitExceeded`` step -> ``Failed``;
* else a non-zero return code -> ``Failed``;
* else ``Success``.

>>> run = CommandResult(status="Finished", execution_time=0.01, return_code=1, stdout="", stderr="boom")
>>> run_status(None, run)
('Failed', '')
>>> run_status(None, CommandResult(status="Error", stderr="no sandbox"))
('SandboxError', 'no sandbox')
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .languages import SERVED

__all__ = [
    "ERROR",
    "FAILED",
    "FINISHED",
    "LANGUAGES",
    "SANDBOX_ERROR",
    "SUCCESS",
    "TIME_LIMIT_EXCEEDED",
    "CommandResult",
    "RunRequest",
    "RunResult",
    "run_status",
]

#: A command's status.
FINISHED, ERROR, TIME_LIMIT_EXCEEDED = "Finished", "Error", "TimeLimitExceeded"
#: A run's status.
SUCCESS, FAILED, SANDBOX_ERROR = "Success", "Failed", "SandboxError"
#: The languages the runner's env serves, in SandboxFusion's names (each needs its toolchain on the
#: host: :func:`boltzlabs_gym.code.languages.availability` says which this one has).
LANGUAGES = SERVED


@dataclass
class RunRequest:
    """One program to run: its source, language, stdin, files (name -> base64) and limits.

    ``files`` and ``fetch_files`` name paths as SandboxFusion does: relative ones in the workspace,
    absolute ones (``/mnt/data/x.csv``) inside the sandbox's private places (``/mnt``, ``/data``,
    ``/home``, ``/tmp``, ``/dev/shm``; the namespaces backend only); any other fails the run as a
    ``SandboxError`` naming it (``docs/code-server.md``, "File paths").
    ``memory_limit_mb`` <= 0 means no per-program limit beyond the sandbox's own.
    """

    code: str
    language: str = "python"
    stdin: str | None = None
    files: Mapping[str, str | None] = field(default_factory=dict)
    fetch_files: Sequence[str] = ()
    run_timeout: float = 10.0
    compile_timeout: float = 10.0
    memory_limit_mb: int = -1

    @classmethod
    def of(cls, item: RunRequest | Mapping[str, Any] | str) -> RunRequest:
        """A request from a request, a dict of its fields (SandboxFusion's ``memory_limit_MB`` too) or bare code."""
        if isinstance(item, RunRequest):
            return item
        if isinstance(item, str):
            return cls(code=item)
        fields = dict(item)
        if "memory_limit_MB" in fields:
            fields["memory_limit_mb"] = fields.pop("memory_limit_MB")
        return cls(**fields)

    def to_action(self, max_output_bytes: int) -> dict:
        """The runner env's step action for this request."""
        return {
            "language": self.language,
            "code": self.code,
            "stdin": self.stdin or "",
            "files": dict(self.files),
            "fetch_files": list(self.fetch_files),
            "run_timeout": float(self.run_timeout),
            "compile_timeout": float(self.compile_timeout),
            "memory_limit_mb": int(self.memory_limit_mb),
            "max_output_bytes": int(max_output_bytes),
        }


@dataclass
class CommandResult:
    """One command's outcome: ``status`` Finished / Error / TimeLimitExceeded, its wall time in
    seconds, return code (negative: killed by that signal; ``None`` after a timeout), and its
    output, decoded as UTF-8 with replacement. ``truncated`` maps ``"stdout"``/``"stderr"`` to the
    bytes dropped past the output limit (empty: nothing was)."""

    status: str
    execution_time: float | None = None
    return_code: int | None = None
    stdout: str | None = None
    stderr: str | None = None
    truncated: dict[str, int] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | None) -> CommandResult | None:
        if data is None:
            return None
        return cls(
            status=str(data.get("status", ERROR)),
            execution_time=data.get("execution_time"),
            return_code=data.get("return_code"),
            stdout=data.get("stdout"),
            stderr=data.get("stderr"),
            truncated={str(k): int(v) for k, v in (data.get("truncated") or {}).items()},
        )

    def to_json(self) -> dict:
        """SandboxFusion's ``CommandRunResult`` fields (``truncated`` is not one of them)."""
        return {
            "status": self.status,
            "execution_time": self.execution_time,
            "return_code": self.return_code,
            "stdout": self.stdout,
            "stderr": self.stderr,
        }


@dataclass
class RunResult:
    """A run's outcome: ``status`` Success / Failed / SandboxError (see :func:`run_status`), the
    compile step's result (``None`` but for compiled languages), the run's (``None`` when
    compilation failed), the fetched files (name -> base64), and the isolation it ran under."""

    status: str
    message: str = ""
    compile_result: CommandResult | None = None
    run_result: CommandResult | None = None
    files: dict[str, str] = field(default_factory=dict)
    isolation: str = ""

    @property
    def ok(self) -> bool:
        """Whether it ran and exited with status 0 (``status == "Success"``)."""
        return self.status == SUCCESS

    @property
    def stdout(self) -> str:
        """The run's stdout ('' if it did not run)."""
        return (self.run_result.stdout if self.run_result else None) or ""

    @property
    def stderr(self) -> str:
        """The run's stderr, or the compiler's when it did not run."""
        result = self.run_result or self.compile_result
        return (result.stderr if result else None) or ""

    @classmethod
    def from_observation(cls, obs: Mapping[str, Any], isolation: str) -> RunResult:
        """The result the runner env's observation describes."""
        compile_result = CommandResult.from_json(obs.get("compile_result"))
        run_result = CommandResult.from_json(obs.get("run_result"))
        status, message = run_status(compile_result, run_result)
        files = {str(k): str(v) for k, v in (obs.get("files") or {}).items()}
        return cls(status, message, compile_result, run_result, files, isolation)

    @classmethod
    def sandbox_error(cls, message: str, isolation: str = "") -> RunResult:
        """A run the sandbox could not carry out (an env that died or missed its deadline, say)."""
        return cls(SANDBOX_ERROR, message, None, CommandResult(status=ERROR, stderr=message), {}, isolation)


def run_status(compile_result: CommandResult | None, run_result: CommandResult | None) -> tuple[str, str]:
    """SandboxFusion's status rules: ``(status, message)`` for a run with these command results."""
    steps = [r for r in (compile_result, run_result) if r is not None]
    for r in steps:
        if r.status == ERROR:
            return SANDBOX_ERROR, r.stderr or ""
    if any(r.status == TIME_LIMIT_EXCEEDED for r in steps):
        return FAILED, ""
    if any(r.return_code is not None and r.return_code != 0 for r in steps):
        return FAILED, ""
    return SUCCESS, ""
