"""Stable-Baselines3 PPO on CartPole-v1, with the 8 envs in sandboxed pool processes.

The SB3 code is unchanged; only ``vec_env_cls=`` is added to SB3's own
``make_vec_env("CartPole-v1", n_envs=8, seed=args.seed)``::

    python examples/sb3_ppo_cartpole.py --timesteps 100000 --seed 0

Hyperparameters are rl-zoo's for CartPole-v1 PPO.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from stable_baselines3 import PPO
from stable_baselines3.common.env_util import make_vec_env

from boltzlabs_gym.sb3 import BoltzLabsSB3VecEnv


def linear(start: float):
    return lambda progress_remaining: progress_remaining * start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--timesteps", type=int, default=100_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--n-envs", type=int, default=8)
    p.add_argument("--isolation", default="auto", help="pool isolation: auto, strict, none")
    args = p.parse_args()

    # The only change to plain SB3: the vec env class, and its pool's options.
    env = make_vec_env(
        "CartPole-v1",
        n_envs=args.n_envs,
        seed=args.seed,
        vec_env_cls=BoltzLabsSB3VecEnv,
        vec_env_kwargs={"isolation": args.isolation},
    )
    try:
        t0 = time.perf_counter()
        model = PPO(
            "MlpPolicy",
            env,
            n_steps=32,
            batch_size=256,
            gae_lambda=0.8,
            gamma=0.98,
            n_epochs=20,
            ent_coef=0.0,
            learning_rate=linear(1e-3),
            clip_range=linear(0.2),
            seed=args.seed,
            device="cpu",
            verbose=0,
        )
        model.learn(total_timesteps=args.timesteps)
        wall = time.perf_counter() - t0
        returns = [ep["r"] for ep in model.ep_info_buffer][-20:]
        print(f"isolation: {env.pool.isolation}")
        print(f"stragglers={env.straggler_count} errors={env.error_count} timing={env.pool.timing}")
        print(f"{args.timesteps} steps in {wall:.1f} s ({args.timesteps / wall:.0f} steps/s)")
        print(f"mean_return_last20={np.mean(returns):.1f}")
    finally:
        env.close()


if __name__ == "__main__":
    main()
