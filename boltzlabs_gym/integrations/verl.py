"""verl: ``compute_score`` (sync and async) and a ``BaseTool`` for multi-turn rollouts.

``compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs)`` is verl's
custom reward function signature (``custom_reward_function.path``/``.name`` in its config). Ground
truth holds the test cases in the forms verl's ``sandbox_fusion`` module grades: stdin/stdout
(``{"inputs", "outputs"}``) or asserts (``{"assert_case"}``), a dict or its JSON text. The answer is
a dict, as verl's reward managers take it: ``{"score": pass rate, "reason": ..., "passed": ...,
"cases": ...}``; ``score`` is 0.0 (never ``None``: verl needs a number) where the reward does not
apply, with the reason. Batched reward managers may pass ``data_sources=``, ``solution_strs=``,
``ground_truths=``, ``extra_infos=`` lists instead: then every program of the batch is graded in one
round trip and a list comes back.

The module-level :func:`compute_score` and :func:`compute_score_async` use a default
:class:`~boltzlabs_gym.integrations.grading.Grader` started on first use (``configure`` sets another).

:class:`CodeTool` is a verl ``BaseTool``: ``create`` leases one pool env for the trajectory,
``execute`` runs the ``code`` parameter in it, ``calc_reward`` grades the last program against the
instance's ``ground_truth`` (passed to ``create``), ``release`` gives the env back (killed, wiped).
verl must be importable for it (``verl.tools.base_tool``); the reward functions need only this module.
"""

from __future__ import annotations

import threading
from typing import Any
from uuid import uuid4

from .grading import Grader, Verdict
from .leases import EnvLeases, describe_run

__all__ = ["compute_score", "compute_score_async", "configure", "code_tool_class"]

_default: dict[str, Any] = {}
_default_lock = threading.Lock()


def configure(grader: Grader | None = None, leases: EnvLeases | None = None) -> None:
    """Set the grader (and the leases :class:`CodeTool` uses) the module-level functions use."""
    with _default_lock:
        if grader is not None:
            _default["grader"] = grader
        if leases is not None:
            _default["leases"] = leases


def _grader() -> Grader:
    with _default_lock:
        if "grader" not in _default:
            _default["grader"] = Grader()
        return _default["grader"]


def _answer(v: Verdict) -> dict:
    return {**v.info(), "score": v.score if v.score is not None else 0.0}


def _batch(solution_str: Any, ground_truth: Any, kwargs: dict) -> tuple[Grader, list, list, bool]:
    """The grader, solutions and ground truths of one call, and whether it came as a batch."""
    grader = kwargs.pop("grader", None) or _grader()
    if "solution_strs" in kwargs:
        solutions, truths, batched = list(kwargs["solution_strs"]), list(kwargs.get("ground_truths") or []), True
    else:
        solutions, truths, batched = [solution_str], [ground_truth], False
    return grader, solutions, truths if len(truths) == len(solutions) else [None] * len(solutions), batched


def compute_score(
    data_source: Any = None, solution_str: Any = None, ground_truth: Any = None, extra_info: Any = None, **kwargs: Any
) -> dict | list[dict]:
    """verl's reward function: grade ``solution_str`` against ``ground_truth``'s test cases (see module doc)."""
    grader, solutions, truths, batched = _batch(solution_str, ground_truth, kwargs)
    answers = [_answer(v) for v in grader.grade(solutions, truths)]
    return answers if batched else answers[0]


async def compute_score_async(
    data_source: Any = None, solution_str: Any = None, ground_truth: Any = None, extra_info: Any = None, **kwargs: Any
) -> dict | list[dict]:
    """:func:`compute_score` as a coroutine (verl's async reward loop)."""
    grader, solutions, truths, batched = _batch(solution_str, ground_truth, kwargs)
    answers = [_answer(v) for v in await grader.grade_async(solutions, truths)]
    return answers if batched else answers[0]


def code_tool_class() -> type:
    """verl's ``BaseTool`` subclass (imports verl): ``CodeTool(config, tool_schema)``, as verl's tool
    registry builds tools. ``config`` may name ``run_timeout``; the leases and grader are the module's."""
    from verl.tools.base_tool import BaseTool
    from verl.tools.schemas import ToolResponse

    class CodeTool(BaseTool):
        """Runs the model's ``code`` in the trajectory's own sandbox; the reward grades its last program."""

        def __init__(self, config: dict, tool_schema: Any):
            super().__init__(config, tool_schema)
            self.run_timeout = float((config or {}).get("run_timeout", 5.0))
            self._instances: dict[str, dict] = {}

        async def create(self, instance_id: str | None = None, **kwargs: Any) -> tuple[str, Any]:
            instance_id = instance_id or str(uuid4())
            leases = _leases()
            index = await _to_thread(leases.acquire)
            self._instances[instance_id] = {"index": index, "ground_truth": kwargs.get("ground_truth"), "code": None}
            return instance_id, ToolResponse()

        async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> tuple[Any, float, dict]:
            state = self._instances.get(instance_id)
            code = (parameters or {}).get("code")
            if state is None or not isinstance(code, str):
                why = "unknown instance" if state is None else "parameter 'code' must be a string"
                return ToolResponse(text=f"error: {why}"), 0.0, {"error": why}
            state["code"] = code
            result = await _leases().run_async(state["index"], code, run_timeout=self.run_timeout)
            text = describe_run(result)
            return ToolResponse(text=text), 0.0, {"status": result.status}

        async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
            state = self._instances.get(instance_id)
            if state is None or state["code"] is None:
                return 0.0
            [verdict] = await _grader().grade_async([state["code"]], [state["ground_truth"]])
            return verdict.score if verdict.score is not None else 0.0

        async def release(self, instance_id: str, **kwargs: Any) -> None:
            state = self._instances.pop(instance_id, None)
            if state is not None:
                await _leases().release_async(state["index"])

    return CodeTool


def _leases() -> EnvLeases:
    with _default_lock:
        if "leases" not in _default:
            _default["leases"] = EnvLeases()
        return _default["leases"]


async def _to_thread(fn: Any, *args: Any, **kwargs: Any) -> Any:
    import asyncio

    return await asyncio.to_thread(fn, *args, **kwargs)
