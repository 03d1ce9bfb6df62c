#!/usr/bin/env python
"""Sweep over envs per sandbox: throughput, the CPU split, memory, at each K.

    python benchmarks/k_sweep.py                                   # CartPole n=256 and 84x84x4 n=64, both modes
    python benchmarks/k_sweep.py --cases cartpole:256 --ks 1,8,32 --modes boltz --seconds 2 --rounds 3

For each case (workload:n), mode (``default``, ``boltz``) and K (those <= n), one
BoltzLabsVecEnv(n, envs_per_sandbox=K) is started (alone: one pool alive at a time), warmed
up, then timed in ``--rounds`` blocks of ``--seconds / --rounds`` each, every block right
after one of a SyncVectorEnv kept alive in this process for the whole run, so that each
ratio to SyncVectorEnv compares the same moments of the machine. Around every block of ours
it reads the CPU time of

* the trainer: this process (``time.process_time``: every thread, ZeroMQ's included),
* the worker: the pool's local worker process (``pool._links[0].process``),
* the envs: every process below the worker (sandbox inits, boltz templates, env processes),

and reports each as microseconds of CPU per env-step, next to the wall time per env-step
and the idle share of the machine (``cpus x wall - all CPU``). Nothing else should run: the
figures are of the whole machine's CPUs. Memory is the pool's PSS (envs plus boltz
template) per env. Prints Markdown tables on stdout, progress on stderr, and writes
``k_sweep.json`` and ``k_sweep.md`` into ``--out``. ``--profile`` adds, per configuration,
the trainer's top functions by own CPU time from an extra, untimed cProfile block.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import bench_envs  # noqa: E402
import cloudpickle  # noqa: E402
import gymnasium as gym  # noqa: E402
import numpy as np  # noqa: E402
import psutil  # noqa: E402

from boltzlabs_gym import BoltzLabsVecEnv  # noqa: E402

cloudpickle.register_pickle_by_value(bench_envs)  # sandboxes cannot import this directory

FACTORIES = {"cartpole": bench_envs.make_cartpole, "large_obs": bench_envs.make_large_obs}
DEFAULT_CASES = "cartpole:256,large_obs:64"
DEFAULT_KS = "1,2,4,8,16,32,64,128,256"
WARMUP_STEPS = 20


# --------------------------------------------------------------------------- CPU accounting
def cpu_seconds(proc: psutil.Process) -> float:
    """User + system CPU seconds of one process (0 once it is gone)."""
    try:
        t = proc.cpu_times()
    except psutil.Error:
        return 0.0
    return t.user + t.system


@dataclass
class ProcessTree:
    """The pool's worker and the processes below it, as they were when the block began."""

    worker: psutil.Process
    envs: list[psutil.Process] = field(default_factory=list)

    @classmethod
    def of_pool(cls, pool) -> ProcessTree:
        worker = psutil.Process(pool._links[0].process.pid)
        return cls(worker, worker.children(recursive=True))

    def sample(self) -> tuple[float, float]:
        """(worker CPU s, envs' CPU s) so far."""
        return cpu_seconds(self.worker), sum(cpu_seconds(p) for p in self.envs)


@dataclass
class CpuSplit:
    """CPU seconds spent during timed blocks, per side, and the blocks' wall time and env-steps."""

    trainer_s: float = 0.0
    worker_s: float = 0.0
    envs_s: float = 0.0
    wall_s: float = 0.0
    env_steps: int = 0

    def add(self, trainer_s: float, worker_s: float, envs_s: float, wall_s: float, env_steps: int) -> None:
        self.trainer_s += trainer_s
        self.worker_s += worker_s
        self.envs_s += envs_s
        self.wall_s += wall_s
        self.env_steps += env_steps

    def per_step_us(self, cpus: int) -> dict:
        steps = max(1, self.env_steps)
        busy = self.trainer_s + self.worker_s + self.envs_s
        return {
            "wall_us": self.wall_s / steps * 1e6,
            "trainer_us": self.trainer_s / steps * 1e6,
            "worker_us": self.worker_s / steps * 1e6,
            "envs_us": self.envs_s / steps * 1e6,
            "cpu_us": busy / steps * 1e6,
            "idle_us": max(0.0, cpus * self.wall_s - busy) / steps * 1e6,
        }


