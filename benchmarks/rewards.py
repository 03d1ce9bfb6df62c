"""Rewards/s for a batch of code completions: the TRL reward function on the pool against two baselines.

A batch of ``--batch`` (64) completions of ``add(a, b)``, three assert cases each (192 programs),
graded three ways:

* ``boltz``: :class:`boltzlabs_gym.integrations.trl.CodeReward` on a
  :class:`~boltzlabs_gym.integrations.grading.Grader` (``--lanes`` x ``--envs-per-lane`` sandboxed
  envs), called the way ``GRPOTrainer`` calls it; the runner is started and warmed up first;
* ``exec``: TRL-style in-process grading, unsandboxed: ``exec(code + case)`` in the grading process,
  one case after another (a case passes when it raises nothing);
* ``threads``: a ``subprocess.run([python, -I, -S, -c, code + case], timeout=--run-timeout)`` per
  case on a thread pool of as many threads as the boltz grader has envs, unsandboxed.

Three mixes: no loops; 10% of the completions loop forever (``while True: pass``); 10% fork and then
both processes loop (model code that uses ``multiprocessing``/``os.fork`` and never returns).
The baselines run in a child process of their own, killed (with its process group) after
``--outer-timeout`` s: one still running then is reported as ``hung``. After each run the processes
it left are counted (``leaked``): for a baseline, the programs still alive on this host (found by a
marker in their command line) and the processes of its child's process group (for one that hung,
those still running when it was killed), all then killed, also when the benchmark itself is
interrupted or terminated; for ``boltz``, the processes below the benchmark's own (worker, envs,
their programs) more than before the run. Median of ``--repeats`` runs where nothing hung.
Printed, never asserted::

    python benchmarks/rewards.py [--batch 64] [--repeats 3] [--lanes 2 --envs-per-lane 8]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

MARKER = "boltz_rewards_bench_marker"
CASES = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 4"]
RIGHT = f"# {MARKER}\ndef add(a, b):\n    return a + b\n"
WRONG = f"# {MARKER}\ndef add(a, b):\n    return a - b\n"
LOOP = f"# {MARKER}\ndef add(a, b):\n    while True:\n        pass\n"
FORK_LOOP = f"# {MARKER}\nimport os\ndef add(a, b):\n    os.fork()\n    while True:\n        pass\n"
#: The baseline's interpreter, started the fastest plain way (isolated, no site: ~4x faster here).
PYTHON = [sys.executable, "-I", "-S", "-c"]
MIXES = {"no loops": None, "10% loops": LOOP, "10% forking loops": FORK_LOOP}


def batch(n: int, looping: str | None) -> list[str]:
    """``n`` completions: every 10th (from the 5th) ``looping`` if given, else 3 right for 1 wrong."""
    out = []
    for i in range(n):
        if looping is not None and i % 10 == 5:
            out.append(looping)
        else:
            out.append(WRONG if i % 4 == 3 else RIGHT)
    return out


# ---------------------------------------------------------------------- baselines (in a child process)
def grade_exec(completions: list[str]) -> list[float]:
    """TRL-style: exec each case in this process; no timeout (nothing can preempt a loop here)."""
    scores = []
    for code in completions:
        passed = 0
        for case in CASES:
            try:
                exec(code + "\n" + case, {})  # noqa: S102 - the unsandboxed baseline, on purpose
                passed += 1
            except Exception:  # noqa: BLE001
                pass
        scores.append(passed / len(CASES))
    return scores


def grade_threads(completions: list[str], threads: int, run_timeout: float) -> list[float]:
    """``subprocess.run`` per case on a thread pool; a case passes on exit 0 within ``run_timeout``."""

    def one(program: str) -> bool:
        try:
            proc = subprocess.run(PYTHON + [program], capture_output=True, timeout=run_timeout)
        except subprocess.TimeoutExpired:
            return False
        return proc.returncode == 0

    programs = [code + "\n" + case for code in completions for case in CASES]
    with ThreadPoolExecutor(threads) as pool:
        passed = list(pool.map(one, programs))
    return [sum(passed[i : i + len(CASES)]) / len(CASES) for i in range(0, len(passed), len(CASES))]


def baseline_child(args: argparse.Namespace) -> None:
    completions = batch(args.batch, MIXES[args.mix])
    t0 = time.perf_counter()
    if args.baseline == "exec":
        scores = grade_exec(completions)
    else:
        scores = grade_threads(completions, args.threads, args.run_timeout)
    print(json.dumps({"seconds": time.perf_counter() - t0, "scores": scores}), flush=True)


def run_baseline(name: str, mix: str, args: argparse.Namespace) -> dict:
    """Run a baseline in a child process (its own process group), killed after ``--outer-timeout``;
    whatever it started is killed after it, however this run ends (a signal to the benchmark too)."""
    cmd = [sys.executable, __file__, "--_baseline", name, "--_mix", mix, "--batch", str(args.batch)]
    cmd += ["--run-timeout", str(args.run_timeout), "--_threads", str(args.lanes * args.envs_per_lane)]
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        try:
            out, _ = child.communicate(timeout=args.outer_timeout)
            result = json.loads(out.decode().strip().splitlines()[-1])
        except subprocess.TimeoutExpired:
            result = {"seconds": None, "scores": None}
        # Still running now: marked programs (children of subprocess.run's killed programs among
        # them) and anything else in the child's process group (exec's own forks carry no marker).
        time.sleep(0.2)  # let processes that are exiting go
        left = set(marked_pids({child.pid})) | set(group_pids(child.pid))
        result["leaked"] = len(left - {child.pid})
    finally:
        _kill_group(child)
        kill_marked()
    return result


def _kill_group(child: subprocess.Popen) -> None:
    try:
        os.killpg(child.pid, signal.SIGKILL)  # the child and what it started (same group)
    except ProcessLookupError:
        pass
    child.wait()


# ---------------------------------------------------------------------- leftover processes
def marked_pids(exclude: set[int] = frozenset()) -> list[int]:  # type: ignore[assignment]
    """Processes on this host whose command line holds :data:`MARKER` (the graded programs)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in exclude or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if MARKER.encode() in f.read():
                    pids.append(int(entry))
        except OSError:
            continue
    return pids


