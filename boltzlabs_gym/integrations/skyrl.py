"""SkyRL: a ``skyrl_gym`` ``BaseTextEnv`` whose trajectories each hold one pool env.

:class:`BoltzCodeEnv` (``BoltzCodeEnv(env_config=None, extras={})``, as SkyRL builds its envs):
``extras["reward_spec"]["ground_truth"]`` holds the test cases (see
:mod:`~boltzlabs_gym.integrations.grading`). ``init(prompt)`` leases one env of an
:class:`~boltzlabs_gym.integrations.leases.EnvLeases` pool; each ``step(action)`` runs the action's
program (its last fenced code block) in that env's sandbox and answers with its output; the
trajectory ends after ``max_turns`` steps (``env_config`` or ``extras``; 1 by default), when its
reward is the pass rate of the last program against the tests (graded in fresh sandboxes);
``close()`` gives the env back (killed, wiped).

:func:`register` registers it as ``"boltz_code"`` with ``skyrl_gym.register``, bound to the leases
and grader given.
"""

from __future__ import annotations

from typing import Any

import skyrl_gym
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput

from .grading import Grader, extract_code
from .leases import EnvLeases, describe_run

__all__ = ["BoltzCodeEnv", "register"]

_bound: dict[str, Any] = {}


class BoltzCodeEnv(BaseTextEnv):
    """A code env of one pool env per trajectory (see the module doc)."""

    def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None, *, leases=None, grader=None):
        super().__init__()
        extras = extras or {}
        self.leases: EnvLeases = leases or _bound["leases"]
        self.grader: Grader = grader or _bound["grader"]
        self.tests = (extras.get("reward_spec") or {}).get("ground_truth")
        config_turns = getattr(env_config, "max_turns", None) if env_config is not None else None
        self.max_turns = int(extras.get("max_turns") or config_turns or 1)
        self.run_timeout = float(extras.get("run_timeout", 5.0))
        self._index: int | None = None
        self._last_code: str | None = None

    def init(self, prompt: Any) -> tuple[Any, dict[str, Any]]:
        """Lease this trajectory's env; the prompt goes on as it is."""
        if self._index is None:
            self._index = self.leases.acquire()
        return prompt, {}

    def step(self, action: str) -> BaseTextEnvStepOutput:
        """Run the action's program in the trajectory's sandbox; the last turn is graded."""
        self.turns += 1
        if self._index is None:
            self.init([])
        assert self._index is not None
        code = extract_code(action)
        done = self.turns >= self.max_turns
        if code is None:
            return BaseTextEnvStepOutput(
                observations=[], reward=0.0, done=True, metadata={"reason": "action is not text"}
            )
        self._last_code = code
        result = self.leases.run(self._index, code, run_timeout=self.run_timeout)
        metadata: dict[str, Any] = {"status": result.status}
        reward = 0.0
        if done:
            [verdict] = self.grader.grade([code], [self.tests])
            reward = verdict.score if verdict.score is not None else 0.0
            metadata.update(verdict.info())
        text = describe_run(result)
        observations = [] if done else [{"role": "user", "content": text}]
        return BaseTextEnvStepOutput(observations=observations, reward=reward, done=done, metadata=metadata)

    def close(self) -> None:
        """Give the trajectory's env back: its processes killed, its workspace wiped."""
        index, self._index = self._index, None
        if index is not None:
            self.leases.release(index)


def register(leases: EnvLeases, grader: Grader, env_id: str = "boltz_code") -> str:
    """Register :class:`BoltzCodeEnv` with ``skyrl_gym.register`` as ``env_id``, bound to ``leases`` and
    ``grader``; ``skyrl_gym.make(env_id, env_config=..., extras=...)`` then builds one. The id."""
    _bound.update(leases=leases, grader=grader)
    if env_id not in skyrl_gym.envs.registration.registry:
        skyrl_gym.register(id=env_id, entry_point="boltzlabs_gym.integrations.skyrl:BoltzCodeEnv")
    return env_id
