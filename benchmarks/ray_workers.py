"""Workers placed by Ray vs the same workers started by hand: throughput and start-up split.

    python benchmarks/ray_workers.py [--envs-per-worker 64] [--steps 100] [--rounds 12]

A pool of 3 x 64 CartPole envs (``boltzlabs_gym.make_vec("CartPole-v1", workers=...)``) on
three workers: placed by ``RayWorkers`` on a local 3-node Ray cluster (ray.cluster_utils,
one CPU per node), or started by hand (``python -m boltzlabs_gym.worker --bind tcp://IP:*
--keys DIR``). Both bind the same node IP and use CURVE. Both pools are alive at once and
step in alternating timed blocks (``--steps`` batched steps each, the order swapped every
round), so the drift of a shared machine hits both alike; the ratio is the median of the
per-round ratios. Step traffic never goes through Ray: the ratio shows what Ray's presence
costs the step loop. Prints a table and writes benchmarks/results/ray_workers.md.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

import boltzlabs_gym  # noqa: E402
from boltzlabs_gym.wire.keys import generate_keys  # noqa: E402
from boltzlabs_gym.testing import WorkerProcess  # noqa: E402

RESULTS = os.path.join(ROOT, "benchmarks", "results", "ray_workers.md")
NODES = 3


def block(envs, actions: list) -> float:
    """Env-steps/s of one timed block of batched steps."""
    t0 = time.perf_counter()
    for a in actions:
        envs.step(a)
    return envs.num_envs * len(actions) / (time.perf_counter() - t0)


def build(workers, n: int, isolation: str, **kw):
    t0 = time.perf_counter()
    envs = boltzlabs_gym.make_vec("CartPole-v1", num_envs=n, workers=workers, isolation=isolation, **kw)
    return envs, time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--envs-per-worker", type=int, default=64)
    parser.add_argument("--steps", type=int, default=100, help="batched steps per timed block")
    parser.add_argument("--rounds", type=int, default=12, help="timed blocks per pool")
    parser.add_argument("--isolation", default="auto")
    parser.add_argument("--out", default=RESULTS)
    args = parser.parse_args()
    import ray
    from ray.cluster_utils import Cluster

    from boltzlabs_gym.ray import RayWorkers

    n = NODES * args.envs_per_worker
    load_before = os.getloadavg()
    loads: list[float] = []  # 1-minute load average at each round: how busy the machine was
    startup: dict[str, dict[str, float]] = {"ray": {}, "tcp": {}}
    keys_root = tempfile.mkdtemp(prefix="bl-bench-keys-")
    keys = os.path.join(keys_root, "keys")
    generate_keys(keys)
    hand: list[WorkerProcess] = []
    cluster = None
    rw = None
    try:
        t0 = time.perf_counter()
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
        for _ in range(NODES - 1):
            cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        startup["ray"]["Ray start/connect"] = time.perf_counter() - t0
        rw = RayWorkers(num_workers=NODES, capacity=args.envs_per_worker).start()
        startup["ray"]["actor placement"] = rw.startup.placement_s
        startup["ray"]["worker start"] = rw.startup.workers_s
        ip = rw.workers[0].node_ip
        t0 = time.perf_counter()
        hand = [WorkerProcess(f"tcp://{ip}:*", keys=keys, capacity=args.envs_per_worker) for _ in range(NODES)]
        startup["tcp"]["Ray start/connect"] = 0.0
        startup["tcp"]["actor placement"] = 0.0
        startup["tcp"]["worker start"] = time.perf_counter() - t0
        configs = {
            "ray": dict(workers=rw),
            "tcp": dict(workers=[w.address for w in hand], keys=keys),
        }
        rates: dict[str, list[float]] = {name: [] for name in configs}
        env_start: dict[str, list[float]] = {name: [] for name in configs}
        pools = {}
        try:
            for name, kw in configs.items():
                print(f"starting the {name} pool ...", file=sys.stderr, flush=True)
                pools[name], took = build(n=n, isolation=args.isolation, **kw)
                env_start[name].append(took)
            rng = np.random.default_rng(0)
            for envs in pools.values():
                envs.reset(seed=0)
                for _ in range(20):  # warm-up
                    envs.step(rng.integers(0, 2, n))
            names = list(pools)
            for r in range(args.rounds):
                loads.append(os.getloadavg()[0])
                actions = [rng.integers(0, 2, n) for _ in range(args.steps)]
                for name in names if r % 2 == 0 else names[::-1]:
                    rates[name].append(block(pools[name], actions))
                print(
                    f"round {r + 1}/{args.rounds}: " + ", ".join(f"{k} {v[-1]:,.0f}" for k, v in rates.items()),
                    file=sys.stderr,
                    flush=True,
                )
            isolation = pools["ray"].isolation.backend if pools["ray"].isolation else None
        finally:
            for envs in pools.values():
                envs.close()
    finally:
        for w in hand:
            w.stop()
        if rw is not None:
            rw.close()
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
        shutil.rmtree(keys_root, ignore_errors=True)
    for name in startup:
        startup[name]["envs start"] = env_start[name][0]
    ray_sps, tcp_sps = statistics.median(rates["ray"]), statistics.median(rates["tcp"])
    ratios = [r / t for r, t in zip(rates["ray"], rates["tcp"])]
    load_after = os.getloadavg()
    lines = [
        f"# Ray-placed workers vs hand-started tcp workers: CartPole, {NODES} x {args.envs_per_worker} envs",
        "",
        f"- command: `python benchmarks/ray_workers.py --envs-per-worker {args.envs_per_worker} "
        f"--steps {args.steps} --rounds {args.rounds}`",
        f"- machine: {os.cpu_count()} CPUs, Python {sys.version.split()[0]}, Ray {ray.__version__}, "
        f"isolation {isolation}; 1-min load average before {load_before[0]:.2f}, while stepping "
        f"{min(loads):.2f}-{max(loads):.2f} (192 idle env processes per pool add to it), after {load_after[0]:.2f}",
        f"- {NODES} Ray nodes on one machine (ray.cluster_utils.Cluster, 1 CPU each) vs {NODES} "
        "`python -m boltzlabs_gym.worker` started by hand; both CURVE, same node IP; both pools alive, "
        f"stepped in alternating blocks of {args.steps} batched steps, {args.rounds} rounds",
        "",
        "| workers | env-steps/s (median) | per round |",
        "|---|---:|---|",
        f"| Ray-placed | {ray_sps:,.0f} | {', '.join(f'{r:,.0f}' for r in rates['ray'])} |",
        f"| hand-started tcp | {tcp_sps:,.0f} | {', '.join(f'{r:,.0f}' for r in rates['tcp'])} |",
        f"| **ratio Ray / tcp** (median of rounds) | **{statistics.median(ratios):.3f}** | "
        f"{', '.join(f'{r:.3f}' for r in ratios)} |",
        "",
        "Start-up, seconds",
        "",
        "| phase | Ray-placed | hand-started tcp |",
        "|---|---:|---:|",
    ]
    for phase in ("Ray start/connect", "actor placement", "worker start", "envs start"):
        lines.append(f"| {phase} | {startup['ray'][phase]:.2f} | {startup['tcp'][phase]:.2f} |")
    total = {name: sum(startup[name].values()) for name in startup}
    lines.append(f"| **total** | **{total['ray']:.2f}** | **{total['tcp']:.2f}** |")
    text = "\n".join(lines) + "\n"
    print(text)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
