"""The factories the adapters pickle into sandboxes import nothing of the trainer side."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import psutil
import pytest

import boltzlabs_gym
from boltzlabs_gym.envside.factories import sb3_monitor_class

from conftest import ISOLATION

#: What an env process must never load: the trainer side's native code.
TRAINER_ONLY = ("libzmq", "_zmq.", "libtorch", "torch/lib")


def _env_process_maps(pool) -> list[str]:
    """The memory maps of every process under the pool's local worker (its envs)."""
    maps = []
    for proc in psutil.Process(pool._links[0].process.pid).children(recursive=True):
        try:
            with open(f"/proc/{proc.pid}/maps") as f:
                maps.append(f.read())
        except OSError:
            pass
    return maps


def test_make_vec_envs_do_not_load_zeromq():
    envs = boltzlabs_gym.make_vec("CartPole-v1", num_envs=2, isolation=ISOLATION)
    try:
        envs.reset(seed=0)
        maps = _env_process_maps(envs.pool)
        assert len(maps) >= 2
        for m in maps:
            assert not [lib for lib in TRAINER_ONLY if lib in m]
    finally:
        envs.close()


def test_sb3_envs_do_not_load_torch_or_zeromq_and_keep_sb3s_monitor():
    pytest.importorskip("stable_baselines3")
    from stable_baselines3.common.monitor import Monitor

    from boltzlabs_gym.sb3 import make_sb3_vec_env

    env = make_sb3_vec_env("CartPole-v1", n_envs=2, seed=0, isolation=ISOLATION)
    try:
        env.reset()
        maps = _env_process_maps(env.venv.pool)
        assert len(maps) >= 2
        for m in maps:
            assert not [lib for lib in TRAINER_ONLY if lib in m]
        assert env.env_is_wrapped(Monitor) == [True, True]
        for _ in range(500):
            _, _, dones, infos = env.step([0, 0])  # always left: CartPole falls within ~10 steps
            if dones.any():
                episode = infos[int(dones.argmax())]["episode"]
                assert set(episode) == {"r", "l", "t"} and episode["l"] >= 1 and episode["r"] == episode["l"]
                break
        else:
            raise AssertionError("no episode ended")
    finally:
        env.close()


def test_sb3_monitor_is_loaded_without_torch_in_a_fresh_interpreter():
    pytest.importorskip("stable_baselines3")
    code = textwrap.dedent("""
        import sys
        from boltzlabs_gym.envside.factories import SB3EnvFactory
        env = SB3EnvFactory("CartPole-v1", {}, None, True)()
        assert type(env).__name__ == "Monitor", type(env)
        env.reset(seed=0)
        done, info = False, {}
        while not done:
            _, _, term, trunc, info = env.step(0)
            done = term or trunc
        assert set(info["episode"]) == {"r", "l", "t"}, info
        assert env.get_episode_lengths() == [info["episode"]["l"]]
        leaked = [m for m in ("torch", "stable_baselines3", "zmq", "boltzlabs_gym.client.pool") if m in sys.modules]
        assert not leaked, leaked
    """)
    # As in an env process: BOLTZLABS_ENV_INDEX set, so importing the package registers nothing.
    env = dict(os.environ, BOLTZLABS_ENV_INDEX="0")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_sb3_monitor_is_sb3s_own_class_once_sb3_is_imported():
    monitor = pytest.importorskip("stable_baselines3.common.monitor")
    assert sb3_monitor_class() is monitor.Monitor
