"""Grade completions against test cases on one code runner: the executor under every reward here.

:class:`Grader` turns a batch of ``(completion, tests)`` pairs into scores. Every program of the
batch (one per test case) is queued at once on one :class:`~boltzlabs_gym.code.CodeRunner`, so a
whole GRPO group or batch is one round trip: each program runs in a sandbox no earlier program
touched, is killed with its whole process tree on its ``run_timeout``, and its sandbox is wiped
and checked (or hard-reset) after it: nothing it started survives, no memory it grew stays. A
program that runs into its timeout holds up its own sandbox only: the others take the batch's next
programs meanwhile.

Test cases, per sample, in the forms verl's ``sandbox_fusion`` grades (a dict or its JSON text):

* ``{"inputs": [...], "outputs": [...]}``: stdin/stdout cases (an output of ``None`` accepts any);
* ``{"assert_case": [...]}`` (or ``{"asserts": [...]}``, or a bare list of strings): assert cases,
  each run as the solution followed by the case; a case passes when the program exits 0.

Code is taken from the completion's last fenced block (```` ```python ... ``` ````, or any
```` ``` ```` block), else the whole completion; a chat completion (a list of messages) gives its
last message's content.

Bad input never raises (a trainer's step must not die of one sample); the score says what happened
and :attr:`Verdict.reason` why (also logged on ``boltzlabs_gym.integrations``):

=====================================  =======================================================
completion not a string / no messages  ``failure_score`` (0.0), reason ``"completion is not text"``
test cases missing or malformed         ``None`` (the reward does not apply), reason says what
a program that loops or overruns        its case fails (killed on ``run_timeout``)
megabytes of output                     cut at the runner's ``max_output_bytes``; graded as usual
runner closed, or its pool lost         ``None`` for every sample, reason ``"runner unavailable: ..."``
=====================================  =======================================================
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from typing_extensions import Unpack

from ..code import AsyncCodeRunner, CodeRunner, RunRequest, RunResult
from ..code.judges import assert_requests, judge_asserts, judge_stdio, stdio_requests
from ..code.runner import RunnerSettings

log = logging.getLogger("boltzlabs_gym.integrations")

__all__ = ["Grader", "Verdict", "TestCases", "extract_code", "parse_tests", "MalformedTests"]

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[ \t]*\n(.*?)```", re.DOTALL)


class MalformedTests(ValueError):
    """A sample's test cases are not in a form :func:`parse_tests` knows."""


@dataclass
class TestCases:
    """One sample's cases: stdin/stdout (``inputs``, ``outputs``) or assert cases (``asserts``)."""

    __test__ = False  # not a pytest class

    inputs: list[str] = field(default_factory=list)
    outputs: list[str | None] = field(default_factory=list)
    asserts: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.asserts) or len(self.inputs)


@dataclass
class Verdict:
    """One sample's grade: ``score`` (pass rate, ``failure_score``, or ``None`` when the reward does
    not apply), the per-case verdicts, and why (``reason``: ``"graded"`` or what went wrong)."""

    score: float | None
    reason: str
    passed: list[bool] = field(default_factory=list)
    statuses: list[str] = field(default_factory=list)

    def info(self) -> dict:
        """A flat dict for a framework's logged infos."""
        return {"score": self.score, "reason": self.reason, "passed": sum(self.passed), "cases": len(self.passed)}


def extract_code(completion: Any) -> str | None:
    """The program in a completion (see the module doc); ``None`` when the completion is not text."""
    if isinstance(completion, list):  # a conversation: the last message's content
        if not completion or not isinstance(completion[-1], dict):
            return None
        completion = completion[-1].get("content")
    if not isinstance(completion, str):
        return None
    blocks = _FENCE.findall(completion)
    if not blocks:
        return completion
    python = [body for lang, body in blocks if lang.lower() in ("python", "py", "python3")]
    return (python or [body for _, body in blocks])[-1]


def parse_tests(tests: Any) -> TestCases:
    """A sample's test cases (see the module doc); :class:`MalformedTests` saying what is wrong."""
    if isinstance(tests, (str, bytes)):
        try:
            tests = json.loads(tests)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise MalformedTests(f"test cases are not JSON: {exc}") from None
    if isinstance(tests, list):
        tests = {"assert_case": tests}
    if not isinstance(tests, dict):
        raise MalformedTests(f"test cases must be a dict or a list, got {type(tests).__name__}")
    asserts = tests.get("assert_case", tests.get("asserts"))
    if asserts is not None:
        if not isinstance(asserts, list) or not asserts or not all(isinstance(a, str) for a in asserts):
            raise MalformedTests("assert cases must be a non-empty list of strings")
        return TestCases(asserts=list(asserts))
    inputs, outputs = tests.get("inputs"), tests.get("outputs")
    if not isinstance(inputs, list) or not isinstance(outputs, list) or not inputs:
        raise MalformedTests("test cases need 'assert_case', or 'inputs' and 'outputs' lists")
    if len(inputs) != len(outputs):
        raise MalformedTests(f"{len(inputs)} inputs but {len(outputs)} outputs")
    if not all(isinstance(i, str) for i in inputs) or not all(o is None or isinstance(o, str) for o in outputs):
        raise MalformedTests("inputs must be strings and outputs strings or null")
    return TestCases(inputs=list(inputs), outputs=list(outputs))


