"""The real envs of ``real_envs.py`` (and ``tests/adapters/test_real_envs.py``), one configuration for all.

Module-level functions, so that a factory pickles: ``real_envs.py`` registers this module with
cloudpickle by value (the sandboxes cannot import this directory), as the other benchmarks do
with ``bench_envs``; SyncVectorEnv, AsyncVectorEnv and SubprocVecEnv call the same functions.

* :func:`make_pong`: ``gym.make("ALE/Pong-v5", frameskip=1)`` (ALE v5's sticky actions,
  ``repeat_action_probability=0.25``), then ``AtariPreprocessing(frame_skip=4, screen_size=84,
  grayscale_obs=True, noop_max=30)``, then ``FrameStackObservation(4)``: a ``(4, 84, 84)`` uint8
  observation. Needs ``ale-py`` and OpenCV (``pip install 'boltzlabs-gym[real-envs]'``).
* :func:`make_half_cheetah`: ``gym.make("HalfCheetah-v5")`` with its defaults (``mujoco``).

``max_episode_steps`` adds a ``TimeLimit`` (the tests' way to get truncations); the benchmark
leaves it out.
"""

from __future__ import annotations

import gymnasium as gym

PONG_ID = "ALE/Pong-v5"
HALF_CHEETAH_ID = "HalfCheetah-v5"
#: The pinned configuration, as printed at the top of the benchmark's output.
PONG_CONFIG = (
    'gym.make("ALE/Pong-v5", frameskip=1) (sticky actions: repeat_action_probability=0.25, ALE v5\'s default), '
    "AtariPreprocessing(frame_skip=4, screen_size=84, grayscale_obs=True, noop_max=30), "
    "FrameStackObservation(4): obs (4, 84, 84) uint8, Discrete(6)"
)
HALF_CHEETAH_CONFIG = 'gym.make("HalfCheetah-v5") with its defaults: obs (17,) float64, Box(-1, 1, (6,), float32)'


def make_pong(max_episode_steps: int | None = None) -> gym.Env:
    import ale_py

    gym.register_envs(ale_py)
    env = gym.make(PONG_ID, frameskip=1)
    env = gym.wrappers.AtariPreprocessing(env, frame_skip=4, screen_size=84, grayscale_obs=True, noop_max=30)
    env = gym.wrappers.FrameStackObservation(env, 4)
    if max_episode_steps is not None:
        env = gym.wrappers.TimeLimit(env, max_episode_steps=max_episode_steps)
    return env


def make_half_cheetah(max_episode_steps: int | None = None) -> gym.Env:
    if max_episode_steps is None:
        return gym.make(HALF_CHEETAH_ID)
    return gym.make(HALF_CHEETAH_ID, max_episode_steps=max_episode_steps)


#: What each env needs importable, and the install that brings it.
REQUIREMENTS = {
    "pong": (("ale_py", "cv2"), "pip install 'boltzlabs-gym[real-envs]' (ale-py, opencv-python-headless)"),
    "halfcheetah": (("mujoco",), "pip install 'boltzlabs-gym[real-envs]' (gymnasium[mujoco])"),
}
FACTORIES = {"halfcheetah": make_half_cheetah, "pong": make_pong}
