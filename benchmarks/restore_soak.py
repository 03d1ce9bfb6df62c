"""Restore a memory snapshot again and again after its copy crashed, and count restores that were not exact.

Each round is ``tests/client/test_snapshots.py::test_a_snapshot_outlives_its_source`` in a fresh pool of
the snapshot test env (two envs): snapshot env 0, step, soft- and hard-reset it, kill it as a
straggler, restore the snapshot into it, crash that copy, then, after a random pause of 0-100
ms (so the restore meets the crashed slot's respawn at every stage), restore into both slots and
step. Both must replay the source's step exactly; a round that does not prints ``BAD`` with the
restore's ``reset_infos``. It found a rare copy that could not mount its ``/proc``.

    python benchmarks/restore_soak.py [--mode default] [--seconds 600] [--seed 0]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

import numpy as np

from boltzlabs_gym import RLPool, SnapshotError

SNAP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "envs", "snap")


def one_round(mode: str, isolation: str, pause: float) -> str | None:
    """One round; ``None`` when both restores were exact, else what went wrong."""
    with RLPool(SNAP, n=2, mode=mode, isolation=isolation, step_timeout=1.0) as pool:
        pool.reset(seed=4)
        pool.step([["write", "f", "kept"], 0])
        snap = pool.snapshot(0)
        expected = pool.step([1, 0])[0][0]
        pool.reset(where=np.array([True, False]))
        pool.reset(where=np.array([True, False]), hard=True)
        if "boltzlabs_straggler" not in pool.step(["hang", 0])[3][0]:
            return "the hanging env was not reported as a straggler"
        try:
            pool.snapshot(0)
            return "a snapshot of a killed env that was not reset was taken"
        except SnapshotError:
            pass
        pool.restore(snap, where=[0])
        first = pool.step([1, 0])[0][0]
        if first != expected:
            return f"first restore: {first} != {expected}; {pool.reset_infos}"
        if "boltzlabs_error" not in pool.step(["crash", 0])[3][0]:
            return "the crash was not reported"
        time.sleep(pause)
        pool.restore(snap, where=[0, 1])
        infos = [dict(i) for i in pool.reset_infos]
        got = pool.step([1, 1])[0]
        if got != [expected, expected]:
            return f"second restore: {got} != {[expected, expected]}; {infos}"
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", default="default", choices=["default", "boltz"])
    parser.add_argument("--isolation", default="auto")
    parser.add_argument("--seconds", type=float, default=600)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    end = time.monotonic() + args.seconds
    rounds = bad = 0
    while time.monotonic() < end:
        rounds += 1
        why = one_round(args.mode, args.isolation, rng.choice([0, 0, 0.001, 0.005, 0.02, 0.05, 0.1]))
        if why is not None:
            bad += 1
            print(f"BAD round {rounds}: {why}", flush=True)
    print(f"{rounds} rounds, {bad} not exact ({args.mode} mode, {args.seconds:g} s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
