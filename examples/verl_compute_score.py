"""verl rewards on the pool: ``compute_score`` for ``custom_reward_function``, one call or a batch.

verl's config names a file and a function (``custom_reward_function.path`` /
``custom_reward_function.name``); :func:`boltzlabs_gym.integrations.verl.compute_score` has the
signature verl calls, ``compute_score(data_source, solution_str, ground_truth, extra_info=None)``,
and grades in the two test styles verl's ``sandbox_fusion`` module grades (stdin/stdout and
asserts). This script needs no verl: it calls the function the way verl's reward managers do, one
sample at a time and as a batch (``solution_strs=``, ``ground_truths=``: one round trip), including
a program that loops forever (killed on ``run_timeout``, score 0.0)::

    python examples/verl_compute_score.py

In verl: ``custom_reward_function.path=examples/verl_compute_score.py`` and
``custom_reward_function.name=compute_score`` (this file re-exports it, on a grader of its own).
"""

from __future__ import annotations

import argparse
import asyncio
import time

from boltzlabs_gym.integrations import verl
from boltzlabs_gym.integrations.grading import Grader
from boltzlabs_gym.integrations.verl import compute_score, compute_score_async

__all__ = ["compute_score", "compute_score_async"]

REVERSE = "```python\nprint(input()[::-1])\n```"
STDIO = {"inputs": ["abc\n", "xy\n"], "outputs": ["cba", "yx"]}
ADD = "def add(a, b):\n    return a + b\n"
LOOP = "def add(a, b):\n    while True:\n        pass\n"
ASSERTS = {"assert_case": ["assert add(1, 2) == 3", "assert add(2, 2) == 4"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-timeout", type=float, default=1.0, help="seconds per test case")
    args = parser.parse_args()
    with Grader(run_timeout=args.run_timeout, envs_per_lane=4, lanes=1) as grader:
        verl.configure(grader)
        one = compute_score("codecontests", REVERSE, STDIO)
        print(f"stdin/stdout, one sample: {one}")
        t0 = time.perf_counter()
        batch = compute_score(
            data_sources=["mbpp"] * 3,
            solution_strs=[ADD, LOOP, "not python("],
            ground_truths=[ASSERTS, ASSERTS, ASSERTS],
            extra_infos=[None] * 3,
        )
        print(f"asserts, a batch of 3 in {time.perf_counter() - t0:.2f} s:")
        for name, answer in zip(["right", "loops", "syntax"], batch):
            print(f"  {name:6s} {answer}")
        again = asyncio.run(compute_score_async("mbpp", ADD, ASSERTS))
        print(f"async: {again}")
        print(f"SCORES={[one['score'], *(a['score'] for a in batch), again['score']]}")


if __name__ == "__main__":
    main()
