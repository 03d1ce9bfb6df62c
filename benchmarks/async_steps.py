"""Envs that don't wait for each other, against lockstep ``step()``: env-steps/s side by side.

    PYTHONPATH=$PWD python benchmarks/async_steps.py [--seconds 5]
    PYTHONPATH=$PWD python benchmarks/async_steps.py --asyncio-rounds 5   # the asyncio row alone


* heavy-tailed env (lognormal step time, median 2 ms, p99 50 ms; sleeping and CPU-burning), n=64:
  ``recv(batch_size=16)`` and ``32`` against lockstep ``step()``;
* CartPole, n=256: send/recv with ``batch_size=n`` against lockstep ``step()``;
* asyncio: 1000 coroutines each stepping a counter env on a 256-env pool, against lockstep;
* where EnvPool is installed, its own async/sync ratio on its CartPole (n=256, ``recv`` of 256
  and of 64), for comparison; else the reason it was skipped.

``--asyncio-rounds N`` measures only the asyncio case, N alternating rounds (lockstep, then
asyncio) on one pool, and prints each round's ratio and their median: that ratio moves by a few
hundredths from one run to the next.

Figures are printed, never asserted (see benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

import numpy as np

import boltzlabs_gym
from boltzlabs_gym import RLPool
from boltzlabs_gym.aio import AsyncPool

HERE = os.path.dirname(os.path.abspath(__file__))
HEAVY = os.path.join(HERE, "env_dirs", "heavy_tail")
COUNTER = os.path.join(os.path.dirname(HERE), "envs", "counter")


def lockstep_rate(pool: RLPool, seconds: float) -> float:
    pool.reset(seed=0)
    actions = [1] * pool.n
    steps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        pool.step(actions)
        steps += pool.n
    return steps / (time.perf_counter() - t0)


def send_recv_rate(pool: RLPool, batch_size: int, seconds: float) -> float:
    pool.reset(seed=0)
    pool.send([1] * pool.n, env_ids=range(pool.n))
    steps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        got = pool.recv(batch_size=batch_size)
        steps += len(got.env_ids)
        pool.send([1] * len(got.env_ids), env_ids=got.env_ids)
    rate = steps / (time.perf_counter() - t0)
    pool.recv()
    return rate


def timed_rate(step, per_call: int, seconds: float) -> float:
    """env-steps/s of calling ``step()`` (``per_call`` env-steps each) for ``seconds``."""
    steps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        step()
        steps += per_call
    return steps / (time.perf_counter() - t0)


def vec_rates(n: int, seconds: float) -> tuple[float, float]:
    envs = boltzlabs_gym.make_vec("CartPole-v1", num_envs=n, batch_size=n)
    try:
        envs.reset(seed=0)
        actions = np.zeros(n, dtype=np.int64)
        lock = timed_rate(lambda: envs.step(actions), n, seconds)
        envs.async_reset(seed=0)
        steps, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            _, _, _, _, info = envs.recv()
            envs.send(actions, info["env_id"])
            steps += n
        rate = steps / (time.perf_counter() - t0)
        envs.recv()
        return lock, rate
    finally:
        envs.close()


def envpool_rates(n: int, batch_size: int, seconds: float) -> tuple[float, float] | str:
    """EnvPool's own CartPole: lockstep ``step`` against ``recv``/``send`` of ``batch_size``; or
    why it was skipped."""
    try:
        import envpool
    except ImportError as exc:
        return f"envpool is not installed ({exc}); pip install envpool"
    sync = envpool.make("CartPole-v1", env_type="gymnasium", num_envs=n, seed=0)
    sync.reset()
    actions = np.zeros(n, dtype=np.int32)
    lock = timed_rate(lambda: sync.step(actions), n, seconds)
    sync.close()
    envs = envpool.make("CartPole-v1", env_type="gymnasium", num_envs=n, batch_size=batch_size, seed=0)
    envs.async_reset()
    batch = np.zeros(batch_size, dtype=np.int32)

    def recv_send() -> None:
        *_, info = envs.recv()
        envs.send(batch, info["env_id"])

    rate = timed_rate(recv_send, batch_size, seconds)
    envs.close()
    return lock, rate


def asyncio_rate(pool: RLPool, coroutines: int, seconds: float) -> float:
    async def main() -> float:
        steps = 0
        stop = time.perf_counter() + seconds

        async def worker() -> None:
            nonlocal steps
            while time.perf_counter() < stop:
                async with face.env() as env:
                    await env.reset(seed=0)
                    for _ in range(20):
                        await env.step(1)
                        steps += 1

        async with AsyncPool(pool) as face:
            t0 = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(coroutines)))
            return steps / (time.perf_counter() - t0)

    return asyncio.run(main())


def asyncio_rounds(rounds: int, seconds: float) -> None:
    ratios = []
    with RLPool(COUNTER, n=256) as pool:
        for r in range(rounds):
            lock = lockstep_rate(pool, seconds)
            rate = asyncio_rate(pool, 1000, seconds)
            ratios.append(rate / lock)
            print(f"round {r + 1}: lockstep {lock:.0f}/s, asyncio {rate:.0f}/s, ratio {rate / lock:.2f}", flush=True)
    print(f"median ratio {statistics.median(ratios):.2f} (min {min(ratios):.2f}, max {max(ratios):.2f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--asyncio-rounds", type=int, default=0, help="only the asyncio case, this many rounds")
    args = parser.parse_args()
    s = args.seconds
    if args.asyncio_rounds:
        asyncio_rounds(args.asyncio_rounds, s)
        return
    rows = []
    for mode in ("sleep", "burn"):
        with RLPool(HEAVY, n=64, env_vars={"HEAVY_TAIL_MODE": mode}) as pool:
            lock = lockstep_rate(pool, s)
            for m in (16, 32):
                rate = send_recv_rate(pool, m, s)
                rows.append((f"heavy-tail {mode}, n=64, recv(batch_size={m})", lock, rate))
    lock, rate = vec_rates(256, s)
    rows.append(("CartPole n=256, send/recv batch_size=n", lock, rate))
    with RLPool(COUNTER, n=256) as pool:
        lock = lockstep_rate(pool, s)
        rate = asyncio_rate(pool, 1000, s)
    rows.append(("counter n=256, asyncio 1000 coroutines", lock, rate))
    skipped = []
    for m in (256, 64):
        got = envpool_rates(256, m, s)
        if isinstance(got, str):
            skipped.append(f"EnvPool skipped: {got}")
            break
        rows.append((f"EnvPool CartPole n=256, recv batch_size={m}", *got))
    print(f"{'case':48} {'lockstep/s':>12} {'async/s':>12} {'ratio':>7}")
    for name, lock, rate in rows:
        print(f"{name:48} {lock:12.0f} {rate:12.0f} {rate / lock:7.2f}")
    for line in skipped:
        print(line)


if __name__ == "__main__":
    main()
