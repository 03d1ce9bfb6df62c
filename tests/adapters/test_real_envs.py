"""Real envs (HalfCheetah-v5 on MuJoCo, preprocessed Atari Pong) step for step against SyncVectorEnv.

The envs are ``benchmarks/real_env_factories.py``'s, the configuration ``benchmarks/real_envs.py``
measures, with a ``TimeLimit`` short enough for autoresets. Every step's observations, rewards,
terminations, truncations and infos (each key, its type and dtype, its ``_key`` mask) must be
SyncVectorEnv's, in all three autoreset modes, with one env per sandbox and with two (another
path). They skip, naming the install, where ale-py, OpenCV or MuJoCo are absent.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import subprocess
import sys

import numpy as np
import pytest
from gymnasium.vector import AutoresetMode, SyncVectorEnv

from boltzlabs_gym import BoltzLabsVecEnv

from conftest import ISOLATION, ROOT

BENCHMARKS = os.path.join(ROOT, "benchmarks")
if BENCHMARKS not in sys.path:
    sys.path.insert(0, BENCHMARKS)

import real_env_factories  # noqa: E402

pytestmark = [pytest.mark.usefixtures("no_leaks"), pytest.mark.timeout(300)]

INSTALL = "pip install 'boltzlabs-gym[real-envs]'"
#: Steps per trajectory and the episode length that forces truncations within them.
CASES = {
    "halfcheetah": dict(
        factory=functools.partial(real_env_factories.make_half_cheetah, max_episode_steps=50), steps=300
    ),
    "pong": dict(factory=functools.partial(real_env_factories.make_pong, max_episode_steps=40), steps=200),
}


def need(env_name: str) -> None:
    modules, _ = real_env_factories.REQUIREMENTS[env_name]
    for module in modules:
        pytest.importorskip(module, reason=f"{env_name} needs {module}: {INSTALL}")


def assert_identical(ours, ref, where: str) -> None:
    """Equal values of the same types: containers, numpy scalars and array dtypes included."""
    assert type(ours) is type(ref), f"{where}: {type(ours).__name__} != SyncVectorEnv's {type(ref).__name__}"
    if isinstance(ref, dict):
        assert ours.keys() == ref.keys(), f"{where}: keys {sorted(ours)} != {sorted(ref)}"
        for k in ref:
            assert_identical(ours[k], ref[k], f"{where}[{k!r}]")
    elif isinstance(ref, (tuple, list)):
        assert len(ours) == len(ref), f"{where}: length {len(ours)} != {len(ref)}"
        for i, (x, y) in enumerate(zip(ours, ref)):
            assert_identical(x, y, f"{where}[{i}]")
    elif isinstance(ref, np.ndarray):
        assert ours.dtype == ref.dtype and ours.shape == ref.shape, (
            f"{where}: {ours.dtype}{ours.shape} != {ref.dtype}{ref.shape}"
        )
        if ref.dtype == object:
            for i, (x, y) in enumerate(zip(ours.ravel(), ref.ravel())):
                assert_identical(x, y, f"{where}[{i}]")
        else:
            np.testing.assert_array_equal(ours, ref, err_msg=where)
    else:
        assert ours == ref or (ours != ours and ref != ref), f"{where}: {ours!r} != {ref!r}"


@pytest.mark.parametrize(
    "k, mode, pool_mode",
    [(k, mode, "default") for k in (1, 2) for mode in AutoresetMode]
    # boltz mode: envs forked from a template that built one already (envside/prebuilt.py)
    + [(k, AutoresetMode.NEXT_STEP, "boltz") for k in (1, 2)],
    ids=lambda v: f"K{v}" if isinstance(v, int) else getattr(v, "value", v),
)
@pytest.mark.parametrize("env_name", list(CASES))
def test_trajectories_match_sync_vector_env(env_name, mode, k, pool_mode):
    need(env_name)
    case = CASES[env_name]
    fns = [case["factory"]] * 4
    ref = SyncVectorEnv(fns, autoreset_mode=mode)
    ours = BoltzLabsVecEnv(fns, autoreset_mode=mode, isolation=ISOLATION, envs_per_sandbox=k, mode=pool_mode)
    try:
        assert ours.single_observation_space == ref.single_observation_space
        assert ours.single_action_space == ref.single_action_space
        assert_identical(ours.reset(seed=11), ref.reset(seed=11), "reset")
        ref.action_space.seed(5)
        ends = 0
        for t in range(case["steps"]):
            actions = ref.action_space.sample()
            got, want = ours.step(actions), ref.step(actions)
            for name, x, y in zip(("obs", "rewards", "terminations", "truncations", "infos"), got, want):
                assert_identical(x, y, f"step {t} {name}")
            done = want[2] | want[3]
            ends += int(done.sum())
            if mode == AutoresetMode.DISABLED and done.any():
                assert_identical(
                    ours.reset(options={"reset_mask": done.copy()}),
                    ref.reset(options={"reset_mask": done.copy()}),
                    f"partial reset after step {t}",
                )
        assert ends >= 4, f"only {ends} episode ends in {case['steps']} steps: no autoreset tested"
    finally:
        ours.close()
        ref.close()


@pytest.mark.timeout(400)
def test_benchmark_smoke_runs_every_implementation(tmp_path):
    """``benchmarks/real_envs.py --smoke``: every implementation on both envs, tiny, none failing."""
    missing = [m for m in ("ale_py", "cv2", "mujoco") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"real_envs.py needs {', '.join(missing)}: {INSTALL}")
    proc = subprocess.run(
        [sys.executable, os.path.join(BENCHMARKS, "real_envs.py"), "--smoke", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=360,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout
    assert "ALE/Pong-v5" in out and "HalfCheetah-v5" in out  # the pinned configuration comes first
    for impl in ("SyncVectorEnv", "AsyncVectorEnv", "SubprocVecEnv", "default", "boltz", "default-k2", "boltz-k2"):
        assert f"| {impl} |" in out, impl
    assert "failed" not in out, out
    assert (tmp_path / "real_envs.json").exists() and (tmp_path / "real_envs.md").exists()
