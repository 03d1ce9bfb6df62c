"""Fault soak: a pool of envs that hang, crash, corrupt their channel and blow their limits.

    python benchmarks/soak.py [--steps 100000] [--n 64] [--seed 0] [--step-timeout 0.5]

A pool of ``n`` envs (``tests/envs/soak``: a deterministic LCG walk, see its ``lcg.py``)
is stepped until ``steps`` env-steps have been taken. At random steps random envs are
told to misbehave: hang, ``os.abort()``, ``os._exit``, write garbage / a JSON non-object /
a bad payload announcement / a 50 MiB line on their real stdout, allocate past their
memory limit, fork past their process limit, raise, return an unencodable obs, print junk
(harmless), leave a setsid child behind (harmless). Checked on every call:

* exactly ``n`` results, each in its own slot;
* every fault is reported in its own slot with the right reason (straggler at the
  deadline, exit status, signal, malformed reply, ...), and no other slot reports anything;
* every non-faulted step equals the fault-free reference (the same LCG computed here
  from the same seeds and actions): obs, reward and done;
* at the end: the worker has as many fds, cgroups and env processes as after start-up,
  and after ``close()`` no process, temp dir, socket or cgroup of the run is left.

Prints the counts (``mismatches`` and ``leaks`` must be 0) and exits non-zero otherwise.
``tests/project/test_soak.py`` runs this at the size set by ``BOLTZLABS_SOAK_STEPS``.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import sys
import time
from collections import Counter

import numpy as np
import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOAK_ENV = os.path.join(ROOT, "tests", "envs", "soak")

if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from boltzlabs_gym import Limits, RLPool  # noqa: E402
from boltzlabs_gym.testing import alive  # noqa: E402


def _load_lcg():
    spec = importlib.util.spec_from_file_location("soak_lcg", os.path.join(SOAK_ENV, "lcg.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


lcg = _load_lcg()

#: (kind, weight). ``hang`` is drawn separately (at most one per call: each costs a deadline).
FAULT_WEIGHTS = {
    "abort": 6,
    "exit": 6,
    "garbage": 6,
    "notobject": 4,
    "badbin": 4,
    "huge": 1,
    "oom": 2,
    "forkbomb": 2,
    "raise": 6,
    "unjsonable": 4,
    "print": 6,
    "leak": 3,
}
#: Faults after which the env steps on normally (nothing to report).
BENIGN = ("print", "leak")
#: Faults that take real time (50 MiB through a pipe, 400 MiB of pages, 30 forks): on a loaded
#: host the env may still be at it when its deadline passes, and then "straggler at the
#: deadline" is the right report (counted as ``slow_faults_caught_by_deadline``).
SLOW_FAULTS = ("huge", "oom", "forkbomb")

MEMORY_LIMIT = 160 << 20
PIDS_LIMIT = 24


def _fault_action(kind: str, rng: np.random.Generator, tag: int, a: int, leak_s: str) -> dict:
    action = {"fault": kind, "a": a}
    if kind == "exit":
        action["code"] = int(rng.integers(3, 120))
    elif kind == "huge":
        action["mib"] = 50
    elif kind == "oom":
        action["mib"] = 400
    elif kind == "forkbomb":
        action["n"] = PIDS_LIMIT + 8
    elif kind == "raise":
        action["tag"] = tag
    elif kind == "leak":
        action["s"] = leak_s
    return action


def _expected(kind: str, action: dict, isolation) -> tuple[str, str]:
    """(where the report must be, text the reason must contain)."""
    props = isolation.properties
    if kind == "hang":
        return "boltzlabs_straggler", "deadline"
    if kind == "abort":
        # SIGABRT; as PID 1 of its own pid namespace the env ignores its own SIGABRT and glibc's
        # abort() ends in SIGSEGV instead: either way a death by signal.
        return "boltzlabs_error", "killed by signal"
    if kind == "exit":
        return "boltzlabs_error", f"exited with status {action['code']}"
    if kind == "garbage":
        return "boltzlabs_error", "not a JSON line"
    if kind == "notobject":
        return "boltzlabs_error", "expected a JSON object"
    if kind == "badbin":
        return "boltzlabs_error", "bad _bin announcement"
    if kind == "huge":
        return "boltzlabs_error", "longer than"
    if kind == "oom":
        if str(props.get("memory_limit", "")).startswith("cgroup"):
            return "boltzlabs_error", "exceeded its memory limit"
        return "boltzlabs_exception", "MemoryError"
    if kind == "forkbomb":
        if not props.get("process_limit"):
            return "none", ""
        return "boltzlabs_exception", "BlockingIOError"
    if kind == "raise":
        return "boltzlabs_exception", f"ValueError: soak fault {action['tag']}"
    if kind == "unjsonable":
        return "boltzlabs_exception", "not JSON-serialisable"
    return "none", ""


def _report_of(info: dict) -> tuple[str, str]:
    """(where the report is, its text) for one slot's info; ("none", "") if none."""
    found = [k for k in ("boltzlabs_straggler", "boltzlabs_error", "boltzlabs_exception") if k in info]
    if not found:
        return "none", ""
    if len(found) > 1:
        return "+".join(found), json.dumps(info)[:300]
    key = found[0]
    body = info[key]
    if key == "boltzlabs_exception":
        return key, str(body.get("traceback", "")) + " where=" + str(body.get("where"))
    return key, str(body.get("reason", "")) + " " + str(body.get("stderr", ""))[-300:]


