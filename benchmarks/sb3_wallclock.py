"""Wall-clock of SB3 PPO on CartPole-v1: BoltzLabsSB3VecEnv vs SubprocVecEnv vs DummyVecEnv.

Same PPO (rl-zoo CartPole hyperparameters), same seeds, same step budget, one process,
one torch thread, run one after the other (both of this library's modes)::

    python benchmarks/sb3_wallclock.py --timesteps 50000 --n-envs 8 --seed 0

Prints a table: wall seconds, env-steps/s, ratio to DummyVecEnv, final mean return.
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


def build(kind: str, n: int, seed: int, isolation: str):
    if kind in ("boltzlabs", "boltzlabs_boltz"):
        mode = "boltz" if kind == "boltzlabs_boltz" else "default"
        return make_sb3_vec_env("CartPole-v1", n_envs=n, seed=seed, isolation=isolation, mode=mode)
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
        help="boltzlabs (default mode), boltzlabs_boltz (mode='boltz'), subproc, dummy",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs of every kind; the order rotates each time so that machine drift cancels out",
    )
    args = p.parse_args()
    torch.set_num_threads(1)
    print(f"cpus={os.cpu_count()} loadavg_before={os.getloadavg()[0]:.1f} gymnasium={gym.__version__}", flush=True)
    kinds = args.kinds.split(",")
    rows = []
    for rep in range(args.repeats):
        order = kinds[rep % len(kinds) :] + kinds[: rep % len(kinds)]
        for k in order:
            rows.append(dict(run(k, args), rep=rep))
            print(f"  rep {rep + 1}/{args.repeats} {k:16s} learn {rows[-1]['wall_s']:6.1f} s", flush=True)
    print(f"loadavg_after={os.getloadavg()[0]:.1f}")
    print(f"PPO CartPole-v1, {args.timesteps} steps, {args.n_envs} envs, seed {args.seed}")
    print(
        f"{'vec env':16s} {'rep':>3s} {'build s':>8s} {'learn s':>8s} {'steps/s':>8s} {'x Dummy':>8s} "
        f"{'x Subproc':>9s} {'ret20':>6s}"
    )
    for r in rows:
        same_rep = {x["kind"]: x["wall_s"] for x in rows if x["rep"] == r["rep"]}
        dummy, subproc = same_rep.get("dummy"), same_rep.get("subproc")
        print(
            f"{r['kind']:16s} {r['rep'] + 1:3d} {r['build_s']:8.2f} {r['wall_s']:8.1f} {r['sps']:8.0f} "
            f"{_ratio(r['wall_s'], dummy):>8s} {_ratio(r['wall_s'], subproc):>9s} {r['ret']:6.1f}"
        )
    if args.repeats > 1:
        print("median over repeats:")
        for k in kinds:
            walls = [r["wall_s"] for r in rows if r["kind"] == k]
            ratios = [
                r["wall_s"] / x["wall_s"]
                for r in rows
                for x in rows
                if r["kind"] == k and x["kind"] == "subproc" and x["rep"] == r["rep"]
            ]
            print(
                f"{k:16s} learn {float(np.median(walls)):6.1f} s"
                + (
                    f"  x Subproc {float(np.median(ratios)):.2f} (each repeat: "
                    + ", ".join(f"{x:.2f}" for x in ratios)
                    + ")"
                    if ratios
                    else ""
                )
            )


def _ratio(wall: float, base: float | None) -> str:
    return f"{wall / base:.2f}" if base else "-"


if __name__ == "__main__":
    main()
