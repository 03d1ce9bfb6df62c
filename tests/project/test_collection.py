"""The collection rules of the repository's root conftest.py, run on small packages of their own.

A module that needs an absent extra's package skips and names the extra; any other import error
still fails collection; ``--sample-each-module`` runs one test of every module.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT


def _root_conftest():
    spec = importlib.util.spec_from_file_location("boltzlabs_root_conftest", os.path.join(ROOT, "conftest.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run_pytest(where, *args):
    """pytest on ``where`` with the root conftest and no other configuration."""
    shutil.copy(os.path.join(ROOT, "conftest.py"), where / "conftest.py")
    (where / "pytest.ini").write_text("[pytest]\n")
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-c", str(where / "pytest.ini"), *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=where,
    )


def _installed(module: str) -> bool:
    """Whether ``module`` imports in a fresh interpreter (this one's ``sys.modules`` may hold stand-ins
    that other tests made, such as a ``verl`` package for verl's client module alone)."""
    check = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
    return subprocess.run([sys.executable, "-c", check], capture_output=True, timeout=60).returncode == 0


def _missing_extra_package() -> tuple[str, str]:
    for module, extra in sorted(_root_conftest().extra_of_module().items()):
        if not _installed(module):
            return module, extra
    pytest.skip("every package the pyproject extras declare is installed here: no absent extra to import")


def test_a_module_needing_an_absent_extra_skips_naming_the_extra(tmp_path):
    module, extra = _missing_extra_package()
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "needs_extra.py").write_text(f'"""Doc.\n\n>>> 1 + 1\n2\n"""\nimport {module}.sub\n')
    (tmp_path / "pkg" / "plain.py").write_text('"""Doc.\n\n>>> 1 + 1\n2\n"""\n')
    out = _run_pytest(tmp_path, "--doctest-modules", "pkg")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 passed, 1 skipped" in out.stdout, out.stdout
    assert f"pkg/needs_extra.py needs {module}, which is not installed: pip install 'boltzlabs-gym[{extra}]'" in out.stdout


@pytest.mark.parametrize(
    "line",
    ["import boltzlabs_gym.no_such_module", "import no_such_package_anywhere", "from boltzlabs_gym import no_such_name"],
)
def test_any_other_import_error_still_fails_collection(tmp_path, line):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "broken.py").write_text(f'"""Doc.\n\n>>> 1 + 1\n2\n"""\n{line}\n')
    out = _run_pytest(tmp_path, "--doctest-modules", "pkg")
    assert out.returncode == 2, out.stdout + out.stderr
    assert "1 error" in out.stdout and "ImportError" in out.stdout, out.stdout


def test_sample_each_module_runs_the_first_test_not_marked_slow(tmp_path):
    marker = 'import pytest\n@pytest.mark.slow\ndef test_slow():\n    raise AssertionError("slow ran")\n'
    (tmp_path / "test_one.py").write_text(marker + "def test_a():\n    pass\ndef test_b():\n    raise AssertionError\n")
    (tmp_path / "test_two.py").write_text("def test_c():\n    pass\ndef test_d():\n    raise AssertionError\n")
    out = _run_pytest(tmp_path, "-p", "no:warnings", "--sample-each-module", "test_one.py", "test_two.py")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "2 passed, 3 deselected" in out.stdout, out.stdout
