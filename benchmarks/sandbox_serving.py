#!/usr/bin/env python
"""What a sandbox of K envs spends serving a step beyond the envs' own steps, warm and with cold caches.

    python benchmarks/sandbox_serving.py                                   # halfcheetah:8, cartpole:8
    python benchmarks/sandbox_serving.py --configs halfcheetah:8,pong:8 --sweeps 0,1,4 --steps 2000

A sandbox process of K envs (``envs_per_sandbox=K``) answers each step with the env side's own
code: the request recognised by its bytes (``SteadyRequests``), each env stepped with its row of
the batch of actions, the rows, rewards, flags and info columns written as one reply. This script
runs that code in this process, on K envs built by the benchmark's factories, with the request a
pool sends for all-zeros actions, the replies written to ``/dev/null``. Per configuration, CPU per
env-step (``time.thread_time``, medians of ``--rounds``):

* ``bare``: the K envs' ``step`` in a loop, nothing else;
* ``served, warm``: the same steps served, request after request (the env's serving overhead);
* ``served after a sweep of N MiB``: before each request, N MiB of this process's memory is
  written (outside the timing), as the trainer's and the other sandboxes' work does to the
  core's caches between two requests of a sandbox when processes outnumber cores.

Compare with the envs' CPU per env-step inside a real pool, which ``benchmarks/step_costs.py``
reports (its ``per env-step`` column). Needs ``boltzlabs-gym[real-envs]`` for the real envs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import bench_envs  # noqa: E402
import numpy as np  # noqa: E402
import real_env_factories  # noqa: E402

from boltzlabs_gym.envside.gym_host import GymHost  # noqa: E402
from boltzlabs_gym.envside.gym_loops import _serve_sandbox_request  # noqa: E402
from boltzlabs_gym.envside.sandbox_rows import SandboxRows  # noqa: E402
from boltzlabs_gym.envside.sandbox_slots import Progress, check_sandbox_request  # noqa: E402
from boltzlabs_gym.envside.steady_requests import SteadyRequests  # noqa: E402
from boltzlabs_gym.wire.protocol import sandbox_step_line  # noqa: E402

FACTORIES = {
    "cartpole": bench_envs.make_cartpole,
    "halfcheetah": real_env_factories.make_half_cheetah,
    "pong": real_env_factories.make_pong,
}


def zero_actions(env, k: int) -> np.ndarray:
    """A batch of ``k`` all-zeros actions of ``env``'s action space (Discrete: int64 zeros)."""
    space = env.action_space
    if space.shape:
        return np.zeros((k, *space.shape), dtype=space.dtype)
    return np.zeros(k, dtype=np.int64)


def request_reader(k: int, actions: np.ndarray):
    """What the env side does to a pool's step request for this batch of actions, before serving it:
    a batch of Box rows is recognised by its bytes (``SteadyRequests``); Discrete actions go as
    integer ops, a line parsed and checked (``check_sandbox_request``)."""
    if actions.ndim > 1:
        data = sandbox_step_line(k, actions.dtype.str, actions.shape[1:], actions.nbytes, False) + actions.tobytes()
        steady = SteadyRequests(count=k)
        if steady.match(data) is None:
            raise SystemExit("the env side does not recognise the steady request")
        return lambda: steady.match(data)
    line = b'{"op":"step","slots":%s,"ops":%s}' % (str(list(range(k))).encode(), str(actions.tolist()).encode())
    return lambda: check_sandbox_request(json.loads(line), [], k)


def measure(name: str, k: int, steps: int, sweeps: list[int], rounds: int) -> dict:
    envs = [FACTORIES[name]() for _ in range(k)]
    for i, env in enumerate(envs):
        env.reset(seed=i)
    hosts = [GymHost(env) for env in envs]
    rows = SandboxRows.of(hosts)
    if rows is None:
        raise SystemExit(f"{name}: its observations do not go as rows of one array (no steady reply to time)")
    actions = zero_actions(envs[0], k)
    read_request = request_reader(k, actions)
    progress = Progress(tempfile.mkdtemp(prefix="sandbox-serving-"))
    out = os.open(os.devnull, os.O_WRONLY)
    sweep_buf = np.zeros(max(sweeps, default=0) << 20, np.uint8)

    def reset_ended(ended) -> None:  # (outside the timing, in both loops)
        for p in np.flatnonzero(ended):
            envs[p].reset()

    def bare() -> float:
        total = 0.0
        ended = np.zeros(k, dtype=bool)
        for _ in range(steps):
            t = time.thread_time()
            for p, env in enumerate(envs):
                _, _, terminated, truncated, _ = env.step(actions[p])
                ended[p] = terminated or truncated
            total += time.thread_time() - t
            reset_ended(ended)
        return total / steps / k * 1e6

    def served(mib: int) -> float:
        sweep = sweep_buf[: mib << 20]
        total = 0.0
        for _ in range(steps):
            if mib:
                sweep += 1
            t = time.thread_time()
            _serve_sandbox_request(hosts, rows, progress, out, read_request())
            total += time.thread_time() - t
            reset_ended(np.frombuffer(rows.flags, np.uint8)[:k] != 0)
        return total / steps / k * 1e6

    samples: dict[str, list[float]] = {"bare": [], **{f"sweep {m}": [] for m in sweeps}}
    for _ in range(rounds):
        samples["bare"].append(bare())
        for m in sweeps:
            samples[f"sweep {m}"].append(served(m))
    os.close(out)
    for env in envs:
        env.close()
    return {"name": name, "k": k, **{key: statistics.median(v) for key, v in samples.items()}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="halfcheetah:8,cartpole:8", help="env:K, comma-separated")
    ap.add_argument("--sweeps", default="0,1,4", help="MiB written between two requests (0: warm)")
    ap.add_argument("--steps", type=int, default=1000, help="requests per measurement")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    sweeps = [int(x) for x in args.sweeps.split(",")]
    print(
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} CPUs, "
        f"load average {os.getloadavg()[0]:.2f}, CPU us per env-step (median of {args.rounds})\n"
    )
    head = ["env", "K", "bare"] + [("served, warm" if m == 0 else f"served after a {m} MiB sweep") for m in sweeps]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * 2 + "---:|" * (len(head) - 2))
    for config in args.configs.split(","):
        name, k = config.split(":")
        r = measure(name, int(k), args.steps, sweeps, args.rounds)
        cells = [name, str(r["k"]), f"{r['bare']:.1f}"] + [
            f"{r[f'sweep {m}']:.1f} (+{r[f'sweep {m}'] - r['bare']:.1f})" for m in sweeps
        ]
        print("| " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
