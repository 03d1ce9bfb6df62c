"""A code task built over several steps, then graded: the env that ``examples/grpo_fork.py`` forks.

An episode has two phases. First the task is *built*, one action per step:

* ``{"spec": text}`` appends a paragraph to the task statement (kept in memory and written
  to ``WORKSPACE/SPEC.md``);
* ``{"add_test": body}`` adds one unit test, ``WORKSPACE/tests/test_NN.py``, whose test
  method's body is ``body`` (Python statements that may use ``self`` and the module
  ``solution``), e.g. ``self.assertEqual(solution.fizzbuzz(3), "Fizz")``.

Then ``{"program": source}`` *grades* a program: it is written to ``WORKSPACE/solution.py``
and the accumulated tests run against it in a subprocess (``python -m unittest``,
``cwd=WORKSPACE``, a scrubbed environment, its own session, killed as a group after
``CODE_TASK_TIME_LIMIT_S`` seconds, 10 by default). The reward is the fraction of the tests
that passed, the episode terminates, and the info carries ``passed``/``failed``/``total``,
``timed_out``, the output's tail and the workspace's files after the run.

``{"ls": true}`` looks at the workspace (its files, in ``info["files"]``) and changes
nothing: not the state, not the step counter; it may be sent at any time, after grading too.

The observation is ``{"spec": str, "tests": int, "step": int, "graded": bool}``.

Snapshots: the env object holds plain attributes only (the spec, the test count, the step
counter), so it pickles as it is and needs no ``get_state``/``set_state`` hooks; the test
files live in the workspace, which every snapshot carries. A fork of a built task therefore
gives each copy the spec, the tests and a workspace of its own. The object keeps no paths
(``WORKSPACE`` is read at each call), so a copy never writes into its source's directory.

The grade is only as trustworthy as ``unittest``'s summary: a program runs in the same
process as the tests and could patch the runner. Containing what such a program *does*
(to the host, to other envs) is the sandbox's job, which is what the example shows.
"""

import os
import re
import shutil
import signal
import subprocess
import sys

from boltzlabs_gym.env import WORKSPACE, serve

TIME_LIMIT_S = float(os.environ.get("CODE_TASK_TIME_LIMIT_S", "10"))
#: The most characters of the test run's output an info carries.
OUTPUT_TAIL = 1500

TEST_TEMPLATE = """import unittest

import solution


class Test{k:02d}(unittest.TestCase):
    def test_{k:02d}(self):
{body}
"""


def _clear_workspace():
    """Empty the workspace: a reset starts from no files (a previous episode's tests included)."""
    for name in os.listdir(WORKSPACE):
        path = os.path.join(WORKSPACE, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            try:
                os.unlink(path)
            except OSError:
                pass


def _workspace_files():
    """The workspace's files, as sorted paths relative to it (what a copy can see of its own state)."""
    found = []
    for root, dirs, files in os.walk(WORKSPACE):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        found += [os.path.relpath(os.path.join(root, f), WORKSPACE) for f in files]
    return sorted(found)


def _summary_count(pattern, text):
    """The last number ``pattern`` matches in ``text`` (the summary is unittest's last word), else 0."""
    found = re.findall(pattern, text)
    return int(found[-1]) if found else 0


def _run_tests():
    """Run ``tests/`` against ``solution.py``: (tests run, tests not passed, timed out, output)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "unittest", "discover", "-s", "tests"],
        cwd=WORKSPACE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        # The program under test gets nothing of ours: no PYTHONPATH to the library, no secrets.
        env={
            "PATH": os.environ.get("PATH", ""),
            "PYTHONPATH": WORKSPACE,
            "HOME": WORKSPACE,
            "PYTHONDONTWRITEBYTECODE": "1",
        },
        start_new_session=True,  # so a timeout kills whatever the program started, too
    )
    try:
        output, _ = proc.communicate(timeout=TIME_LIMIT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        return 0, 0, True, f"timed out after {TIME_LIMIT_S:g} s\n{output or ''}"
    ran = _summary_count(r"Ran (\d+) tests?", output)
    not_passed = sum(_summary_count(rf"{kind}=(\d+)", output) for kind in ("failures", "errors", "skipped"))
    return ran, not_passed, False, output


class CodeTask:
    """One episode's task: the spec so far, how many tests, how many steps; see the module docstring."""

    def __init__(self):
        self.spec = []
        self.tests = 0
        self.t = 0
        self.graded = False

    def _obs(self):
        return {"spec": "\n\n".join(self.spec), "tests": self.tests, "step": self.t, "graded": self.graded}

    def reset(self, seed, options=None):
        _clear_workspace()
        os.makedirs(os.path.join(WORKSPACE, "tests"))
        self.spec, self.tests, self.t, self.graded = [], 0, 0, False
        return self._obs()

    def step(self, action):
        if not isinstance(action, dict) or len(action) != 1:
            raise ValueError(f"an action is a one-key object, one of {sorted(ACTIONS)}; got {action!r}")
        [(kind, value)] = action.items()
        handler = ACTIONS.get(kind)
        if handler is None:
            raise ValueError(f"unknown action {kind!r}; expected one of {sorted(ACTIONS)}")
        return handler(self, value)

    def _add_spec(self, text):
        self.spec.append(str(text))
        with open(os.path.join(WORKSPACE, "SPEC.md"), "w") as f:
            f.write(self._obs()["spec"] + "\n")
        self.t += 1
        return self._obs(), 0.0, False, {}

    def _add_test(self, body):
        self.tests += 1
        lines = str(body).splitlines() or ["pass"]
        source = TEST_TEMPLATE.format(k=self.tests, body="\n".join("        " + line for line in lines))
        with open(os.path.join(WORKSPACE, "tests", f"test_{self.tests:02d}.py"), "w") as f:
            f.write(source)
        self.t += 1
        return self._obs(), 0.0, False, {}

    def _grade(self, program):
        with open(os.path.join(WORKSPACE, "solution.py"), "w") as f:
            f.write(str(program))
        ran, not_passed, timed_out, output = _run_tests()
        # Count against the tests this env wrote, not what the run claims: a program that deletes
        # test files, or prints a summary of its own, cannot raise its score past what ran and passed.
        passed = max(0, min(ran - not_passed, self.tests))
        self.t += 1
        self.graded = True
        info = {
            "passed": passed,
            "failed": self.tests - passed,
            "total": self.tests,
            "timed_out": timed_out,
            "output": output[-OUTPUT_TAIL:],
            "files": _workspace_files(),
        }
        return self._obs(), passed / self.tests if self.tests else 0.0, True, info

    def _ls(self, _value):
        return self._obs(), 0.0, self.graded, {"files": _workspace_files()}


ACTIONS = {"spec": CodeTask._add_spec, "add_test": CodeTask._add_test, "program": CodeTask._grade, "ls": CodeTask._ls}


serve(factory=CodeTask)
