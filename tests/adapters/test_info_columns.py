"""Infos of numbers travel as typed columns (one env per sandbox: one row; several: a column per
key of the sandbox reply) and array actions as one batch per sandbox: the vector env's results stay
SyncVectorEnv's, values, dtypes and ``_key`` masks, in every autoreset mode.

Hypothesis draws the infos: which keys, of which kinds (Python and numpy scalars, small arrays, and
kinds that cannot be columns: strings, numpy bools, nested dicts), which keys each env leaves out at
each step, and a key whose kind changes mid-run (the general path then, checked in full).
"""

from __future__ import annotations

import functools

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import data_equivalence
from gymnasium.vector import AutoresetMode, SyncVectorEnv
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from boltzlabs_gym import BoltzLabsVecEnv
from conftest import ISOLATION

#: What a drawn key's values are: each a function of the env's generator.
KINDS = {
    "int": lambda rng: int(rng.integers(-5, 1 << 40)),
    "float": lambda rng: float(rng.normal()),
    "bool": lambda rng: bool(rng.integers(2)),
    "np.float32": lambda rng: np.float32(rng.normal()),
    "np.float64": lambda rng: np.float64(rng.normal()),
    "np.int16": lambda rng: np.int16(rng.integers(-300, 300)),
    "np.uint8": lambda rng: np.uint8(rng.integers(256)),
    "nd.f4x3": lambda rng: rng.normal(size=3).astype(np.float32),
    "nd.i8x2x2": lambda rng: rng.integers(-9, 9, size=(2, 2)),
    "nd.bool4": lambda rng: rng.integers(2, size=4).astype(bool),
    # Not columns: the general path.
    "str": lambda rng: f"s{int(rng.integers(9))}",
    "np.bool_": lambda rng: np.bool_(rng.integers(2)),
    "dict": lambda rng: {"inner": int(rng.integers(9))},
}


class InfoShapesEnv(gym.Env):
    """Infos of the drawn keys and kinds; each env leaves a key out where its generator says, and
    ``change`` (key, step, kind) switches one key's kind from that step of every episode on."""

    metadata: dict = {"render_modes": []}

    def __init__(self, keys: dict, horizon: int, drop: float, change=None, reset_keys: bool = True):
        self.observation_space = gym.spaces.Box(-np.inf, np.inf, (3,), np.float32)
        self.action_space = gym.spaces.Box(-1, 1, (2,), np.float32)
        self.keys, self.horizon, self.drop, self.change, self.reset_keys = keys, horizon, drop, change, reset_keys

    def _info(self) -> dict:
        info = {}
        for key, kind in self.keys.items():
            if self.change is not None and key == self.change[0] and self.t >= self.change[1]:
                kind = self.change[2]
            if self.np_random.random() >= self.drop:
                info[key] = KINDS[kind](self.np_random)
        return info

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self.np_random.normal(size=3).astype(np.float32), self._info() if self.reset_keys else {}

    def step(self, action):
        assert action.shape == (2,), action
        self.t += 1
        obs = (self.np_random.normal(size=3) + float(np.sum(action))).astype(np.float32)
        return obs, float(self.t), self.t % 7 == 0, self.t >= self.horizon, self._info()


def assert_same(got, want, where):
    for name, a, b in zip(("obs", "rewards", "terminations", "truncations", "infos"), got, want):
        assert data_equivalence(a, b, exact=True), f"{where} {name}:\n{a!r}\n!=\n{b!r}"


def run_both(factory, n: int, k: int, mode: AutoresetMode, steps: int, action_dtype=np.float32):
    ours = BoltzLabsVecEnv([factory] * n, isolation=ISOLATION, envs_per_sandbox=k, autoreset_mode=mode)
    ref = SyncVectorEnv([factory] * n, autoreset_mode=mode)
    try:
        assert_same(ours.reset(seed=3), ref.reset(seed=3), "reset")
        rng = np.random.default_rng(0)
        for t in range(steps):
            actions = rng.uniform(-1, 1, size=(n, 2)).astype(action_dtype)
            got, want = ours.step(actions), ref.step(actions)
            assert_same(got, want, f"step {t}")
            if mode == AutoresetMode.DISABLED:
                done = np.logical_or(want[2], want[3])
                if done.any():
                    options = {"reset_mask": done}
                    assert_same(ours.reset(options=options), ref.reset(options=options), f"reset after {t}")
    finally:
        ours.close()
        ref.close()


key_names = st.sampled_from(["x_position", "lives", "frame_number", "reward_ctrl", "a", "b_c"])
infos = st.dictionaries(key_names, st.sampled_from(list(KINDS)), min_size=1, max_size=4)


# no_leaks checks once, after every example ran (each closes its vector envs).
@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    keys=infos,
    drop=st.sampled_from([0.0, 0.3]),
    change=st.one_of(st.none(), st.tuples(key_names, st.integers(1, 5), st.sampled_from(list(KINDS)))),
    k=st.sampled_from([1, 2, 3]),
    mode=st.sampled_from(list(AutoresetMode)),
    reset_keys=st.booleans(),
)
def test_infos_match_sync_vector_env(keys, drop, change, k, mode, reset_keys, no_leaks):
    factory = functools.partial(InfoShapesEnv, keys, horizon=6, drop=drop, change=change, reset_keys=reset_keys)
    run_both(factory, n=4, k=k, mode=mode, steps=14)


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32])
def test_each_env_gets_its_row_in_the_batchs_dtype(k, dtype, no_leaks):
    """A batch of array actions goes as one payload per sandbox; each env gets its row in the
    dtype of the batch (a float64 row for a float32 space too), as from SyncVectorEnv."""
    factory = functools.partial(DtypeEcho)
    ours = BoltzLabsVecEnv([factory] * 4, isolation=ISOLATION, envs_per_sandbox=k)
    try:
        ours.reset(seed=0)
        actions = np.arange(8).reshape(4, 2).astype(dtype)
        _, _, _, _, info = ours.step(actions)
        assert list(info["dtype"]) == [np.dtype(dtype).str] * 4
        np.testing.assert_array_equal(info["action"], actions.astype(np.float64))
    finally:
        ours.close()


class DtypeEcho(gym.Env):
    """Says which dtype its action came in, and the action."""

    metadata: dict = {"render_modes": []}
    observation_space = gym.spaces.Box(-1, 1, (1,), np.float32)
    action_space = gym.spaces.Box(-10, 10, (2,), np.float32)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(1, np.float32), {}

    def step(self, action):
        return np.zeros(1, np.float32), 0.0, False, False, {"dtype": action.dtype.str, "action": action.astype(np.float64)}


def test_a_batch_of_the_wrong_shape_is_refused_naming_the_env(no_leaks):
    """A batch whose rows are not the space's shape goes the per-env way, which names the env and
    the shape before anything is sent; the pool steps on."""
    ours = BoltzLabsVecEnv([DtypeEcho] * 4, isolation=ISOLATION, envs_per_sandbox=2)
    try:
        ours.reset(seed=0)
        with pytest.raises(ValueError, match=r"action for env 0 does not fit .* shape \(3,\)"):
            ours.step(np.zeros((4, 3), np.float32))
        _, _, _, _, info = ours.step(np.ones((4, 2), np.float32))
        assert list(info["dtype"]) == ["<f4"] * 4
    finally:
        ours.close()
