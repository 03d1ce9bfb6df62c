"""Gymnasium's vector-env contract, item by item, with SyncVectorEnv as the reference.

Each test states one clause of the contract that Gymnasium's own ``tests/vector`` checks
(spaces, seeding, autoreset modes, infos, async calls and their exceptions, observation
modes, ``make_vec``, wrappers) and holds ``BoltzLabsVecEnv`` to what ``SyncVectorEnv`` does
with the same envs, so code written for Gymnasium's vectorizers switches by the class name
alone. Differences that must stay (the JSON boundary) are in the README's table.
"""

from __future__ import annotations

import copy
import functools
import multiprocessing
import time

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.spaces import Box, Dict, Discrete, MultiBinary, MultiDiscrete, Tuple
from gymnasium.utils.env_checker import data_equivalence
from gymnasium.vector import AutoresetMode, SyncVectorEnv
from gymnasium.vector.utils import batch_differing_spaces

import boltzlabs_gym
from boltzlabs_gym import BoltzLabsError, BoltzLabsVecEnv, PoolClosedError

from conftest import ISOLATION
from vector_envs import DictTupleEnv

pytestmark = pytest.mark.usefixtures("no_leaks")

N = 3


# --------------------------------------------------------------------------- envs


class CountEnv(gym.Env):
    """Gymnasium's counting env: the obs is the step count (a Python int), the reward the
    action; the episode terminates when the count reaches ``max_count``."""

    def __init__(self, max_count: int = 3):
        self.observation_space = Discrete(5)
        self.action_space = Discrete(5)
        self.max_count = max_count
        self.count = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.count = 0
        return self.count, {}

    def step(self, action):
        self.count += 1
        return self.count, float(action), self.count == self.max_count, False, {}


class SpacesEnv(gym.Env):
    """Observations sampled from its own space, seeded by ``reset(seed=...)``; checks each action."""

    def __init__(self, observation_space: gym.Space, action_space: gym.Space | None = None, horizon: int = 4):
        # Copies: SyncVectorEnv's envs would otherwise share one space, and one generator.
        self.observation_space = copy.deepcopy(observation_space)
        self.action_space = copy.deepcopy(action_space if action_space is not None else observation_space)
        self.horizon = horizon

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        if seed is not None:
            self.observation_space.seed(seed)
        self.t = 0
        return self.observation_space.sample(), {}

    def step(self, action):
        assert action in self.action_space, f"action {action!r} not in {self.action_space}"
        self.t += 1
        return self.observation_space.sample(), 1.0, False, self.t >= self.horizon, {"t": self.t}


def make_seeded(env_id: str, seed: int, **kwargs):
    """Gymnasium's test factory: an env whose action space and env were seeded by the factory."""
    env = gym.make(env_id, disable_env_checker=True, **kwargs)
    env.action_space.seed(seed)
    env.reset(seed=seed)
    return env


def vectors(fns, **kwargs):
    """(ours, reference) over the same factories."""
    ours = BoltzLabsVecEnv(fns, isolation=ISOLATION, **kwargs)
    try:
        ref = SyncVectorEnv(fns, **kwargs)
    except BaseException:
        ours.close()
        raise
    return ours, ref


def assert_same_transition(got, want, where=""):
    names = ("obs", "rewards", "terminations", "truncations", "infos")
    for name, a, b in zip(names, got, want):
        assert data_equivalence(a, b, exact=True), f"{where} {name}: {a!r} != {b!r}"


@pytest.fixture(scope="module")
def cartpoles():
    """One shared pool (three CartPoles) for the clauses that leave it as they found it."""
    envs = BoltzLabsVecEnv([functools.partial(make_seeded, "CartPole-v1", i) for i in range(N)], isolation=ISOLATION)
    yield envs
    envs.close()


# --------------------------------------------------------------------------- spaces


