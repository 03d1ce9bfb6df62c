"""Running untrusted programs for rewards and tools: a code runner on the pool, and grading helpers.

* :class:`CodeRunner` (threads) and :class:`AsyncCodeRunner` (asyncio): ``run``, ``run_many``,
  ``grade_stdio``, ``grade_asserts``; every program in a freshly forked sandbox.
* :mod:`~boltzlabs_gym.code.runs`: :class:`RunRequest`, :class:`RunResult`,
  :class:`CommandResult` and SandboxFusion's status rules.
* :mod:`~boltzlabs_gym.code.judges`: verl's two test styles.

The HTTP server that speaks SandboxFusion's API over this runner is :mod:`boltzlabs_gym.code.server`.
"""

from .judges import Grade, assert_requests, judge_asserts, judge_stdio, stdio_requests
from .runner import RUNNER_ENV_DIR, AsyncCodeRunner, CodeRunner, QueueFullError, RunnerStats
from .runs import LANGUAGES, CommandResult, RunRequest, RunResult, run_status

__all__ = [
    "LANGUAGES",
    "RUNNER_ENV_DIR",
    "AsyncCodeRunner",
    "CodeRunner",
    "CommandResult",
    "Grade",
    "QueueFullError",
    "RunRequest",
    "RunResult",
    "RunnerStats",
    "assert_requests",
    "judge_asserts",
    "judge_stdio",
    "run_status",
    "stdio_requests",
]
