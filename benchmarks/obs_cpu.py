"""CPU per env step with and without shared observation regions, both pools alive at once.

    python benchmarks/obs_cpu.py --env large_obs --n 64 --k 1,8 --steps 200 --rounds 5

Wall-clock rates on a shared 2-core machine move with its load; CPU seconds spent per env step
move much less. For each configuration two vector envs run side by side, ``shared_obs=True`` and
``shared_obs=False`` (bytes on the pipes, as before regions existed), in alternating blocks, and
this prints per env step: the trainer's CPU (this process), the CPU of the worker and the env
processes (every descendant), and the wall time, as medians over rounds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import cloudpickle
import numpy as np
import psutil

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_envs  # noqa: E402

cloudpickle.register_pickle_by_value(bench_envs)

from boltzlabs_gym import BoltzLabsVecEnv  # noqa: E402

FACTORIES = {"cartpole": bench_envs.make_cartpole, "large_obs": bench_envs.make_large_obs}


def _children_cpu() -> float:
    total = 0.0
    for child in psutil.Process().children(recursive=True):
        try:
            t = child.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def _block(venv, steps: int, rng) -> tuple[float, float, float]:
    n = venv.num_envs
    actions = [rng.integers(0, venv.single_action_space.n, n) for _ in range(steps)]
    c0, t0, w0 = _children_cpu(), time.process_time(), time.perf_counter()
    for a in actions:
        venv.step(a)
    w1, t1, c1 = time.perf_counter(), time.process_time(), _children_cpu()
    per = 1e6 / (steps * n)
    return (t1 - t0) * per, (c1 - c0) * per, (w1 - w0) * per


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--env", choices=sorted(FACTORIES), default="large_obs")
    parser.add_argument("--n", type=int, default=64)
    parser.add_argument("--k", default="1,8")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    print(f"load before: {os.getloadavg()[0]:.1f}")
    print("| env | n | K | shared_obs | trainer CPU us/env-step | worker+envs CPU us/env-step | wall us/env-step |")
    print("|---|---:|---:|---|---:|---:|---:|")
    for k in [int(x) for x in args.k.split(",")]:
        extra = {"envs_per_sandbox": k} if k > 1 else {}
        envs = {
            shared: BoltzLabsVecEnv([FACTORIES[args.env]] * args.n, shared_obs=shared, **extra)
            for shared in (True, False)
        }
        try:
            samples: dict[bool, list] = {True: [], False: []}
            for venv in envs.values():
                venv.reset(seed=0)
                _block(venv, 5, rng)  # warm
            for r in range(args.rounds):
                for shared in (True, False) if r % 2 == 0 else (False, True):
                    samples[shared].append(_block(envs[shared], args.steps, rng))
            for shared, rows in samples.items():
                med = [statistics.median(col) for col in zip(*rows)]
                print(f"| {args.env} | {args.n} | {k} | {shared} | {med[0]:.1f} | {med[1]:.1f} | {med[2]:.1f} |")
        finally:
            for venv in envs.values():
                venv.close()
    print(f"load after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