SPACES = {
    "box_scalar_f64": Box(-1.0, 1.0, (), np.float64),
    "box_image_u8": Box(0, 255, (8, 8, 3), np.uint8),
    "discrete_start": Discrete(5, start=-2),
    "multidiscrete": MultiDiscrete([11, 13, 17]),
    "multibinary": MultiBinary(19),
    "nested": Dict(
        {
            "position": Dict({"x": Discrete(29), "y": Discrete(31)}),
            "velocity": Tuple((Discrete(37), Box(0, 255, (), np.uint8))),
            "pair": Tuple((Discrete(7), Box(np.array([0.0, -1.0]), np.array([1.0, 1.0]), dtype=np.float64))),
            "grid": Box(np.array([[-1.0, 0.0], [0.0, -1.0]]), np.ones((2, 2)), dtype=np.float64),
        }
    ),
    # JSON-expressible, so they cross as themselves.
    "sequence": gym.spaces.Sequence(Tuple((Discrete(3), Box(0, 1, (2,), np.float32)))),
    "sequence_stacked": gym.spaces.Sequence(Box(0, 1, (2,), np.float32), stack=True),
    "oneof": gym.spaces.OneOf([Discrete(2), Box(0, 1, (2,), np.float32)]),
    "graph": gym.spaces.Graph(Box(-1, 1, (3,), np.float32), Discrete(4)),
    "graph_of_dicts": gym.spaces.Graph(Dict({"pos": Box(-1, 1, (3,)), "label": Discrete(5)}), None),
}


@pytest.mark.parametrize("name", list(SPACES))
def test_every_space_kind_steps_like_sync(name):
    """Batched spaces, observations in them, and the same transitions as SyncVectorEnv."""
    space = SPACES[name]
    ours, ref = vectors([functools.partial(SpacesEnv, space)] * N)
    try:
        assert ours.single_observation_space == ref.single_observation_space
        assert ours.observation_space == ref.observation_space
        assert ours.action_space == ref.action_space
        got, want = ours.reset(seed=5), ref.reset(seed=5)
        assert got[0] in ours.observation_space
        assert data_equivalence(got, want, exact=True)
        ref.action_space.seed(9)
        for t in range(6):
            actions = ref.action_space.sample()
            got, want = ours.step(actions), ref.step(actions)
            assert got[0] in ours.observation_space
            assert_same_transition(got, want, f"{name} step {t}")
    finally:
        ours.close()
        ref.close()


def test_every_envs_spaces_are_checked():
    """Envs whose observation or action spaces differ are refused, as SyncVectorEnv refuses them."""
    fns = [functools.partial(make_seeded, "CartPole-v1", 0)] * 2 + [functools.partial(make_seeded, "FrozenLake-v1", 1)]
    with pytest.raises(RuntimeError):
        SyncVectorEnv(fns)
    with pytest.raises(RuntimeError, match="spaces are not equivalent.*observation_mode='different'") as err:
        BoltzLabsVecEnv(fns, isolation=ISOLATION)
    assert isinstance(err.value, BoltzLabsError) and "sub-environment 2" in str(err.value)
    obs = Box(0, 1, (2,))
    fns = [functools.partial(SpacesEnv, obs, Discrete(2)), functools.partial(SpacesEnv, obs, Discrete(3))]
    with pytest.raises(RuntimeError, match="Sub-environment 1's action space"):
        BoltzLabsVecEnv(fns, isolation=ISOLATION)


def test_observation_mode_different_and_custom():
    spaces = [Box(low=0, high=i, shape=(5,)) for i in range(1, 4)]
    fns = [functools.partial(SpacesEnv, space, Discrete(2)) for space in spaces]
    for mode in ("different", (batch_differing_spaces(spaces), Box(low=0, high=1, shape=(5,)))):
        ours, ref = vectors(fns, observation_mode=mode)
        try:
            assert ours.observation_mode == mode
            assert ours.observation_space == ref.observation_space == batch_differing_spaces(spaces)
            assert ours.single_observation_space == ref.single_observation_space
            assert data_equivalence(ours.reset(seed=3), ref.reset(seed=3), exact=True)
            got, want = ours.step(np.array([0, 1, 0])), ref.step(np.array([0, 1, 0]))
            assert_same_transition(got, want, f"mode {mode}")
        finally:
            ours.close()
            ref.close()


