"""Collect Stable-Baselines3's own vec-env tests from its source distribution, adapted to build
``BoltzLabsSB3VecEnv`` (README.md here says how and why).

No SB3 code is kept in this repository: at collection time the sdist of the installed SB3
version, downloaded from PyPI into ``$BOLTZLABS_SB3_SDIST_DIR`` (default ``.cache/sb3-sdist/``
at the repository root; ``.ci/run`` downloads it), gives its four ``tests/test_vec_*.py``; each
is adapted by construction only (``sb3_adaptation.py``), written under
``.cache/sb3-tests/<version>/`` and collected here as a test module, under this folder's
conftests and its ``sb3_swap`` worker fixture. Without the sdist (or SB3) they skip and say
what to download. The marks the suite puts on some of them (known differences, slow
training) are applied below by test name, never by editing the text.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
import tarfile
from pathlib import Path

import pytest

from .sb3_adaptation import AdaptationError, adapt, module_functions

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
# The adapted modules import sb3_swap by its bare name (they live outside this package).
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

#: SB3's test files that run here.
UPSTREAM_FILES = ("test_vec_envs.py", "test_vec_monitor.py", "test_vec_normalize.py", "test_vec_check_nan.py")

#: Tests whose difference from DummyVecEnv/SubprocVecEnv stays (docs/sb3-differences.md): strict,
#: so the suite says so if one starts passing.
XFAIL = {
    ("test_vec_envs.py", "test_vecenv_func_checker"): (
        "each sandbox unpickles its own copy of the factories' env: distinct envs, nothing to refuse"
    ),
    ("test_vec_check_nan.py", "test_check_nan"): (
        "its last step's action, shape (2,), does not fit the Box (1,) action space: refused"
    ),
}

#: Tests that spend most of their time training a model with torch (they still run by default).
SLOW = {
    ("test_vec_normalize.py", "test_her_normalization"),
    ("test_vec_normalize.py", "test_offpolicy_normalization"),
    ("test_vec_monitor.py", "test_vec_monitor_ppo"),
}


def sdist_dir() -> Path:
    """Where the SB3 sdist is looked for (and where ``.ci/run`` downloads it)."""
    return Path(os.environ.get("BOLTZLABS_SB3_SDIST_DIR") or REPO / ".cache" / "sb3-sdist")


def download_command(version: str) -> str:
    """The command that puts the sdist of SB3 ``version`` where :func:`sdist_dir` looks."""
    return f'pip download --no-deps --no-binary :all: "stable-baselines3=={version}" -d {sdist_dir()}'


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Collector | None:
    # This file is the one certain to be in this folder: its turn in the folder's collection
    # brings in the upstream tests, once, as children of the folder.
    if file_path.resolve() == HERE / "conftest.py":
        return SB3UpstreamTests.from_parent(parent, name="stable-baselines3 sdist")
    return None


class SB3UpstreamTests(pytest.Collector):
    """SB3's vec-env test files for the installed SB3, from its sdist, adapted: one module each."""

    def collect(self):
        try:
            version = importlib.metadata.version("stable-baselines3")
        except importlib.metadata.PackageNotFoundError:
            pytest.skip("stable-baselines3 is not installed (pip install -e '.[test]')")
        sdist = _find_sdist(version)
        if sdist is None:
            pytest.skip(
                f"SB3's vec-env tests come from the stable-baselines3 {version} sdist, not in {sdist_dir()}: "
                f"run {download_command(version)}"
            )
        try:
            texts = _upstream_texts(sdist)
            adapted = {name: adapt(text, name) for name, text in texts.items()}
            _check_marked_tests(adapted)
        except (AdaptationError, tarfile.TarError, OSError) as exc:
            raise self.CollectError(
                f"SB3's vec-env tests from {sdist} could not be adapted: {exc}\n"
                "A new SB3 release changed them; update tests/adapters/sb3_upstream/ (README.md)."
            ) from exc
        out = REPO / ".cache" / "sb3-tests" / version
        for name, text in adapted.items():
            yield SB3UpstreamModule.from_parent(self, path=_write_if_changed(out / name, text))


class SB3UpstreamModule(pytest.Module):
    """One adapted SB3 test file (the marks of :data:`XFAIL` and :data:`SLOW` are put on its tests)."""


def _find_sdist(version: str) -> Path | None:
    for name in (f"stable_baselines3-{version}.tar.gz", f"stable-baselines3-{version}.tar.gz"):
        path = sdist_dir() / name
        if path.is_file():
            return path
    return None


def _upstream_texts(sdist: Path) -> dict[str, str]:
    """The text of each of :data:`UPSTREAM_FILES`, read from ``<top>/tests/`` in the sdist."""
    wanted = {}
    with tarfile.open(sdist) as archive:
        for member in archive.getmembers():
            parts = member.name.split("/")
            if member.isfile() and len(parts) == 3 and parts[1] == "tests" and parts[2] in UPSTREAM_FILES:
                handle = archive.extractfile(member)
                assert handle is not None  # a regular file
                wanted[parts[2]] = handle.read().decode("utf-8")
    missing = sorted(set(UPSTREAM_FILES) - set(wanted))
    if missing:
        raise AdaptationError(f"the sdist has no tests/{', tests/'.join(missing)}")
    return wanted


def _check_marked_tests(adapted: dict[str, str]) -> None:
    """Each test the suite marks by name is still there: a renamed one would lose its mark unseen."""
    for filename, test in sorted({*XFAIL, *SLOW}):
        if test not in module_functions(adapted[filename]):
            raise AdaptationError(f"{filename} has no {test} any more, and the suite marks it (conftest.py)")


def _write_if_changed(path: Path, text: str) -> Path:
    """Write ``text`` at ``path`` unless it is there already; atomic, for runs side by side.

    A changed file also drops its cached bytecode: pytest checks it by size and mtime in
    seconds only, which a regeneration within the same second could match.
    """
    if path.is_file() and path.read_text(encoding="utf-8") == text:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.{os.getpid()}")
    staging.write_text(text, encoding="utf-8")
    os.replace(staging, path)
    for cached in (path.parent / "__pycache__").glob(f"{path.stem}.*.pyc"):
        cached.unlink(missing_ok=True)
    return path


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        module = item.getparent(SB3UpstreamModule)
        if module is None:
            continue
        key = (module.path.name, getattr(item, "originalname", item.name))
        if key in XFAIL:
            item.add_marker(pytest.mark.xfail(strict=True, reason=XFAIL[key]))
        if key in SLOW:
            item.add_marker(pytest.mark.slow)
