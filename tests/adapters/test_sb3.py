"""The SB3 adapter against SB3's own DummyVecEnv, under SB3's wrappers, and in training."""

from __future__ import annotations

import functools
import os
import time

import gymnasium as gym
import numpy as np
import pytest

sb3 = pytest.importorskip("stable_baselines3")

from gymnasium.vector import AutoresetMode  # noqa: E402
from stable_baselines3 import PPO  # noqa: E402
from stable_baselines3.common.monitor import Monitor  # noqa: E402
from stable_baselines3.common.vec_env import DummyVecEnv, VecFrameStack, VecMonitor, VecNormalize  # noqa: E402

from boltzlabs_gym import BoltzLabsVecEnv  # noqa: E402
from boltzlabs_gym.vector import ActionBatchError  # noqa: E402
from boltzlabs_gym.sb3 import BoltzLabsSB3VecEnv, make_sb3_vec_env  # noqa: E402

ISOLATION = os.environ.get("BOLTZLABS_TEST_ISOLATION", "auto")


def _cartpole(max_steps=None):
    def make():
        return gym.make("CartPole-v1", max_episode_steps=max_steps) if max_steps else gym.make("CartPole-v1")

    return make


def _sb3_env(n, max_steps=None, **kw):
    kw.setdefault("isolation", ISOLATION)
    venv = BoltzLabsVecEnv([_cartpole(max_steps) for _ in range(n)], autoreset_mode=AutoresetMode.SAME_STEP, **kw)
    return BoltzLabsSB3VecEnv(venv)


def test_import_is_lazy():
    import subprocess
    import sys

    code = "import sys, boltzlabs_gym; boltzlabs_gym.BoltzLabsVecEnv; assert 'stable_baselines3' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_requires_same_step(no_leaks):
    venv = BoltzLabsVecEnv([_cartpole()], isolation=ISOLATION)
    try:
        with pytest.raises(ValueError, match="SAME_STEP"):
            BoltzLabsSB3VecEnv(venv)
    finally:
        venv.close()


@pytest.mark.parametrize("max_steps", [None, 15])
def test_matches_dummy_vec_env_step_by_step(no_leaks, max_steps):
    """Observations, rewards, dones, infos, terminal observations, TimeLimit.truncated."""
    n = 4
    ours = _sb3_env(n, max_steps)
    ref = DummyVecEnv([_cartpole(max_steps) for _ in range(n)])
    try:
        assert ours.observation_space == ref.observation_space
        assert ours.action_space == ref.action_space
        assert ours.seed(7) == ref.seed(7)
        o, r = ours.reset(), ref.reset()
        np.testing.assert_array_equal(o, r)
        assert o.dtype == r.dtype
        assert ours.reset_infos == ref.reset_infos
        rng = np.random.default_rng(0)
        dones = truncs = 0
        for t in range(400):
            actions = rng.integers(0, 2, size=n)
            a, b = ours.step(actions), ref.step(actions)
            for x, y in zip(a[:3], b[:3]):
                np.testing.assert_array_equal(x, y, err_msg=f"step {t}")
                assert x.dtype == y.dtype and x.shape == y.shape
            for ia, ib in zip(a[3], b[3]):
                assert ia.keys() == ib.keys(), (t, ia, ib)
                assert ia["TimeLimit.truncated"] == ib["TimeLimit.truncated"]
                if "terminal_observation" in ib:
                    dones += 1
                    truncs += ib["TimeLimit.truncated"]
                    np.testing.assert_array_equal(ia["terminal_observation"], ib["terminal_observation"])
                    assert ia["terminal_observation"].dtype == ib["terminal_observation"].dtype
        assert dones > 10
        if max_steps:
            assert truncs > 0
        # Seeds are used once: a second reset is unseeded on both sides (no equality), but
        # seeding again reproduces the first episode.
        ours.seed(7)
        ref.seed(7)
        np.testing.assert_array_equal(ours.reset(), ref.reset())
    finally:
        ours.close()
        ref.close()


def test_set_options_used_once(no_leaks):
    env = _sb3_env(2)
    try:
        env.set_options([{"low": -0.01, "high": 0.01}, {"low": -0.2, "high": 0.2}])
        obs = env.reset()
        assert np.all(np.abs(obs[0]) <= 0.01)
        assert env._options == [{}, {}]
        env.set_options({"low": -0.001, "high": 0.001})
        obs = env.reset()
        assert np.all(np.abs(obs) <= 0.001)
    finally:
        env.close()


