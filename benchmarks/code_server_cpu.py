"""Where a code server request's CPU goes: the server, its worker, the envs and their zygotes, the programs.

Starts ``boltzlabs-gym code-server`` (with ``--python``'s interpreter, so another tree's server can
be measured beside this one's), sends ``--runs`` ``print(1)`` requests (or ``--language``'s trivial
program from ``code_languages.py``) from ``--concurrency``
client threads after a warm-up, and reads the CPU time of every process of the server's tree
before and after (psutil: user + system of each live process, plus what each reaped of its
children). Per run, in ms:

  server      the HTTP server and the runner's lanes (the code server's own process)
  worker      the worker process (ZeroMQ, the env pipes, spawning and killing envs)
  envs        the envs, zygotes and boltz templates alive at the end (their own CPU)
  programs    what those reaped: the programs (forked by the zygotes, or the envs)
  ended envs  what the worker reaped: the envs it killed, whole lifetimes, their programs included
              (a hard reset: a new env per run)

and the whole machine's CPU per run (``/proc/stat``, kernel threads included) less this
process's own (the load generator's), for comparison::

    python benchmarks/code_server_cpu.py                      # the wipe path
    python benchmarks/code_server_cpu.py --no-wipe            # without the wipe: fresh namespaces per program
    python benchmarks/code_server_cpu.py --python /path/to/other-tree-venv/bin/python --rounds 2

Rounds alternate the paths (and interpreters, when several ``--python`` are given), so that the
VM's speed drifting from minute to minute falls on all alike.
"""

from __future__ import annotations

import argparse
import collections
import os
import socket
import subprocess
import sys
import threading
import time

import psutil
import requests
from code_server import machine_busy_s, own_cpu_s  # (the fair benchmark's CPU accounting)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(python: str, wipe: bool) -> tuple[subprocess.Popen, str]:
    port = free_port()
    argv = [python, "-m", "boltzlabs_gym.cli", "code-server", "--port", str(port), "--lanes", "4"]
    argv += ["--envs-per-lane", "4"] + ([] if wipe else ["--no-wipe"])
    # (cwd "/": run from a checkout, `python -m` would import that checkout's package, not python's)
    server = subprocess.Popen(argv, stdout=subprocess.DEVNULL, cwd="/")
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            requests.get(url + "/v1/ping", timeout=1)
            return server, url
        except requests.ConnectionError:
            time.sleep(0.1)
    server.kill()
    raise SystemExit(f"the server ({python}) did not answer within 120 s")


def tree_cpu(root: psutil.Process) -> dict[int, tuple[int, str, float, float]]:
    """pid -> (parent pid, name, own CPU s, reaped children's CPU s) of ``root`` and its descendants."""
    out = {}
    for p in [root, *root.children(recursive=True)]:
        try:
            t = p.cpu_times()
            out[p.pid] = (p.ppid(), p.name(), t.user + t.system, t.children_user + t.children_system)
        except psutil.Error:
            pass
    return out


def request_body(language: str) -> dict:
    """The trivial program of ``language``: ``print(1)`` for python, else code_languages.py's."""
    if language == "python":
        return {"code": "print(1)", "language": "python"}
    from code_languages import PROGRAMS

    return {"code": PROGRAMS[language].code, "language": language, "run_timeout": 20, "compile_timeout": 30}


def send(url: str, runs: int, concurrency: int, body: dict) -> None:
    def client(k: int) -> None:
        with requests.Session() as s:
            for _ in range(k):
                r = s.post(url + "/run_code", json=body, timeout=120).json()
                if r.get("status") != "Success":
                    raise SystemExit(f"a run failed: {r}")

    threads = [threading.Thread(target=client, args=(runs // concurrency,)) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def measure(python: str, wipe: bool, runs: int, concurrency: int, body: dict) -> dict[str, float]:
    server, url = start_server(python, wipe)
    try:
        send(url, 4 * concurrency, concurrency, body)  # warm-up
        root = psutil.Process(server.pid)
        worker_pids = {c.pid for c in root.children()}
        before, m0, g0, t0 = tree_cpu(root), machine_busy_s(), own_cpu_s(), time.perf_counter()
        send(url, runs, concurrency, body)
        after, m1, g1, t1 = tree_cpu(root), machine_busy_s(), own_cpu_s(), time.perf_counter()
        status = requests.get(url + "/v1/status", timeout=10).json()
    finally:
        server.terminate()
        server.wait(30)
    n = runs // concurrency * concurrency
    parts: dict[str, float] = collections.defaultdict(float)
    for pid, (_ppid, _name, own, reaped) in after.items():
        own0, reaped0 = before.get(pid, (0, "", 0.0, 0.0))[2:]
        if pid == server.pid:
            parts["server"] += own - own0
        elif pid in worker_pids:
            parts["worker"] += own - own0
            parts["ended envs"] += reaped - reaped0
        else:
            parts["envs"] += own - own0
            parts["programs"] += reaped - reaped0
    row = {k: 1000 * v / n for k, v in parts.items()}
    row["tree"] = sum(row.values())
    row["machine less load generator"] = 1000 * ((m1 - m0) - (g1 - g0)) / n
    row["runs/s"] = n / (t1 - t0)
    row["wipes"], row["hard resets"] = status.get("wipes", 0), status.get("hard_resets", 0)
    row["fresh"] = status.get("fresh", 0)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--python", nargs="*", default=[sys.executable], help="interpreters whose servers to measure")
    ap.add_argument("--runs", type=int, default=800)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--language", default="python", help="the trivial program of this language (code_languages.py's)")
    ap.add_argument("--no-wipe", action="store_true", help="only the path without the wipe (--no-wipe)")
    ap.add_argument("--wipe-only", action="store_true", help="only the wipe path")
    args = ap.parse_args()
    paths = [False] if args.no_wipe else [True] if args.wipe_only else [True, False]
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S')}, load average {os.getloadavg()[0]:.2f} at the start", flush=True)
    columns = ["server", "worker", "envs", "programs", "ended envs", "tree", "machine less load generator"]
    print("| server | path | round | runs/s | " + " | ".join(columns) + " | wiped / fresh / hard resets |")
    print("|---|---|---:|---:|" + "---:|" * len(columns) + "---:|")
    for r in range(args.rounds):
        for python in args.python:
            for wipe in paths:
                row = measure(python, wipe, args.runs, args.concurrency, request_body(args.language))
                cells = " | ".join(f"{row.get(c, 0.0):.2f}" for c in columns)
                path = "wipe" if wipe else "no wipe"
                print(
                    f"| {python} | {path} | {r + 1} | {row['runs/s']:.0f} | {cells} | "
                    f"{row['wipes']} / {row['fresh']} / {row['hard resets']} |",
                    flush=True,
                )
    print("CPU in ms per run; `tree` is the server's process tree, `machine` includes kernel threads.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
