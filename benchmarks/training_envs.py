"""Env factories of ``training.py``, shipped by value into every sandbox and worker.

The sandboxes (and AsyncVectorEnv's workers) cannot import this directory, so
``training.py`` registers this module with ``cloudpickle.register_pickle_by_value``: the
functions travel as code. Imports happen inside them, so the env processes import only
what the env needs (never torch or SB3).
"""

from __future__ import annotations


def make_atari(env_id: str = "ALE/Breakout-v5"):
    """One Atari env as CleanRL's ppo_atari builds it, with Gymnasium's own wrappers.

    ALE v5 with ``frameskip=1`` (the frame skip is AtariPreprocessing's), 84x84 grayscale
    frames, up to 30 no-ops at reset, four stacked frames, and RecordEpisodeStatistics
    outermost so that ``info["episode"]`` carries the episode's unclipped game score.
    """
    import ale_py
    import gymnasium as gym

    gym.register_envs(ale_py)
    env = gym.make(env_id, frameskip=1)
    env = gym.wrappers.AtariPreprocessing(env, frame_skip=4, screen_size=84, grayscale_obs=True, noop_max=30)
    env = gym.wrappers.FrameStackObservation(env, 4)
    return gym.wrappers.RecordEpisodeStatistics(env)
