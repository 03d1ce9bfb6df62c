"""The code server against SandboxFusion and a subprocess pool: runs/s, latency, CPU per run, right answers.

    # the fair comparison (docs/code-server.md, "Throughput against SandboxFusion"): SandboxFusion set up by
    # ../shared/tools/sandboxfusion/setup.sh in /work/sf and started with `SF_HOME=/work/sf /work/sf/start.sh 8090`
    python benchmarks/code_server.py --sandboxfusion http://127.0.0.1:8090 --sandboxfusion-home /work/sf \\
        --record code-server-vs-sandboxfusion-DATE
    # our server run by a venv under /tmp (the wipe works there too: the table shows its wipes and hard resets)
    python benchmarks/code_server.py --python /tmp/blg-venv/bin/python --sandboxfusion http://127.0.0.1:8090 \\
        --sandboxfusion-home /work/sf
    # a smoke run: seconds, not minutes
    python benchmarks/code_server.py --workloads print:1 humaneval:8 --seconds 1 --rounds 1 --humaneval-limit 8

Workloads (``--workloads NAME[:C[,C...]]``; a bare name runs at its default concurrencies), each a
program list with the verdict a correct server gives every program (code_workloads.py):
  print      ``print(1)`` at concurrency 1, 8, 64
  humaneval  OpenAI HumanEval's 164 canonical solutions and 164 broken ones (body ``return None``), at 32
  mbpp       an MBPP-style function and three asserts (not run by default)
  mix        75% mbpp, 20% infinite loops (run_timeout 1 s), 5% memory hogs (not run by default)

Servers (``--servers``), alive side by side; each workload at each concurrency is measured in
``--rounds`` rounds of ``--seconds`` per server, the servers taking turns within a round (in an order
rotated every round), so that a drift of the machine's speed hits all of them alike:
  boltzlabs      ``boltzlabs-gym code-server`` started here by ``--python`` from this checkout: sandboxed,
                 wiped in place after every run where the sandbox allows it (else hard-reset)
  bl-reset       the same with ``--no-wipe``: each Python program in namespaces of its own (no wipe),
                 every other program followed by a hard reset
  sandboxfusion  SandboxFusion at ``--sandboxfusion URL``, started beforehand; ``--sandboxfusion-home`` (the
                 folder setup.sh made) has its setup read and printed: commit, uvicorn/uvloop/httptools,
                 isolation, runtime interpreter. Absent: its column is skipped, with the reason.
  subprocess     a thread per client running ``subprocess.run([python, "-c", code], timeout=...)`` (what
                 SkyRL's python tool does; no sandbox, no HTTP, no memory limit: the mix's hogs succeed) on a
                 bare interpreter: a venv with nothing installed, made here from the base interpreter of
                 ``--python`` and removed after (``--subprocess-python`` names another)

Every client thread posts back to back over one keep-alive connection. A round's ``--seconds`` are
timed from the moment every client has had its first answer (the server then holds as many requests
as there are clients, as in the steady state) and count the runs that end within them; those still
running then finish uncounted (their verdicts are checked too).

* runs/s: median over rounds (range); latency p50/p99 over every round's runs; ``vs SandboxFusion``:
  runs/s divided by SandboxFusion's in the same round (median, range).
* CPU ms/run: all CPU time of the machine in the round (``/proc/stat``: user, nice, system, irq,
  softirq, steal; kernel threads included, since namespace teardown runs there), less this process's
  own (the load generator: ``getrusage(RUSAGE_SELF)``, every thread), over the round's runs. The
  subprocess pool's threads are the pool itself, so nothing is taken off there. Other users' CPU is
  in it too: the setup lists what the machine burns with every server idle (flagged past 0.1 cores).
* right/n: runs whose status is the expected one (HumanEval: canonical Success, broken Failed), of
  every run, and how many of the workload's programs were run at all.
* After each workload, /v1/status of our servers: runs wiped in place, run in fresh namespaces, and
  hard resets. A hard reset on the wipe path means the wipe failed (the env was not clean): flagged,
  with the server log's reasons.
* The Python that runs the programs is asked of each server (``sys.version``); ours and SandboxFusion's
  must be the same version (``--allow-python-mismatch`` measures anyway, flagged).

Then, if asked, a leak check: ``--leak-requests`` runs (20% timeouts of 0.5 s, 5% memory hogs) through
our server, and its process tree, zombies and RSS before and after::

    python benchmarks/code_server.py --servers boltzlabs --workloads print:1 --seconds 1 --rounds 1 --leak-requests 500

``--record NAME`` writes docs/benchmark-results/NAME.md and NAME.json.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import http.client
import itertools
import json
import math
import os
import platform
import random
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from urllib.parse import urlsplit

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import code_server_setups as setups  # noqa: E402
import code_workloads as workloads  # noqa: E402
import machine  # noqa: E402
import psutil  # noqa: E402

SERVERS = ("boltzlabs", "bl-reset", "sandboxfusion", "subprocess")
CLK_TCK = os.sysconf("SC_CLK_TCK")
P99_TARGET_MS = 15.0  # ours (the wipe path) at concurrency 1 (issue #47)
WIPE_FAILING = "the wipe is failing"  # in a flag: keep our servers' logs
RAMP_LIMIT_S = 60.0  # the longest wait for every client's first answer before a round is timed
NOT_QUIET_CORES = 0.1  # busy cores with every server idle past which the CPU figures carry others' work
VERSION_PROBE = "import sys; print(sys.version.split()[0]); print(sys.executable)"


# --------------------------------------------------------------------------- CPU accounting
def machine_busy_s() -> float:
    """CPU seconds the whole machine has spent on anything but idle and iowait since boot.

    user + nice + system + irq + softirq + steal; guest time is already inside user and nice.
    """
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / CLK_TCK


def own_cpu_s() -> float:
    """CPU seconds of this process, every thread (the load generator)."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def background_cores(seconds: float) -> float:
    """How many cores the machine keeps busy while nothing is sent (other users, idle servers)."""
    before = machine_busy_s()
    time.sleep(seconds)
    return (machine_busy_s() - before) / seconds


