"""Cost of the network hop: one local ipc worker vs two tcp workers on loopback vs two across veth.

    python benchmarks/remote_workers.py [--n 256] [--steps 300] [--repeats 3]

Counter env (envs/counter). Configurations are interleaved per repetition so machine
drift cancels. Prints env-steps/s and roundtrip_ms - worker_ms (the transport's share).
The veth configuration needs root and iproute2; it is skipped with the reason otherwise.
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

from boltzlabs_gym import RLPool  # noqa: E402
from boltzlabs_gym.wire.keys import generate_keys  # noqa: E402
from boltzlabs_gym.testing import NetnsHost, NetnsUnavailable, WorkerProcess  # noqa: E402

COUNTER = os.path.join(ROOT, "envs", "counter")


def measure(pool: RLPool, steps: int) -> dict:
    n = pool.n
    pool.reset(seed=0)
    actions = [1] * n
    for _ in range(20):  # warm-up
        pool.step(actions)
    transport, rt = [], []
    t0 = time.perf_counter()
    for _ in range(steps):
        _, _, dones, _ = pool.step(actions)
        transport.append(pool.timing.roundtrip_ms - pool.timing.worker_ms)
        rt.append(pool.timing.roundtrip_ms)
        if dones.any():
            pool.reset(where=dones)
    wall = time.perf_counter() - t0
    return {
        "steps_per_s": n * steps / wall,
        "roundtrip_ms_median": statistics.median(rt),
        "transport_ms_median": statistics.median(transport),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=256)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--isolation", default="auto")
    args = parser.parse_args()

    keys_root = tempfile.mkdtemp(prefix="bl-bench-keys-")
    keys = os.path.join(keys_root, "keys")
    generate_keys(keys)
    loopback = [WorkerProcess(capacity=args.n), WorkerProcess(capacity=args.n)]
    hosts, veth, skipped = [], [], None
    try:
        for k in (1, 2):
            host = NetnsHost(k)
            hosts.append(host)
            veth.append(WorkerProcess(f"tcp://{host.inside}:5555", keys=keys, prefix=host.prefix, capacity=args.n))
    except NetnsUnavailable as exc:
        skipped = str(exc)
    configs = {"1 local ipc worker": dict(), "2 tcp workers, loopback": dict(workers=[w.address for w in loopback])}
    if not skipped:
        configs["2 workers across veth (CURVE)"] = dict(workers=[w.address for w in veth], keys=keys)
    results: dict[str, list[dict]] = {name: [] for name in configs}
    try:
        for rep in range(args.repeats):
            for name, kwargs in configs.items():
                print(f"[{rep + 1}/{args.repeats}] {name} ...", file=sys.stderr, flush=True)
                with RLPool(COUNTER, n=args.n, isolation=args.isolation, **kwargs) as pool:
                    results[name].append(measure(pool, args.steps))
    finally:
        for w in loopback + veth:
            w.stop()
        for h in hosts:
            h.close()
        shutil.rmtree(keys_root, ignore_errors=True)
    base = statistics.median(r["steps_per_s"] for r in results["1 local ipc worker"])
    print(f"\ncounter env, n={args.n}, {args.steps} steps x {args.repeats} interleaved repeats, load {os.getloadavg()[0]:.1f}")
    print(f"{'configuration':32s} {'env-steps/s':>12s} {'vs ipc':>7s} {'roundtrip ms':>13s} {'transport ms':>13s}")
    for name, runs in results.items():
        sps = statistics.median(r["steps_per_s"] for r in runs)
        rt = statistics.median(r["roundtrip_ms_median"] for r in runs)
        tr = statistics.median(r["transport_ms_median"] for r in runs)
        print(f"{name:32s} {sps:12.0f} {sps / base:7.2f} {rt:13.2f} {tr:13.3f}")
    if skipped:
        print(f"2 workers across veth: skipped ({skipped})")


if __name__ == "__main__":
    main()
