"""Real envs: envs/GiB and start-up + reset of preprocessed Atari Pong, ours against AsyncVectorEnv.

    PYTHONPATH=$PWD python benchmarks/real_env_memory.py                    # 32 envs, 3 rounds
    PYTHONPATH=$PWD python benchmarks/real_env_memory.py --n 32 --rounds 5 --impls async,boltz
    PYTHONPATH=$PWD python benchmarks/real_env_memory.py --out benchmarks/results/pong-density-X.md

The env (``--env pong``, the only one for now) is what an Atari PPO trains on:
``gym.make("ALE/Pong-v5", frameskip=1)`` (sticky actions 0.25) under
``AtariPreprocessing(frame_skip=4, screen_size=84, grayscale_obs=True, noop_max=30)`` and
``FrameStackObservation(4)``. Implementations (``--impls``):

* ``async``: ``gymnasium.vector.AsyncVectorEnv`` (shared memory, the platform's default context:
  fork on Linux): isolates nothing;
* ``boltz``, ``default``: ``BoltzLabsVecEnv([make]*n, mode=..., envs_per_sandbox=1)``, sandboxed
  with the best isolation the host allows.

Per implementation and round: the wall time of construction plus ``reset(seed=0)`` (both also
apart), then, after a pause, the PSS (psutil ``memory_full_info().pss``, shared pages split
between the processes that map them) of every process the implementation created, the trainer
(this process) excluded on both sides: AsyncVectorEnv's children; our worker, template, its spare
and the envs. envs/GiB = n / that sum. Rounds alternate the order of the implementations; the
figures are medians over rounds, with min and max. The trainer builds and closes one env before
the first round (so the libraries' file pages are mapped here whichever side runs first). Other
processes share the machine: the load average is recorded at the start and end of every measurement.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import psutil

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import cloudpickle  # noqa: E402
import real_env_factories  # noqa: E402 - the pinned Pong: real_envs.py's
from boltz_memory import _classify, _procs_since  # noqa: E402 - the same process grouping and PSS

cloudpickle.register_pickle_by_value(real_env_factories)  # sandboxes cannot import this directory

GIB = 2**30
POOL_KW = {"start_timeout": 600, "heartbeat_timeout": 120}


ENVS = {"pong": real_env_factories.make_pong}


class Ours:
    def __init__(self, mode: str, make):
        self.mode, self.make = mode, make
        self.name = f"boltzlabs[{mode}]"

    def construct(self, n: int) -> None:
        from boltzlabs_gym import BoltzLabsVecEnv

        self.vec = BoltzLabsVecEnv([self.make] * n, mode=self.mode, **POOL_KW)

    def reset(self, seed: int):
        return self.vec.reset(seed=seed)

    def extra(self) -> dict:
        pool = self.vec._pool
        per_env = pool.memory()  # the worker's own count (boltzlabs_gym.client.stats.measure_pss)
        return {
            "isolation": str(pool.isolation.backend if pool.isolation else None),
            "pool_memory_mib": (sum(per_env) + pool.template_pss) / 2**20,
        }

    def close(self) -> None:
        self.vec.close()


class Async:
    name = "AsyncVectorEnv"

    def __init__(self, make):
        self.make = make

    def construct(self, n: int) -> None:
        from gymnasium.vector import AsyncVectorEnv

        self.vec = AsyncVectorEnv([self.make] * n, shared_memory=True)

    def reset(self, seed: int):
        return self.vec.reset(seed=seed)

    def extra(self) -> dict:
        return {}

    def close(self) -> None:
        self.vec.close()


def measure(impl, n: int, seed: int, settle_s: float) -> dict:
    gc.collect()
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    rec: dict = {"impl": impl.name, "n": n, "load_start": os.getloadavg()[0]}
    t0 = time.perf_counter()
    try:
        impl.construct(n)
        t1 = time.perf_counter()
        obs, _ = impl.reset(seed)
        t2 = time.perf_counter()
    except Exception as exc:  # noqa: BLE001 - recorded, not fatal
        rec["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        try:
            impl.close()
        except Exception:  # noqa: BLE001
            pass
        return rec
    rec.update(construct_s=t1 - t0, reset_s=t2 - t1, start_reset_s=t2 - t0, obs_shape=list(obs.shape))
    try:
        time.sleep(settle_s)
        groups = _classify(_procs_since(before))
        total = sum(sum(v) for v in groups.values())
        rec.update(
            processes={k: len(v) for k, v in groups.items()},
            pss_mib={k: sum(v) / 2**20 for k, v in groups.items()},
            total_pss_mib=total / 2**20,
            pss_per_env_mib=total / n / 2**20,
            envs_per_gib=n / (total / GIB),
            envs_per_gib_without_worker=n / ((total - sum(groups["worker"])) / GIB),
        )
        rec.update(impl.extra())
    finally:
        impl.close()
    rec["load_end"] = os.getloadavg()[0]
    return rec


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=HERE, capture_output=True, text=True, check=True).stdout.strip()
    except Exception:  # noqa: BLE001
        return "?"


def _med(rows: list[dict], key: str) -> tuple[float, float, float]:
    xs = [r[key] for r in rows if key in r]
    return (statistics.median(xs), min(xs), max(xs)) if xs else (float("nan"),) * 3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--env", default="pong", choices=sorted(ENVS))
    ap.add_argument("--n", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--impls", default="async,boltz,default")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--settle", type=float, default=1.0, help="seconds between reset and the PSS reading")
    ap.add_argument("--out", default=None, help="a Markdown record (and the raw rows beside it as .json)")
    args = ap.parse_args(argv)
    make = ENVS[args.env]
    keys = args.impls.split(",")
    meta = {
        "command": "python " + " ".join([os.path.relpath(sys.argv[0], os.path.dirname(HERE)), *sys.argv[1:]]),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "commit": _git("rev-parse", "--short", "HEAD")
        + (" (dirty)" if _git("status", "--porcelain", "--", "..", ":!benchmarks/results") else ""),
        "machine": f"{platform.platform()}, {os.cpu_count()} CPUs, {psutil.virtual_memory().total / GIB:.1f} GiB, "
        f"Python {sys.version.split()[0]}",
        "load_start": os.getloadavg(),
    }
    # the trainer builds (and closes) one env first, as a training script does to read the spaces: the
    # libraries' file pages are then mapped here for every round and either order (AsyncVectorEnv's
    # constructor does the same), so no side's figure depends on which ran first
    make().close()
    rows: list[dict] = []
    for r in range(args.rounds):
        order = keys if r % 2 == 0 else keys[::-1]
        for key in order:
            impl = Async(make) if key == "async" else Ours(key, make)
            rec = measure(impl, args.n, args.seed, args.settle)
            rec["round"] = r
            rows.append(rec)
            print(json.dumps(rec), flush=True)
    meta["load_end"] = os.getloadavg()
    text = _report(meta, args, keys, rows)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
        with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 0


def _report(meta: dict, args, keys: list[str], rows: list[dict]) -> str:
    names = {"async": "AsyncVectorEnv", "boltz": "boltzlabs[boltz]", "default": "boltzlabs[default]"}
    lines = [
        f"# {args.env}: envs/GiB and start-up + reset, n={args.n}",
        "",
        f"* command: `{meta['command']}`",
        f"* date: {meta['date']}; commit: {meta['commit']}",
        f"* machine: {meta['machine']}",
        f"* load average (1/5/15 min): start {'/'.join(f'{x:.2f}' for x in meta['load_start'])}, "
        f"end {'/'.join(f'{x:.2f}' for x in meta['load_end'])}",
        "",
        "Medians over rounds (min-max). PSS of every process each side created, the trainer excluded; "
        "ours: worker + template (and its spare) + envs.",
        "",
        "| impl | rounds | start+reset s | construct s | reset s | MiB/env | envs/GiB | envs/GiB w/o worker "
        "| worker / template / envs MiB | load 1-min |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for key in keys:
        mine = [r for r in rows if r["impl"] == names[key] and "error" not in r]
        errs = [r["error"] for r in rows if r["impl"] == names[key] and "error" in r]
        if not mine:
            lines.append(f"| {names[key]} | 0 | {'; '.join(errs) or '-'} |")
            continue

        def cell(k: str, fmt: str = ".2f", rows: list[dict] = mine) -> str:
            m, lo, hi = _med(rows, k)
            return f"{m:{fmt}} ({lo:{fmt}}-{hi:{fmt}})"

        parts = "/".join(
            f"{statistics.median(r['pss_mib'][g] for r in mine):.0f}" for g in ("worker", "template", "env")
        )
        loads = ", ".join(f"{r['load_start']:.1f}-{r['load_end']:.1f}" for r in mine)
        lines.append(
            f"| {names[key]} | {len(mine)} | {cell('start_reset_s')} | {cell('construct_s')} | {cell('reset_s')} "
            f"| {cell('pss_per_env_mib')} | {cell('envs_per_gib', '.0f')} "
            f"| {cell('envs_per_gib_without_worker', '.0f')} | {parts} | {loads} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