# --------------------------------------------------------------------------- the servers measured
@dataclass
class Outcome:
    """A run's status, and for a timed-out one the seconds from its start to its kill."""

    status: str
    killed_after_s: float | None = None


RunFn = Callable[[workloads.Job], Outcome]


@dataclass
class Target:
    """A server under measurement: how to send it a program, and what to report of it."""

    name: str
    run: RunFn
    url: str | None = None
    wipe: bool | None = None  # ours only: the wipe path (True) or hard reset always (False)
    proc: subprocess.Popen | None = None
    log_path: str | None = None
    python: str | None = None  # the subprocess pool's interpreter
    subtract_client_cpu: bool = True  # False for the subprocess pool, whose threads are the pool


def via_server(url: str) -> RunFn:
    """Post programs to ``url``/run_code, one keep-alive connection per client thread.

    http.client rather than requests: the load generator's CPU is taken off the figures, but on a
    2-core machine it still competes with the server for the cores.
    """
    parts = urlsplit(url)
    local = threading.local()

    def run(job: workloads.Job) -> Outcome:
        conn = getattr(local, "conn", None)
        if conn is None:
            conn = local.conn = http.client.HTTPConnection(
                parts.hostname, parts.port or 80, timeout=job.run_timeout + 60
            )
        body = {"code": job.code, "language": "python", "run_timeout": job.run_timeout, "memory_limit_MB": 256}
        try:
            conn.request("POST", "/run_code", json.dumps(body), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            data = resp.read()
        except (OSError, http.client.HTTPException) as e:
            conn.close()
            local.conn = None
            return Outcome(f"HTTP error {type(e).__name__}")
        if resp.status != 200:
            return Outcome(f"HTTP {resp.status}")
        try:
            reply = json.loads(data)
        except ValueError:  # counted as a wrong answer, not lost with its client thread
            return Outcome("not JSON")
        run_result = reply.get("run_result") or {}
        if run_result.get("status") == "TimeLimitExceeded":
            return Outcome(reply["status"], float(run_result.get("execution_time") or "nan"))
        return Outcome(reply["status"])

    return run


def via_subprocess(python: str) -> RunFn:
    def run(job: workloads.Job) -> Outcome:
        t = time.perf_counter()
        try:
            p = subprocess.run([python, "-c", job.code], capture_output=True, timeout=job.run_timeout)
        except subprocess.TimeoutExpired:
            return Outcome("Failed", time.perf_counter() - t)
        return Outcome("Success" if p.returncode == 0 else "Failed")

    return run


def get_json(url: str, timeout: float = 5) -> dict:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=timeout)
    try:
        conn.request("GET", parts.path)
        resp = conn.getresponse()
        if resp.status != 200:
            raise OSError(f"GET {url}: HTTP {resp.status}")
        return json.loads(resp.read())
    finally:
        conn.close()


# `boltzlabs-gym code-server`, with the runner's log at INFO: its one INFO line says why an env was not
# clean after a program and was hard-reset (the server itself logs warnings only).
LAUNCH_WITH_UNCLEAN_LOG = """
import logging, sys
handler = logging.StreamHandler()
handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
logging.getLogger("boltzlabs_gym.code").addHandler(handler)
logging.getLogger("boltzlabs_gym.code").setLevel(logging.INFO)
from boltzlabs_gym.cli import main
sys.exit(main(sys.argv[1:]))
"""


def start_our_server(args, name: str, port: int, wipe: bool, log_dir: str) -> Target:
    """``code-server`` run by ``--python`` from this checkout (cwd: the repository root, first on its path)."""
    cmd = [
        args.python, "-c", LAUNCH_WITH_UNCLEAN_LOG, "code-server", "--port", str(port),
        "--lanes", str(args.lanes), "--envs-per-lane", str(args.envs_per_lane), "--memory-mb", "1024",
        "--python", "worker",  # programs under --python's interpreter, the one the baselines run
        *([] if wipe else ["--no-wipe"]),
    ]  # fmt: skip
    url, proc, log_path = launch_server(cmd, name, port, log_dir, cwd=ROOT, timeout=120)
    return Target(name, via_server(url), url=url, wipe=wipe, proc=proc, log_path=log_path)