def test_observation_mode_refusals():
    with pytest.raises(ValueError, match="Invalid `observation_mode`, expected: 'same' or 'different'"):
        BoltzLabsVecEnv([functools.partial(SpacesEnv, Box(0, 1, (5,)))] * 2, observation_mode="invalid",
                        isolation=ISOLATION)
    shapes = [functools.partial(SpacesEnv, Box(0, 1, (i + 1,)), Discrete(2)) for i in range(3)]
    with pytest.raises(Exception) as want:
        SyncVectorEnv(shapes, observation_mode="different")
    with pytest.raises(type(want.value), match=str(want.value)[:30]):
        BoltzLabsVecEnv(shapes, observation_mode="different", isolation=ISOLATION)


# --------------------------------------------------------------------------- seeding


def test_np_random_seed_is_the_tuple_of_env_seeds(cartpoles):
    ref = SyncVectorEnv([functools.partial(make_seeded, "CartPole-v1", i) for i in range(N)])
    try:
        assert cartpoles.np_random_seed == ref.np_random_seed == (0, 1, 2)  # the factories' seeds
        cartpoles.reset(seed=42)
        ref.reset(seed=42)
        assert cartpoles.np_random_seed == ref.np_random_seed == (42, 43, 44)
        cartpoles.reset(seed=None)  # a reset without a seed keeps it
        ref.reset(seed=None)
        assert cartpoles.np_random_seed == ref.np_random_seed == (42, 43, 44)
        assert isinstance(cartpoles.np_random, np.random.Generator)
    finally:
        ref.close()


@pytest.mark.parametrize("env_id", ["Pendulum-v1", "CartPole-v1"])
def test_batched_action_space_inherits_the_factorys_seed(env_id):
    ours, ref = vectors([functools.partial(make_seeded, env_id, 123)])
    try:
        ours_state = ours.action_space.np_random.bit_generator.state
        assert ours_state == ref.action_space.np_random.bit_generator.state
        single = ours.single_action_space.np_random.bit_generator.state
        assert single == ref.single_action_space.np_random.bit_generator.state
        for _ in range(20):
            assert np.array_equal(ours.action_space.sample(), ref.action_space.sample())
    finally:
        ours.close()
        ref.close()


def seeded_tuple_env():
    env = DictTupleEnv()
    env.action_space.seed(7)
    return env


def test_nested_action_space_inherits_the_seed():
    ours, ref = vectors([seeded_tuple_env] * 2)
    try:
        for _ in range(5):
            assert data_equivalence(ours.action_space.sample(), ref.action_space.sample(), exact=True)
    finally:
        ours.close()
        ref.close()


# --------------------------------------------------------------------------- autoreset


@pytest.mark.parametrize("mode", list(AutoresetMode), ids=lambda m: m.value)
def test_autoreset_modes_count_like_sync(mode):
    """Gymnasium's counting test of each autoreset mode, compared value by value (and type by
    type: SAME_STEP's final_obs holds the env's own Python ints)."""
    ours, ref = vectors([CountEnv] * N, autoreset_mode=mode)
    try:
        assert ours.metadata["autoreset_mode"] == ref.metadata["autoreset_mode"] == mode
        for envs in (ours, ref):
            envs.set_attr("max_count", [2, 3, 3])
        assert data_equivalence(ours.reset(), ref.reset(), exact=True)
        for t in range(7):
            actions = [1, 2, 3]
            got, want = ours.step(actions), ref.step(actions)
            assert_same_transition(got, want, f"{mode.value} step {t}")
            if "final_obs" in want[4]:
                assert [type(x) for x in got[4]["final_obs"]] == [type(x) for x in want[4]["final_obs"]]
            if mode == AutoresetMode.DISABLED and (want[2] | want[3]).any():
                mask = want[2] | want[3]
                assert data_equivalence(ours.reset(options={"reset_mask": mask}),
                                        ref.reset(options={"reset_mask": mask.copy()}), exact=True)
    finally:
        ours.close()
        ref.close()


@pytest.mark.parametrize("ends", [1, 2, 3])
def test_concurrent_episode_ends_infos(ends):
    """Envs that end together: masks and final observations exactly as SyncVectorEnv's."""
    fns = [functools.partial(make_seeded, "CartPole-v1", 42)] * N
    ours, ref = vectors(fns, autoreset_mode=AutoresetMode.SAME_STEP)
    try:
        actions = np.array([0] * ends + [1] * (N - ends))
        assert data_equivalence(ours.reset(seed=[42] * N), ref.reset(seed=[42] * N), exact=True)
        for t in range(40):
            got, want = ours.step(actions), ref.step(actions)
            assert_same_transition(got, want, f"step {t}")
    finally:
        ours.close()
        ref.close()


