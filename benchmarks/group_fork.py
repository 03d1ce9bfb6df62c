"""GRPO groups as forks: set-up once + fork into G copies, against G set-ups.

Two env directories, a pool of 1 + G envs each, ``--repeats`` rounds, median seconds:

* ``envs/code_task`` (the factory form): the set-up is ``examples/grpo_fork.py``'s eight build
  steps (two spec paragraphs, six unit tests written into the workspace);
* ``benchmarks/env_dirs/prepared_task`` (the function form, module globals, no state hooks): the
  set-up is ``--setup-steps`` steps of ``--setup-ms`` of CPU each (a build stands behind it).

``G set-ups``: reset the G envs and step each through the set-up (every set-up step one batched
call over the G envs). ``once + fork``: :func:`boltzlabs_gym.integrations.groups.prepare_group`:
reset env 0, step it through the set-up, ``pool.fork(0, into=[1..G])``. Each copy's state is then
checked (the same observation as after a set-up of its own). Printed, never asserted::

    python benchmarks/group_fork.py [--group 8] [--mode boltz] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from boltzlabs_gym import RLPool  # noqa: E402
from boltzlabs_gym.integrations.groups import prepare_group, step_envs  # noqa: E402

CODE_TASK = os.path.join(os.path.dirname(HERE), "envs", "code_task")
PREPARED = os.path.join(HERE, "env_dirs", "prepared_task")
CODE_TASK_SETUP = [
    {"spec": "Write solution.py defining fizzbuzz(n) -> str."},
    {"spec": "Multiples of 3 give 'Fizz', of 5 'Buzz', of both 'FizzBuzz'; any other n gives str(n)."},
    *(
        {"add_test": f"self.assertEqual(solution.fizzbuzz({n}), {want!r})"}
        for n, want in [(1, "1"), (3, "Fizz"), (10, "Buzz"), (15, "FizzBuzz"), (45, "FizzBuzz"), (7, "7")]
    ),
]


def g_setups(pool: RLPool, group: list[int], setup: list) -> list:
    mask = [i in group for i in range(pool.n)]
    obs = pool.reset(seed=0, where=mask)
    for action in setup:
        steps = step_envs(pool, {i: action for i in group})
        obs = [steps[i].obs if i in steps else o for i, o in enumerate(obs)]
    return obs


def measure(env_dir: str, setup: list, args, kind: str = "auto") -> tuple[float, float, str]:
    group = list(range(1, args.group + 1))
    with RLPool(env_dir, 1 + args.group, mode=args.mode, isolation=args.isolation) as pool:
        pool.reset(seed=0)
        plain, forked = [], []
        taken = "?"
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            obs = g_setups(pool, group, setup)
            plain.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            obs_f = prepare_group(pool, 0, group, setup, kind=kind)
            forked.append(time.perf_counter() - t0)
            if any(obs_f[i] != obs[i] for i in group):
                raise SystemExit(f"{env_dir}: a copy's observation differs from its source's")
            with pool.snapshot(0, kind=kind) as snap:
                taken = snap.kind
        return statistics.median(plain), statistics.median(forked), f"{taken}, {pool.isolation.backend}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--mode", default="boltz", choices=["default", "boltz"])
    p.add_argument("--isolation", default="auto")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--setup-steps", type=int, default=4)
    p.add_argument("--setup-ms", type=float, default=250.0)
    args = p.parse_args()
    rows = [
        ("code_task (factory, 8 build steps)", CODE_TASK, CODE_TASK_SETUP, "auto"),
        ("code_task (factory, 8 build steps)", CODE_TASK, CODE_TASK_SETUP, "portable"),
        (
            f"prepared_task (function form, {args.setup_steps} x {args.setup_ms:g} ms)",
            PREPARED,
            [{"setup": args.setup_ms}] * args.setup_steps,
            "auto",
        ),
    ]
    print(f"G={args.group} mode={args.mode} repeats={args.repeats} (median seconds)")
    print("| env | G set-ups (s) | set-up once + fork (s) | speed-up | snapshot kind, backend |")
    print("|---|---:|---:|---:|---|")
    for name, env_dir, setup, kind in rows:
        plain, forked, kind = measure(env_dir, setup, args, kind)
        print(f"| {name} | {plain:.3f} | {forked:.3f} | {plain / forked:.2f}x | {kind} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
