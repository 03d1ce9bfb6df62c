"""A code-grading env: the action is a program, the reward is whether the tests pass.

Each step writes the action's code to ``WORKSPACE/solution.py`` and runs
``python3 -m unittest discover -s <env dir>/tests`` on it, with a time limit.
Reward 1.0 when every test passes, else 0.0; one step per episode.
"""

import os
import shutil
import subprocess
import sys

from boltzlabs_gym.env import ENV_DIR, WORKSPACE, serve

TIME_LIMIT_S = float(os.environ.get("CODE_ENV_TIME_LIMIT_S", "10"))


def _task():
    with open(os.path.join(ENV_DIR, "TASK.md")) as f:
        return f.read()


def reset(seed):
    return {"task": _task()}


def _clear_workspace():
    for name in os.listdir(WORKSPACE):
        path = os.path.join(WORKSPACE, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            try:
                os.unlink(path)
            except OSError:
                pass


def step(action):
    _clear_workspace()
    with open(os.path.join(WORKSPACE, "solution.py"), "w") as f:
        f.write(str(action))
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "unittest", "discover", "-s", os.path.join(ENV_DIR, "tests")],
            cwd=WORKSPACE,
            capture_output=True,
            text=True,
            timeout=TIME_LIMIT_S,
            env={"PATH": os.environ.get("PATH", ""), "PYTHONPATH": WORKSPACE, "HOME": WORKSPACE, "PYTHONDONTWRITEBYTECODE": "1"},
            start_new_session=True,
        )
        passed = proc.returncode == 0
        output = (proc.stdout + proc.stderr)[-2000:]
    except subprocess.TimeoutExpired as exc:
        passed = False
        output = f"timed out after {TIME_LIMIT_S:g} s: {str(exc.stderr or '')[-500:]}"
    return {"task": None}, 1.0 if passed else 0.0, True, {"passed": passed, "output": output}


serve(reset=reset, step=step)
