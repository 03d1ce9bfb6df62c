"""Boltz mode vs default mode vs Gymnasium AsyncVectorEnv: envs per GiB, start-up, hard reset.

    python benchmarks/boltz_memory.py                       # n = 64, 256, 1024 (as memory allows)
    python benchmarks/boltz_memory.py --sizes 64 --out /tmp/b.json

Side by side, in one run, for two workloads:
* ``cartpole``: Gymnasium ``CartPole-v1`` from factories (``BoltzLabsVecEnv([make]*n, mode=...)``)
  against ``gymnasium.vector.AsyncVectorEnv([make]*n, context="fork" | "forkserver")``;
* ``numpy_gym_dir``: an env directory (``env_dirs/numpy_gym``) whose module-level code imports
  numpy and Gymnasium, as an ``RLPool`` (AsyncVectorEnv has no env-directory form: its CartPole
  rows are the reference for both).

Per implementation and n: start-up (construction until every env answered its first reset),
PSS of the env processes (psutil, shared pages split honestly) -> envs/GiB, plus the template's
and the worker's PSS listed separately, and the median latency of a hard reset of one env
(boltzlabs only; AsyncVectorEnv has none). Everything runs sandboxed with the best isolation the
host allows (``isolation="auto"``). Sizes whose estimated memory would not fit are skipped and say
so. Other processes share the machine: timings are noisy; the load average is recorded.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time

import numpy as np
import psutil

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

ENV_DIR = os.path.join(HERE, "env_dirs", "numpy_gym")
GIB = 2**30
#: generous timeouts: on a shared 2-core box a 1024-env start can keep the worker's event loop
#: from answering a heartbeat within the default 10 s (the worker launches envs in its loop)
POOL_KW = {"start_timeout": 600, "heartbeat_timeout": 120}


def make_cartpole():
    import gymnasium as gym

    return gym.make("CartPole-v1")


def _procs_since(before: set[int]) -> list[psutil.Process]:
    out = []
    for p in psutil.Process().children(recursive=True):
        if p.pid not in before:
            try:
                if p.status() != psutil.STATUS_ZOMBIE:
                    out.append(p)
            except psutil.Error:
                pass
    return out


def _pss(p: psutil.Process) -> int:
    try:
        return int(p.memory_full_info().pss)
    except psutil.Error:
        return 0


def _classify(procs: list[psutil.Process]) -> dict[str, list[int]]:
    """PSS per process, split into worker / template / env processes."""
    groups: dict[str, list[int]] = {"worker": [], "template": [], "env": []}
    me = os.getpid()
    for p in procs:
        try:
            name, cmd, ppid = p.name(), " ".join(p.cmdline()), p.ppid()
        except psutil.Error:
            continue
        if "boltzlabs_gym.worker" in cmd and name != "boltz-env":
            kind = "worker"
        elif name in ("boltz-template", "boltz-spare"):
            kind = "template"  # the template and its one idle spare: listed apart, counted in envs/GiB
        elif "from multiprocessing.forkserver import" in cmd and ppid == me:
            kind = "template"  # the forkserver process: AsyncVectorEnv's template, counted the same way
        elif "resource_tracker" in cmd:
            kind = "worker"
        else:
            kind = "env"
        groups[kind].append(_pss(p))
    return groups


class Impl:
    name = "?"

    def start(self, n: int): ...
    def hard_reset_ms(self, reps: int) -> list[float]:
        return []
    def close(self): ...


class Ours(Impl):
    def __init__(self, workload: str, mode: str):
        self.workload, self.mode = workload, mode
        self.name = f"boltzlabs[{mode}]"

    def start(self, n):
        from boltzlabs_gym import BoltzLabsVecEnv, RLPool

        if self.workload == "cartpole":
            self.vec = BoltzLabsVecEnv([make_cartpole] * n, mode=self.mode, **POOL_KW)
            self.vec.reset(seed=0)
            self.pool = self.vec._pool
        else:
            self.vec = None
            self.pool = RLPool(ENV_DIR, n=n, mode=self.mode, **POOL_KW)
            self.pool.reset(seed=0)
        self.n = n

    def hard_reset_ms(self, reps):
        out = []
        for i in range(reps):
            mask = np.zeros(self.n, dtype=bool)
            mask[(i * 7) % self.n] = True
            t0 = time.perf_counter()
            self.pool.reset(seed=i, where=mask, hard=True)
            out.append((time.perf_counter() - t0) * 1e3)
        return out

    def close(self):
        (self.vec or self.pool).close()


class Async(Impl):
    def __init__(self, context: str):
        self.context = context
        self.name = f"AsyncVectorEnv[{context}]"

    def start(self, n):
        from gymnasium.vector import AsyncVectorEnv

        self.vec = AsyncVectorEnv([make_cartpole] * n, context=self.context, shared_memory=True)
        self.vec.reset(seed=0)

    def close(self):
        self.vec.close()


def measure(impl: Impl, n: int, reps: int) -> dict:
    gc.collect()
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    rec = {"impl": impl.name, "n": n}
    t0 = time.perf_counter()
    try:
        impl.start(n)
    except Exception as exc:  # noqa: BLE001 - recorded, not fatal
        rec["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        try:
            impl.close()
        except Exception:  # noqa: BLE001
            pass
        return rec
    rec["startup_s"] = time.perf_counter() - t0
    try:
        time.sleep(0.5)
        groups = _classify(_procs_since(before))
        env_pss = sum(groups["env"])
        rec["env_processes"] = len(groups["env"])
        rec["env_pss_mib"] = env_pss / 2**20
        rec["pss_per_env_mib"] = env_pss / max(1, n) / 2**20
        rec["template_pss_mib"] = sum(groups["template"]) / 2**20
        rec["worker_pss_mib"] = sum(groups["worker"]) / 2**20
        rec["envs_per_gib"] = n / ((env_pss + sum(groups["template"])) / GIB) if env_pss else None
        rec["envs_per_gib_incl_worker"] = n / ((env_pss + sum(groups["template"]) + sum(groups["worker"])) / GIB)
        lat = impl.hard_reset_ms(reps)
        if lat:
            rec["hard_reset_ms_median"] = statistics.median(lat)
            rec["hard_reset_ms_p90"] = float(np.percentile(lat, 90))
        if isinstance(impl, Ours):
            rec["isolation"] = str(impl.pool.isolation)
    finally:
        t1 = time.perf_counter()
        impl.close()
        rec["close_s"] = time.perf_counter() - t1
    return rec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="64,256,1024")
    ap.add_argument("--reps", type=int, default=21, help="hard resets timed per config")
    ap.add_argument("--workloads", default="cartpole,numpy_gym_dir")
    ap.add_argument("--impls", default="boltz,default,fork,forkserver")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "boltz_memory.json"))
    args = ap.parse_args(argv)
    sizes = [int(x) for x in args.sizes.split(",")]
    impls = args.impls.split(",")
    # rough PSS per env (MiB) to skip what cannot fit; measured values replace these as we go
    guess = {"boltz": 6, "default": 40, "fork": 6, "forkserver": 40}
    results = []
    meta = {
        "machine": platform.platform(), "cpus": os.cpu_count(),
        "mem_gib": psutil.virtual_memory().total / GIB, "load_start": os.getloadavg(),
        "python": sys.version.split()[0],
    }
    for workload in args.workloads.split(","):
        for n in sizes:
            for key in impls:
                if key in ("fork", "forkserver"):
                    if workload != "cartpole":
                        continue
                    impl = Async(key)
                else:
                    impl = Ours(workload, key)
                need = guess[key] * n / 1024
                avail = psutil.virtual_memory().available / GIB
                if need > 0.6 * avail:
                    rec = {"impl": impl.name, "n": n, "workload": workload,
                           "skipped": f"needs ~{need:.1f} GiB of {avail:.1f} GiB available"}
                else:
                    rec = measure(impl, n, args.reps if key in ("boltz", "default") else 0)
                    rec["workload"] = workload
                    rec["load"] = os.getloadavg()[0]
                    if rec.get("pss_per_env_mib"):
                        guess[key] = max(guess[key], rec["pss_per_env_mib"] * 1.3)
                results.append(rec)
                print(json.dumps(rec), flush=True)
    meta["load_end"] = os.getloadavg()
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    _table(results)
    return 0


def _table(results: list[dict]) -> None:
    print(f"\n{'workload':14} {'impl':28} {'n':>5} {'start s':>8} {'MiB/env':>8} {'envs/GiB':>9} "
          f"{'tmpl MiB':>8} {'wrk MiB':>8} {'hard ms':>8}")
    for r in results:
        if "skipped" in r or "error" in r:
            print(f"{r.get('workload', ''):14} {r['impl']:28} {r['n']:>5}  {r.get('skipped') or r.get('error')}")
            continue
        hr = r.get("hard_reset_ms_median")
        print(f"{r['workload']:14} {r['impl']:28} {r['n']:>5} {r['startup_s']:8.2f} {r['pss_per_env_mib']:8.2f} "
              f"{r['envs_per_gib']:9.0f} {r['template_pss_mib']:8.1f} {r['worker_pss_mib']:8.1f} "
              f"{(f'{hr:.1f}' if hr else '-'):>8}")


if __name__ == "__main__":
    sys.exit(main())
