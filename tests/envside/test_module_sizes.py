"""The env side stays in rooms one can read: no module of ``envside/`` over 600 lines, and
``boltzlabs_gym/env.py`` only the env author's face (the hosts behind ``serve()`` live in ``envside/``)."""

from __future__ import annotations

from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "boltzlabs_gym"
ENVSIDE = sorted((PACKAGE / "envside").glob("*.py"))


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines())


@pytest.mark.parametrize("path", ENVSIDE, ids=[p.name for p in ENVSIDE])
def test_no_envside_module_is_over_600_lines(path):
    assert _lines(path) <= 600, f"envside/{path.name} has {_lines(path)} lines: split it by what its parts do"


def test_env_py_is_the_env_authors_face_only():
    assert _lines(PACKAGE / "env.py") <= 110, "env.py is what env code imports; the JSON env host is envside/json_host.py"
