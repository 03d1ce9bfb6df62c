"""Quickstart: grade a batch of good and bad programs in sandboxed, resident envs.

    python examples/quickstart.py

Each env is the code-grading env in envs/code_env: the action is a program, the
reward is 1.0 when its tests pass. One call grades the whole batch.
"""

import os
import time

from boltzlabs_gym import RLPool
from boltzlabs_gym.testing import CODE_ENV_BROKEN, CODE_ENV_GOOD, CODE_ENV_WRONG

ENV_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "envs", "code_env")

GOOD, WRONG, BROKEN = CODE_ENV_GOOD, CODE_ENV_WRONG, CODE_ENV_BROKEN
PROGRAMS = [GOOD, WRONG, BROKEN, GOOD, GOOD, WRONG, GOOD, BROKEN]


def main() -> None:
    started = time.perf_counter()
    with RLPool(ENV_DIR, n=len(PROGRAMS)) as pool:
        print(f"{pool.n} envs ready in {time.perf_counter() - started:.2f} s; {pool.isolation}")
        pool.reset(seed=0)
        obs, rewards, dones, infos = pool.step(PROGRAMS)
        for i, (program, reward) in enumerate(zip(PROGRAMS, rewards)):
            kind = {GOOD: "good", WRONG: "wrong", BROKEN: "broken"}[program]
            print(f"env {i}: {kind:6s} program -> reward {reward:.1f}")
        t = pool.timing
        print(f"timing: worker {t.worker_ms:.1f} ms, round trip {t.roundtrip_ms:.1f} ms, stragglers {list(t.stragglers)}")
        print(f"memory: {pool.envs_per_gb():.0f} envs/GiB (PSS of each env's process tree)")
        expected = [1.0 if p is GOOD else 0.0 for p in PROGRAMS]
        assert rewards.tolist() == expected, (rewards.tolist(), expected)


if __name__ == "__main__":
    main()
