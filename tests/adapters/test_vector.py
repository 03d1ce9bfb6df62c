"""BoltzLabsVecEnv against Gymnasium's VectorEnv contract, compared with SyncVectorEnv."""

from __future__ import annotations

import functools
import time

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.vector import AutoresetMode, SyncVectorEnv
from gymnasium.vector.utils import batch_space

import boltzlabs_gym
from boltzlabs_gym import BoltzLabsVecEnv, PoolClosedError

from conftest import COUNTER, ISOLATION
from vector_envs import DictTupleEnv, FlakyCartPole, MixedRepliesCartPole

pytestmark = pytest.mark.usefixtures("no_leaks")


def assert_same(a, b, where=""):
    """Recursive equality of observations/infos (arrays, dicts, tuples)."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{where}: keys {sorted(a)} != {sorted(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, tuple):
        assert isinstance(b, tuple) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, np.ndarray) and a.dtype == object:
        assert isinstance(b, np.ndarray) and a.shape == b.shape, where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        a_arr, b_arr = np.asarray(a), np.asarray(b)
        assert a_arr.dtype == b_arr.dtype, f"{where}: dtype {a_arr.dtype} != {b_arr.dtype}"
        np.testing.assert_array_equal(a_arr, b_arr, err_msg=where)


def make_cartpole():
    return gym.make("CartPole-v1")


ENV_FACTORIES = {"CartPole-v1": make_cartpole, "DictTuple": DictTupleEnv, "MixedReplies": MixedRepliesCartPole}


@pytest.mark.parametrize("mode", list(AutoresetMode), ids=lambda m: m.value)
@pytest.mark.parametrize("env_name", list(ENV_FACTORIES))
def test_matches_sync_vector_env_step_by_step(env_name, mode):
    fns = [ENV_FACTORIES[env_name]] * 3
    ours = BoltzLabsVecEnv(fns, autoreset_mode=mode, isolation=ISOLATION)
    ref = SyncVectorEnv(fns, autoreset_mode=mode)
    try:
        assert ours.single_observation_space == ref.single_observation_space
        assert ours.single_action_space == ref.single_action_space
        assert ours.observation_space == ref.observation_space
        assert ours.metadata["autoreset_mode"] == mode
        o1, i1 = ours.reset(seed=7)
        o2, i2 = ref.reset(seed=7)
        assert_same(o1, o2, "reset obs")
        assert_same(i1, i2, "reset infos")
        ref.action_space.seed(3)
        for t in range(60):
            actions = ref.action_space.sample()
            r1 = ours.step(actions)
            r2 = ref.step(actions)
            for name, x, y in zip(("obs", "rewards", "terminations", "truncations", "infos"), r1, r2):
                assert_same(x, y, f"step {t} {name}")
            if mode == AutoresetMode.DISABLED:
                done = r2[2] | r2[3]
                if done.any():
                    mask = done.copy()
                    options = {"reset_mask": mask}
                    a = ours.reset(options=options)
                    assert "reset_mask" in options  # the caller's dict is not mutated
                    b = ref.reset(options={"reset_mask": mask})
                    assert_same(a, b, f"partial reset at {t}")
    finally:
        ours.close()
        ref.close()


def test_vector_wrappers_run_on_top():
    envs = BoltzLabsVecEnv([make_cartpole] * 4, isolation=ISOLATION)
    envs = gym.wrappers.vector.RecordEpisodeStatistics(envs)
    envs = gym.wrappers.vector.NormalizeObservation(envs)
    envs = gym.wrappers.vector.ClipReward(envs, -0.5, 0.5)
    try:
        envs.reset(seed=0)
        envs.action_space.seed(0)
        episodes = 0
        for _ in range(200):
            obs, rewards, terms, truncs, infos = envs.step(envs.action_space.sample())
            assert obs.shape == (4, 4) and rewards.max() <= 0.5
            if "episode" in infos:
                episodes += int(infos["_episode"].sum())
                assert (infos["episode"]["r"][infos["_episode"]] > 0).all()
        assert episodes > 4
    finally:
        envs.close()


def test_record_episode_statistics_survives_partial_reset():
    # Gymnasium's own vectorizers pop reset_mask from the caller's options, which makes
    # RecordEpisodeStatistics wipe running envs' statistics; ours never mutates options.
    envs = gym.wrappers.vector.RecordEpisodeStatistics(
        BoltzLabsVecEnv([make_cartpole] * 2, autoreset_mode=AutoresetMode.DISABLED, isolation=ISOLATION)
    )
    try:
        envs.reset(seed=0)
        for _ in range(3):
            envs.step(np.array([0, 0]))
        envs.reset(options={"reset_mask": np.array([True, False])})
        assert envs.episode_lengths.tolist() == [0, 3]
    finally:
        envs.close()


def test_make_vec_forms_and_vector_entry_point():
    envs = boltzlabs_gym.make_vec("CartPole-v1", num_envs=2, isolation=ISOLATION, max_episode_steps=5)
    try:
        envs.reset(seed=1)
        truncs = [envs.step(np.array([0, 0]))[3] for _ in range(5)]
        assert truncs[-1].all() or any(t.any() for t in truncs)
    finally:
        envs.close()
    envs = boltzlabs_gym.make_vec(DictTupleEnv, num_envs=2, isolation=ISOLATION, render_mode="rgb_array")
    try:
        envs.reset(seed=0)
        assert envs.render_mode == "rgb_array"
        frames = envs.render()
        assert len(frames) == 2 and frames[0].shape == (4, 6, 3) and frames[0].dtype == np.uint8
    finally:
        envs.close()
    envs = boltzlabs_gym.make_vec(COUNTER, num_envs=2, isolation=ISOLATION)
    try:
        obs, infos = envs.reset(seed=0)
        assert obs == ({"t": 0}, {"t": 0})
        obs, rewards, terms, truncs, infos = envs.step([1, 2])
        assert obs == ({"t": 1}, {"t": 1}) and rewards.tolist() == [1.0, 2.0]
    finally:
        envs.close()
    envs = gym.make_vec("boltzlabs_gym:BoltzLabsCartPole-v0", num_envs=3, vectorization_mode="vector_entry_point")
    try:
        assert isinstance(envs, BoltzLabsVecEnv) and envs.spec.id == "BoltzLabsCartPole-v0"
        obs, _ = envs.reset(seed=0)
        assert obs.shape == (3, 4)
    finally:
        envs.close()


def test_call_get_attr_set_attr():
    envs = BoltzLabsVecEnv([DictTupleEnv] * 3, isolation=ISOLATION)
    try:
        envs.reset(seed=0)
        assert envs.get_attr("level") == (0, 0, 0)
        envs.set_attr("level", [1, 2, 3])
        assert envs.call("double_level", k=3) == (3, 6, 9)
        envs.set_attr("level", 5)
        assert envs.get_attr("level") == (5, 5, 5)
        with pytest.raises(RuntimeError, match="no_such_method"):
            envs.call("no_such_method")
    finally:
        envs.close()


@pytest.mark.parametrize("mode", [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP], ids=lambda m: m.value)
@pytest.mark.parametrize("fault", ["hang", "crash"])
def test_straggler_and_crash_infos_with_masks(fault, mode):
    n = 4
    fns = [functools.partial(FlakyCartPole, i, 2, fault, 3) for i in range(n)]
    envs = BoltzLabsVecEnv(fns, autoreset_mode=mode, isolation=ISOLATION, step_timeout=1.0)
    try:
        envs.reset(seed=0)
        key = "boltzlabs_straggler" if fault == "hang" else "boltzlabs_error"
        for t in range(1, 4):
            t0 = time.monotonic()
            obs, rewards, terms, truncs, infos = envs.step(np.zeros(n, dtype=np.int64))
            if t < 3:
                assert key not in infos
        assert time.monotonic() - t0 < 1.0 + 2.0
        assert infos[f"_{key}"].tolist() == [False, False, True, False]
        if fault == "crash":
            assert "exited with status 9" in infos[key]["reason"][2]
        assert truncs[2] and not terms[2] and rewards[2] == 0
        np.testing.assert_array_equal(obs[2], np.zeros(4, dtype=np.float32))
        assert not truncs[[0, 1, 3]].any()
        # The slot comes back on the next step, without an extra round trip.
        calls = envs.pool.timing.calls
        obs, rewards, terms, truncs, infos = envs.step(np.zeros(n, dtype=np.int64))
        assert envs.pool.timing.calls == calls + 1
        assert key not in infos and not truncs[2] and abs(obs[2]).max() < 0.2
    finally:
        envs.close()


def test_exception_inside_env_reported_with_traceback():
    fns = [functools.partial(FlakyCartPole, i, 1, "raise", 2) for i in range(2)]
    envs = BoltzLabsVecEnv(fns, isolation=ISOLATION)
    try:
        envs.reset(seed=0)
        envs.step(np.zeros(2, dtype=np.int64))
        obs, rewards, terms, truncs, infos = envs.step(np.zeros(2, dtype=np.int64))
        assert terms[1] and infos["_boltzlabs_exception"].tolist() == [False, True]
        assert "flaky env raised on purpose" in infos["boltzlabs_exception"]["traceback"][1]
        obs, _, terms, truncs, _ = envs.step(np.zeros(2, dtype=np.int64))  # reset on the next step
        assert not terms[1] and abs(obs[1]).max() < 0.2
    finally:
        envs.close()


def test_step_wait_timeout_leaves_no_stale_reply():
    fns = [functools.partial(FlakyCartPole, i, 0, "hang", 1) for i in range(2)]
    envs = BoltzLabsVecEnv(fns, isolation=ISOLATION, step_timeout=2.0)
    try:
        envs.reset(seed=0)
        envs.step_async(np.zeros(2, dtype=np.int64))
        with pytest.raises(TimeoutError):
            envs.step_wait(timeout=0.3)
        time.sleep(2.5)  # the late reply (with the straggler) arrives now and must be dropped
        obs, _ = envs.reset(seed=0)
        ref = SyncVectorEnv([make_cartpole] * 2)
        np.testing.assert_array_equal(obs, ref.reset(seed=0)[0])
        ref.close()
    finally:
        envs.close()


def test_bad_input_errors_name_the_problem():
    envs = BoltzLabsVecEnv([make_cartpole] * 2, isolation=ISOLATION)
    try:
        envs.reset(seed=0)
        with pytest.raises(ValueError, match="expected 2 actions|batched action space"):
            envs.step(np.zeros(3, dtype=np.int64))
        with pytest.raises(ValueError, match="action for env 0 .*integer"):
            envs.step(np.zeros(2, dtype=np.float32))  # not the int fast path: the codec names the env
        # An int batch takes the fast path; an out-of-range action is still that env's error alone.
        _, _, terms, _, infos = envs.step(np.array([1, 7], dtype=np.int32))
        assert terms.tolist() == [False, True] and infos["_boltzlabs_exception"].tolist() == [False, True]
        assert infos["boltzlabs_exception"]["where"][1] == "action"
        with pytest.raises(ValueError, match="length must match"):
            envs.reset(seed=[1, 2, 3])
        with pytest.raises(TypeError, match="reset_mask"):
            envs.reset(options={"reset_mask": [True, False]})
        with pytest.raises(ValueError, match="autoreset_mode"):
            BoltzLabsVecEnv([make_cartpole], autoreset_mode="sometimes")
        with pytest.raises(TypeError, match="env_fns\\[1\\]"):
            BoltzLabsVecEnv([make_cartpole, 3])
    finally:
        envs.close()


def test_close_is_bounded_and_idempotent():
    envs = BoltzLabsVecEnv([make_cartpole] * 2, isolation=ISOLATION)
    envs.reset(seed=0)
    t0 = time.monotonic()
    envs.close()
    envs.close()
    assert envs.closed and time.monotonic() - t0 < 10
    with pytest.raises(PoolClosedError):
        envs.step(np.zeros(2, dtype=np.int64))


def test_batched_spaces_and_contract_attributes():
    envs = BoltzLabsVecEnv([make_cartpole] * 5, isolation=ISOLATION)
    try:
        assert envs.num_envs == 5
        assert envs.action_space == batch_space(envs.single_action_space, 5)
        assert isinstance(envs.metadata["autoreset_mode"], AutoresetMode)
        envs.reset(seed=11)
        # The tuple of the envs' seeds, as SyncVectorEnv's.
        assert envs.np_random_seed == (11, 12, 13, 14, 15) and isinstance(envs.np_random, np.random.Generator)
        envs.spec = gym.spec("CartPole-v1")  # make_vec assigns it
        assert envs.isolation.backend in ("namespaces", "bwrap", "process")
    finally:
        envs.close()
