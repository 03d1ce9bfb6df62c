"""The envs a boltz template builds and its forks inherit (envside/prebuilt.py), in this process:
which envs qualify, and the fresh random streams an inherited env gets. End to end, in real
sandboxes: tests/worker/test_boltz_prebuilt.py."""

from __future__ import annotations

import random

import numpy as np
import pytest

from boltzlabs_gym.envside import prebuilt

gym = pytest.importorskip("gymnasium")


class UserWrapper(gym.Wrapper):
    """A wrapper of a module the template does not know: it may keep state of its own."""


def _cartpole():
    return gym.make("CartPole-v1")


def _pong(**kw):
    ale_py = pytest.importorskip("ale_py")
    from gymnasium.wrappers import AtariPreprocessing, FrameStackObservation

    gym.register_envs(ale_py)
    env = gym.make("ALE/Pong-v5", frameskip=1, **kw)
    env = AtariPreprocessing(env, frame_skip=4, screen_size=84, grayscale_obs=True, noop_max=30)
    return FrameStackObservation(env, 4)


@pytest.fixture(autouse=True)
def _nothing_held():
    prebuilt._held.clear()
    yield
    prebuilt._held.clear()


def test_gymnasium_and_ale_envs_are_inheritable_unknown_layers_or_extra_generators_are_not():
    assert prebuilt.inheritable(_cartpole())
    assert prebuilt.inheritable(_pong())
    assert not prebuilt.inheritable(UserWrapper(_cartpole()))
    env = _cartpole()
    env.unwrapped.my_rng = random.Random(0)  # a stream _fresh_streams would not know to replace
    assert not prebuilt.inheritable(env)
    env = _cartpole()
    env.unwrapped.streams = [np.random.default_rng(0)]
    assert not prebuilt.inheritable(env)


def test_build_keeps_one_env_per_distinct_factory_up_to_the_limit_and_take_hands_it_out_once():
    calls = []

    def counted():
        calls.append(1)
        return _cartpole()

    factories = [counted, counted, _cartpole] + [lambda: _cartpole() for _ in range(prebuilt.LIMIT + 2)]
    assert prebuilt.build(factories) == prebuilt.LIMIT
    assert len(calls) == 1
    env = prebuilt.take(counted)
    assert env is not None and prebuilt.take(counted) is None  # once
    assert prebuilt.build_env(counted) is not env and len(calls) == 2  # then built as before
    assert prebuilt.take(factories[-1]) is None  # beyond the limit: never built


def test_an_env_that_is_not_inheritable_is_closed_not_held():
    closed = []

    class Closing(UserWrapper):
        def close(self):
            closed.append(True)
            super().close()

    assert prebuilt.build([lambda: Closing(_cartpole())]) == 0
    assert closed == [True]


def test_take_gives_fresh_generators_to_every_layer_and_space():
    env = _cartpole()
    env.reset(seed=1)
    env.action_space.seed(1)
    factory = lambda: env  # noqa: E731
    prebuilt._held.append((factory, env))
    before = env.unwrapped.np_random.bit_generator.state
    assert prebuilt.take(factory) is env
    assert env.unwrapped._np_random is None and env.action_space._np_random is None
    assert env.unwrapped.np_random.bit_generator.state != before  # drawn again, from OS entropy
    # a seeded reset is what it is for a new env
    assert np.array_equal(env.reset(seed=5)[0], _cartpole().reset(seed=5)[0])


def test_an_inherited_atari_env_reloads_its_rom_with_a_fresh_seed_before_an_unseeded_first_use():
    env = _pong(repeat_action_probability=0.25)
    ale = env.unwrapped
    factory = lambda: env  # noqa: E731
    prebuilt._held.append((factory, env))
    loads = []
    real_load = type(ale).load_game
    ale.load_game = lambda: (loads.append(1), real_load(ale))[1]
    prebuilt.take(factory)
    assert "reset" in vars(ale) and "step" in vars(ale)
    env.reset()  # unseeded: the emulator's seed is the fresh one seed_game() drew
    assert loads == [1] and "reset" not in vars(ale) and "step" not in vars(ale)
    env.reset()
    assert loads == [1]  # once only

    env2 = _pong()
    prebuilt._held.append((factory, env2))
    ale2 = env2.unwrapped
    loads2 = []
    ale2.load_game = lambda: (loads2.append(1), real_load(ale2))[1]
    prebuilt.take(factory)
    obs, _ = env2.reset(seed=3)  # seeded: AtariEnv.reset loads the ROM itself, once
    assert loads2 == [1]
    assert np.array_equal(obs, _pong().reset(seed=3)[0])


@pytest.mark.parametrize(
    "read",
    [
        lambda: __import__("os").environ.get("BOLTZLABS_ENV_INDEX", "-1"),
        lambda: __import__("os").getenv("BOLTZLABS_WORKSPACE"),
        lambda: dict(__import__("os").environ),
        lambda: __import__("boltzlabs_gym.envside.process_setup").envside.process_setup.ENV_INDEX % 3,
        lambda: __import__("os").path.join(__import__("boltzlabs_gym.env").env.WORKSPACE, "videos"),
    ],
    ids=["environ.get", "getenv", "all of environ", "ENV_INDEX", "WORKSPACE"],
)
def test_a_factory_that_reads_what_differs_between_envs_is_built_in_each_fork(read, monkeypatch):
    """In the template these are the template's own values: an env built from them must not be inherited."""
    import os

    from boltzlabs_gym import env as env_module
    from boltzlabs_gym.envside import process_setup

    index, workspace = process_setup.PerEnvInt(-1), process_setup.PerEnvStr("/workspace")
    monkeypatch.setattr(process_setup, "ENV_INDEX", index)
    monkeypatch.setattr(process_setup, "WORKSPACE", workspace)
    monkeypatch.setattr(env_module, "WORKSPACE", workspace)
    environ = os.environ

    def factory():
        read()
        return _cartpole()

    assert prebuilt.build([factory]) == 0
    assert os.environ is environ and process_setup.ENV_INDEX is index and env_module.WORKSPACE is workspace
    assert prebuilt.build([_cartpole]) == 1  # one that reads none of them is inherited