# --------------------------------------------------------------------------- async calls and exceptions


def test_reset_async_reset_wait(cartpoles):
    ref = SyncVectorEnv([functools.partial(make_seeded, "CartPole-v1", i) for i in range(N)])
    try:
        cartpoles.reset_async(seed=8)
        assert data_equivalence(cartpoles.reset_wait(), ref.reset(seed=8), exact=True)
    finally:
        ref.close()


def test_gymnasiums_exceptions(cartpoles):
    envs = cartpoles
    envs.reset(seed=0)
    with pytest.raises(gym.error.NoAsyncCallError, match="`step_wait` without any prior call to `step_async`") as err:
        envs.step_wait()
    assert err.value.name == "step" and isinstance(err.value, BoltzLabsError)
    with pytest.raises(gym.error.NoAsyncCallError) as err:
        envs.reset_wait()
    assert err.value.name == "reset"

    envs.reset_async(seed=1)
    with pytest.raises(gym.error.AlreadyPendingCallError,
                       match=r"Calling `step_async` while waiting for a pending call to `reset` to complete\.") as err:
        envs.step_async(np.zeros(N, dtype=np.int64))
    assert err.value.name == "reset" and isinstance(err.value, BoltzLabsError)
    with pytest.raises(gym.error.AlreadyPendingCallError):
        envs.reset_async()
    envs.reset_wait()

    envs.step_async(np.zeros(N, dtype=np.int64))
    with pytest.raises(gym.error.AlreadyPendingCallError, match="pending call to `step`") as err:
        envs.reset()
    assert err.value.name == "step"
    with pytest.raises(gym.error.AlreadyPendingCallError):
        envs.get_attr("gravity")
    with pytest.raises(gym.error.NoAsyncCallError):
        envs.reset_wait()
    obs, *_ = envs.step_wait()
    assert obs.shape == (N, 4)


class SlowEnv(CountEnv):
    """Sleeps ``action / 10`` seconds in every step."""

    def step(self, action):
        time.sleep(float(action) / 10)
        return super().step(action)


def test_wait_timeouts_and_close_while_pending():
    """As AsyncVectorEnv: a timed-out wait raises multiprocessing.TimeoutError and ends the call;
    closing with a call pending warns."""
    envs = BoltzLabsVecEnv([SlowEnv] * 2, isolation=ISOLATION)
    try:
        envs.reset(seed=0)
        envs.step_async(np.array([0, 4]))
        with pytest.raises(multiprocessing.TimeoutError) as err:
            envs.step_wait(timeout=0.1)
        assert isinstance(err.value, TimeoutError) and isinstance(err.value, BoltzLabsError)
        with pytest.raises(gym.error.NoAsyncCallError):
            envs.step_wait()
        time.sleep(0.5)  # the late reply arrives, and is dropped
        obs, _ = envs.reset(seed=0)
        assert obs.tolist() == [0, 0]
        envs.step_async(np.array([0, 0]))
        with pytest.warns(UserWarning, match="Calling `close` while waiting for a pending call to `step` to complete"):
            envs.close()
    finally:
        envs.close()


def test_wrong_action_count_is_a_type_and_value_error(cartpoles):
    cartpoles.reset(seed=0)
    for error in (TypeError, ValueError):
        with pytest.raises(error, match=f"expected {N} actions \\(one per env\\), got {N + 1}"):
            cartpoles.step(np.zeros(N + 1, dtype=np.int64))
    obs, *_ = cartpoles.step(np.zeros(N, dtype=np.int64))  # nothing was left pending
    assert obs.shape == (N, 4)


def test_closed_environment_error():
    envs = BoltzLabsVecEnv([CountEnv] * 2, isolation=ISOLATION)
    envs.close()
    for call in (lambda: envs.step([0, 0]), lambda: envs.reset(), lambda: envs.step_wait(), lambda: envs.get_attr("x")):
        with pytest.raises(gym.error.ClosedEnvironmentError) as err:
            call()
        assert isinstance(err.value, PoolClosedError)


