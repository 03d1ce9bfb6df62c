"""The code server on a Ray cluster (``code-server --ray``): runs/s and p50/p99 of ``print(1)``.

    PYTHONPATH=$PWD python benchmarks/code_server_ray.py --nodes 4 --cpus-per-node 8 \\
        --lanes-per-worker 2 --envs-per-lane 8 --concurrency 16 64 256 --requests 2000

Starts a local Ray cluster of ``--nodes`` nodes (``ray.cluster_utils.Cluster``, ``--cpus-per-node``
CPUs each; or uses the cluster at ``--ray-address``), then ``boltzlabs-gym code-server --ray`` on it
(one worker per node, ``--lanes-per-worker`` lanes of ``--envs-per-lane`` sandboxes on each), and
posts ``print(1)`` from ``C`` client threads back to back for each concurrency ``C``. Prints where
the lanes ran (``/v1/status``), a table (runs/s, p50, p99, successes, runs per lane) and a JSON line.

The nodes of a local cluster share this machine's cores: on a small machine the figures say what
the Ray placement costs, not how it scales. For scaling, run it on a machine with many cores (nodes
x cpus-per-node <= cores), or on a real cluster with ``--ray-address HEAD:PORT`` (``--nodes`` is
then what the cluster has). ``--nodes 1`` gives the one-node baseline to compare against.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import requests  # noqa: E402
from code_server import measure, via_server, workload  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_cluster(nodes: int, cpus: int):
    """A local Ray cluster of ``nodes`` nodes of ``cpus`` CPUs each."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": cpus, "include_dashboard": False})
    for _ in range(nodes - 1):
        cluster.add_node(num_cpus=cpus)
    cluster.wait_for_nodes()
    return cluster


def start_server(args, address: str, port: int) -> tuple[subprocess.Popen, str]:
    """``boltzlabs-gym code-server --ray`` on the cluster at ``address``; its URL once it answers."""
    cmd = [sys.executable, "-m", "boltzlabs_gym.cli", "code-server", "--ray", "--ray-address", address]
    cmd += ["--port", str(port), "--lanes-per-worker", str(args.lanes_per_worker)]
    cmd += ["--envs-per-lane", str(args.envs_per_lane), "--isolation", args.isolation, "--memory-mb", "1024"]
    cmd += ["--ray-cpus-per-worker", str(args.ray_cpus_per_worker), "--max-queue", str(max(1024, 4 * args.requests))]
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.Popen(cmd, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + args.start_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the code server exited ({proc.returncode}) before it answered")
        try:
            if requests.get(url + "/v1/ping", timeout=1).ok:
                return proc, url
        except requests.ConnectionError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"the code server did not answer within {args.start_timeout:g} s")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=2, help="local cluster nodes (default 2)")
    p.add_argument("--cpus-per-node", type=int, default=1, help="CPUs of each local node (default 1)")
    p.add_argument("--ray-address", default=None, help="use this running cluster instead of a local one")
    p.add_argument("--ray-cpus-per-worker", type=float, default=1.0, help="CPUs each worker's actor reserves")
    p.add_argument("--lanes-per-worker", type=int, default=2)
    p.add_argument("--envs-per-lane", type=int, default=4)
    p.add_argument("--concurrency", type=int, nargs="+", default=[8, 64])
    p.add_argument("--requests", type=int, default=256, help="runs per concurrency")
    p.add_argument("--warmup", type=int, default=32, help="runs before the timed ones")
    p.add_argument("--isolation", default="auto")
    p.add_argument("--start-timeout", type=float, default=300.0)
    args = p.parse_args()

    cluster = None if args.ray_address else start_cluster(args.nodes, args.cpus_per_node)
    address = args.ray_address or cluster.address
    proc, url = start_server(args, address, free_port())
    try:
        status = requests.get(url + "/v1/status", timeout=10).json()
        placement = status["lane_placement"]
        print(f"{len(placement)} lanes, {status['isolation']['backend']} isolation:", flush=True)
        for lane in placement:
            print(f"  lane {lane['lane']}: {lane['envs']} sandboxes on {lane['where']}")
        run = via_server(url)
        measure(run, workload("print", args.warmup), min(8, args.warmup))
        rows = []
        for c in args.concurrency:
            before = {
                la["lane"]: la["runs"] for la in requests.get(url + "/v1/status", timeout=10).json()["lane_placement"]
            }
            m = measure(run, workload("print", args.requests), c)
            m = {k: v for k, v in m.items() if not k.startswith("tle_")}  # (print(1) never times out)
            after = requests.get(url + "/v1/status", timeout=10).json()["lane_placement"]
            m["runs_per_lane"] = [la["runs"] - before.get(la["lane"], 0) for la in after]
            rows.append({"concurrency": c, **m})
        print()
        print("| concurrency | runs/s | p50 ms | p99 ms | ok | runs per lane |")
        print("|---:|---:|---:|---:|---:|---|")
        for r in rows:
            per_lane = " ".join(map(str, r["runs_per_lane"]))
            print(
                f"| {r['concurrency']} | {r['runs_per_s']:.1f} | {r['p50_ms']:.0f} | {r['p99_ms']:.0f} "
                f"| {r['ok']}/{r['n']} | {per_lane} |"
            )
        record = {
            "benchmark": "code_server_ray",
            "nodes": args.nodes if cluster is not None else len({la["where"].split()[1] for la in placement}),
            "local_cluster": cluster is not None,
            "cpus_per_node": args.cpus_per_node if cluster is not None else None,
            "lanes": len(placement),
            "envs_per_lane": args.envs_per_lane,
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "load_avg": os.getloadavg()},
            "rows": rows,
        }
        print(json.dumps(record))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        if cluster is not None:
            cluster.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
