"""The examples run as scripts, the way a user runs them."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from conftest import ISOLATION, ROOT

EXAMPLES = os.path.join(ROOT, "examples")


def _run(script, *args, timeout):
    proc = subprocess.run(
        [sys.executable, os.path.join(EXAMPLES, script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        # Two cores shared with the env processes: a second torch thread only thrashes.
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    print(proc.stdout[-3000:])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def _mean_return(out: str) -> float:
    m = re.findall(r"^mean_return_last20=([0-9.]+|nan)$", out, re.M)
    assert m, out
    return float(m[-1])


def test_code_rl_contains_hostile_programs(no_leaks):
    out = _run("code_rl.py", "--rounds", "2", "--isolation", ISOLATION, timeout=120)
    assert "CONTAINED=True" in out
    assert "host sentinel intact: True" in out and "env dir intact: True" in out
    assert re.search(r"bytes received on 127\.0\.0\.1:\d+: 0$", out, re.M)
    assert re.search(r"right/plain\s+1\.00", out)
    assert re.search(r"wrong/order\s+0\.00", out)
    assert "envs/GiB:" in out and "isolation=" in out and "Timing(" in out
    if "NOT running the hostile candidates" not in out:  # isolation none refuses to run them
        for name in ("hostile/rmtree", "hostile/forever", "hostile/socket"):
            assert re.search(rf"{name}\s+0\.00", out), name
        assert "timed out" in out
        assert "HOSTILE deleted" not in out and "HOSTILE wrote" not in out and "HOSTILE connected" not in out


@pytest.mark.parametrize("mode", ["default", "boltz"])
def test_grpo_fork_grades_isolated_copies(no_leaks, mode):
    out = _run("grpo_fork.py", "--mode", mode, "--isolation", ISOLATION, timeout=120)
    assert re.search(r"^fork env 0 -> 8 copies: [0-9.]+ ms \(every copy's obs is env 0's: True\)$", out, re.M)
    assert re.search(r"^FORK_MS=[0-9.]+$", out, re.M)
    expected = {
        "right/plain": "1.00",
        "right/concat": "1.00",
        "right/table": "1.00",
        "wrong/order": "0.67",
        "wrong/only-fizz": "0.33",
        "wrong/syntax": "0.00",
        "hostile/forever": "0.00",
        "hostile/marker": "0.00",
    }
    for name, reward in expected.items():
        assert re.search(rf"^\s+\d+\s+{re.escape(name)}\s+{reward}\s", out, re.M), name
    assert re.search(r"hostile/forever .*timed out \(env's time limit\)", out)
    assert "group: mean=0.500 std=0.441" in out
    # The hostile copy's marker and deleted tests are its own; the source is as it was before the fork.
    assert re.search(r"\(hostile/marker\): marker=True tests=False$", out, re.M)
    assert len(re.findall(r"\): marker=False tests=True$", out, re.M)) == 7
    assert "env 0 (source): obs unchanged=True files unchanged=True" in out
    assert "SOURCE_UNCHANGED=True" in out
    if "does not hide other envs' files" not in out:  # the process backend lets a copy read the others
        assert "HOSTILE saw other copies' workspaces: 0 []" in out
        assert "ISOLATED=True" in out


def test_async_ppo_runs_on_recv_batches(no_leaks):
    """EnvPool-style async PPO at tiny size: every env is handed back by recv() and trained on."""
    out = _run(
        "async_ppo.py",
        *("--num-envs", "4", "--batch-size", "2", "--num-steps", "8", "--total-timesteps", "64"),
        *("--update-epochs", "1", "--isolation", ISOLATION),
        timeout=120,
    )
    assert re.search(r"^global_step=64 mean_return_last20=\S+ SPS=\d+$", out, re.M), out
    assert "envs_seen=4/4" in out
    _mean_return(out)


def test_async_ppo_runs_unchanged_on_envpool():
    """The same script on EnvPool itself: only the construction line differs."""
    pytest.importorskip("envpool")
    out = _run(
        "async_ppo.py",
        *("--vectorizer", "envpool", "--num-envs", "4", "--batch-size", "2", "--num-steps", "8"),
        *("--total-timesteps", "64", "--update-epochs", "1"),
        timeout=120,
    )
    assert "envs_seen=4/4" in out

@pytest.mark.slow
@pytest.mark.timeout(600)
def test_cleanrl_ppo_learns_cartpole(no_leaks):
    out = _run(
        "cleanrl_ppo.py", "--total-timesteps", "60000", "--seed", "1", "--isolation", ISOLATION, timeout=580
    )
    assert _mean_return(out) >= 195


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sb3_example_learns_cartpole(no_leaks):
    out = _run("sb3_ppo_cartpole.py", "--timesteps", "50000", "--seed", "0", "--isolation", ISOLATION, timeout=580)
    assert _mean_return(out) >= 195
    assert "stragglers=0 errors=0" in out


def _needs(module: str, extra: str) -> None:
    import importlib.util

    if importlib.util.find_spec(module) is None:
        pytest.skip(f"pip install 'boltzlabs-gym[{extra}]'")


def test_trl_grpo_rewards_example_trains(no_leaks):
    _needs("trl", "trl")
    out = _run("trl_grpo_rewards.py", "--steps", "2", timeout=300)
    assert re.search(r"^\s+right\s+reward=1\.0\s+\(3/3 cases, graded\)$", out, re.M)
    assert re.search(r"^\s+wrong\s+reward=0\.0", out, re.M) and re.search(r"^\s+loops\s+reward=0\.0", out, re.M)
    assert "STEPS=2" in out


def test_verl_compute_score_example_grades_both_styles(no_leaks):
    out = _run("verl_compute_score.py", timeout=120)
    assert "SCORES=[1.0, 1.0, 0.0, 0.0, 1.0]" in out


def test_skyrl_env_example_keeps_files_per_trajectory(no_leaks):
    _needs("skyrl_gym", "skyrl")
    out = _run("skyrl_env.py", timeout=120)
    assert "trajectory 'writes a file': turns printed ['ok', 'True'], reward 1.0" in out
    assert "trajectory 'next': turns printed ['False', 'False'], reward 0.5" in out
    assert "envs leased after close: 0" in out and "REWARDS=[1.0, 0.5]" in out
