"""TRL: reward functions for ``GRPOTrainer(reward_funcs=[...])`` and a class for ``environment_factory=``.

Rewards (sync :class:`CodeReward`, async :class:`AsyncCodeReward`), called by TRL as
``reward(prompts, completions, **columns) -> list[float | None]``: each completion is graded against
its row's test cases (column ``tests_column``, in a form :mod:`~boltzlabs_gym.integrations.grading`
reads) on one :class:`~boltzlabs_gym.integrations.grading.Grader`, the whole batch in one round trip.
The score is the pass rate; ``None`` where a row has no (valid) test cases, so TRL leaves this reward
out for that sample. A program that loops forever is killed on the grader's ``run_timeout`` and
fails its cases (score 0.0 if it fails them all). The reason for each score goes to TRL's completion
table (``log_extra``, column ``"<name>_reason"``) and to :attr:`CodeReward.last_infos`::

    grader = Grader(run_timeout=2.0, envs_per_lane=8, lanes=2)
    trainer = GRPOTrainer(model=..., reward_funcs=[CodeReward(grader)], train_dataset=ds)  # ds has "tests"

Environment: :func:`code_environment` returns a class for ``environment_factory=``: each instance
leases one env of an :class:`~boltzlabs_gym.integrations.leases.EnvLeases` pool for its rollout;
``reset(**row)`` gives the previous rollout's env back (killed, wiped) and leases one, ``run_code``
is its one tool, ``get_reward()`` grades the last program run against the row's tests.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import trl  # noqa: F401  (the extra: this module is for TRL, and says so when TRL is missing)

from .grading import Grader, Verdict
from .leases import EnvLeases, describe_run

__all__ = ["AsyncCodeReward", "CodeReward", "code_environment", "BoltzCodeEnvironment"]


class CodeReward:
    """A TRL reward function: ``(prompts, completions, **kwargs) -> list[float | None]`` (see module doc).

    ``grader``: the executor (shared; not closed here). ``tests_column``: the dataset column with
    each row's test cases. ``name``: the reward's name in TRL's logs.
    """

    def __init__(self, grader: Grader, *, tests_column: str = "tests", name: str = "boltz_code"):
        self.grader = grader
        self.tests_column = tests_column
        self.__name__ = name
        #: One dict per sample of the last call: score, reason, cases passed, cases.
        self.last_infos: list[dict] = []

    def _tests(self, completions: Sequence[Any], kwargs: dict) -> list[Any]:
        tests = kwargs.get(self.tests_column)
        if not isinstance(tests, (list, tuple)) or len(tests) != len(completions):
            return [None] * len(completions)  # each sample: "malformed test cases", score None
        return list(tests)

    def _report(self, verdicts: list[Verdict], kwargs: dict) -> list[float | None]:
        self.last_infos = [v.info() for v in verdicts]
        log_extra = kwargs.get("log_extra")
        if callable(log_extra):
            try:
                log_extra(f"{self.__name__}_reason", [v.reason for v in verdicts])
            except Exception:  # noqa: BLE001 - logging must not fail the step
                pass
        return [v.score for v in verdicts]

    def __call__(self, prompts: Sequence[Any], completions: Sequence[Any], **kwargs: Any) -> list[float | None]:
        """Grade ``completions`` against ``kwargs[tests_column]``; one score (or ``None``) each."""
        return self._report(self.grader.grade(completions, self._tests(completions, kwargs)), kwargs)


class AsyncCodeReward(CodeReward):
    """:class:`CodeReward` as a coroutine: TRL runs it on its event loop beside other async rewards."""

    async def __call__(self, prompts: Sequence[Any], completions: Sequence[Any], **kwargs: Any) -> list[float | None]:  # type: ignore[override]
        """Grade ``completions`` against ``kwargs[tests_column]``; one score (or ``None``) each."""
        verdicts = await self.grader.grade_async(completions, self._tests(completions, kwargs))
        return self._report(verdicts, kwargs)


class BoltzCodeEnvironment:
    """A TRL environment holding one pool env per rollout. Made by :func:`code_environment`, which
    binds ``leases``, ``grader``, ``tests_column`` and ``run_timeout``; TRL calls it with no arguments.

    Public methods other than ``reset`` and ``get_reward`` become the model's tools in TRL: there is
    one, :meth:`run_code`.
    """

    leases: EnvLeases
    grader: Grader | None = None
    tests_column: str = "tests"
    run_timeout: float = 5.0

    def __init__(self) -> None:
        self._held: list[int] = []  # the leased env's index while a rollout holds one
        self._tests: Any = None
        self._last_code: str | None = None
        weakref.finalize(self, _give_back, self.leases, self._held)

    def reset(self, **row: Any) -> str | None:
        """Start a rollout: give the last rollout's env back (killed, wiped) and lease one; keep the row's tests."""
        _give_back(self.leases, self._held)
        self._held.append(self.leases.acquire())
        self._tests, self._last_code = row.get(self.tests_column), None
        return None

    def run_code(self, code: str) -> str:
        """Run a Python program in this rollout's sandbox and return what it printed.

        Files the program writes stay for the rollout's next program. It is killed (with everything
        it started) after the time limit.

        Args:
            code: The Python source code to run.

        Returns:
            The exit status, then the program's standard output and standard error.
        """
        if not isinstance(code, str):
            return f"error: code must be a string, got {type(code).__name__}"
        if not self._held:
            self.reset()
        self._last_code = code
        return describe_run(self.leases.run(self._held[0], code, run_timeout=self.run_timeout))

    def get_reward(self) -> float:
        """The rollout's reward: the pass rate of the last program run against the row's tests (0.0
        without a program; 0.0 without a grader or valid tests, with the reason logged)."""
        if self.grader is None or self._last_code is None:
            return 0.0
        [verdict] = self.grader.grade([self._last_code], [self._tests])
        return verdict.score if verdict.score is not None else 0.0


def _give_back(leases: EnvLeases, held: list[int]) -> None:
    while held:
        leases.release(held.pop())


def code_environment(
    leases: EnvLeases, grader: Grader | None = None, *, tests_column: str = "tests", run_timeout: float = 5.0
) -> type[BoltzCodeEnvironment]:
    """A :class:`BoltzCodeEnvironment` class bound to ``leases`` (and ``grader`` for ``get_reward``),
    for ``GRPOTrainer(environment_factory=code_environment(leases, grader))``."""
    attrs = {"leases": leases, "grader": grader, "tests_column": tests_column, "run_timeout": float(run_timeout)}
    return type("BoltzCodeEnvironment", (BoltzCodeEnvironment,), attrs)