def test_attributes_with_indices(no_leaks):
    env = _sb3_env(3)
    try:
        env.reset()
        assert env.get_attr("render_mode") == [None, None, None]
        # get_attr does not call: a method comes back as its repr, not its result.
        assert "bound method" in env.get_attr("reset", indices=0)[0]
        env.set_attr("my_flag", 3, indices=[0, -1])
        assert env.get_attr("my_flag", indices=[0, 2]) == [3, 3]
        assert env.get_attr("my_flag", indices=-1) == [3]
        assert env.has_attr("my_flag") is False  # env 1 lacks it
        assert env.has_attr("gravity") is True
        with pytest.raises(AttributeError):
            env.get_attr("no_such_attribute")
        with pytest.raises(IndexError):
            env.get_attr("gravity", indices=[3])
        out = env.env_method("reset", indices=[-1], seed=5)
        assert len(out) == 1 and len(out[0]) == 2
        np.testing.assert_array_equal(out[0][0], gym.make("CartPole-v1").reset(seed=5)[0])
        assert env.env_is_wrapped(gym.wrappers.TimeLimit) == [True] * 3
        assert env.env_is_wrapped(Monitor, indices=[1]) == [False]
    finally:
        env.close()


def test_monitor_inside_and_render(no_leaks):
    def make():
        class Frames(gym.Wrapper):  # CartPole's own renderer needs pygame
            @property
            def render_mode(self):
                return "rgb_array"

            def render(self):
                return np.full((6, 8, 3), 7, dtype=np.uint8)

        return Monitor(Frames(gym.make("CartPole-v1")))

    venv = BoltzLabsVecEnv([make, make], autoreset_mode=AutoresetMode.SAME_STEP, isolation=ISOLATION)
    env = BoltzLabsSB3VecEnv(venv)
    try:
        assert env.render_mode == "rgb_array"
        assert env.env_is_wrapped(Monitor) == [True, True]
        env.reset()
        frames = env.get_images()
        assert len(frames) == 2 and frames[0].ndim == 3 and frames[0].dtype == np.uint8
        assert env.render(mode="rgb_array").ndim == 3
        episodes = []
        for _ in range(200):
            _, _, dones, infos = env.step(np.zeros(2, dtype=np.int64))
            episodes += [i["episode"] for i, d in zip(infos, dones) if d]
        assert episodes and all({"r", "l", "t"} <= e.keys() for e in episodes)
    finally:
        env.close()


def test_under_vec_wrappers(no_leaks):
    env = VecFrameStack(VecNormalize(VecMonitor(_sb3_env(4, max_steps=30))), n_stack=3)
    try:
        env.seed(0)
        obs = env.reset()
        assert obs.shape == (4, 12)
        episodes = 0
        for _ in range(100):
            obs, rew, dones, infos = env.step(np.array([env.action_space.sample() for _ in range(4)]))
            assert obs.shape == (4, 12) and rew.shape == (4,)
            for info, d in zip(infos, dones):
                if d:
                    episodes += 1
                    assert "episode" in info and info["terminal_observation"].shape == (12,)
        assert episodes >= 4
    finally:
        env.close()


# --------------------------------------------------------------------------- by the class name


class EchoEnv(gym.Env):
    """Echoes each action into its info; says which modules its process has imported."""

    def __init__(self, action_space=None):
        self.action_space = action_space or gym.spaces.Dict(
            {"move": gym.spaces.Discrete(3), "aim": gym.spaces.Box(-1, 1, (2,), np.float32)}
        )
        self.observation_space = gym.spaces.Box(-1, 1, (2,), np.float32)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(2, np.float32), {}

    def step(self, action):
        assert action in self.action_space, action
        return np.zeros(2, np.float32), 0.0, False, False, {"action": action}

    def imported(self, name):
        import sys

        return name in sys.modules

    def echo(self, *args, **kwargs):
        return {"args": list(args), "kwargs": kwargs, "types": [type(a).__name__ for a in args]}


