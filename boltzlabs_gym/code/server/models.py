"""SandboxFusion's request and response models, field for field (pydantic), and this server's size limits.

Field names, defaults and enums follow ``sandbox/server/sandbox_api.py`` and
``sandbox/runners/types.py`` of github:bytedance/SandboxFusion, so its clients (verl's
``call_sandbox_api``, ROLL, SkyRL) parse the answers unchanged. ``language`` accepts SandboxFusion's
29 names (any other is a 422, as there); the ones this server does not run get a ``SandboxError``
whose message names the supported ones.
"""

from __future__ import annotations

from enum import Enum
from typing import Literal

from pydantic import BaseModel, Field, field_validator

__all__ = [
    "MAX_CODE_BYTES",
    "MAX_FILES_BYTES",
    "MAX_STDIN_BYTES",
    "CommandRunResult",
    "CommandRunStatus",
    "Language",
    "RunCodeRequest",
    "RunCodeResponse",
    "RunStatus",
]

#: Largest ``code`` accepted (characters); larger requests get a 422.
MAX_CODE_BYTES = 1 << 20
#: Largest ``stdin`` accepted (characters).
MAX_STDIN_BYTES = 16 << 20
#: Largest total of ``files`` accepted (base64 characters).
MAX_FILES_BYTES = 32 << 20

Language = Literal[
    "python", "cpp", "nodejs", "go", "go_test", "java", "php", "csharp", "bash", "typescript", "sql",
    "rust", "cuda", "lua", "R", "perl", "D_ut", "ruby", "scala", "julia", "pytest", "junit",
    "kotlin_script", "jest", "verilog", "python_gpu", "lean", "swift", "racket",
]  # fmt: skip


class CommandRunStatus(str, Enum):
    """A command's outcome."""

    Finished = "Finished"
    Error = "Error"
    TimeLimitExceeded = "TimeLimitExceeded"


class RunStatus(str, Enum):
    """A run's outcome (SandboxFusion's ``parse_run_status`` rules)."""

    Success = "Success"
    Failed = "Failed"
    SandboxError = "SandboxError"


class CommandRunResult(BaseModel):
    """One command's result: status, wall seconds, return code, stdout, stderr."""

    status: CommandRunStatus
    execution_time: float | None = None
    return_code: int | None = None
    stdout: str | None = None
    stderr: str | None = None


class RunCodeRequest(BaseModel):
    """``POST /run_code``'s body."""

    compile_timeout: float = Field(10, gt=0, description="compile timeout for compiled languages")
    run_timeout: float = Field(10, gt=0, description="code run timeout")
    memory_limit_MB: int = Field(-1, description="maximum memory allowed in megabytes")
    code: str = Field(..., max_length=MAX_CODE_BYTES, examples=['print("hello")'], description="the code to run")
    stdin: str | None = Field(None, max_length=MAX_STDIN_BYTES, description="optional string to pass into stdin")
    language: Language = Field(..., examples=["python"], description="the language or execution mode")
    files: dict[str, str | None] = Field({}, description="a dict from file path to base64 encoded file content")
    fetch_files: list[str] = Field([], description="a list of file paths to fetch after code execution")

    @field_validator("files")
    @classmethod
    def _files_fit(cls, files: dict[str, str | None]) -> dict[str, str | None]:
        total = sum(len(v or "") for v in files.values())
        if total > MAX_FILES_BYTES:
            raise ValueError(f"files hold {total} base64 characters; at most {MAX_FILES_BYTES} are accepted")
        return files


class RunCodeResponse(BaseModel):
    """``POST /run_code``'s answer."""

    status: RunStatus
    message: str
    compile_result: CommandRunResult | None = None
    run_result: CommandRunResult | None = None
    executor_pod_name: str | None = None
    files: dict[str, str] = {}
