"""The code server against an unsandboxed subprocess pool: executions/s and p50/p99 latency.

Workloads, each at concurrency 1, 8 and 64 (client threads posting back to back):
  print      ``print(1)``
  mbpp       an MBPP-style function and three asserts
  mix        75% mbpp, 20% infinite loops (run_timeout 1 s), 5% memory hogs (512 MiB under a 256 MiB limit)

Servers, alive side by side:
  boltzlabs  ``boltzlabs-gym code-server`` (started here; sandboxed, wiped and checked in place after
             every run where the sandbox allows it, else hard-reset)
  bl-reset   the same with ``--no-wipe``: every sandbox hard-reset after every run (``--no-reset-server``
             leaves it out)
  sandboxfusion  SandboxFusion's own server at ``--sandboxfusion URL``, started beforehand from its
             source (docs/code-server.md: how, and which isolation)
  subprocess a ThreadPoolExecutor of the client's concurrency running
             ``subprocess.run([python, "-c", code], timeout=...)`` (what SkyRL's python tool does; no
             sandbox, no HTTP)

``tle p99`` is the p99 latency of the runs that timed out (run_timeout 1 s), end to end (queueing for
a sandbox included); ``tle kill`` is their p99 measured from the run's start in its sandbox to its
kill: the ``execution_time`` the server reports (for the subprocess pool, which has no queue, its
wall time around ``subprocess.run``).

Then a leak check: ``--leak-requests`` runs (20% timeouts of 0.5 s, 5% memory hogs: 2,000 and 500
of 10,000) through the server, and the server's process tree, zombies and RSS before and
after (``--leak-only`` skips the table)::

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

    def run(code: str, timeout: float) -> tuple[str, float | None]:
        import threading

        s = session_per_thread.setdefault(threading.get_ident(), requests.Session())
        body = {"code": code, "language": "python", "run_timeout": timeout, "memory_limit_MB": 256}
        r = s.post(url + "/run_code", json=body, timeout=timeout + 60).json()
        run_result = r.get("run_result") or {}
        if run_result.get("status") == "TimeLimitExceeded":
            return r["status"], float(run_result.get("execution_time") or "nan")
        return r["status"], None

    return run


def via_subprocess(code: str, timeout: float) -> tuple[str, float | None]:
    """A run's status and, if it timed out, seconds from its start to its kill (``None``: it did not)."""
    t = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=timeout)
        return ("Success" if p.returncode == 0 else "Failed"), None
    except subprocess.TimeoutExpired:
        return "Failed", time.perf_counter() - t


def measure(run, jobs: list[tuple[str, float]], concurrency: int) -> dict:
    latencies: list[float] = []
    timed_out: list[float] = []  # end to end
    killed_after: list[float] = []  # from the run's start in its sandbox

    def one(job):
        t = time.perf_counter()
        status, tle_s = run(*job)
        latencies.append(time.perf_counter() - t)
        if tle_s is not None:
            timed_out.append(time.perf_counter() - t)
            killed_after.append(tle_s)
        return status

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as ex:
        statuses = list(ex.map(one, jobs))
    wall = time.perf_counter() - t0
    latencies.sort()
    timed_out.sort()
    killed_after.sort()
    pick = lambda xs, q: xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")  # noqa: E731
    return {
        "runs_per_s": len(jobs) / wall,
        "p50_ms": 1000 * pick(latencies, 0.50),
        "p99_ms": 1000 * pick(latencies, 0.99),
        "tle_p99_ms": 1000 * pick(timed_out, 0.99),
        "tle_kill_p99_ms": 1000 * pick(killed_after, 0.99),
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
        jobs.append((LOOP, 0.5) if u < 0.20 else (HOG, 10.0) if u < 0.25 else ("print(1)", 10.0))
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


def start_server(args, port: int, *extra: str) -> tuple[subprocess.Popen, str]:
    cmd = [
        sys.executable, "-m", "boltzlabs_gym.cli", "code-server", "--port", str(port),
        "--lanes", str(args.lanes), "--envs-per-lane", str(args.envs_per_lane), "--memory-mb", "1024", *extra,
    ]  # fmt: skip
    proc = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}"
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
    p.add_argument("--workloads", nargs="+", default=["print", "mbpp", "mix"], choices=["print", "mbpp", "mix"])
    p.add_argument("--leak-requests", type=int, default=500)
    p.add_argument("--leak-only", action="store_true", help="only the leak check")
    p.add_argument("--no-reset-server", action="store_true", help="leave out the --no-wipe server")
    p.add_argument(
        "--sandboxfusion",
        metavar="URL",
        help="also measure a SandboxFusion server already running at URL (started from its source: "
        "docs/code-server.md says how), side by side",
    )
    args = p.parse_args()
    procs = []
    try:
        proc, url = start_server(args, args.port)
        procs.append(proc)
        servers = [("boltzlabs", via_server(url))]
        if not (args.no_reset_server or args.leak_only):
            reset_proc, reset_url = start_server(args, args.port + 1, "--no-wipe")
            procs.append(reset_proc)
            servers.append(("bl-reset", via_server(reset_url)))
        if args.sandboxfusion:
            servers.append(("sandboxfusion", via_server(args.sandboxfusion.rstrip("/"))))
        servers.append(("subprocess", via_subprocess))
        status = requests.get(url + "/v1/status").json()
        print(f"boltzlabs isolation: {status['isolation']['backend']}; lanes {args.lanes} x {args.envs_per_lane} envs")
        print(f"host: {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f} (shared machine)")
        if not args.leak_only:
            table(args, servers)
            status = requests.get(url + "/v1/status").json()
            print(f"boltzlabs: {status['wipes']} runs wiped in place, {status['hard_resets']} hard resets")
        if args.leak_requests:
            print("leak check:", leak_check(url, proc.pid, args.leak_requests, 16))
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    return 0


def table(args, servers) -> None:
    print(f"{'workload':8} {'conc':>4} {'server':13} {'runs/s':>8} {'p50 ms':>8} {'p99 ms':>8}", end=" ")
    print(f"{'tle p99':>8} {'tle kill':>8} {'ok/n':>9}")
    for name in args.workloads:
        for c in args.concurrency:
            n = args.requests * (2 if c >= 64 else 1) if c > 1 else max(8, args.requests // 4)
            jobs = workload(name, n)
            rate = {}
            for label, run in servers:
                m = measure(run, jobs, c)
                rate[label] = m["runs_per_s"]
                print(
                    f"{name:8} {c:>4} {label:13} {m['runs_per_s']:8.1f} {m['p50_ms']:8.0f} {m['p99_ms']:8.0f}"
                    f" {m['tle_p99_ms']:8.0f} {m['tle_kill_p99_ms']:8.0f} {m['ok']:>4}/{m['n']:<4}",
                    flush=True,
                )
            ratios = ", ".join(
                f"{label}/{other} {rate[label] / rate[other]:.2f}x"
                for label, other in (
                    ("boltzlabs", "subprocess"),
                    ("boltzlabs", "bl-reset"),
                    ("boltzlabs", "sandboxfusion"),
                )
                if label in rate and other in rate
            )
            print(f"{'':14} ratios: {ratios}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
