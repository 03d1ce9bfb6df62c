"""Wall-clock of SB3 PPO on CartPole-v1: BoltzLabsSB3VecEnv vs SubprocVecEnv vs DummyVecEnv.

Same PPO (rl-zoo CartPole hyperparameters), same seeds, same step budget, one process,
one torch thread, run one after the other (both of this library's modes)::

    python benchmarks/sb3_wallclock.py --timesteps 50000 --n-envs 8 --seed 0
    python benchmarks/sb3_wallclock.py --envs-per-sandbox 1,4,8 --repeats 3   # ours at K = 1, 4 and 8

Kinds: ``boltzlabs`` (mode="default"), ``boltzlabs_boltz`` (mode="boltz"), each optionally
``-kK`` for ``envs_per_sandbox=K`` (``boltzlabs-k8``; ``--envs-per-sandbox`` runs each of
ours at every K), ``subproc``, ``dummy``. Prints a table: wall seconds, env-steps/s, learn
wall time / DummyVecEnv's and / SubprocVecEnv's of the same repeat (below 1: faster), final
mean return; with repeats, the medians, and the K of ours with the lowest wall time.
"""

from __future__ import annotations

import argparse
import os
import time

import gymnasium as gym
import numpy as np
import torch
from stable_baselines3 import PPO
from stable_baselines3.common.env_util import make_vec_env
from stable_baselines3.common.logger import Logger
from stable_baselines3.common.vec_env import DummyVecEnv, SubprocVecEnv

from boltzlabs_gym.sb3 import make_sb3_vec_env

OURS = ("boltzlabs", "boltzlabs_boltz")


def split_k(kind: str) -> tuple[str, int]:
    """``"boltzlabs_boltz-k8"`` -> ``("boltzlabs_boltz", 8)``; no suffix: K = 1."""
    base, sep, k = kind.rpartition("-k")
    return (base, int(k)) if sep and k.isdigit() else (kind, 1)


def expand_kinds(kinds: list[str], ks: list[int] | None) -> list[str]:
    """Each of ours without a ``-kK`` suffix once per K (K = 1 keeps the plain name)."""
    if not ks:
        return kinds
    out = []
    for kind in kinds:
        out += [kind if k == 1 else f"{kind}-k{k}" for k in ks] if kind in OURS else [kind]
    return out


def build(kind: str, n: int, seed: int, isolation: str):
    base, k = split_k(kind)
    if base in OURS:
        mode = "boltz" if base == "boltzlabs_boltz" else "default"
        kwargs = {"envs_per_sandbox": k} if k > 1 else {}  # only then: K = 1 runs on versions without it
        return make_sb3_vec_env("CartPole-v1", n_envs=n, seed=seed, isolation=isolation, mode=mode, **kwargs)
    cls = {"subproc": SubprocVecEnv, "dummy": DummyVecEnv}[kind]
    return make_vec_env("CartPole-v1", n_envs=n, seed=seed, vec_env_cls=cls)