def launch_server(
    cmd: list[str], name: str, port: int, log_dir: str, cwd: str, timeout: float
) -> tuple[str, subprocess.Popen, str]:
    """Start a code server (``cmd``, its output in ``<log_dir>/<name>.log``) and wait until it
    answers ``/v1/ping``; its URL, process and log. Exits the benchmark, with the log's end, if the
    server dies or stays silent for ``timeout`` seconds."""
    log_path = os.path.join(log_dir, f"{name}.log")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{name} exited at start-up ({shlex.join(cmd)}):\n{tail(log_path, 30)}")
        try:
            get_json(url + "/v1/ping", timeout=1)
            return url, proc, log_path
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"{name} did not answer /v1/ping within {timeout:g} s:\n{tail(log_path, 30)}")


def tail(path: str, lines: int) -> str:
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-lines:])


def stop(targets: list[Target]) -> None:
    for t in targets:
        if t.proc is not None:
            t.proc.terminate()
    for t in targets:
        if t.proc is not None:
            try:
                t.proc.wait(30)
            except subprocess.TimeoutExpired:
                t.proc.kill()


def sandboxfusion_target(args) -> tuple[Target | None, str | None]:
    """SandboxFusion at ``--sandboxfusion``, or ``None`` and why it is skipped."""
    if not args.sandboxfusion:
        return None, "no --sandboxfusion URL given"
    url = args.sandboxfusion.rstrip("/")
    if url.endswith("/run_code"):
        url = url[: -len("/run_code")]
    try:
        get_json(url + "/v1/ping", timeout=3)
    except (OSError, ValueError) as e:
        return None, f"no answer from {url}/v1/ping ({e}); start it: SF_HOME=DIR DIR/start.sh PORT"
    return Target("sandboxfusion", via_server(url), url=url), None


# --------------------------------------------------------------------------- one round
@dataclass
class Round:
    """One server's measurement of one workload at one concurrency, for ``seconds``."""

    server: str
    workload: str
    concurrency: int
    round: int
    seconds: float
    ramp_s: float  # from the first request to every client's first answer, untimed
    runs: int  # ended within the timed window
    runs_per_s: float
    p50_ms: float
    p99_ms: float
    machine_cpu_s: float
    client_cpu_s: float
    cpu_ms_per_run: float
    right: int  # of every run: the ramp's, the window's and those that ended after it
    checked: int
    statuses: dict[str, int]
    wrong_examples: list[str]
    programs_run: set[str]
    latencies_ms: list[float]
    tle_end_to_end_ms: list[float]
    tle_killed_after_ms: list[float]
    timed_right: int = 0  # of the timed runs, those with the expected status (code_languages.py's rate)

    def to_json(self) -> dict:
        skip = {"programs_run", "latencies_ms", "tle_end_to_end_ms", "tle_killed_after_ms"}
        out = {k: v for k, v in self.__dict__.items() if k not in skip}
        out["programs_run"] = len(self.programs_run)
        return out


