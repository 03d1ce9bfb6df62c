"""The code runtime's Python (``boltzlabs-gym code-runtime install``): a ``pytest`` program run by a
real code runner imports numpy and pandas from it. Skips, naming the cause, where the runtime,
numpy or pandas is not installed."""

from __future__ import annotations

import os
import subprocess

import pytest

from boltzlabs_gym.code import CodeRunner
from boltzlabs_gym.code.code_runtime import RuntimeInstallError
from boltzlabs_gym.code.languages import availability, runtime_dir
from boltzlabs_gym.code.python_runtime import CORE_PACKAGES, PACKAGE_SETS, PACKAGES, install_python
from conftest import ISOLATION

RUNTIME_PYTHON = os.path.join(runtime_dir(), "python")

PROGRAM = f"""
import numpy as np
import pandas as pd


def test_numpy_and_pandas_from_the_runtime():
    frame = pd.DataFrame({{"x": np.arange(4)}})
    assert frame["x"].sum() == 6
    assert np.__file__.startswith({RUNTIME_PYTHON!r} + "/"), np.__file__
    assert pd.__file__.startswith({RUNTIME_PYTHON!r} + "/"), pd.__file__
"""


def _runtime_missing() -> str | None:
    why = availability().get("pytest")
    if why is not None:
        return f"the pytest language cannot run here: {why}"
    python = os.path.join(RUNTIME_PYTHON, "bin", "python")
    tried = subprocess.run([python, "-c", "import numpy, pandas"], capture_output=True, text=True)
    if tried.returncode != 0:
        last = (tried.stderr.strip().splitlines() or ["no output"])[-1]
        return f"numpy or pandas is not in the code runtime's Python ({python}): {last}"
    return None


def test_package_sets_are_sandboxfusions_list():
    assert PACKAGE_SETS == {"core": CORE_PACKAGES, "full": PACKAGES}
    assert len(PACKAGES) == len(set(PACKAGES)) == 103  # SandboxFusion's 102, and setuptools<81
    assert set(CORE_PACKAGES) <= set(PACKAGES)


@pytest.mark.skipif(not os.path.exists("/usr/bin/python3"), reason="no /usr/bin/python3 to make the venv from")
def test_a_package_that_fails_is_logged_by_name_and_pytest_failing_raises(tmp_path, caplog):
    # local files that are not there: pip fails on them without asking a registry
    caplog.set_level("WARNING")
    where = install_python(str(tmp_path), ("/nonexistent/broken-1.0-py3-none-any.whl",))
    assert os.path.exists(os.path.join(where, "bin", "python"))
    assert "python package /nonexistent/broken-1.0-py3-none-any.whl not installed" in caplog.text
    with pytest.raises(RuntimeInstallError, match="pip install pytest"):
        install_python(str(tmp_path), ("pytest @ file:///nonexistent/pytest-7.4.4-py3-none-any.whl",))


def test_pytest_program_imports_numpy_and_pandas_from_the_runtime():
    why = _runtime_missing()
    if why is not None:
        pytest.skip(why)
    with CodeRunner(envs_per_lane=1, lanes=1, isolation=ISOLATION, max_run_timeout=60) as runner:
        result = runner.run(PROGRAM, language="pytest", run_timeout=60)
    assert result.status == "Success", (result.stdout, result.stderr)
    assert "1 passed" in result.stdout