def test_make_vec_env_builds_it_by_the_class_name(no_leaks):
    from stable_baselines3.common.env_util import make_vec_env

    env = make_vec_env(
        "CartPole-v1",
        n_envs=2,
        seed=3,
        vec_env_cls=BoltzLabsSB3VecEnv,
        vec_env_kwargs={"isolation": ISOLATION, "step_timeout": 5},
    )
    ref = make_vec_env("CartPole-v1", n_envs=2, seed=3)
    try:
        assert type(env) is BoltzLabsSB3VecEnv and env.pool.step_timeout == 5
        assert env.env_is_wrapped(Monitor) == [True, True]  # make_vec_env's Monitor, applied in the sandbox
        np.testing.assert_array_equal(env.reset(), ref.reset())
        for _ in range(30):
            actions = [env.action_space.sample() for _ in range(2)]
            for a, b in zip(env.step(actions)[:3], ref.step(actions)[:3]):
                np.testing.assert_array_equal(a, b)
    finally:
        env.close()


def test_make_vec_env_envs_never_import_sb3_or_torch(no_leaks):
    from stable_baselines3.common.env_util import make_vec_env

    inner = make_vec_env(EchoEnv, n_envs=2, vec_env_cls=BoltzLabsSB3VecEnv, vec_env_kwargs={"isolation": ISOLATION})
    with pytest.warns(UserWarning, match="already wrapped with a `Monitor`"):  # SB3's own check sees it
        monitored = VecMonitor(inner)
    env = VecFrameStack(VecNormalize(monitored), n_stack=2)
    try:
        # make_vec_env's recipe holds SB3's Monitor and _patch_env: loaded as two files, not as SB3.
        assert env.env_method("imported", "torch") == [False, False]
        assert env.env_method("imported", "stable_baselines3") == [False, False]
        assert env.env_is_wrapped(Monitor) == [True, True]
        env.reset()
        _, _, _, infos = env.step([env.action_space.sample() for _ in range(2)])
        assert set(infos[0]["action"]) == {"move", "aim"}
    finally:
        env.close()


def test_actions_one_per_env_for_any_space_and_surplus_rows_cut(no_leaks):
    box = gym.spaces.Box(-1, 1, (2,), np.float32)
    spaces = {
        "dict": None,
        "tuple": gym.spaces.Tuple((gym.spaces.Discrete(3), box)),
        "box": box,
    }
    for name, space in spaces.items():
        fns = [functools.partial(EchoEnv, space)] * 2
        ours, ref = BoltzLabsSB3VecEnv(fns, isolation=ISOLATION), DummyVecEnv(fns)
        try:
            ours.reset(), ref.reset()
            ours.action_space.seed(0)
            # SB3's form for Dict/Tuple: a list, one action per env, with a surplus row
            actions = [ours.action_space.sample() for _ in range(3)]
            got, want = ours.step(actions)[3], ref.step(actions)[3]
            for g, w in zip(got, want):  # (an echoed tuple comes back a list: the info boundary)
                np.testing.assert_equal(g["action"], w["action"], err_msg=name)
            if name == "box":  # an array with surplus rows: the first num_envs, as DummyVecEnv
                rows = np.arange(8, dtype=np.float32).reshape(4, 2) / 10
                got, want = ours.step(rows)[3], ref.step(rows)[3]
                np.testing.assert_array_equal([g["action"] for g in got], [w["action"] for w in want])
            with pytest.raises(ActionBatchError, match="one action per env"):
                ours.step(actions[:1])
        finally:
            ours.close()


def test_array_arguments_cross_as_arrays(no_leaks):
    env = BoltzLabsSB3VecEnv([EchoEnv] * 2, isolation=ISOLATION)
    try:
        goal = np.arange(6, dtype=np.float32).reshape(3, 2)
        infos = np.array([{"is_success": True}, {}], dtype=object)  # HER's infos
        (out,) = env.env_method("echo", goal, infos, indices=[1], scale=np.int16(3), mask=np.ones(2, bool))
        np.testing.assert_array_equal(out["args"][0], goal)
        assert out["args"][0].dtype == np.float32 and out["types"] == ["ndarray", "list"]
        assert out["args"][1] == [{"is_success": True}, {}]
        assert out["kwargs"]["scale"] == 3 and out["kwargs"]["mask"].dtype == np.bool_
        env.set_attr("table", np.eye(2), indices=0)
        np.testing.assert_array_equal(env.get_attr("table", indices=0)[0], np.eye(2))
    finally:
        env.close()