def pick(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def pick_or_none(xs: list[float], q: float) -> float | None:
    """``pick``, but ``None`` (JSON null) where nothing was measured (no run timed out)."""
    return pick(xs, q) if xs else None


def measure_round(
    target: Target, workload: str, jobs: list[workloads.Job], concurrency: int, seconds: float, index: int
) -> Round:
    """``concurrency`` client threads send ``jobs`` (cycling) back to back; ``seconds`` of it are timed.

    The timed window opens once every client has had its first answer: from then on the server holds
    ``concurrency`` requests at every moment, as in the steady state. Timed from the first request
    instead, a server whose answers take a large part of the window would lose the wait for its first
    ones, a bias against the slower server. Runs that end in the window are counted; those still in
    flight when it closes finish uncounted, balancing those in flight when it opened.
    """
    records: list[tuple[float, float, Outcome, workloads.Job]] = []  # (end, latency, outcome, job)
    counter = itertools.count()  # next() on it is atomic under the GIL
    first_answers = threading.Semaphore(0)
    window = {"start": math.inf, "end": math.inf}

    def client() -> None:
        first = True
        while time.perf_counter() < window["end"]:
            job = jobs[next(counter) % len(jobs)]
            t = time.perf_counter()
            outcome = target.run(job)
            done = time.perf_counter()
            records.append((done, done - t, outcome, job))
            if first:
                first_answers.release()
                first = False

    threads = [threading.Thread(target=client, daemon=True) for _ in range(concurrency)]
    started = time.perf_counter()
    for th in threads:
        th.start()
    ramp_deadline = started + RAMP_LIMIT_S
    for _ in range(concurrency):
        if not first_answers.acquire(timeout=max(0.0, ramp_deadline - time.perf_counter())):
            break  # a client still waits for its first answer: time the round anyway
    busy0, own0 = machine_busy_s(), own_cpu_s()
    window["start"] = time.perf_counter()
    window["end"] = window["start"] + seconds
    time.sleep(seconds)
    busy, own = machine_busy_s() - busy0, own_cpu_s() - own0
    for th in threads:
        th.join()
    timed = [r for r in records if window["start"] < r[0] <= window["end"]]
    ramp_s = window["start"] - started
    return summarize_round(target, workload, records, timed, busy, own, concurrency, seconds, index, ramp_s)


def summarize_round(
    target: Target,
    workload: str,
    records: list[tuple[float, float, Outcome, workloads.Job]],
    timed: list[tuple[float, float, Outcome, workloads.Job]],
    busy_s: float,
    own_s: float,
    concurrency: int,
    seconds: float,
    index: int,
    ramp_s: float,
) -> Round:
    """The round's figures: runs, latency and CPU from the ``timed`` runs; verdicts from every run."""
    statuses = Counter(outcome.status for _, _, outcome, _ in records)
    wrong = [f"{job.name}: {outcome.status}" for _, _, outcome, job in records if outcome.status != job.expect]
    server_cpu_s = busy_s - (own_s if target.subtract_client_cpu else 0.0)
    return Round(
        server=target.name,
        workload=workload,
        concurrency=concurrency,
        round=index,
        seconds=seconds,
        ramp_s=ramp_s,
        runs=len(timed),
        runs_per_s=len(timed) / seconds,
        p50_ms=1000 * pick([r[1] for r in timed], 0.50),
        p99_ms=1000 * pick([r[1] for r in timed], 0.99),
        machine_cpu_s=busy_s,
        client_cpu_s=own_s,
        cpu_ms_per_run=1000 * server_cpu_s / len(timed) if timed else float("nan"),
        right=len(records) - len(wrong),
        checked=len(records),
        statuses=dict(statuses),
        wrong_examples=wrong[:5],
        programs_run={job.name for _, _, _, job in records},
        latencies_ms=[1000 * r[1] for r in timed],
        tle_end_to_end_ms=[1000 * r[1] for r in timed if r[2].killed_after_s is not None],
        tle_killed_after_ms=[1000 * r[2].killed_after_s for r in timed if r[2].killed_after_s is not None],
        timed_right=sum(outcome.status == job.expect for _, _, outcome, job in timed),
    )


# --------------------------------------------------------------------------- a workload: every round
def parse_workloads(specs: list[str]) -> list[tuple[str, int]]:
    """``NAME[:C[,C...]]`` -> (name, concurrency) cells; a bare name at its default concurrencies."""
    cells = []
    for spec in specs:
        name, _, conc = spec.partition(":")
        if name not in workloads.NAMES:
            raise SystemExit(
                f"unknown workload {name!r} in --workloads {spec!r}; expected {', '.join(workloads.NAMES)}"
            )
        try:
            levels = [int(c) for c in conc.split(",")] if conc else list(workloads.DEFAULT_CONCURRENCY[name])
        except ValueError:
            raise SystemExit(f"--workloads {spec!r}: concurrencies are integers, e.g. print:1,8,64") from None
        cells += [(name, c) for c in levels]
    return cells


def our_counts(target: Target) -> dict[str, int]:
    status = get_json(target.url + "/v1/status")
    return {"wipes": status["wipes"], "fresh": status.get("fresh", 0), "hard_resets": status["hard_resets"]}


def rotated(targets: list[Target], k: int) -> list[Target]:
    k %= len(targets)
    return targets[k:] + targets[:k]


def measure_cell(targets: list[Target], name: str, concurrency: int, jobs, args) -> tuple[list[Round], dict]:
    """Every round of one workload at one concurrency, the servers taking turns; and our servers' counts."""
    ours = [t for t in targets if t.wipe is not None]
    before = {t.name: our_counts(t) for t in ours}
    rounds = []
    for r in range(args.rounds):
        for target in rotated(targets, r):
            rd = measure_round(target, name, jobs, concurrency, args.seconds, r)
            log(
                f"{name} c={concurrency} round {r + 1}/{args.rounds} {target.name:13} {rd.runs_per_s:7.1f} runs/s"
                f"  p50 {rd.p50_ms:6.1f} ms  p99 {rd.p99_ms:6.1f} ms  CPU {rd.cpu_ms_per_run:6.1f} ms/run"
                f"  right {rd.right}/{rd.checked}"
            )
            rounds.append(rd)
    after = {t.name: our_counts(t) for t in ours}
    counts = {n: {k: after[n][k] - before[n][k] for k in after[n]} for n in after}
    return rounds, counts


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)} if xs else {}


