"""pytest programs run in a child of a warm zygote (runner_env/_warm.py, _zygote.py), as ``python -m
pytest`` would run them; Python programs see nothing of it; the wipe keeps and checks it. Each with
the wipe and without it (``wipe=False``: the warm zygote clones each program's namespaces)."""

from __future__ import annotations

import base64
import contextlib
import subprocess

import pytest

from boltzlabs_gym.code import CodeRunner


@pytest.fixture(scope="module", params=[True, False], ids=["wipe", "fresh"])
def runner(request):
    with _runner(request.param) as r:
        yield r
        if not request.param:  # every pytest program in namespaces made for it: none hard-reset
            assert r.stats().hard_resets == 0, r.stats()


@contextlib.contextmanager
def _runner(wipe: bool):
    with CodeRunner(envs_per_lane=1, lanes=1, wipe=wipe) as r:
        if r.languages.get("pytest") is not None:
            pytest.skip(f"pytest programs cannot run on this host: {r.languages['pytest']}")
        if not wipe and r.fresh_unavailable is not None:
            pytest.skip(f"no fresh namespaces per program under {r.isolation.backend}: {r.fresh_unavailable}")
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
    conftest = "import pytest\n@pytest.fixture\ndef seven():\n    return 7\n"
    files = _files(**{"conftest.py": conftest, "helper.py": "X = 7\n"})
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


def test_python_programs_do_not_see_the_warm_pytest(runner):
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
    assert int(callbacks) <= int(fresh.stdout), "pytest's plugins' atexit functions run in Python programs"
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
    code = "import sys\ndef test_argv():\n    assert sys.argv[0].endswith('pytest/__main__.py'), sys.argv\n"
    argv = runner.run(code, language="pytest")
    assert argv.status == "Success", argv.stdout


def test_pytest_programs_run_in_a_child_of_the_warm_interpreter(runner):
    """Not a new ``python -m pytest`` process: the interpreter started once, for the template."""
    runner.run("def test_first():\n    pass\n", language="pytest")  # (the env's first makes the warm zygote)
    code = "import sys\ndef test_warm():\n    assert sys.orig_argv[1:3] != ['-m', 'pytest'], sys.orig_argv\n"
    result = runner.run(code, language="pytest")
    assert result.status == "Success", result.stdout


@pytest.mark.parametrize("wipe", [True, False], ids=["wipe", "fresh"])
def test_a_requests_files_never_reach_the_warm_zygote(wipe):
    """The warm zygote is made at an env's first pytest program, whose files are in the workspace
    by then: a module there named like one pytest imports is not what the warm zygote imports, so
    the next program (its own workspace, the same warm zygote) finds pytest's own."""
    with _runner(wipe) as r:
        poison = _files(**{"iniconfig.py": "raise SystemExit('poisoned iniconfig')\n"})
        first = r.run("def test_a():\n    pass\n", language="pytest", files=poison)
        check = "import iniconfig\ndef test_b():\n    assert 'poison' not in open(iniconfig.__file__).read()\n"
        second = r.run(check, language="pytest")
        stats = r.stats()
    assert "poisoned" not in first.stdout + first.stderr
    assert second.status == "Success", second.stdout + second.stderr
    assert stats.hard_resets == 0 and (stats.wipes if wipe else stats.fresh) >= 2


#: A program that kills its parent: with the wipe, its warm zygote; without it, its namespaces' PID 1
#: (which drops signals it has no handler for), and everything else it can see
KILLERS = {
    True: "import os, signal\ndef test_kill():\n    os.kill(os.getppid(), signal.SIGKILL)\n",
    False: (
        "import os, signal\ndef test_kill():\n    assert os.getppid() == 1\n"
        "    for pid in (os.getppid(), -1):\n        os.kill(pid, signal.SIGKILL)\n"
    ),
}


@pytest.mark.parametrize("wipe", [True, False], ids=["wipe", "fresh"])
def test_a_program_that_kills_its_parent_leaves_the_next_ones_a_working_pytest(wipe):
    """With the wipe, it kills its warm zygote, and its env is hard-reset. Without it, the warm
    zygote is in no namespace the program sees, and nothing is reset. The next programs run on."""
    with _runner(wipe) as r:
        r.run(KILLERS[wipe], language="pytest")
        after = r.run("def test_ok():\n    assert True\n", language="pytest")
        python = r.run("print(7)")
        stats = r.stats()
    assert after.status == "Success" and "1 passed" in after.stdout, after.stdout + after.stderr
    assert python.stdout == "7\n"
    if wipe:
        assert stats.hard_resets >= 1
    else:
        assert stats.hard_resets == 0 and stats.fresh == 3, stats