def test_construction_is_checked_as_subproc_vec_env_checks_it(no_leaks):
    with pytest.raises(ValueError, match="cannot find context for 'illegal_method'"):
        BoltzLabsSB3VecEnv([EchoEnv], start_method="illegal_method")
    with pytest.raises(TypeError, match="autoreset_mode"):
        BoltzLabsSB3VecEnv([EchoEnv], autoreset_mode=AutoresetMode.NEXT_STEP)
    with pytest.raises(TypeError, match="list of env factories"):
        BoltzLabsSB3VecEnv(EchoEnv)
    venv = BoltzLabsVecEnv([EchoEnv], autoreset_mode=AutoresetMode.SAME_STEP, isolation=ISOLATION)
    try:
        with pytest.raises(TypeError, match="as it was built"):
            BoltzLabsSB3VecEnv(venv, step_timeout=3)
        assert BoltzLabsSB3VecEnv(venv).venv is venv
    finally:
        venv.close()


def _hangs_once_env():
    """CartPole whose env 0 hangs in its 40th step (in each process it runs in)."""

    class Hang(gym.Wrapper):
        def __init__(self, env):
            super().__init__(env)
            self.steps = 0

        def step(self, action):
            self.steps += 1
            if os.environ.get("BOLTZLABS_ENV_INDEX") == "0" and self.steps == 40:
                time.sleep(3600)
            return self.env.step(action)

    return Hang(gym.make("CartPole-v1"))


def test_straggler_during_learning_is_reported_not_fatal(no_leaks):
    venv = BoltzLabsVecEnv(
        [_hangs_once_env for _ in range(4)],
        autoreset_mode=AutoresetMode.SAME_STEP,
        isolation=ISOLATION,
        step_timeout=0.5,
    )
    seen = []

    from stable_baselines3.common.callbacks import BaseCallback

    class Watch(BaseCallback):
        def _on_step(self):
            for i, info in enumerate(self.locals["infos"]):
                if info.get("boltzlabs_straggler"):
                    seen.append((i, bool(self.locals["dones"][i]), info["TimeLimit.truncated"]))
            return True

    env = VecMonitor(BoltzLabsSB3VecEnv(venv))
    try:
        model = PPO("MlpPolicy", env, n_steps=64, batch_size=64, n_epochs=1, seed=0, device="cpu")
        model.learn(512, callback=Watch())
        assert seen and all(i == 0 and done and trunc for i, done, trunc in seen), seen
        assert env.venv.straggler_count >= 1 and env.venv.straggler_count == len(seen)
        assert env.venv.pool.timing.total_stragglers >= 1
        # After the straggler the env was respawned and reset: training went on with it.
        obs = env.reset()
        assert np.all(np.abs(obs[0]) <= 0.05)
    finally:
        env.close()


def _ppo_cartpole(env, seed, total):
    return PPO(
        "MlpPolicy",
        env,
        n_steps=32,
        batch_size=256,
        gae_lambda=0.8,
        gamma=0.98,
        n_epochs=20,
        ent_coef=0.0,
        learning_rate=lambda f: 1e-3 * f,
        clip_range=lambda f: 0.2 * f,
        seed=seed,
        device="cpu",
        verbose=0,
    ).learn(total)


@pytest.fixture
def one_torch_thread():
    """Two cores shared with the env processes: a second torch thread only thrashes."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ppo_learns_cartpole(no_leaks, one_torch_thread):
    env = make_sb3_vec_env("CartPole-v1", n_envs=8, seed=0, isolation=ISOLATION)
    try:
        t0 = time.monotonic()
        model = _ppo_cartpole(env, seed=0, total=50_000)
        returns = [ep["r"] for ep in model.ep_info_buffer][-20:]
        print(f"mean return of last 20 episodes: {np.mean(returns):.1f} in {time.monotonic() - t0:.0f} s")
        assert len(returns) == 20 and np.mean(returns) >= 195
        assert env.straggler_count == 0 and env.error_count == 0
    finally:
        env.close()