def summarize_cell(rounds: list[Round], servers: list[str], programs: int) -> list[dict]:
    """One row per server: runs/s and CPU over rounds, latency over every run, verdicts, ratio to SandboxFusion."""
    sf = {r.round: r for r in rounds if r.server == "sandboxfusion"}
    rows = []
    for server in servers:
        rs = [r for r in rounds if r.server == server]
        latencies = [x for r in rs for x in r.latencies_ms]
        ratios = [r.runs_per_s / sf[r.round].runs_per_s for r in rs if r.round in sf and sf[r.round].runs_per_s > 0]
        rows.append(
            {
                "server": server,
                "runs_per_s": spread([r.runs_per_s for r in rs]),
                "p50_ms": pick(latencies, 0.50),
                "p99_ms": pick(latencies, 0.99),
                "cpu_ms_per_run": spread([r.cpu_ms_per_run for r in rs if r.runs]),
                "client_cpu_ms_per_run": spread([1000 * r.client_cpu_s / r.runs for r in rs if r.runs]),
                "right": sum(r.right for r in rs),
                "checked": sum(r.checked for r in rs),
                "statuses": dict(sum((Counter(r.statuses) for r in rs), Counter())),
                "wrong_examples": [w for r in rs for w in r.wrong_examples][:5],
                "programs_run": len(set().union(*(r.programs_run for r in rs))),
                "programs": programs,
                "tle_p99_ms": pick_or_none([x for r in rs for x in r.tle_end_to_end_ms], 0.99),
                "tle_kill_p99_ms": pick_or_none([x for r in rs for x in r.tle_killed_after_ms], 0.99),
                "vs_sandboxfusion": spread(ratios),
            }
        )
    return rows


# --------------------------------------------------------------------------- the report
def fmt_spread(s: dict, spec: str = ".1f", unit: str = "") -> str:
    if not s:
        return "-"
    if len({s["min"], s["max"]}) == 1:
        return f"{s['median']:{spec}}{unit}"
    return f"{s['median']:{spec}}{unit} ({s['min']:{spec}}-{s['max']:{spec}})"