# --------------------------------------------------------------------------- attributes, make_vec, wrappers


def test_call_get_attr_set_attr_like_sync(cartpoles):
    ref = SyncVectorEnv([functools.partial(make_seeded, "CartPole-v1", i) for i in range(N)])
    try:
        for envs in (cartpoles, ref):
            envs.set_attr("gravity", [9.81, 3.72, 8.87])
        assert cartpoles.get_attr("gravity") == ref.get_attr("gravity") == (9.81, 3.72, 8.87)
        assert cartpoles.call("gravity") == ref.call("gravity")
        for envs in (cartpoles, ref):
            envs.set_attr("gravity", 9.8)
        assert cartpoles.get_attr("gravity") == ref.get_attr("gravity") == (9.8,) * N
        with pytest.raises(AttributeError):
            ref.get_attr("no_such_attribute")
        with pytest.raises(AttributeError):
            cartpoles.get_attr("no_such_attribute")
    finally:
        ref.close()


@pytest.mark.parametrize("mode", [AutoresetMode.SAME_STEP, AutoresetMode.SAME_STEP.value])
def test_make_vec_takes_vector_kwargs(mode):
    envs = boltzlabs_gym.make_vec("CartPole-v1", num_envs=2, vector_kwargs={"autoreset_mode": mode},
                                  isolation=ISOLATION)
    try:
        assert envs.autoreset_mode == envs.metadata["autoreset_mode"] == AutoresetMode.SAME_STEP
    finally:
        envs.close()


def test_record_episode_statistics_like_sync():
    fns = [functools.partial(make_seeded, "CartPole-v1", i) for i in range(N)]
    ours, ref = vectors(fns)
    ours = gym.wrappers.vector.RecordEpisodeStatistics(ours)
    ref = gym.wrappers.vector.RecordEpisodeStatistics(ref)
    try:
        ours.reset(seed=1)
        ref.reset(seed=1)
        ref.action_space.seed(2)
        episodes = 0
        for _ in range(80):
            actions = ref.action_space.sample()
            _, _, _, _, got = ours.step(actions)
            _, _, _, _, want = ref.step(actions)
            assert got.keys() == want.keys()
            if "episode" in want:
                episodes += int(want["_episode"].sum())
                assert np.array_equal(got["_episode"], want["_episode"])
                for key in ("r", "l"):
                    assert np.array_equal(got["episode"][key], want["episode"][key])
        assert episodes >= 3
        assert list(ours.return_queue) == list(ref.return_queue)
    finally:
        ours.close()
        ref.close()


# --------------------------------------------------------------------------- the JSON boundary


class ScalarActionEnv(gym.Env):
    """A Box(()) action: reports the type and dtype each action reached the env in."""

    observation_space = Box(-1, 1, (), np.float32)
    action_space = Box(-1, 1, (), np.float32)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros((), np.float32), {}

    def step(self, action):
        info = {"type": type(action).__name__, "dtype": str(np.asarray(action).dtype)}
        return np.zeros((), np.float32), 0.0, False, False, info


def test_scalar_box_actions_reach_the_env_in_the_callers_dtype():
    ours, ref = vectors([ScalarActionEnv] * 2)
    try:
        ours.reset(seed=0)
        ref.reset(seed=0)
        for actions in (np.array([0.5, -0.5], np.float64), np.array([0.25, 0.0], np.float32)):
            assert data_equivalence(ours.step(actions)[4], ref.step(actions)[4], exact=True)
    finally:
        ours.close()
        ref.close()


class NoJsonSpace(gym.Space):
    """A space of the user's own: it has no JSON form."""

    def contains(self, x):
        return isinstance(x, int)


def test_custom_spaces_cross_as_json_space():
    """A custom space has no JSON form: values cross as JSON, sampling says why it cannot."""
    envs = BoltzLabsVecEnv([functools.partial(SpacesEnv, Discrete(3), NoJsonSpace())] * 2, isolation=ISOLATION)
    try:
        assert isinstance(envs.single_action_space, boltzlabs_gym.wire.spaces.JsonSpace)
        envs.reset(seed=0)
        envs.step([1, 2])
        with pytest.raises(NotImplementedError, match="cannot be sampled"):
            envs.action_space.sample()
    finally:
        envs.close()
