"""GRPO with fork: build a code task once, branch it into G isolated copies, grade one program in each.

GRPO scores a *group* of G attempts at the same task and uses each attempt's reward minus
the group's mean as its advantage. Here the task's state is built over several steps in
env 0 of a pool of 1 + G envs (``envs/code_task``: a spec, then one unit test per step,
written into env 0's workspace), and ``pool.fork(0, into=[1..G])`` copies env 0 (its env
object and its workspace, tests included) into the G other slots in one batched call,
instead of replaying the build steps G times. Each copy then grades a different program:
right ones, wrong ones and two hostile ones (an infinite loop the env's time limit stops,
and one that leaves a marker file, deletes its copy's tests and looks for the other copies'
files). The script prints the fork's time and a GRPO table (reward, group mean,
advantage, advantage / std), then checks that

* the copies are isolated: the marker and the deleted tests are seen in the hostile copy
  alone (every other copy still lists its tests and no marker), and the hostile program
  found no other copy's files;
* env 0, the source, is unchanged: same observation, same files, and it still grades a
  right program 1.0 with every one of its tests::

    python examples/grpo_fork.py                 # G = 8, mode "default"
    python examples/grpo_fork.py --group 4 --mode boltz
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import numpy as np

from boltzlabs_gym import RLPool
from boltzlabs_gym.client.results import Transition, read_step

HERE = os.path.dirname(os.path.abspath(__file__))
CODE_TASK = os.path.join(os.path.dirname(HERE), "envs", "code_task")
MARKER = "MARKER_from_hostile_copy"

#: The task, built in env 0 one action per step: two spec paragraphs, then six tests.
BUILD = [
    {"spec": "Write solution.py defining fizzbuzz(n) -> str."},
    {"spec": "Multiples of 3 give 'Fizz', of 5 'Buzz', of both 'FizzBuzz'; any other n gives str(n)."},
    {"add_test": "self.assertEqual(solution.fizzbuzz(1), '1')"},
    {"add_test": "self.assertEqual(solution.fizzbuzz(3), 'Fizz')"},
    {"add_test": "self.assertEqual(solution.fizzbuzz(10), 'Buzz')"},
    {"add_test": "self.assertEqual(solution.fizzbuzz(15), 'FizzBuzz')"},
    {"add_test": "self.assertEqual(solution.fizzbuzz(45), 'FizzBuzz')"},
    {"add_test": "self.assertEqual([solution.fizzbuzz(n) for n in (7, 9, 20)], ['7', 'Fizz', 'Buzz'])"},
]

RIGHT = """
def fizzbuzz(n):
    if n % 15 == 0:
        return "FizzBuzz"
    if n % 3 == 0:
        return "Fizz"
    if n % 5 == 0:
        return "Buzz"
    return str(n)
"""

#: The group's programs, in slot order (slot k + 1 grades CANDIDATES[k % len]): name -> source.
CANDIDATES = {
    "right/plain": RIGHT,
    "right/concat": 'def fizzbuzz(n):\n    return ("Fizz" * (n % 3 == 0) + "Buzz" * (n % 5 == 0)) or str(n)\n',
    "wrong/order": RIGHT.replace("n % 15 == 0", "n % 15 == 99"),  # checks 3 before 15: "Fizz" for 15
    "wrong/only-fizz": 'def fizzbuzz(n):\n    return "Fizz" if n % 3 == 0 else str(n)\n',
    "hostile/forever": "while True:\n    pass\n",
    "right/table": 'def fizzbuzz(n):\n    return {0: "FizzBuzz", 3: "Fizz", 5: "Buzz", 6: "Fizz", 9: "Fizz",'
    ' 10: "Buzz", 12: "Fizz"}.get(n % 15, str(n))\n',
    "hostile/marker": f"""
import os, shutil
# Leave a file in this copy's workspace and wreck its tests: no other copy may see either.
with open({MARKER!r}, "w") as f:
    f.write("written by the hostile copy")
shutil.rmtree("tests", ignore_errors=True)
# Look for the other copies' files: next to this workspace, and through any process's cwd.
here = os.path.realpath(os.getcwd())
places = [os.path.join(os.path.dirname(here), d) for d in os.listdir(os.path.dirname(here))]
places += [os.path.join("/proc", p, "cwd") for p in os.listdir("/proc") if p.isdigit()]
seen = set()
for place in places:
    try:
        real = os.path.realpath(place)
        if real != here and "solution.py" in os.listdir(place):
            seen.add(real)
    except OSError:
        pass
