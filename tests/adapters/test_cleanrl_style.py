"""A CleanRL-style rollout with stateful wrappers inside the envs: the class name alone switches.

CleanRL's ``ppo_continuous_action.py`` builds each env with ``NormalizeObservation`` and
``NormalizeReward`` inside it, seeds with ``envs.reset(seed=args.seed)`` and feeds the
observations back into the policy. With the same seed, two runs must be identical, and
identical to ``SyncVectorEnv``'s: the first ``reset(seed=...)`` must be each env's first
reset, or the wrappers' running statistics start from an extra, randomly seeded observation.
"""

from __future__ import annotations

import functools

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.vector import SyncVectorEnv

from boltzlabs_gym import BoltzLabsVecEnv

from conftest import ISOLATION

pytestmark = pytest.mark.usefixtures("no_leaks")

SEED = 1
NUM_ENVS = 2
STEPS = 40
GAMMA = 0.99


def clip_obs(obs):
    return np.clip(obs, -10, 10)


def clip_reward(reward):
    return float(np.clip(reward, -10, 10))


def make_env(env_id: str):
    """CleanRL's continuous-action ``make_env`` thunk (its wrappers, in its order)."""
    env = gym.make(env_id)
    env = gym.wrappers.FlattenObservation(env)
    env = gym.wrappers.RecordEpisodeStatistics(env)
    env = gym.wrappers.ClipAction(env)
    env = gym.wrappers.NormalizeObservation(env)
    env = gym.wrappers.TransformObservation(env, clip_obs, env.observation_space)
    env = gym.wrappers.NormalizeReward(env, gamma=GAMMA)
    env = gym.wrappers.TransformReward(env, clip_reward)
    return env


def rollout(envs) -> list:
    """A deterministic stand-in for the policy: the action is a function of the observation,
    so any difference in what the envs saw shows in everything after it."""
    try:
        obs, _ = envs.reset(seed=SEED)
        trace = [obs]
        for _ in range(STEPS):
            actions = np.tanh(obs[:, :1] * 2.0).astype(np.float32) * 2.0
            obs, rewards, terms, truncs, _ = envs.step(actions)
            trace += [obs, rewards, terms, truncs]
        return trace
    finally:
        envs.close()


def assert_identical(a: list, b: list, what: str) -> None:
    assert len(a) == len(b)
    for k, (x, y) in enumerate(zip(a, b)):
        assert x.dtype == y.dtype and np.array_equal(x, y), f"{what}: first difference at item {k}"


def test_same_seed_same_run_and_same_as_sync_vector_env():
    fns = [functools.partial(make_env, "Pendulum-v1")] * NUM_ENVS
    first = rollout(BoltzLabsVecEnv(fns, isolation=ISOLATION))
    second = rollout(BoltzLabsVecEnv(fns, isolation=ISOLATION))
    reference = rollout(SyncVectorEnv(fns))
    assert_identical(first, second, "two runs with the same seed")
    assert_identical(first, reference, "BoltzLabsVecEnv against SyncVectorEnv")