@dataclass
class _Plan:
    """One sample: its verdict already (bad input), or its requests to run."""

    verdict: Verdict | None = None
    cases: TestCases | None = None
    requests: list[RunRequest] = field(default_factory=list)


class Grader:
    """Grades batches of completions on one :class:`~boltzlabs_gym.code.CodeRunner`, sync or async.

    Args:
        runner: the runner to use (shared; the grader does not close it), or ``None`` to start one
            of its own with ``runner_settings``, :class:`~boltzlabs_gym.code.CodeRunner`'s
            arguments as keywords (closed by :meth:`close`).
        run_timeout: seconds one test case may run; the program and everything it started is
            killed then, and the case fails.
        memory_limit_mb: the program's address-space limit (``<= 0``: only the sandbox's own).
        language: the programs' language (``python``, ``bash``, ``cpp``, ``nodejs``).
        failure_score: the score of a completion that is not text.
    """

    def __init__(
        self,
        runner: CodeRunner | None = None,
        *,
        run_timeout: float = 5.0,
        memory_limit_mb: int = -1,
        language: str = "python",
        failure_score: float = 0.0,
        **runner_settings: Unpack[RunnerSettings],
    ):
        if runner is not None and runner_settings:
            raise TypeError(f"Grader(runner) takes no settings of a new runner, got {sorted(runner_settings)}")
        self._own = runner is None
        self.runner = CodeRunner(**runner_settings) if runner is None else runner
        self._async = AsyncCodeRunner(runner=self.runner)
        self.run_timeout = float(run_timeout)
        self.memory_limit_mb = int(memory_limit_mb)
        self.language = language
        self.failure_score = failure_score

    # ------------------------------------------------------------------ grading
    def grade(self, completions: Sequence[Any], tests: Sequence[Any]) -> list[Verdict]:
        """One verdict per completion, graded against its ``tests``; every program in one round trip."""
        plans = self._plan(completions, tests)
        try:
            results = self.runner.run_many([r for p in plans for r in p.requests])
        except Exception as exc:  # noqa: BLE001 - closed or lost: no sample is graded, none raises
            return self._unavailable(plans, exc)
        return self._judge(plans, results)

    async def grade_async(self, completions: Sequence[Any], tests: Sequence[Any]) -> list[Verdict]:
        """:meth:`grade` for asyncio: awaits the runner without blocking the event loop."""
        plans = self._plan(completions, tests)
        try:
            results = await self._async.run_many([r for p in plans for r in p.requests])
        except Exception as exc:  # noqa: BLE001
            return self._unavailable(plans, exc)
        return self._judge(plans, results)

    async def __call__(self, completions: Sequence[Any], tests: Sequence[Any]) -> list[float | None]:
        """The plain async reward: ``await grader(completions, tests)`` -> one score per completion
        (``None`` where the reward does not apply), for AReaL- or OpenRLHF-style reward hooks to wrap."""
        return [v.score for v in await self.grade_async(completions, tests)]

    def _plan(self, completions: Sequence[Any], tests: Sequence[Any]) -> list[_Plan]:
        if len(completions) != len(tests):
            raise ValueError(f"{len(completions)} completions but {len(tests)} test-case entries")
        return [self._plan_one(c, t) for c, t in zip(completions, tests)]

    def _plan_one(self, completion: Any, tests: Any) -> _Plan:
        try:
            cases = parse_tests(tests)
        except MalformedTests as exc:
            return _Plan(Verdict(None, f"malformed test cases: {exc}"))
        code = extract_code(completion)
        if code is None:
            return _Plan(Verdict(self.failure_score, f"completion is not text ({type(completion).__name__})"))
        fields = {"language": self.language, "run_timeout": self.run_timeout, "memory_limit_mb": self.memory_limit_mb}
        if cases.asserts:
            requests = assert_requests(code, cases.asserts, **fields)
        else:
            requests = stdio_requests(code, cases.inputs, **fields)
        return _Plan(cases=cases, requests=requests)

    def _judge(self, plans: list[_Plan], results: list[RunResult]) -> list[Verdict]:
        verdicts, k = [], 0
        for plan in plans:
            if plan.verdict is not None:
                verdicts.append(plan.verdict)
                continue
            assert plan.cases is not None
            mine = results[k : k + len(plan.requests)]
            k += len(plan.requests)
            grade = judge_asserts(mine) if plan.cases.asserts else judge_stdio(mine, plan.cases.outputs)
            statuses = [_status(r) for r in mine]
            verdicts.append(Verdict(grade.score, "graded", grade.passed, statuses))
        for v in verdicts:
            if v.reason != "graded":
                log.warning("reward: %s -> %s", v.reason, v.score)
        return verdicts

    def _unavailable(self, plans: list[_Plan], exc: Exception) -> list[Verdict]:
        reason = f"runner unavailable: {type(exc).__name__}: {exc}"
        log.error("reward: %s; %d samples get None", reason, len(plans))
        return [p.verdict if p.verdict is not None else Verdict(None, reason) for p in plans]

    # ------------------------------------------------------------------ closing
    def close(self) -> None:
        """Close the runner if the grader started it."""
        if self._own:
            self.runner.close()

    def __enter__(self) -> Grader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _status(result: RunResult) -> str:
    """A case's outcome in one word: the run's status (``TimeLimitExceeded`` ...) or the sandbox's."""
    run = result.run_result
    return run.status if run is not None else result.status
