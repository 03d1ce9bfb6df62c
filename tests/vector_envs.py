"""Gymnasium envs used by the vector conformance tests (importable inside sandboxes by reference)."""

from __future__ import annotations

import time

import gymnasium as gym
import numpy as np


class DictTupleEnv(gym.Env):
    """Dict observation with a nested Tuple; Tuple action; short random-length episodes."""

    metadata = {"render_modes": ["rgb_array"], "render_fps": 30}

    def __init__(self, render_mode=None):
        self.render_mode = render_mode
        self.observation_space = gym.spaces.Dict(
            {
                "pos": gym.spaces.Box(-10, 10, (3,), np.float32),
                "extra": gym.spaces.Tuple((gym.spaces.Discrete(5), gym.spaces.MultiBinary(4))),
            }
        )
        self.action_space = gym.spaces.Tuple((gym.spaces.Discrete(3), gym.spaces.Box(-1, 1, (2,), np.float32)))
        self.level = 0

    def _obs(self):
        return {
            "pos": self.pos.copy(),
            "extra": (int(self.t % 5), (self.np_random.random(4) > 0.5).astype(np.int8)),
        }

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        self.pos = self.np_random.uniform(-1, 1, 3).astype(np.float32)
        self.horizon = int(self.np_random.integers(3, 9))
        return self._obs(), {"start": float(self.pos[0]), "level": self.level}

    def step(self, action):
        discrete, box = action
        self.t += 1
        self.pos = np.clip(self.pos + np.float32(discrete - 1) * 0.1 + np.float32(box.sum()), -10, 10).astype(np.float32)
        terminated = bool(abs(self.pos[0]) > 5)
        truncated = self.t >= self.horizon
        return self._obs(), float(self.pos.sum()), terminated, truncated, {"t": self.t, "arr": np.arange(2) * self.t}

    def render(self):
        return np.full((4, 6, 3), self.t, dtype=np.uint8)

    def double_level(self, k=2):
        self.level *= k
        return self.level


class FlakyCartPole(gym.Wrapper):
    """CartPole that hangs (or crashes) at a chosen step of env index ``bad_index``."""

    def __init__(self, index: int, bad_index: int, fault: str, at_step: int):
        super().__init__(gym.make("CartPole-v1"))
        self.index, self.bad_index, self.fault, self.at_step = index, bad_index, fault, at_step
        self.steps = 0

    def step(self, action):
        self.steps += 1
        if self.index == self.bad_index and self.steps == self.at_step:
            if self.fault == "hang":
                time.sleep(3600)
            elif self.fault == "crash":
                import os

                os._exit(9)
            elif self.fault == "raise":
                raise RuntimeError("flaky env raised on purpose")
        return self.env.step(action)


class MixedRepliesCartPole(gym.Wrapper):
    """CartPole whose steps alternate between the plain reply (array obs, empty info) that the
    vector env reads without JSON and replies that need the JSON path: an info every third
    step and a non-finite reward every seventh."""

    def __init__(self):
        super().__init__(gym.make("CartPole-v1"))
        self.steps = 0

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        self.steps += 1
        if self.steps % 3 == 0:
            info = {"step": self.steps, "x": np.float32(obs[0])}
        if self.steps % 7 == 0:
            reward = float("inf")
        return obs, reward, terminated, truncated, info
