"""pytest programs run in a child of the warm interpreter (runner_env/_preload.py), as ``python -m
pytest`` would run them, and Python programs see nothing of that preload."""

from __future__ import annotations

import base64
import subprocess

import pytest

from boltzlabs_gym.code import CodeRunner


@pytest.fixture(scope="module")
def runner():
    with CodeRunner(envs_per_lane=1, lanes=1) as r:
        if r.languages.get("pytest") is not None:
            pytest.skip(f"pytest programs cannot run on this host: {r.languages['pytest']}")
        yield r


def _files(**named: str) -> dict[str, str]:
    return {name: base64.b64encode(text.encode()).decode() for name, text in named.items()}


def test_a_failing_test_reports_pytests_assertion_introspection(runner):
    """The test file is imported through pytest's assertion rewriting, as in a fresh pytest."""
    result = runner.run("def test_sum():\n    x = 2\n    assert x + 1 == 4\n", language="pytest")
    assert result.status == "Failed" and result.run_result.return_code == 1
    assert "assert (2 + 1) == 4" in result.stdout, result.stdout
    assert "1 failed" in result.stdout


def test_conftest_fixtures_and_modules_in_the_workspace_are_found(runner):
    files = _files(**{"conftest.py": "import pytest\n@pytest.fixture\ndef seven():\n    return 7\n", "helper.py": "X = 7\n"})
    code = "import helper\ndef test_it(seven, tmp_path, capsys):\n    print('out')\n    assert helper.X == seven\n"
    result = runner.run(code, language="pytest", files=files)
    assert result.status == "Success", result.stdout + result.stderr
    assert "1 passed" in result.stdout
    assert "PytestAssertRewriteWarning" not in result.stdout + result.stderr


def test_installed_plugins_are_loaded_as_pytest_loads_them(runner):
    """Every ``pytest11`` plugin of the programs' Python is registered in a program's session, and
    none warns that it was imported before pytest could rewrite it."""
    python = runner.python or "python"
    listing = (
        "import importlib.metadata as m\n"
        "print(sorted(e.name for e in m.entry_points(group='pytest11')))\n"
    )
    expected = subprocess.run([python, "-c", listing], capture_output=True, text=True, check=True).stdout.strip()
    code = (
        "import importlib.metadata as m\n"
        "def test_plugins(pytestconfig):\n"
        "    names = sorted(e.name for e in m.entry_points(group='pytest11'))\n"
        f"    assert names == {expected}\n"
        "    for name in names:\n"
        "        assert pytestconfig.pluginmanager.has_plugin(name), name\n"
    )
    result = runner.run(code, language="pytest")
    assert result.status == "Success", result.stdout[-3000:] + result.stderr[-3000:]
    assert "cannot be rewritten" not in result.stdout + result.stderr


def test_python_programs_do_not_see_the_preloaded_pytest(runner):
    code = (
        "import sys, atexit\n"
        "print(sorted(m for m in ('pytest', '_pytest', 'pluggy', 'iniconfig') if m in sys.modules))\n"
        "print(atexit._ncallbacks())\n"
    )
    result = runner.run(code)
    assert result.status == "Success", result.stderr
    loaded, callbacks = result.stdout.splitlines()
    assert loaded == "[]"
    fresh = subprocess.run(
        [runner.python or "python", "-c", "import logging, atexit; print(atexit._ncallbacks())"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert int(callbacks) <= int(fresh.stdout), "the preload's atexit functions run in Python programs"
    assert runner.run("import pytest\nprint(pytest.__name__)").stdout == "pytest\n"


def test_a_program_that_changes_pytest_leaves_the_next_program_a_fresh_pytest(runner):
    spoil = "import _pytest.python\n_pytest.python.Function = None\ndef test_a():\n    pass\n"
    runner.run(spoil, language="pytest")
    for _ in range(runner.capacity + 1):
        result = runner.run("def test_ok():\n    assert True\n", language="pytest")
        assert result.status == "Success" and "1 passed" in result.stdout, result.stdout + result.stderr


def test_a_pytest_program_exits_as_python_m_pytest_does(runner):
    """No tests collected is pytest's exit code 5; ``sys.exit`` in a test module is an error."""
    empty = runner.run("x = 1\n", language="pytest")
    assert empty.status == "Failed" and empty.run_result.return_code == 5
    assert "no tests ran" in empty.stdout
    argv = runner.run("import sys\ndef test_argv():\n    assert sys.argv[0].endswith('pytest/__main__.py'), sys.argv\n", language="pytest")
    assert argv.status == "Success", argv.stdout


def test_pytest_programs_run_in_a_child_of_the_warm_interpreter(runner):
    """Not a new ``python -m pytest`` process: the interpreter started once, for the template."""
    code = "import sys\ndef test_warm():\n    assert sys.orig_argv[1:3] != ['-m', 'pytest'], sys.orig_argv\n"
    result = runner.run(code, language="pytest")
    assert result.status == "Success", result.stdout
