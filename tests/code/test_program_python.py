"""Python programs run under the code runtime's interpreter (its own venv and packages, a warm
template of its own), not the project's; and a pool's ``env_python`` is held to interpreters a
sandbox shows."""

from __future__ import annotations

import os
import sys

import pytest

from boltzlabs_gym import RLPool
from boltzlabs_gym.code import CodeRunner
from boltzlabs_gym.code.languages import program_python, runtime_dir
from boltzlabs_gym.worker.session import check_env_python


def test_programs_run_under_the_runtime_interpreter_with_a_wipe_in_force():
    python = program_python()
    if python is None:
        pytest.skip(f"no code runtime at {runtime_dir()} (boltzlabs-gym code-runtime install)")
    with CodeRunner(envs_per_lane=1, lanes=1) as runner:
        assert runner.python == python and runner.pool_options.env_python == python
        prefix = os.path.dirname(os.path.dirname(python))
        for _ in range(2):  # the second program comes from the same warm template, after a wipe
            result = runner.run("import sys; print(sys.prefix); print(sys.executable)")
            assert result.ok and result.stdout.split() == [prefix, python], result.stderr
        assert runner.wipe_in_force == (runner.wipe_unavailable is None)
        assert runner.run("def test_one():\n    assert 1 + 1 == 2\n", language="pytest").ok


def test_the_workers_own_interpreter_when_asked():
    with CodeRunner(envs_per_lane=1, lanes=1, python=None) as runner:
        assert runner.python is None
        result = runner.run("import sys; print(sys.version_info[:2])")
        assert result.ok and result.stdout.strip() == str(tuple(sys.version_info[:2]))


def test_env_python_must_be_an_interpreter_a_sandbox_shows(tmp_path):
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    with pytest.raises(ValueError, match="outside /usr and this worker's Python"):
        check_env_python(str(fake))
    with pytest.raises(ValueError, match="not an executable file"):
        check_env_python(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="absolute path"):
        check_env_python("python3")
    assert check_env_python(sys.executable) == sys.executable


def test_a_pool_refuses_an_env_python_outside_what_sandboxes_show(tmp_path):
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    env_dir = os.path.join(os.path.dirname(__file__), os.pardir, "envs", "hello")
    if not os.path.isdir(env_dir):
        pytest.skip(f"no test env at {env_dir}")
    with pytest.raises(Exception, match="outside /usr"):
        with RLPool(env_dir, 1, env_python=str(fake)) as pool:
            pool.reset()
