"""The vector env's faces take the pool's settings as RLPool does: one PoolOptions, keywords over it."""

from __future__ import annotations

import functools

import gymnasium as gym
import pytest

import boltzlabs_gym
from boltzlabs_gym import BoltzLabsVecEnv, PoolOptions

from conftest import ISOLATION

pytestmark = pytest.mark.usefixtures("no_leaks")


def test_make_vec_folds_keywords_over_options_and_hands_every_setting_to_the_pool():
    # heartbeat_timeout and lease are settings make_vec once mistook for the env's own kwargs.
    options = PoolOptions(step_timeout=7.0, isolation=ISOLATION)
    envs = boltzlabs_gym.make_vec("CartPole-v1", 2, options=options, heartbeat_timeout=12.0, lease=300.0)
    try:
        assert envs.pool.options.step_timeout == 7.0
        assert envs.pool.options.heartbeat_timeout == 12.0
        assert envs.pool.options.lease == 300.0
        obs, _ = envs.reset(seed=0)
        assert obs.shape == (2, 4)
    finally:
        envs.close()


def test_an_unknown_setting_is_refused_by_name_before_any_process_starts():
    with pytest.raises(TypeError, match="unknown pool setting 'step_timeuot'"):
        BoltzLabsVecEnv([functools.partial(gym.make, "CartPole-v1")], step_timeuot=1.0)


def test_a_pool_and_settings_together_are_refused():
    envs = boltzlabs_gym.make_vec("CartPole-v1", 1, isolation=ISOLATION)
    try:
        with pytest.raises(ValueError, match="not both"):
            BoltzLabsVecEnv(pool=envs.pool, options=PoolOptions())
    finally:
        envs.close()
