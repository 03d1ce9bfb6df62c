"""Gymnasium envs used by the benchmark suite (pickled by value into every worker).

* ``CounterEnv``   - the JSON counter env of ``envs/counter`` as a ``gymnasium.Env``
  with a ``Box(1)`` observation: +1 per step, reward = action, ends at 100.
* ``LargeObsEnv``  - a cheap step with an 84x84x4 uint8 observation (copy-bound).
* ``DictObsEnv``   - LargeObsEnv's frames in a Dict beside a small state vector (a
  pixels-plus-proprioception observation).
* ``HangEnv``      - a counter whose action 2 wedges the env forever (straggler test).
"""

from __future__ import annotations

import time

import gymnasium as gym
import numpy as np

OBS_SHAPE = (84, 84, 4)


class CounterEnv(gym.Env):
    metadata: dict = {"render_modes": []}

    def __init__(self, episode_len: int = 100):
        self.observation_space = gym.spaces.Box(0.0, np.inf, shape=(1,), dtype=np.float32)
        self.action_space = gym.spaces.Discrete(2)
        self.episode_len = episode_len
        self.t = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(1, dtype=np.float32), {}

    def step(self, action):
        self.t += 1
        return np.array([self.t], dtype=np.float32), float(action), self.t >= self.episode_len, False, {}


class LargeObsEnv(gym.Env):
    """Returns one of 8 pre-drawn 84x84x4 frames per step: the env's own cost is ~0."""

    metadata: dict = {"render_modes": []}

    def __init__(self, episode_len: int = 200):
        self.observation_space = gym.spaces.Box(0, 255, shape=OBS_SHAPE, dtype=np.uint8)
        self.action_space = gym.spaces.Discrete(2)
        self.episode_len = episode_len
        self.t = 0
        self._frames = np.zeros((8, *OBS_SHAPE), dtype=np.uint8)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self._frames = self.np_random.integers(0, 256, size=(8, *OBS_SHAPE), dtype=np.uint8)
        self.t = 0
        return self._frames[0], {}

    def step(self, action):
        self.t += 1
        return self._frames[self.t % 8], float(action), self.t >= self.episode_len, False, {}


class DictObsEnv(LargeObsEnv):
    """LargeObsEnv's frames as ``{"pixels", "state"}``: the copy-bound case with a Dict space."""

    def __init__(self, episode_len: int = 200):
        super().__init__(episode_len)
        self.observation_space = gym.spaces.Dict(
            {
                "pixels": gym.spaces.Box(0, 255, shape=OBS_SHAPE, dtype=np.uint8),
                "state": gym.spaces.Box(-np.inf, np.inf, shape=(8,), dtype=np.float32),
            }
        )
        self._state = np.zeros(8, dtype=np.float32)

    def reset(self, *, seed=None, options=None):
        frame, info = super().reset(seed=seed, options=options)
        return self._dict(frame), info

    def step(self, action):
        frame, reward, terminated, truncated, info = super().step(action)
        return self._dict(frame), reward, terminated, truncated, info

    def _dict(self, frame):
        self._state[0] = self.t
        return {"pixels": frame, "state": self._state}


class HangEnv(CounterEnv):
    """Action 2 never returns (a wedged env); 0/1 are plain counter steps."""

    def __init__(self):
        super().__init__(episode_len=10**9)
        self.action_space = gym.spaces.Discrete(3)

    def step(self, action):
        if int(action) == 2:
            while True:
                time.sleep(3600)
        return super().step(action)


def make_cartpole():
    return gym.make("CartPole-v1")


def make_counter():
    return CounterEnv()


def make_large_obs():
    return LargeObsEnv()


def make_dict_obs():
    return DictObsEnv()


def make_hang():
    return HangEnv()
