"""mode="boltz" with envs the template built: each forked env inherits the template's env
(envside/prebuilt.py) and still has its own state and its own random streams. Real worker, real
sandboxes, Atari Pong (ale-py) as a training script builds it."""

from __future__ import annotations

import time

import numpy as np
import pytest

from conftest import ISOLATION

pytestmark = pytest.mark.usefixtures("no_leaks")

gym = pytest.importorskip("gymnasium")
ale_py = pytest.importorskip("ale_py")


def make_pong(noop_max: int = 30):
    import ale_py
    import gymnasium as gym
    from gymnasium.wrappers import AtariPreprocessing, FrameStackObservation

    gym.register_envs(ale_py)
    env = gym.make("ALE/Pong-v5", frameskip=1)  # sticky actions: repeat_action_probability=0.25
    env.unwrapped.built_at = time.monotonic_ns()  # the same in every env that inherited one env
    env = AtariPreprocessing(env, frame_skip=4, screen_size=84, grayscale_obs=True, noop_max=noop_max)
    return FrameStackObservation(env, 4)


def _vec(n: int, factory=make_pong, **kw):
    from boltzlabs_gym import BoltzLabsVecEnv

    return BoltzLabsVecEnv([factory] * n, mode="boltz", isolation=ISOLATION, **kw)


def _actions(n: int, steps: int) -> np.ndarray:
    return np.random.default_rng(0).integers(0, 6, size=(steps, n))


@pytest.mark.parametrize("envs_per_sandbox", [1, 2])
def test_inherited_envs_match_envs_built_alone_and_never_touch_each_other(envs_per_sandbox):
    n, steps = 4, 40
    seeds = [7, 8, 7, 9]
    actions = _actions(n, steps)
    actions[:, 2] = (actions[:, 2] + 3) % 6  # env 2 has env 0's seed but other actions
    envs = _vec(n, envs_per_sandbox=envs_per_sandbox)
    try:
        built = envs.get_attr("built_at")
        # the template's env was inherited (by every env, or by the first of each sandbox of two)
        assert len(set(built)) == (1 if envs_per_sandbox == 1 else 1 + n // 2)
        obs, _ = envs.reset(seed=seeds)
        trajectory = [obs]
        for t in range(steps):
            obs, *_ = envs.step(actions[t])
            trajectory.append(obs)
    finally:
        envs.close()
    for i in range(n):  # each env is what an env built on its own does with its own seed and actions
        ref = make_pong()
        assert np.array_equal(trajectory[0][i], ref.reset(seed=seeds[i])[0]), i
        for t in range(steps):
            assert np.array_equal(trajectory[t + 1][i], ref.step(actions[t, i])[0]), (i, t)
    assert not np.array_equal(trajectory[-1][0], trajectory[-1][2])  # same seed, own actions, own state


def test_unseeded_inherited_envs_draw_their_own_emulator_streams():
    """No random no-ops (noop_max=0): the envs differ only through the emulator's sticky actions,
    whose seed each inherited env must draw for itself (not keep the template's)."""
    n, steps = 4, 60
    envs = _vec(n, factory=lambda: make_pong(noop_max=0))
    try:
        assert len(set(envs.get_attr("built_at"))) == 1
        envs.reset()  # no seed
        for t in range(steps):
            obs, *_ = envs.step(np.full(n, 2 + t % 2))  # UP, DOWN, ...: sticky actions make them differ
    finally:
        envs.close()
    assert len({obs[i].tobytes() for i in range(n)}) > 1


def test_a_hard_reset_forks_a_new_env_that_inherits_again():
    envs = _vec(2)
    try:
        envs.reset(seed=0)
        for _ in range(10):
            envs.step(np.array([2, 3]))
        envs.pool.reset(seed=[None, 21], where=np.array([False, True]), hard=True)  # a fresh fork of env 1
        assert len(set(envs.get_attr("built_at"))) == 1  # the template's env, inherited again
        obs, _ = envs.reset(seed=[None, 21])
        assert np.array_equal(obs[1], make_pong().reset(seed=21)[0])
    finally:
        envs.close()