def cell_markdown(cell: dict, args) -> list[str]:
    title = "`print(1)`" if cell["workload"] == "print" else cell["workload"]
    out = [
        f"### {title}, concurrency {cell['concurrency']}, {args.rounds} x {args.seconds:g} s",
        "",
        "| server | runs/s | p50 ms | p99 ms | CPU ms/run | right / runs | programs run | vs SandboxFusion |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in cell["rows"]:
        out.append(
            f"| {row['server']} | {fmt_spread(row['runs_per_s'])} | {row['p50_ms']:.1f} | {row['p99_ms']:.1f}"
            f" | {fmt_spread(row['cpu_ms_per_run'])} | {row['right']}/{row['checked']}"
            f" | {row['programs_run']}/{row['programs']} | {fmt_spread(row['vs_sandboxfusion'], '.2f', 'x')} |"
        )
    tle = [r for r in cell["rows"] if r["tle_p99_ms"] is not None]
    if tle:
        out += [
            "",
            "Timed-out runs, p99 end to end / from their start to their kill: "
            + "; ".join(f"{r['server']} {r['tle_p99_ms']:.0f} / {r['tle_kill_p99_ms']:.0f} ms" for r in tle),
        ]
    if cell["our_counts"]:
        out += [
            "",
            "After this workload, /v1/status: "
            + "; ".join(
                f"{n} {c['wipes']} runs wiped in place, {c['fresh']} in fresh namespaces, {c['hard_resets']} hard resets"
                for n, c in cell["our_counts"].items()
            ),
        ]
    return out + [""]


def cell_flags(cell: dict, targets: dict[str, Target]) -> list[str]:
    """What must not pass unseen: a failing wipe, a wrong answer."""
    where = f"{cell['workload']} c={cell['concurrency']}"
    flags = []
    for name, c in cell["our_counts"].items():
        if targets[name].wipe and c["hard_resets"]:
            runs = c["wipes"] + c["hard_resets"]
            flags.append(
                f"{name} (the wipe path) hard-reset {c['hard_resets']} of {runs} runs in {where}: {WIPE_FAILING}"
                + unclean_reasons(targets[name].log_path)
            )
    for row in cell["rows"]:
        if row["right"] != row["checked"]:
            flags.append(
                f"{row['server']} answered {row['checked'] - row['right']} of {row['checked']} runs wrong in {where}"
                f" (statuses {row['statuses']}; e.g. {row['wrong_examples'][:3]})"
            )
    return flags


def unclean_reasons(log_path: str | None, most: int = 3) -> str:
    """The distinct reasons the server logged for envs that were not clean after a program."""
    if not log_path:
        return ""
    with open(log_path, errors="replace") as f:
        reasons = {line.split("not clean after a program", 1)[1].strip() for line in f if "not clean after" in line}
    return f"; the log says: {sorted(reasons)[:most]}" if reasons else "; the log gives no reason"


def p99_at_concurrency_1(cells: list[dict]) -> list[str]:
    lines = []
    for cell in cells:
        if cell["concurrency"] != 1:
            continue
        parts = []
        for row in cell["rows"]:
            mark = ""
            if row["server"] == "boltzlabs":  # the wipe path; a hard reset per run costs more than the target
                mark = " (met)" if row["p99_ms"] < P99_TARGET_MS else " (MISSED)"
            parts.append(f"{row['server']} {row['p99_ms']:.1f} ms{mark}")
        lines.append(
            f"p99 at concurrency 1, {cell['workload']} (target for ours < {P99_TARGET_MS:g} ms): " + ", ".join(parts)
        )
    return lines


# --------------------------------------------------------------------------- who runs the programs
def python_of_programs(target: Target) -> tuple[str, str]:
    """The version and executable of the Python that runs ``target``'s programs, asked of the server itself."""
    if target.python is not None:  # the subprocess pool
        out = subprocess.run([target.python, "-c", VERSION_PROBE], capture_output=True, text=True, check=True)
        version, executable = out.stdout.split()
        return version, executable
    parts = urlsplit(target.url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        body = {"code": VERSION_PROBE, "language": "python", "run_timeout": 10}
        conn.request("POST", "/run_code", json.dumps(body), {"Content-Type": "application/json"})
        reply = json.loads(conn.getresponse().read())
    finally:
        conn.close()
    out = (reply.get("run_result") or {}).get("stdout") or ""
    if len(out.split()) != 2:
        raise SystemExit(f"{target.name} did not run the version probe: {reply}")
    version, executable = out.split()
    return version, executable


def check_pythons(targets: list[Target], allow_mismatch: bool) -> tuple[dict, list[str]]:
    """Ask every server which Python runs its programs; ours and SandboxFusion's must be the same version."""
    pythons = {t.name: python_of_programs(t) for t in targets}
    versions = {v for v, _ in pythons.values()}
    flags = []
    if len(versions) > 1:
        flags.append(
            "the servers run programs on different Pythons: "
            + ", ".join(f"{n} {v} ({exe})" for n, (v, exe) in pythons.items())
        )
        ours = {pythons[n][0] for n in ("boltzlabs", "bl-reset") if n in pythons}
        if "sandboxfusion" in pythons and pythons["sandboxfusion"][0] not in ours and not allow_mismatch:
            raise SystemExit(
                f"!!! refusing to measure: {flags[0]}. Set SandboxFusion's runtime venv up from the same "
                "interpreter as --python, or pass --allow-python-mismatch to measure anyway (flagged)."
            )
    return {n: {"version": v, "executable": exe} for n, (v, exe) in pythons.items()}, flags


# --------------------------------------------------------------------------- header, record
def header(args) -> dict:
    """Date, commit, machine and load: what a reader needs to weigh the figures."""
    commit = subprocess.run(["git", "rev-parse", "--short=10", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True
    )
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": commit.stdout.strip() + (" (uncommitted changes)" if dirty.stdout.strip() else ""),
        "cpu_model": machine.cpu_model(),
        "cpu_count": os.cpu_count(),
        "mem_total_gib": machine.mem_total_gib(),
        "kernel": platform.release(),
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
        "command": shlex.join([os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]]),
    }


def header_lines(h: dict) -> list[str]:
    return [
        f"- date {h['date']}, git {h['git_commit']}",
        f"- machine: {h['cpu_model']}, {h['cpu_count']} CPUs, {h['mem_total_gib']} GiB, Linux {h['kernel']}",
        f"- load average at the start: {' '.join(f'{x:.2f}' for x in h['loadavg_start'])}",
        f"- command: `python {h['command']}`",
    ]


def write_record(name: str, directory: str, markdown: str, result: dict) -> None:
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, name + ".md"), "w") as f:
        f.write(markdown)
    with open(os.path.join(directory, name + ".json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
        f.write("\n")
    log(f"recorded {os.path.join(directory, name)}.md and .json")


# --------------------------------------------------------------------------- leak check
def run_all(run: RunFn, jobs: list[workloads.Job], concurrency: int) -> None:
    with ThreadPoolExecutor(concurrency) as ex:
        list(ex.map(run, jobs))


def process_tree(pid: int) -> list[psutil.Process]:
    p = psutil.Process(pid)
    return [p, *p.children(recursive=True)]


def leak_check(target: Target, n: int, concurrency: int) -> dict:
    """``n`` runs (20% timeouts, 5% memory hogs) through our server: its processes and RSS before and after."""
    pid = target.proc.pid
    run_all(target.run, workloads.jobs_for("print") * 64, 8)  # the RSS baseline is taken after the first runs
    before_rss, before = psutil.Process(pid).memory_info().rss, len(process_tree(pid))
    rng = random.Random(1)
    jobs = []
    for _ in range(n):
        u = rng.random()
        code, timeout = (workloads.LOOP, 0.5) if u < 0.20 else (workloads.HOG, 10.0) if u < 0.25 else ("print(1)", 10.0)
        jobs.append(workloads.Job(code, timeout, "", "leak"))
    run_all(target.run, jobs, concurrency)
    time.sleep(1.0)
    procs = process_tree(pid)
    return {
        "requests": n,
        "processes_before": before,
        "processes_after": len(procs),
        "zombies": sum(p.status() == psutil.STATUS_ZOMBIE for p in procs),
        "server_rss_growth_mib": round((psutil.Process(pid).memory_info().rss - before_rss) / 2**20, 1),
    }


# --------------------------------------------------------------------------- main
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--workloads",
        nargs="+",
        default=["print", "humaneval"],
        metavar="NAME[:C,...]",
        help=f"of {', '.join(workloads.NAMES)}; default: print (at 1, 8, 64) and humaneval (at 32)",
    )
    p.add_argument("--seconds", type=float, default=8.0, help="per server, per round, per workload and concurrency")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--servers", default=",".join(SERVERS), help=f"comma-separated subset of {','.join(SERVERS)}")
    p.add_argument("--python", default=sys.executable, help="the interpreter that runs our server (default: this one)")
    p.add_argument("--port", type=int, default=18181, help="ours; --no-wipe's is the next one")
    p.add_argument("--lanes", type=int, default=4)
    p.add_argument("--envs-per-lane", type=int, default=4)
    p.add_argument("--sandboxfusion", metavar="URL", help="SandboxFusion's server, started beforehand")
    p.add_argument("--sandboxfusion-home", metavar="DIR", help="the folder setup.sh made for it: its setup is printed")
    p.add_argument("--sandboxfusion-source", metavar="GITDIR", help="the git dir its source came from (for its commit)")
    p.add_argument(
        "--allow-python-mismatch",
        action="store_true",
        help="measure even if SandboxFusion's programs run on another Python version than ours (flagged)",
    )
    p.add_argument("--subprocess-python", help="the subprocess pool's interpreter (default: a fresh bare venv)")
    p.add_argument("--humaneval-limit", type=int, help="only the first N problems (N canonical + N broken programs)")
    p.add_argument("--idle-seconds", type=float, default=2.0, help="how long the idle machine's CPU is read")
    p.add_argument("--leak-requests", type=int, default=0, help="then this many runs through ours, checking for leaks")
    p.add_argument("--record", metavar="NAME", help="write NAME.md and NAME.json into --record-dir")
    p.add_argument("--record-dir", default=os.path.join(ROOT, "docs", "benchmark-results"))
    args = p.parse_args(argv)
    unknown = set(args.servers.split(",")) - set(SERVERS)
    if unknown:
        p.error(f"--servers: unknown {sorted(unknown)}; expected a subset of {','.join(SERVERS)}")
    return args


def start_targets(args, log_dir: str, skipped: dict, cleanup: list) -> tuple[list[Target], dict]:
    """Start ours, find SandboxFusion, make the subprocess pool's venv; and describe each setup."""
    wanted = args.servers.split(",")
    ours = setups.probe_interpreter(args.python, setups.HTTP_STACK)
    imported = subprocess.run(
        [args.python, "-c", "import boltzlabs_gym; print(boltzlabs_gym.__file__)"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    ).stdout.strip()
    setup: dict = {"ours": {"interpreter": ours.__dict__, "boltzlabs_gym": imported}}
    targets = []
    for name, wipe, port in (("boltzlabs", True, args.port), ("bl-reset", False, args.port + 1)):
        if name in wanted:
            targets.append(start_our_server(args, name, port, wipe, log_dir))
            cleanup.append(targets[-1])
    if "sandboxfusion" in wanted:
        sf, why = sandboxfusion_target(args)
        if sf is None:
            skipped["sandboxfusion"] = why
        else:
            targets.append(sf)
            if args.sandboxfusion_home:
                desc = setups.describe_sandboxfusion(args.sandboxfusion_home, sf.url, args.sandboxfusion_source)
                setup["sandboxfusion"] = desc.to_json()
                setup["sandboxfusion_lines"] = desc.lines()
            else:
                setup["sandboxfusion_lines"] = ["SandboxFusion's setup is not described: no --sandboxfusion-home"]
    if "subprocess" in wanted:
        python = args.subprocess_python
        if python is None:
            python, holder = setups.make_bare_venv(ours.base_executable)
            cleanup.append(holder)
        pool = setups.probe_interpreter(python)
        setup["subprocess"] = pool.__dict__ | {"made_here": args.subprocess_python is None}
        targets.append(Target("subprocess", via_subprocess(python), python=python, subtract_client_cpu=False))
    for t in targets:
        if t.wipe is not None:
            status = get_json(t.url + "/v1/status")
            setup.setdefault("isolation", (status["isolation"] or {}).get("backend"))
    return targets, setup


def setup_lines(args, setup: dict, pythons: dict) -> list[str]:
    ours = setup["ours"]["interpreter"]
    stack = ", ".join(f"{k} {v or '-'}" for k, v in ours["packages"].items())
    lines = [
        f"- boltzlabs: `boltzlabs-gym code-server` from {setup['ours']['boltzlabs_gym']}, run by {ours['path']}"
        f" (Python {ours['version']}, start-up {ours['startup_ms']:.1f} ms, which its programs do not pay: they are"
        f" forked from a warm interpreter); {args.lanes} lanes x {args.envs_per_lane} envs, isolation"
        f" {setup.get('isolation')}, wiped in place after every run; bl-reset: the same with --no-wipe (each Python"
        " program in namespaces of its own)",
        f"  - our HTTP stack: {stack}",
    ]
    for i, line in enumerate(setup.get("sandboxfusion_lines", [])):
        lines.append(("- " if i == 0 else "  - ") + line.strip())
    if "subprocess" in setup:
        sub = setup["subprocess"]
        made = "--subprocess-python"
        if sub["made_here"]:
            made = "a venv with nothing installed, made for this run from the base interpreter of --python"
        pth = ", ".join(sub["pth_files"]) or "none"
        lines.append(
            f"- subprocess pool: {sub['path']} ({made}): Python {sub['version']}, start-up"
            f" {sub['startup_ms']:.1f} ms (median of 10 `python -c pass`), .pth: {pth}"
        )
    lines.append(
        "- Python that runs the programs (asked of each server): "
        + ", ".join(f"{n} {p['version']} ({p['executable']})" for n, p in pythons.items())
    )
    return lines


def http_stack_note(setup: dict) -> list[str]:
    """Say so when SandboxFusion's uvicorn has uvloop/httptools and ours has not (or the other way round)."""
    theirs = (setup.get("sandboxfusion") or {}).get("server_packages")
    if not theirs:
        return []
    ours = setup["ours"]["interpreter"]["packages"]
    differ = [k for k in ("uvloop", "httptools") if bool(ours.get(k)) != bool(theirs.get(k))]
    if not differ:
        return []
    return [
        f"- note: the HTTP stacks differ in {', '.join(differ)}: ours "
        + ", ".join(f"{k} {ours.get(k) or 'absent'}" for k in differ)
        + "; SandboxFusion's "
        + ", ".join(f"{k} {theirs.get(k) or 'absent'}" for k in differ)
    ]


def main(argv=None) -> int:
    args = parse_args(argv)
    cells_wanted = parse_workloads(args.workloads)
    head = header(args)
    log_dir = tempfile.mkdtemp(prefix="code-bench-logs-")
    skipped: dict[str, str] = {}
    cleanup: list = []
    flags: list[str] = []
    try:
        targets, setup = start_targets(args, log_dir, skipped, cleanup)
        if not targets:
            raise SystemExit(f"nothing to measure: {skipped}")
        for name, why in skipped.items():
            log(f"skipped {name}: {why}")
        pythons, python_flags = check_pythons(targets, args.allow_python_mismatch)
        flags += python_flags
        for line in setup_lines(args, setup, pythons) + http_stack_note(setup):
            log(line)
        for t in targets:  # warm: first requests, connections, imports, page cache
            run_all(t.run, workloads.jobs_for("print") * 16, 4)
        idle = background_cores(args.idle_seconds)
        log(f"background: {idle:.2f} cores busy with every server idle (other users' load included)")
        if idle > NOT_QUIET_CORES:
            flags.append(
                f"the machine was not quiet: {idle:.2f} cores busy with every server idle, in every CPU per run"
            )
        cells = []
        for name, concurrency in cells_wanted:
            try:
                jobs = workloads.jobs_for(name, args.humaneval_limit)
            except workloads.WorkloadUnavailable as e:
                skipped[f"{name} c={concurrency}"] = str(e)
                log(f"skipped {name} c={concurrency}: {e}")
                continue
            rounds, counts = measure_cell(targets, name, concurrency, jobs, args)
            programs = len({j.name for j in jobs})
            cell = {
                "workload": name,
                "concurrency": concurrency,
                "our_counts": counts,
                "rows": summarize_cell(rounds, [t.name for t in targets], programs),
                "rounds": [r.to_json() for r in rounds],
            }
            for flag in cell_flags(cell, {t.name: t for t in targets}):
                log(f"!!! {flag}")
                flags.append(flag)
            cells.append(cell)
        leak = None
        ours = [t for t in targets if t.wipe]
        if args.leak_requests and ours:
            leak = leak_check(ours[0], args.leak_requests, 16)
        result = {
            "header": head,
            "setup": setup,
            "pythons": pythons,
            "background_cores": idle,
            "cells": cells,
            "skipped": skipped,
            "flags": flags,
            "leak_check": leak,
        }
        markdown = report(args, result)
        print(markdown, flush=True)
        if args.record:
            write_record(args.record, args.record_dir, markdown, result)
    finally:
        stop([c for c in cleanup if isinstance(c, Target)])
        for c in cleanup:
            if isinstance(c, tempfile.TemporaryDirectory):
                c.cleanup()
        if any(WIPE_FAILING in f for f in flags):  # the logs say why
            log(f"our servers' logs kept in {log_dir}")
        else:
            shutil.rmtree(log_dir, ignore_errors=True)
    return 0


def report(args, result: dict) -> str:
    lines = ["# Code server against SandboxFusion and a subprocess pool", ""] + header_lines(result["header"])
    lines += ["", "## Setup", ""] + setup_lines(args, result["setup"], result["pythons"])
    lines += http_stack_note(result["setup"])
    lines += [
        f"- background: {result['background_cores']:.2f} cores busy with every server idle"
        " (other users' load included; it is in the CPU per run)",
        "",
    ]
    lines += [f"skipped {name}: {why}" for name, why in result["skipped"].items()]
    lines += ["", "## Results", ""]
    for cell in result["cells"]:
        lines += cell_markdown(cell, args)
    lines += p99_at_concurrency_1(result["cells"])
    if result["leak_check"]:
        lines += ["", f"Leak check (boltzlabs): {result['leak_check']}"]
    if result["flags"]:
        lines += ["", "## !!! Flags", ""] + [f"- !!! {f}" for f in result["flags"]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
