#!/usr/bin/env python
"""Paired throughput: every implementation alive at once, short blocks in rotating order.

    python benchmarks/paired.py --sizes 8,64,256                 # CartPole-v1, ours vs AsyncVectorEnv
    python benchmarks/paired.py --env large_obs --sizes 8 --impls async,default,boltz

On a shared machine whose speed moves by 2-3x within minutes, one timed block per
implementation (``run.py``) compares samples taken minutes apart. Here every
implementation of one size is started first, then each round times one short block of
each, in an order rotated every round, and the figure is the median over rounds of
``AsyncVectorEnv's block time / this implementation's``: both sides of every ratio come
from the same few seconds of the machine's life. Prints a Markdown table on stdout;
progress goes to stderr.

Implementations: ``async`` (gymnasium AsyncVectorEnv, shared memory; the reference),
``sync`` (SyncVectorEnv), ``default``, ``boltz``, ``process`` (BoltzLabsVecEnv with
mode="default" / mode="boltz" / isolation="process"). Append ``@US`` to one of ours to set
``busy_poll_us`` (``default@0``), ``+aslr`` for ``env_aslr=True`` (``default+aslr``:
every env interpreter with its own randomized layout, as before that became the default),
and ``+hop`` for ``direct=False`` (``default+hop``: every step through the worker, as
before the direct lane). A final ``+metrics`` (``default+metrics``, ``default+hop+metrics``)
serves the worker's ``/metrics`` and scrapes it once a second while the pool steps, 15 times
the usual Prometheus rate (issue #24: metrics must cost nothing measurable on the step path).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import cloudpickle  # noqa: E402
import gymnasium as gym  # noqa: E402
import numpy as np  # noqa: E402

import bench_envs  # noqa: E402
from boltzlabs_gym import BoltzLabsVecEnv  # noqa: E402

cloudpickle.register_pickle_by_value(bench_envs)  # sandboxes cannot import this directory

FACTORIES = {"cartpole": bench_envs.make_cartpole, "large_obs": bench_envs.make_large_obs}
#: Steps per timed block: about 0.1-0.4 s per block on a 2-core box.
BLOCK_STEPS = {8: 200, 32: 80, 64: 40, 128: 20, 256: 10}
REFERENCE = "async"


def make_impl(name: str, factory, n: int):
    """A vector env for ``name`` (see the module docstring)."""
    if name.endswith("+metrics"):
        env = make_impl_plain(name[: -len("+metrics")], factory, n, metrics_port=0)
        _scrape_every_second(env.pool.metrics_url)
        return env
    return make_impl_plain(name, factory, n)


def _scrape_every_second(url: str) -> None:
    import threading
    import urllib.request

    def scrape() -> None:
        while True:
            try:
                urllib.request.urlopen(url, timeout=5).read()
            except OSError:
                return  # the pool closed
            time.sleep(1.0)

    threading.Thread(target=scrape, daemon=True).start()


def make_impl_plain(name: str, factory, n: int, **kwargs):
    """A vector env for ``name`` without ``+metrics``."""
    kind, _, busy_poll = name.partition("@")
    kind, plus, option = kind.partition("+")
    if plus and option not in ("aslr", "hop"):
        raise SystemExit(f"unknown option {option!r} in {name!r}: +aslr or +hop")
    if kind == "async":
        return gym.vector.AsyncVectorEnv([factory] * n, shared_memory=True)
    if kind == "sync":
        return gym.vector.SyncVectorEnv([factory] * n)
    if busy_poll:
        kwargs["busy_poll_us"] = float(busy_poll)
    if option == "aslr":
        kwargs["env_aslr"] = True
    if option == "hop":
        kwargs["direct"] = False
    if kind == "default":
        return BoltzLabsVecEnv([factory] * n, **kwargs)
    if kind == "boltz":
        return BoltzLabsVecEnv([factory] * n, mode="boltz", **kwargs)
    if kind == "process":
        return BoltzLabsVecEnv([factory] * n, isolation="process", **kwargs)
    raise SystemExit(f"unknown implementation {name!r}: async, sync, default, boltz, process (optionally +aslr or +hop, @US)")


def measure(names: list[str], factory, n: int, rounds: int, block: int, seed: int = 0) -> dict[str, list[float]]:
    """Seconds per block, per implementation, with every implementation alive at once."""
    envs = {}
    try:
        for name in names:
            t0 = time.perf_counter()
            envs[name] = make_impl(name, factory, n)
            envs[name].reset(seed=seed)
            print(f"  started {name} n={n} in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        space = envs[names[0]].action_space
        space.seed(seed)
        actions = [space.sample() for _ in range(64)]
        for env in envs.values():
            for i in range(min(block, 50)):
                env.step(actions[i % 64])
        times: dict[str, list[float]] = {name: [] for name in names}
        for r in range(rounds):
            k = r % len(names)
            for name in names[k:] + names[:k]:
                env = envs[name]
                t0 = time.perf_counter()
                for i in range(block):
                    env.step(actions[(r + i) % 64])
                times[name].append(time.perf_counter() - t0)
        return times
    finally:
        for env in envs.values():
            env.close()


def summarize(times: dict[str, list[float]], n: int, block: int, reference: str) -> list[dict]:
    """Env-steps/s per implementation and the per-round ratios to ``reference``."""
    ref = np.array(times[reference])
    rows = []
    for name, t in times.items():
        t = np.array(t)
        ratio = ref / t
        rows.append({
            "impl": name, "n": n, "steps_per_s": n * block * len(t) / t.sum(),
            "ratio_median": float(np.median(ratio)), "ratio_p25": float(np.percentile(ratio, 25)),
            "ratio_p75": float(np.percentile(ratio, 75)),
        })
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--env", choices=sorted(FACTORIES), default="cartpole")
    parser.add_argument("--sizes", default="8,64,256")
    parser.add_argument("--impls", default="async,default,boltz")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--block", type=int, default=None, help="steps per timed block (default: by n)")
    args = parser.parse_args(argv)
    names = args.impls.split(",")
    if REFERENCE not in names:
        names.insert(0, REFERENCE)
    factory = FACTORIES[args.env]
    print(f"| env | n | impl | env-steps/s | / AsyncVectorEnv, median (p25-p75) of {args.rounds} rounds |")
    print("|---|---:|---|---:|---|")
    for n in (int(x) for x in args.sizes.split(",")):
        block = args.block or BLOCK_STEPS.get(n, max(1, 2000 // n))
        times = measure(names, factory, n, args.rounds, block)
        for row in summarize(times, n, block, REFERENCE):
            print(f"| {args.env} | {n} | {row['impl']} | {row['steps_per_s']:,.0f} | {row['ratio_median']:.2f} "
                  f"({row['ratio_p25']:.2f}-{row['ratio_p75']:.2f}) |", flush=True)
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
