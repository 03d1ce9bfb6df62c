"""The boltzlabs-gym command: check, isolation, status, worker refusals."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import COUNTER, ISOLATION, ROOT

pytestmark = pytest.mark.usefixtures("no_leaks")


def run_cli(*args, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "boltzlabs_gym.cli", *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


def test_check_good_env_finds_no_problem():
    out = run_cli("check", COUNTER, "--isolation", ISOLATION)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "no problems found" in out.stdout


def test_check_explains_exception_in_step(tmp_path):
    (tmp_path / "env.py").write_text(
        "from boltzlabs_gym.env import serve\n"
        "def step(a):\n    raise KeyError('missing piece')\n"
        "serve(reset=lambda seed: 0, step=step)\n"
    )
    out = run_cli("check", str(tmp_path), "--isolation", ISOLATION)
    assert out.returncode == 1
    assert "step() raised" in out.stdout and "missing piece" in out.stdout


def test_check_explains_bad_reward(tmp_path):
    (tmp_path / "env.py").write_text(
        "from boltzlabs_gym.env import serve\n"
        "import sys, os, json\n"
        "serve(reset=lambda seed: 0, step=lambda a: (0, 'lots', False, {}))\n"
    )
    out = run_cli("check", str(tmp_path), "--isolation", ISOLATION)
    assert out.returncode == 1 and "step() raised" in out.stdout and "could not convert string to float" in out.stdout


def test_check_without_env_py(tmp_path):
    out = run_cli("check", str(tmp_path))
    assert out.returncode == 1 and "has no env.py" in out.stdout


def test_check_env_that_dies_at_start(tmp_path):
    (tmp_path / "env.py").write_text("import sys\nsys.stderr.write('no simulator here\\n')\nsys.exit(4)\n")
    out = run_cli("check", str(tmp_path), "--isolation", ISOLATION)
    assert out.returncode == 1 and "did not start" in out.stdout and "no simulator here" in out.stdout


def test_isolation_lists_backends():
    out = run_cli("isolation")
    assert out.returncode == 0 and "process" in out.stdout and "namespaces" in out.stdout


def test_isolation_says_what_the_kernel_does_to_the_sandboxes_filters():
    from boltzlabs_gym.worker.sandbox.namespaces import NamespaceBackend

    if not NamespaceBackend().available()[0]:
        pytest.skip(f"no namespaces sandbox here: {NamespaceBackend().available()[1]}")
    out = run_cli("isolation")
    expected = NamespaceBackend().report().properties["speculation"]
    assert f"speculation mitigations: {expected}" in out.stdout, out.stdout


def test_worker_refuses_public_bind_without_auth():
    out = run_cli("worker", "--bind", "tcp://0.0.0.0:5599", timeout=30)
    assert out.returncode == 2 and "CURVE" in out.stderr


@pytest.mark.parametrize("bad", ["inf", "-1", "nan", "2e6", "soon"])
def test_worker_refuses_a_busy_poll_window_it_could_spin_forever_in(tmp_path, bad):
    option = "--busy-poll-us"
    out = subprocess.run([sys.executable, "-m", "boltzlabs_gym.worker", "--bind", f"ipc://{tmp_path}/w.sock",
                          option, bad], capture_output=True, text=True, timeout=30, cwd=ROOT)
    assert out.returncode == 2 and option in out.stderr and "microseconds" in out.stderr, out.stderr


def test_worker_help_names_the_busy_poll_knob_once():
    out = subprocess.run([sys.executable, "-m", "boltzlabs_gym.worker", "--help"], capture_output=True, text=True,
                         timeout=30, cwd=ROOT)
    assert out.returncode == 0 and "--busy-poll-us" in out.stdout and "spin" not in out.stdout