def run(kind: str, args) -> dict:
    t_build = time.perf_counter()
    env = build(kind, args.n_envs, args.seed, args.isolation)
    build_s = time.perf_counter() - t_build
    try:
        model = PPO(
            "MlpPolicy",
            env,
            n_steps=32,
            batch_size=256,
            gae_lambda=0.8,
            gamma=0.98,
            n_epochs=20,
            ent_coef=0.0,
            learning_rate=lambda f: 1e-3 * f,
            clip_range=lambda f: 0.2 * f,
            seed=args.seed,
            device="cpu",
            verbose=0,
        )
        # SB3's default logger makes a /tmp/SB3-<time> folder per model even at verbose=0.
        model.set_logger(Logger(folder=None, output_formats=[]))
        t0 = time.perf_counter()
        model.learn(args.timesteps)
        wall = time.perf_counter() - t0
        ret = float(np.mean([e["r"] for e in model.ep_info_buffer][-20:]))
    finally:
        env.close()
    return {"kind": kind, "build_s": build_s, "wall_s": wall, "sps": args.timesteps / wall, "ret": ret}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--timesteps", type=int, default=50_000)
    p.add_argument("--n-envs", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--isolation", default="auto")
    p.add_argument(
        "--kinds",
        default="boltzlabs,boltzlabs_boltz,subproc,dummy",
        help="boltzlabs (default mode), boltzlabs_boltz (mode='boltz'), either with -kK, subproc, dummy",
    )
    p.add_argument("--envs-per-sandbox", help="comma-separated K values to run each of ours at (e.g. 1,4,8)")
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs of every kind; the order rotates each time so that machine drift cancels out",
    )
    args = p.parse_args()
    torch.set_num_threads(1)
    print(f"cpus={os.cpu_count()} loadavg_before={os.getloadavg()[0]:.1f} gymnasium={gym.__version__}", flush=True)
    ks = [int(k) for k in args.envs_per_sandbox.split(",")] if args.envs_per_sandbox else None
    kinds = expand_kinds(args.kinds.split(","), ks)
    rows = []
    for rep in range(args.repeats):
        order = kinds[rep % len(kinds) :] + kinds[: rep % len(kinds)]
        for k in order:
            rows.append(dict(run(k, args), rep=rep))
            print(f"  rep {rep + 1}/{args.repeats} {k:20s} learn {rows[-1]['wall_s']:6.1f} s", flush=True)
    print(f"loadavg_after={os.getloadavg()[0]:.1f}")
    print(f"PPO CartPole-v1, {args.timesteps} steps, {args.n_envs} envs, seed {args.seed}")
    print_rows(rows)
    print_medians(rows, kinds)


def same_repeat(rows: list[dict], row: dict, kind: str) -> float | None:
    """The learn wall time of ``kind`` in ``row``'s repeat."""
    return next((x["wall_s"] for x in rows if x["kind"] == kind and x["rep"] == row["rep"]), None)


def print_rows(rows: list[dict]) -> None:
    print(
        f"{'vec env':20s} {'rep':>3s} {'build s':>8s} {'learn s':>8s} {'steps/s':>8s} {'/ Dummy':>8s} "
        f"{'/ Subproc':>9s} {'ret20':>6s}"
    )
    for r in rows:
        dummy, subproc = same_repeat(rows, r, "dummy"), same_repeat(rows, r, "subproc")
        print(
            f"{r['kind']:20s} {r['rep'] + 1:3d} {r['build_s']:8.2f} {r['wall_s']:8.1f} {r['sps']:8.0f} "
            f"{_ratio(r['wall_s'], dummy):>8s} {_ratio(r['wall_s'], subproc):>9s} {r['ret']:6.1f}"
        )


def median_ratio(rows: list[dict], kind: str, base: str) -> tuple[float, list[float]] | None:
    """Median over repeats of ``kind``'s learn wall time / ``base``'s in the same repeat, and each."""
    ratios = [r["wall_s"] / b for r in rows if r["kind"] == kind and (b := same_repeat(rows, r, base))]
    return (float(np.median(ratios)), ratios) if ratios else None


def print_medians(rows: list[dict], kinds: list[str]) -> None:
    """Median learn time of every kind, its ratios to DummyVecEnv and SubprocVecEnv, and the best K of ours."""
    print("median over repeats (learn wall time / the baseline's in the same repeat; below 1: faster):")
    for k in kinds:
        walls = [r["wall_s"] for r in rows if r["kind"] == k]
        line = f"{k:20s} learn {float(np.median(walls)):6.1f} s"
        for base in ("dummy", "subproc"):
            m = median_ratio(rows, k, base)
            if m and k != base:
                line += f"  / {base} {m[0]:.2f} (" + ", ".join(f"{x:.2f}" for x in m[1]) + ")"
        print(line)
    for base in OURS:
        ours = [k for k in kinds if split_k(k)[0] == base]
        if ours:
            best = min(ours, key=lambda k: float(np.median([r["wall_s"] for r in rows if r["kind"] == k])))
            m = median_ratio(rows, best, "dummy")
            print(f"best K for {base}: {split_k(best)[1]} ({best}" + (f", / dummy {m[0]:.2f})" if m else ")"))


def _ratio(wall: float, base: float | None) -> str:
    return f"{wall / base:.2f}" if base else "-"


if __name__ == "__main__":
    main()
