"""The code server against an unsandboxed subprocess pool: executions/s and p50/p99 latency.

Workloads, each at concurrency 1, 8 and 64 (client threads posting back to back):
  print      ``print(1)``
  mbpp       an MBPP-style function and three asserts
  mix        75% mbpp, 20% infinite loops (run_timeout 1 s), 5% memory hogs (512 MiB under a 256 MiB limit)

Servers, alive side by side:
  boltzlabs  ``boltzlabs-gym code-server`` (started here; sandboxed, a fresh sandbox per run)
  subprocess a ThreadPoolExecutor of the client's concurrency running
             ``subprocess.run([python, "-c", code], timeout=...)`` (what SkyRL's python tool does; no
             sandbox, no HTTP)

Then a leak check: ``--leak-requests`` runs (10% timeouts, 5% memory hogs) through the server, and
the server's process tree, zombies and RSS before and after::

    python benchmarks/code_server.py --lanes 4 --envs-per-lane 4 --requests 64 --leak-requests 500
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import requests

MBPP = """
def similar_elements(a, b):
    return tuple(sorted(set(a) & set(b)))

assert similar_elements((3, 4, 5, 6), (5, 7, 4, 10)) == (4, 5)
assert similar_elements((1, 2, 3, 4), (5, 4, 3, 7)) == (3, 4)
assert similar_elements((11, 12, 14, 13), (17, 15, 14, 13)) == (13, 14)
"""
LOOP = "while True:\n    pass\n"
HOG = "x = bytearray(512 << 20)\nprint(len(x))\n"


def workload(name: str, n: int, seed: int = 0) -> list[tuple[str, float]]:
    """``n`` (code, run_timeout) pairs."""
    if name == "print":
        return [("print(1)", 10.0)] * n
    if name == "mbpp":
        return [(MBPP, 10.0)] * n
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        u = rng.random()
        out.append((LOOP, 1.0) if u < 0.20 else (HOG, 10.0) if u < 0.25 else (MBPP, 10.0))
    return out


def via_server(url: str):
    session_per_thread: dict[int, requests.Session] = {}

    def run(code: str, timeout: float) -> str:
        import threading

        s = session_per_thread.setdefault(threading.get_ident(), requests.Session())
        body = {"code": code, "language": "python", "run_timeout": timeout, "memory_limit_MB": 256}
        r = s.post(url + "/run_code", json=body, timeout=timeout + 60)
        return r.json()["status"]

    return run


def via_subprocess(code: str, timeout: float) -> str:
    try:
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=timeout)
        return "Success" if p.returncode == 0 else "Failed"
    except subprocess.TimeoutExpired:
        return "Failed"


def measure(run, jobs: list[tuple[str, float]], concurrency: int) -> dict:
    latencies: list[float] = []

    def one(job):
        t = time.perf_counter()
        status = run(*job)
        latencies.append(time.perf_counter() - t)
        return status

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as ex:
        statuses = list(ex.map(one, jobs))
    wall = time.perf_counter() - t0
    latencies.sort()
    pick = lambda q: latencies[min(len(latencies) - 1, int(q * len(latencies)))]  # noqa: E731
    return {
        "runs_per_s": len(jobs) / wall,
        "p50_ms": 1000 * pick(0.50),
        "p99_ms": 1000 * pick(0.99),
        "ok": sum(s == "Success" for s in statuses),
        "n": len(jobs),
    }


def tree(pid: int) -> list[psutil.Process]:
    p = psutil.Process(pid)
    return [p, *p.children(recursive=True)]


def leak_check(url: str, server_pid: int, n: int, concurrency: int) -> dict:
    run = via_server(url)
    measure(run, workload("print", 64), 8)  # warm: the RSS baseline is taken after the first runs
    before_rss = psutil.Process(server_pid).memory_info().rss
    before = len(tree(server_pid))
    rng = random.Random(1)
    jobs = []
    for _ in range(n):
        u = rng.random()
        jobs.append((LOOP, 0.5) if u < 0.10 else (HOG, 10.0) if u < 0.15 else ("print(1)", 10.0))
    measure(run, jobs, concurrency)
    time.sleep(1.0)
    procs = tree(server_pid)
    zombies = [p.pid for p in procs if p.status() == psutil.STATUS_ZOMBIE]
    return {
        "requests": n,
        "processes_before": before,
        "processes_after": len(procs),
        "zombies": len(zombies),
        "server_rss_growth_mib": (psutil.Process(server_pid).memory_info().rss - before_rss) / 2**20,
    }


def start_server(args) -> tuple[subprocess.Popen, str]:
    cmd = [
        sys.executable, "-m", "boltzlabs_gym.cli", "code-server", "--port", str(args.port),
        "--lanes", str(args.lanes), "--envs-per-lane", str(args.envs_per_lane), "--memory-mb", "1024",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{args.port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if requests.get(url + "/v1/ping", timeout=1).ok:
                return proc, url
        except requests.ConnectionError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit("the code server did not start")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, default=18181)
    p.add_argument("--lanes", type=int, default=4)
    p.add_argument("--envs-per-lane", type=int, default=4)
    p.add_argument("--requests", type=int, default=64, help="runs per cell (x2 at concurrency 64)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--leak-requests", type=int, default=500)
    args = p.parse_args()
    proc, url = start_server(args)
    try:
        status = requests.get(url + "/v1/status").json()
        print(f"boltzlabs isolation: {status['isolation']['backend']}; lanes {args.lanes} x {args.envs_per_lane} envs")
        print(f"host: {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f} (shared machine)")
        print(f"{'workload':8} {'conc':>4} {'server':10} {'runs/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'ok/n':>9}")
        for name in ("print", "mbpp", "mix"):
            for c in args.concurrency:
                n = args.requests * (2 if c >= 64 else 1) if c > 1 else max(8, args.requests // 4)
                jobs = workload(name, n)
                for label, run in (("boltzlabs", via_server(url)), ("subprocess", via_subprocess)):
                    m = measure(run, jobs, c)
                    print(
                        f"{name:8} {c:>4} {label:10} {m['runs_per_s']:8.1f} {m['p50_ms']:8.0f} {m['p99_ms']:8.0f}"
                        f" {m['ok']:>4}/{m['n']:<4}",
                        flush=True,
                    )
        if args.leak_requests:
            print("leak check:", leak_check(url, proc.pid, args.leak_requests, 16))
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
