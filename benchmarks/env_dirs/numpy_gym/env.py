"""An env directory whose module-level code imports numpy and Gymnasium (a typical Python env).

CartPole dynamics, JSON observations: what boltz mode shares between forks is the import.
"""

import gymnasium as gym
import numpy as np

from boltzlabs_gym.env import serve

env = gym.make("CartPole-v1")
_ = np.zeros(16)


def reset(seed, options=None):
    obs, _info = env.reset(seed=seed)
    return obs.tolist()


def step(action):
    obs, reward, terminated, truncated, _info = env.step(int(action))
    return obs.tolist(), float(reward), bool(terminated), bool(truncated), {}


serve(reset=reset, step=step)
