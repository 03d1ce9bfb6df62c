"""A SkyRL environment on the pool: each trajectory holds one sandboxed env, two turns, then a reward.

:func:`boltzlabs_gym.integrations.skyrl.register` registers ``BoltzCodeEnv`` (a ``skyrl_gym``
``BaseTextEnv``) as ``"boltz_code"``; SkyRL's generator then builds one per trajectory with
``skyrl_gym.make("boltz_code", env_config=..., extras=row)``. Here two trajectories are played by
hand the way SkyRL's generator plays them (``init``, ``step(action)`` per turn, ``close``): the
first trajectory writes a file in its sandbox and finds it on its next turn, the second (on the
env the first gave back) does not; each last turn is graded against
``extras["reward_spec"]["ground_truth"]`` in fresh sandboxes. ``close`` gives the env back killed
and wiped::

    python examples/skyrl_env.py
"""

from __future__ import annotations

import argparse

import skyrl_gym

from boltzlabs_gym.integrations.grading import Grader
from boltzlabs_gym.integrations.leases import EnvLeases
from boltzlabs_gym.integrations.skyrl import register

TESTS = {"assert_case": ["assert add(1, 2) == 3", "assert add(2, 2) == 4"]}
WRITE_HELPER = "```python\nopen('helper.py', 'w').write('def plus(a, b):\\n    return a + b\\n')\nprint('ok')\n```"
CHECK_HELPER = "```python\nimport os\nprint(os.path.exists('helper.py'))\n```"
RIGHT = "```python\ndef add(a, b):\n    return a + b\n```"
WRONG = "```python\ndef add(a, b):\n    return a * b\n```"


def play(env_id: str, turns: list[str], run_timeout: float) -> tuple[list[str], float]:
    """One trajectory: its observations (program outputs) and its final reward."""
    extras = {"reward_spec": {"ground_truth": TESTS}, "max_turns": len(turns), "run_timeout": run_timeout}
    env = skyrl_gym.make(env_id, env_config=None, extras=extras)
    env.init([{"role": "user", "content": "Write add(a, b)."}])
    outputs, reward = [], 0.0
    try:
        for action in turns:
            out = env.step(action)
            outputs += [o["content"].splitlines()[2] for o in out["observations"]]
            reward = out["reward"]
    finally:
        env.close()
    return outputs, reward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-timeout", type=float, default=2.0)
    args = parser.parse_args()
    with Grader(run_timeout=args.run_timeout, envs_per_lane=2, lanes=1) as grader, EnvLeases(2) as leases:
        env_id = register(leases, grader)
        rewards = []
        plays = [("writes a file", [WRITE_HELPER, CHECK_HELPER, RIGHT]), ("next", [CHECK_HELPER, CHECK_HELPER, WRONG])]
        for name, turns in plays:
            outputs, reward = play(env_id, turns, args.run_timeout)
            rewards.append(reward)
            print(f"trajectory {name!r}: turns printed {outputs}, reward {reward}")
        print(f"envs leased after close: {leases.leased}")
        print(f"REWARDS={rewards}")


if __name__ == "__main__":
    main()