def _worker_cgroups(worker_pid: int) -> list[str]:
    found = []
    for ctrl in ("memory", "pids"):
        found += glob.glob(f"/sys/fs/cgroup/{ctrl}/**/boltzlabs-{worker_pid}-*", recursive=True)
    return found


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _marked(marker: str) -> list:
    out = []
    for p in psutil.process_iter(["cmdline"]):
        if p.info["cmdline"] == ["sleep", marker]:
            out.append(p)
    return alive(out)


def run_soak(
    steps: int = 100_000,
    n: int = 64,
    seed: int = 0,
    step_timeout: float = 0.5,
    fault_rate: float = 0.006,
    hang_rate: float = 0.03,
    isolation: str = "auto",
    mode: str = "default",
    log=print,
    max_errors_shown: int = 20,
) -> dict:
    """Run the soak; return the counts (``mismatches`` and ``leaks`` must be 0)."""
    rng = np.random.default_rng(seed)
    kinds = list(FAULT_WEIGHTS)
    weights = np.array([FAULT_WEIGHTS[k] for k in kinds], dtype=float)
    weights /= weights.sum()
    leak_s = f"{7000 + os.getpid() % 1000 + (seed % 1000) / 1000:.3f}"  # marks this run's leaked children
    counts: Counter = Counter()
    injected: Counter = Counter()
    problems: list[str] = []

    def problem(msg: str) -> None:
        counts["mismatches"] += 1
        if len(problems) < max_errors_shown:
            problems.append(msg)
            log("MISMATCH " + msg)

    tmp = os.environ.get("TMPDIR", "/tmp")
    t_start = time.monotonic()
    pool = RLPool(
        SOAK_ENV, n=n, isolation=isolation, mode=mode, step_timeout=step_timeout, reset_timeout=60.0, start_timeout=60.0,
        limits=Limits(memory_bytes=MEMORY_LIMIT, pids=PIDS_LIMIT),
    )
    worker = psutil.Process(pool._links[0].process.pid)
    worker_root = [d for d in glob.glob(os.path.join(tmp, "boltzlabs-worker-*"))
                   if _read(os.path.join(d, "owner.pid")) == str(worker.pid)]
    pool_tmp = pool._links[0].tmpdir
    socket_path = pool._links[0].address[len("ipc://"):]
    trainer_fds0 = _fds(os.getpid())
    closed = False
    try:
        isolation_report = pool.isolation
        log(f"soak: n={n} steps={steps} seed={seed} mode={mode} step_timeout={step_timeout} {isolation_report}")
        # Model state per env: (seed, x, t) of the running episode; None: needs a reset.
        episode = [0] * n
        model: list = [None] * n

        def seed_of(i: int) -> int:
            return seed * 1_000_003 + i * 10_007 + episode[i]

        def reset_where(mask: np.ndarray) -> None:
            seeds = [seed_of(i) if mask[i] else None for i in range(n)]
            obs = pool.reset(seed=seeds, where=mask)
            counts["reset_calls"] += 1
            if len(obs) != n:
                problem(f"reset returned {len(obs)} observations for {n} envs")
            for i in np.flatnonzero(mask):
                want = lcg.reset_obs(seeds[i], int(i))
                if obs[i] != want:
                    problem(f"env {i} reset(seed={seeds[i]}): got {str(obs[i])[:200]} {pool.reset_infos[i]}, want {want}")
                    model[i] = None
                    continue
                model[i] = (seeds[i], want["x"], 0)
                counts["resets"] += 1

        reset_where(np.ones(n, dtype=bool))
        worker_fds0 = _fds(worker.pid)
        cgroups0 = len(_worker_cgroups(worker.pid))
        env_procs0 = len(alive(worker.children(recursive=True)))

        calls = 0
        while counts["env_steps"] < steps:
            need = np.array([m is None for m in model])
            if need.any():
                for i in np.flatnonzero(need):
                    episode[i] += 1
                reset_where(need)
                if any(m is None for m in model):
                    # A reset failed (already counted): try again next round.
                    continue
            actions: list = []
            planned: dict[int, tuple[str, dict]] = {}
            a = rng.integers(0, 1000, size=n)
            faulted = rng.random(n) < fault_rate
            hang_at = int(rng.integers(n)) if rng.random() < hang_rate else -1
            for i in range(n):
                if i == hang_at:
                    kind = "hang"
                elif faulted[i]:
                    kind = kinds[int(rng.choice(len(kinds), p=weights))]
                else:
                    actions.append(int(a[i]))
                    continue
                action = _fault_action(kind, rng, calls * n + i, int(a[i]), leak_s)
                planned[i] = (kind, action)
                actions.append(action)
                injected[kind] += 1
            obs, rewards, dones, infos = pool.step(actions)
            calls += 1
            counts["env_steps"] += n
            if not (len(obs) == len(infos) == n and rewards.shape == (n,) and dones.shape == (n,)):
                problem(f"step returned {len(obs)} obs / {len(infos)} infos / {rewards.shape} rewards for {n} envs")
                continue
            expected_stragglers, expected_errors = set(), set()
            for i in range(n):
                where, text = _report_of(infos[i])
                kind, action = planned.get(i, (None, None))
                want_where, want_text = _expected(kind, action, isolation_report) if kind else ("none", "")
                if want_where == "boltzlabs_straggler" or (kind in SLOW_FAULTS and where == "boltzlabs_straggler"):
                    expected_stragglers.add(i)
                elif want_where == "boltzlabs_error":
                    expected_errors.add(i)
                slow_ok = kind in SLOW_FAULTS and where == "boltzlabs_straggler" and "deadline" in text
                if want_where != "none":
                    counts["faults_expected"] += 1
                    if slow_ok:
                        counts["slow_faults_caught_by_deadline"] += 1
                    if (where == want_where and want_text in text) or slow_ok:
                        counts["faults_reported"] += 1
                        if obs[i] is not None or rewards[i] != 0 or not dones[i]:
                            problem(f"env {i} {kind}: a failed slot must hold obs None, reward 0, done; "
                                    f"got {str(obs[i])[:100]}, {rewards[i]}, {dones[i]}")
                    else:
                        problem(f"env {i} {kind}: want {want_where} containing {want_text!r}, got {where}: {text[:300]!r}")
                    model[i] = None
                    continue
                if where != "none":
                    counts["spurious_reports"] += 1
                    problem(f"env {i} ({kind or 'healthy'}) at call {calls}: unexpected {where}: {text[:300]!r}")
                    model[i] = None
                    continue
                if model[i] is None:
                    continue
                s, x, t = model[i]
                x = lcg.advance(x, action["a"] if action else actions[i])
                t += 1
                want = lcg.step_obs(x, t, i, s)
                want_done = t >= lcg.episode_length(s)
                if obs[i] != want or rewards[i] != np.float32(lcg.reward(x)) or bool(dones[i]) != want_done:
                    problem(f"env {i} step {t} of seed {s}: got {str(obs[i])[:200]} r={rewards[i]} done={dones[i]}, "
                            f"want {want} r={lcg.reward(x)} done={want_done}")
                    model[i] = None
                    continue
                counts["healthy_steps_checked"] += 1
                model[i] = None if want_done else (s, x, t)
            timing = pool.timing
            if set(timing.stragglers) != expected_stragglers or set(timing.errors) != expected_errors:
                problem(f"call {calls}: timing lists stragglers {timing.stragglers} errors {timing.errors}, "
                        f"want {sorted(expected_stragglers)} {sorted(expected_errors)}")
            if calls % 200 == 0:
                log(f"  {counts['env_steps']} env-steps, {sum(injected.values())} faults injected, "
                    f"{counts['faults_reported']} reported, {counts['mismatches']} mismatches, "
                    f"{time.monotonic() - t_start:.0f} s")
        counts["calls"] = calls

        # ---- leaks while running: bring every env back, then compare with start-up
        need = np.ones(n, dtype=bool)
        for i in range(n):
            episode[i] += 1
        reset_where(need)
        leaks: dict[str, object] = {}
        deadline = time.monotonic() + 15
        while True:
            fds, cgs = _fds(worker.pid), len(_worker_cgroups(worker.pid))
            procs = len(alive(worker.children(recursive=True)))
            marked = _marked(leak_s)
            hard_ok = True
            if fds == worker_fds0 and cgs == cgroups0 and procs <= env_procs0 + len(marked):
                break
            if time.monotonic() > deadline:
                hard_ok = False
                break
            time.sleep(0.2)
        if not hard_ok:
            leaks["worker_fds"] = f"{worker_fds0} -> {fds}"
            leaks["cgroups"] = f"{cgroups0} -> {cgs}"
            leaks["worker_tree_processes"] = f"{env_procs0} -> {procs} ({len(marked)} leaked-on-purpose children alive)"
        counts["worker_fds_start"], counts["worker_fds_end"] = worker_fds0, fds
        counts["cgroups_start"], counts["cgroups_end"] = cgroups0, cgs
        # Leaked-on-purpose children live until their env's process tree goes: a hard reset ends them.
        counts["leaked_children_alive_before_hard_reset"] = len(marked)
        pool.reset(seed=[seed_of(i) for i in range(n)], hard=True)
        if not _wait(lambda: not _marked(leak_s), 10):
            if isolation_report.properties.get("pid_namespace") or isolation_report.properties.get("tree_kill") == "cgroup":
                leaks["children_after_hard_reset"] = len(_marked(leak_s))
            else:
                counts["children_survive_hard_reset_without_pid_namespace"] = len(_marked(leak_s))
        tree = [worker] + worker.children(recursive=True)
        pool.close()
        closed = True
        if not _wait(lambda: not alive(tree), 15):
            leaks["processes_after_close"] = [p.pid for p in alive(tree)]
        if not _wait(lambda: not _worker_cgroups(worker.pid), 10):
            leaks["cgroups_after_close"] = _worker_cgroups(worker.pid)
        left = [p for p in [*worker_root, pool_tmp, socket_path] if p and os.path.exists(p)]
        if left:
            leaks["paths_after_close"] = left
        trainer_fds = _fds(os.getpid())
        if trainer_fds > trainer_fds0:
            leaks["trainer_fds"] = f"{trainer_fds0} -> {trainer_fds}"
        if _marked(leak_s) and isolation_report.properties.get("pid_namespace"):
            leaks["leaked_children_after_close"] = len(_marked(leak_s))
        counts["leaks"] = len(leaks)
        counts["seconds"] = round(time.monotonic() - t_start, 1)
        result = {
            "steps": counts["env_steps"],
            "calls": calls,
            "faults_injected": sum(injected.values()),
            "faults_injected_by_kind": dict(sorted(injected.items())),
            "faults_expected_reported": counts["faults_expected"],
            "faults_reported": counts["faults_reported"],
            "spurious_reports": counts["spurious_reports"],
            "slow_faults_caught_by_deadline": counts["slow_faults_caught_by_deadline"],
            "healthy_steps_checked": counts["healthy_steps_checked"],
            "resets": counts["resets"],
            "mismatches": counts["mismatches"],
            "leaks": counts["leaks"],
            "leak_details": leaks,
            "worker_fds": f"{counts['worker_fds_start']} -> {counts['worker_fds_end']}",
            "cgroups": f"{counts['cgroups_start']} -> {counts['cgroups_end']}",
            "isolation": isolation_report.backend,
            "seconds": counts["seconds"],
            "problems": problems,
        }
        return result
    finally:
        if not closed:
            pool.close()


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _wait(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return bool(predicate())


def format_counts(result: dict) -> str:
    keys = ("steps", "calls", "faults_injected", "faults_expected_reported", "faults_reported", "spurious_reports",
            "slow_faults_caught_by_deadline", "healthy_steps_checked", "resets", "mismatches", "leaks", "worker_fds", "cgroups", "isolation", "seconds")
    lines = [f"  {k:26s} {result[k]}" for k in keys]
    lines.append(f"  {'faults by kind':26s} {result['faults_injected_by_kind']}")
    if result["leak_details"]:
        lines.append(f"  {'leak details':26s} {result['leak_details']}")
    return "soak counts:\n" + "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=int(os.environ.get("BOLTZLABS_SOAK_STEPS", 100_000)))
    parser.add_argument("--n", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--step-timeout", type=float, default=0.5)
    parser.add_argument("--fault-rate", type=float, default=0.006, help="chance an env-step is a (non-hang) fault")
    parser.add_argument("--hang-rate", type=float, default=0.03, help="chance a call carries one hanging env")
    parser.add_argument("--isolation", default=os.environ.get("BOLTZLABS_TEST_ISOLATION", "auto"))
    parser.add_argument("--mode", default="default", choices=["default", "boltz"])
    parser.add_argument("--json", help="also write the counts here")
    args = parser.parse_args(argv)
    result = run_soak(args.steps, args.n, args.seed, args.step_timeout, args.fault_rate, args.hang_rate, args.isolation,
                      args.mode)
    print(format_counts(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if result["mismatches"] == 0 and result["leaks"] == 0 and result["faults_reported"] == result["faults_expected_reported"] else 1


if __name__ == "__main__":
    sys.exit(main())