print("HOSTILE saw other copies' workspaces:", len(seen), sorted(seen)[:3])
""",
    "wrong/syntax": "def fizzbuzz(n) return str(n)\n",
}


def step_envs(pool: RLPool, actions: dict[int, Any]) -> dict[int, Transition]:
    """Step only the envs named in ``actions`` (``pool.step`` steps every env), each with its own action."""
    pool.batch_async([(i, {"op": "step", "action": a}, ()) for i, a in actions.items()])
    return {r.index: read_step(r, pool.step_timeout) for r in pool.batch_wait()}


def build_task(pool: RLPool) -> dict:
    """Build the task in env 0 alone, one action per step; its last observation."""
    obs = None
    for action in BUILD:
        [t] = step_envs(pool, {0: action}).values()
        obs = t.obs
        print(f"  env 0 step {obs['step']}: {next(iter(action))} -> tests={obs['tests']}")
    return obs


def grpo_table(names: list[str], steps: dict[int, Transition]) -> np.ndarray:
    """Print the group's rewards and advantages (reward - mean, and that over the std); the rewards."""
    rewards = np.array([steps[slot].reward for slot in sorted(steps)], dtype=np.float64)
    mean, std = rewards.mean(), rewards.std()
    print(f"{'slot':>4}  {'candidate':16s} {'reward':>6} {'passed':>7} {'adv':>6} {'adv/std':>7}  note")
    for (slot, t), name, r in zip(sorted(steps.items()), names, rewards):
        info = t.info
        note = "timed out (env's time limit)" if info.get("timed_out") else ""
        note += "".join(line for line in str(info.get("output", "")).splitlines() if line.startswith("HOSTILE"))
        if t.failure is not None:
            note = f"FAILED: {t.failure}"
        scaled = (r - mean) / std if std > 0 else 0.0
        passed = f"{info.get('passed', 0)}/{info.get('total', '?')}"
        print(f"{slot:>4}  {name:16s} {r:6.2f} {passed:>7} {r - mean:+6.2f} {scaled:+7.2f}  {note}")
    print(f"group: mean={mean:.3f} std={std:.3f}")
    return rewards


def check_isolation(names: list[str], listings: dict[int, list[str]], steps: dict[int, Transition]) -> bool:
    """Whether the hostile copy's marker and deleted tests stayed its own, and it found no other copy."""
    ok = True
    for (slot, files), name in zip(sorted(listings.items()), names):
        has_marker, has_tests = MARKER in files, any(f.startswith("tests/") for f in files)
        expect_marker = name == "hostile/marker"
        ok &= has_marker == expect_marker and has_tests != expect_marker
        print(f"  slot {slot} ({name}): marker={has_marker} tests={has_tests}")
    for slot, name in zip(sorted(steps), names):
        if name == "hostile/marker":
            ok &= "HOSTILE saw other copies' workspaces: 0 " in str(steps[slot].info.get("output"))
    return ok


def check_source(pool: RLPool, look: Transition, source_obs: dict, source_files: list[str]) -> bool:
    """Whether env 0 is as it was before the fork (``look``: its ls now), and still grades a right program 1.0."""
    obs_same, files_same = look.obs == source_obs, look.info.get("files") == source_files
    print(f"  env 0 (source): obs unchanged={obs_same} files unchanged={files_same}")
    [regrade] = step_envs(pool, {0: {"program": RIGHT}}).values()
    info = regrade.info
    print(f"  env 0 grades right/plain: reward={regrade.reward:.2f} ({info['passed']}/{info['total']} tests)")
    return obs_same and files_same and regrade.reward == 1.0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--group", type=int, default=8, help="G: how many copies of the task to grade")
    p.add_argument("--mode", default="default", choices=["default", "boltz"])
    p.add_argument("--isolation", default="auto")
    p.add_argument("--time-limit", type=float, default=2.0, help="the env's own limit on one test run (s)")
    args = p.parse_args()
    if args.group < 1:
        p.error("--group must be at least 1")

    t_start = time.perf_counter()
    copies = list(range(1, args.group + 1))
    names = [list(CANDIDATES)[k % len(CANDIDATES)] for k in range(args.group)]
    pool = RLPool(
        CODE_TASK,
        1 + args.group,
        mode=args.mode,
        isolation=args.isolation,
        step_timeout=args.time_limit + 5.0,  # a backstop: the env's own time limit fires first
        env_vars={"CODE_TASK_TIME_LIMIT_S": str(args.time_limit)},
    )
    with pool:
        print(f"mode: {args.mode}  {pool.isolation}")
        pool.reset(seed=0)
        print(f"building the task in env 0 ({len(BUILD)} steps):")
        source_obs = build_task(pool)
        [source_files] = [t.info["files"] for t in step_envs(pool, {0: {"ls": True}}).values()]

        t0 = time.perf_counter()
        obs = pool.fork(0, into=copies)
        fork_ms = (time.perf_counter() - t0) * 1e3
        same = all(obs[i] == source_obs for i in copies)
        print(f"fork env 0 -> {args.group} copies: {fork_ms:.1f} ms (every copy's obs is env 0's: {same})")

        t0 = time.perf_counter()
        steps = step_envs(pool, {slot: {"program": CANDIDATES[name]} for slot, name in zip(copies, names)})
        print(f"graded {args.group} programs in {time.perf_counter() - t0:.2f} s")
        grpo_table(names, steps)

        print("workspaces after grading (ls of every env):")
        looks = step_envs(pool, {i: {"ls": True} for i in [0, *copies]})
        isolated = check_isolation(names, {i: looks[i].info.get("files", []) for i in copies}, steps)
        source_ok = check_source(pool, looks[0], source_obs, source_files)
        # The process backend gives each env a private workspace but hides no files: a copy there can
        # read the others' workspaces (as fresh envs there can), so it reports ISOLATED=False by design.
        hides_files = "hidden_host_files" not in pool.isolation.missing
        if not hides_files:
            print(f"note: isolation={pool.isolation.backend} does not hide other envs' files; use a sandbox that does")
    print(f"FORK_MS={fork_ms:.1f}")
    print(f"ISOLATED={isolated}")
    print(f"SOURCE_UNCHANGED={source_ok}")
    print(f"wall_s={time.perf_counter() - t_start:.1f}")
    return 0 if same and source_ok and (isolated or not hides_files) else 1


if __name__ == "__main__":
    raise SystemExit(main())