def group_pids(pgid: int) -> list[int]:
    """Processes of process group ``pgid``."""
    return [pid for pid, (_, group) in _proc_table().items() if group == pgid]


def descendants(root: int) -> set[int]:
    """Every process below ``root`` (children, their children, ...)."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in _proc_table().items():
        children.setdefault(ppid, []).append(pid)
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _proc_table() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, process group) of every process this benchmark can see."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        table[int(entry)] = (int(fields[1]), int(fields[2]))
    return table


def kill_marked() -> None:
    for pid in marked_pids():  # only this benchmark's programs carry the marker
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# ---------------------------------------------------------------------- boltz
def run_boltz(reward, mix: str, args: argparse.Namespace) -> dict:
    """One graded batch; ``leaked``: processes below this one (worker, envs, zygotes, programs) more
    than before it (sandboxed programs are forks of their env's zygote: they carry no marker)."""
    completions = batch(args.batch, MIXES[mix])
    tests = [{"assert_case": CASES}] * len(completions)
    before = len(descendants(os.getpid()))
    t0 = time.perf_counter()
    scores = reward(["write add"] * len(completions), completions, tests=tests)
    seconds = time.perf_counter() - t0
    time.sleep(0.2)  # let processes that are exiting go
    leaked = max(0, len(descendants(os.getpid())) - before) + len(marked_pids())
    return {"seconds": seconds, "scores": scores, "leaked": leaked}


# ---------------------------------------------------------------------- report
def summarise(runs: list[dict], expected: list[float]) -> dict:
    done = [r for r in runs if r["seconds"] is not None]
    leaked = max(r["leaked"] for r in runs)
    if not done:
        return {"seconds": None, "leaked": leaked, "correct": None}
    return {
        "seconds": statistics.median(r["seconds"] for r in done),
        "leaked": leaked,
        "correct": all(r["scores"] == expected for r in done),
        "hung_runs": len(runs) - len(done),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--lanes", type=int, default=2)
    parser.add_argument("--envs-per-lane", type=int, default=8)
    parser.add_argument("--run-timeout", type=float, default=2.0, help="seconds per case (boltz and threads)")
    parser.add_argument("--outer-timeout", type=float, default=20.0, help="seconds before a baseline is 'hung'")
    parser.add_argument("--_baseline", choices=["exec", "threads"], help=argparse.SUPPRESS)
    parser.add_argument("--_mix", dest="mix", default="no loops", help=argparse.SUPPRESS)
    parser.add_argument("--_threads", dest="threads", type=int, default=16, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.baseline = args._baseline
    if args.baseline:
        baseline_child(args)
        return

    from boltzlabs_gym.integrations.grading import Grader
    from boltzlabs_gym.integrations.trl import CodeReward

    for sig in (signal.SIGTERM, signal.SIGHUP):  # as Ctrl-C: the running baseline's processes are killed
        signal.signal(sig, lambda signum, _frame: sys.exit(128 + signum))
    envs = args.lanes * args.envs_per_lane
    print(f"batch={args.batch} completions x {len(CASES)} asserts, run_timeout={args.run_timeout}s, ", end="")
    print(f"boltz {args.lanes}x{args.envs_per_lane} envs, threads={envs}, cpus={os.cpu_count()}")
    rows = []
    with Grader(run_timeout=args.run_timeout, envs_per_lane=args.envs_per_lane, lanes=args.lanes) as grader:
        print(f"isolation: {grader.runner.isolation.backend}")
        reward = CodeReward(grader)
        reward(["warm up"] * 4, [RIGHT] * 4, tests=[CASES] * 4)
        for mix, looping in MIXES.items():
            completions = batch(args.batch, looping)
            expected = [0.0 if c in (LOOP, FORK_LOOP, WRONG) else 1.0 for c in completions]
            results = {"boltz": summarise([run_boltz(reward, mix, args) for _ in range(args.repeats)], expected)}
            for name in ("threads", "exec"):
                runs = []
                for _ in range(args.repeats):
                    runs.append(run_baseline(name, mix, args))
                    if runs[-1]["seconds"] is None:
                        break  # hung: once is enough to show it
                results[name] = summarise(runs, expected)
            rows.append((mix, results))
    print_table(rows, args.batch)
    time.sleep(0.2)
    print(f"\nbenchmark programs still running after it: {len(marked_pids())}")


def print_table(rows: list[tuple[str, dict]], n: int) -> None:
    print()
    print(f"{'mix':<20} {'grader':<8} {'seconds':>8} {'rewards/s':>10} {'vs threads':>10} {'leaked':>7} correct")
    for mix, results in rows:
        threads = results["threads"]["seconds"]
        for name, r in results.items():
            if r["seconds"] is None:
                secs, rate, ratio = "hung", "-", "-"
            else:
                secs, rate = f"{r['seconds']:.2f}", f"{n / r['seconds']:.1f}"
                ratio = f"{r['seconds'] / threads:.2f}x" if threads else "-"
            correct = "-" if r["correct"] is None else str(r["correct"])
            print(f"{mix:<20} {name:<8} {secs:>8} {rate:>10} {ratio:>10} {r['leaked']:>7} {correct}")


if __name__ == "__main__":
    main()