# --------------------------------------------------------------------------- timed blocks
def step_for(env, actions: list, seconds: float) -> tuple[float, int]:
    """Step ``env`` for about ``seconds`` (at least 3 steps); (wall seconds, batched steps)."""
    steps, t0 = 0, time.perf_counter()
    while True:
        env.step(actions[steps % len(actions)])
        steps += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds and steps >= 3:
            return elapsed, steps


def timed_block(vec: BoltzLabsVecEnv, tree: ProcessTree, actions: list, seconds: float, split: CpuSplit) -> float:
    """One block of ours with its CPU split added to ``split``; env-steps/s."""
    w0, e0 = tree.sample()
    c0 = time.process_time()
    wall, steps = step_for(vec, actions, seconds)
    c1 = time.process_time()
    w1, e1 = tree.sample()
    split.add(c1 - c0, w1 - w0, e1 - e0, wall, steps * vec.num_envs)
    return steps * vec.num_envs / wall


def profile_block(vec, actions: list, seconds: float, top: int = 8) -> list[dict]:
    """The trainer's top functions by own CPU time over an extra, untimed block."""
    prof = cProfile.Profile(time.process_time)
    prof.enable()
    step_for(vec, actions, seconds)
    prof.disable()
    stats = pstats.Stats(prof, stream=io.StringIO())
    rows = []
    for (file, line, func), (_cc, calls, tottime, _cum, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        rows.append({"func": f"{os.path.basename(file)}:{line}({func})", "calls": calls, "tottime_s": tottime})
    rows.sort(key=lambda r: -r["tottime_s"])
    total = sum(r["tottime_s"] for r in rows) or 1.0
    for r in rows:
        r["share"] = r["tottime_s"] / total
    return rows[:top]


# --------------------------------------------------------------------------- one configuration
def pool_memory_per_env(pool) -> float | None:
    """PSS per env in bytes, the boltz template's share included."""
    try:
        pss = pool.memory()
    except Exception:
        return None
    return (sum(pss) + getattr(pool, "template_pss", 0)) / len(pss)


def measure_config(case: dict, mode: str, k: int, sync_env, args) -> dict:
    """Start ours at (mode, K), time it against SyncVectorEnv in alternation, close it."""
    n, factory, actions = case["n"], case["factory"], case["actions"]
    row: dict = {"workload": case["workload"], "n": n, "mode": mode, "k": k, "sandboxes": -(-n // k)}
    kwargs: dict = {"mode": mode}
    if k > 1:
        kwargs["envs_per_sandbox"] = k
    t0 = time.perf_counter()
    vec = BoltzLabsVecEnv([factory] * n, **kwargs)
    try:
        vec.reset(seed=args.seed)
        row["startup_s"] = time.perf_counter() - t0
        tree = ProcessTree.of_pool(vec.pool)
        row["processes_below_worker"] = len(tree.envs)
        for i in range(WARMUP_STEPS):
            vec.step(actions[i % len(actions)])
        split, ours_sps, sync_sps, worker_ms, roundtrip_ms = CpuSplit(), [], [], [], []
        block_s = args.seconds / args.rounds
        for _ in range(args.rounds):
            wall, steps = step_for(sync_env, actions, block_s)
            sync_sps.append(steps * n / wall)
            ours_sps.append(timed_block(vec, tree, actions, block_s, split))
            worker_ms.append(vec.pool.timing.worker_ms)
            roundtrip_ms.append(vec.pool.timing.roundtrip_ms)
        ratios = np.array(ours_sps) / np.array(sync_sps)
        row.update(
            steps_per_s=float(np.median(ours_sps)),
            sync_steps_per_s=float(np.median(sync_sps)),
            vs_sync_median=float(np.median(ratios)),
            vs_sync_min=float(ratios.min()),
            vs_sync_max=float(ratios.max()),
            worker_ms_last=float(np.median(worker_ms)),
            roundtrip_ms_last=float(np.median(roundtrip_ms)),
            pss_per_env_bytes=pool_memory_per_env(vec.pool),
            **split.per_step_us(args.cpus),
        )
        if args.profile:
            row["trainer_profile"] = profile_block(vec, actions, block_s)
    finally:
        vec.close()
    return row


def sync_cpu_per_step_us(sync_env, actions: list, n: int, seconds: float) -> float:
    """SyncVectorEnv's CPU per env-step: the envs' own cost, plus Gymnasium's batching."""
    c0 = time.process_time()
    _, steps = step_for(sync_env, actions, seconds)
    return (time.process_time() - c0) / (steps * n) * 1e6


# --------------------------------------------------------------------------- report
def best_rows(rows: list[dict]) -> list[dict]:
    """Per (workload, n, mode): the K with the highest median ratio to SyncVectorEnv."""
    best: dict = {}
    for r in rows:
        key = (r["workload"], r["n"], r["mode"])
        if "vs_sync_median" in r and (key not in best or r["vs_sync_median"] > best[key]["vs_sync_median"]):
            best[key] = r
    return list(best.values())


def _f(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def markdown(result: dict) -> str:
    lines = [
        f"# envs_per_sandbox sweep ({result['cpus']} CPUs, load average {result['loadavg_start'][0]:.2f} at start, "
        f"{result['loadavg_end'][0]:.2f} at end; {result['rounds']} rounds of "
        f"{result['seconds'] / result['rounds']:.2f} s per configuration, each after a SyncVectorEnv block)",
        "",
        "CPU and wall figures are microseconds per env-step over the timed blocks of ours; idle = "
        "CPUs x wall - all CPU. SyncVectorEnv's own CPU per env-step, for scale: "
        + ", ".join(f"{k} {v:.1f} us" for k, v in result["sync_cpu_us"].items()),
        "",
        "| workload | n | mode | K | sandboxes | env-steps/s | / Sync median (min-max) | wall us | trainer us "
        "| worker us | envs us | idle us | start-up s | PSS/env MiB |",
        "|---|---:|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        if "error" in r:
            lines.append(
                f"| {r['workload']} | {r['n']} | {r['mode']} | {r['k']} | {r['sandboxes']} | error: {r['error']} |"
            )
            continue
        pss = r.get("pss_per_env_bytes")
        lines.append(
            f"| {r['workload']} | {r['n']} | {r['mode']} | {r['k']} | {r['sandboxes']} | {r['steps_per_s']:,.0f} "
            f"| {r['vs_sync_median']:.2f} ({r['vs_sync_min']:.2f}-{r['vs_sync_max']:.2f}) | {r['wall_us']:.2f} "
            f"| {r['trainer_us']:.2f} | {r['worker_us']:.2f} | {r['envs_us']:.2f} | {r['idle_us']:.2f} "
            f"| {r['startup_s']:.1f} | {_f(pss / 2**20 if pss else None, '.1f')} |"
        )
    lines += ["", "Best K per workload and mode (highest median ratio to SyncVectorEnv):", ""]
    for r in best_rows(result["rows"]):
        lines.append(
            f"- {r['workload']} n={r['n']} mode={r['mode']}: K={r['k']} ({r['sandboxes']} sandboxes), "
            f"{r['steps_per_s']:,.0f} env-steps/s, {r['vs_sync_median']:.2f}x SyncVectorEnv; per env-step "
            f"trainer {r['trainer_us']:.2f} us, worker {r['worker_us']:.2f} us, envs {r['envs_us']:.2f} us, "
            f"idle {r['idle_us']:.2f} us"
        )
        for p in r.get("trainer_profile", [])[:5]:
            lines.append(f"  - trainer {p['share']:.0%} {p['func']} ({p['calls']} calls)")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- main
def parse_cases(text: str, rng_seed: int, block_steps: int = 64) -> list[dict]:
    cases = []
    for item in text.split(","):
        workload, _, n = item.partition(":")
        if workload not in FACTORIES or not n.isdigit():
            raise SystemExit(f"bad case {item!r}: WORKLOAD:N with WORKLOAD in {', '.join(FACTORIES)}")
        space = gym.vector.utils.batch_space(FACTORIES[workload]().action_space, int(n))
        space.seed(rng_seed)
        actions = [space.sample() for _ in range(block_steps)]
        cases.append({"workload": workload, "n": int(n), "factory": FACTORIES[workload], "actions": actions})
    return cases


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_case(case: dict, modes: list[str], ks: list[int], args) -> tuple[list[dict], float]:
    sync_env = gym.vector.SyncVectorEnv([case["factory"]] * case["n"])
    sync_env.reset(seed=args.seed)
    rows = []
    try:
        sync_us = sync_cpu_per_step_us(sync_env, case["actions"], case["n"], 0.5)
        for mode in modes:
            for k in (k for k in ks if k <= case["n"]):
                try:
                    row = measure_config(case, mode, k, sync_env, args)
                except Exception as exc:  # one failed configuration does not end the sweep
                    row = {"workload": case["workload"], "n": case["n"], "mode": mode, "k": k,
                           "sandboxes": -(-case["n"] // k), "error": f"{type(exc).__name__}: {exc}"}  # fmt: skip
                    log(f"  {case['workload']} n={case['n']} {mode} K={k}: ERROR {row['error']}")
                else:
                    log(
                        f"  {case['workload']} n={case['n']} {mode:7s} K={k:<4d} {row['steps_per_s']:10,.0f} steps/s "
                        f"{row['vs_sync_median']:5.2f}x Sync; us/step trainer {row['trainer_us']:.2f} worker "
                        f"{row['worker_us']:.2f} envs {row['envs_us']:.2f} idle {row['idle_us']:.2f}"
                    )
                rows.append(row)
    finally:
        sync_env.close()
    return rows, sync_us


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 2)[2],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--cases", default=DEFAULT_CASES, help=f"comma-separated WORKLOAD:N (default {DEFAULT_CASES})")
    ap.add_argument("--ks", default=DEFAULT_KS, help=f"envs per sandbox to try, those <= n (default {DEFAULT_KS})")
    ap.add_argument("--modes", default="default,boltz")
    ap.add_argument("--seconds", type=float, default=3.0, help="timed seconds of ours per configuration")
    ap.add_argument("--rounds", type=int, default=5, help="blocks the seconds are split into")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", action="store_true", help="also cProfile the trainer in one extra block per config")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    args = ap.parse_args(argv)
    args.cpus = len(os.sched_getaffinity(0))
    ks = [int(k) for k in args.ks.split(",")]
    modes = args.modes.split(",")
    result: dict = {"cpus": args.cpus, "seconds": args.seconds, "rounds": args.rounds, "ks": ks, "modes": modes,
                    "loadavg_start": list(os.getloadavg()), "rows": [], "sync_cpu_us": {}}  # fmt: skip
    t0 = time.perf_counter()
    for case in parse_cases(args.cases, args.seed):
        rows, sync_us = run_case(case, modes, ks, args)
        result["rows"].extend(rows)
        result["sync_cpu_us"][f"{case['workload']} n={case['n']}"] = sync_us
    result["loadavg_end"] = list(os.getloadavg())
    result["elapsed_s"] = time.perf_counter() - t0
    md = markdown(result)
    print(md)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "k_sweep.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(args.out, "k_sweep.md"), "w") as f:
        f.write(md)
    log(f"done in {result['elapsed_s']:.0f} s; wrote {args.out}/k_sweep.json and k_sweep.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
