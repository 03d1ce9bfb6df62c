"""Grading programs the two ways verl's sandbox-fusion reward does: stdin/stdout cases and assert cases.

* stdin/stdout: one run per input; a case passes when the run succeeds (``Success``) and its
  stdout equals the expected output up to trailing newlines; an expected output of ``None``
  accepts any output of a successful run (verl's rule in ``_process_single_case``).
* asserts: one run per assert case, the solution followed by the case; a case passes when the
  program exits with status 0.

The request builders and judges are pure functions;
:meth:`~boltzlabs_gym.code.CodeRunner.grade_stdio` and ``grade_asserts`` run them.

>>> from boltzlabs_gym.code.runs import CommandResult, RunResult
>>> ok = RunResult("Success", run_result=CommandResult("Finished", 0.01, 0, "3\\n", ""))
>>> judge_stdio([ok, ok], ["3", "4\\n"]).passed
[True, False]
>>> [r.code for r in assert_requests("def f(): return 1", ["assert f() == 1"])]
['def f(): return 1\\nassert f() == 1\\n']
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .runs import SUCCESS, RunRequest, RunResult

__all__ = ["Grade", "assert_requests", "judge_asserts", "judge_stdio", "stdio_requests"]


@dataclass
class Grade:
    """Per-case verdicts and runs; :attr:`score` is the pass rate."""

    passed: list[bool]
    results: list[RunResult]

    @property
    def score(self) -> float:
        """Fraction of cases passed (0.0 without cases)."""
        return sum(self.passed) / len(self.passed) if self.passed else 0.0

    @property
    def all_passed(self) -> bool:
        """Whether there were cases and every one passed."""
        return bool(self.passed) and all(self.passed)


def stdio_requests(code: str, inputs: list[str], **fields: Any) -> list[RunRequest]:
    """One request per stdin in ``inputs`` (``fields``: language, run_timeout, ... as in :class:`RunRequest`)."""
    return [RunRequest(code=code, stdin=stdin, **fields) for stdin in inputs]


def judge_stdio(results: list[RunResult], outputs: list[str | None]) -> Grade:
    """Compare each run's stdout with its expected output (trailing newlines ignored)."""
    if len(results) != len(outputs):
        raise ValueError(f"{len(results)} runs but {len(outputs)} expected outputs")
    passed = []
    for result, expected in zip(results, outputs):
        ran = result.status == SUCCESS and result.run_result is not None
        same = expected is None or result.stdout.rstrip("\n") == str(expected).rstrip("\n")
        passed.append(ran and same)
    return Grade(passed, results)


def assert_requests(code: str, asserts: list[str], **fields: Any) -> list[RunRequest]:
    """One program per assert case: ``code``, a newline, the case."""
    return [RunRequest(code=f"{code}\n{case}\n", **fields) for case in asserts]


def judge_asserts(results: list[RunResult]) -> Grade:
    """A case passes when its program exits with status 0."""
    return Grade([r.status == SUCCESS for r in results], results)
