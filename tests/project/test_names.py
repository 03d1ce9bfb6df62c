"""Module names that explain themselves: no two modules of the package share a basename.

Allowed: ``__init__``/``__main__``; ``env.py`` (an env directory's entry point is a contract, and
the env author's face is named for it); and the two halves of one feature across the trainer and
the worker (``client/X.py`` beside ``worker/X.py``), which mirror each other across processes.
Test folders differ by more than one letter.
"""

from __future__ import annotations

import collections
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ALWAYS_ALLOWED = {"__init__.py", "__main__.py", "env.py"}
MIRRORED = {"boltzlabs_gym/client", "boltzlabs_gym/worker"}


def _modules_by_basename() -> dict[str, list[str]]:
    found = collections.defaultdict(list)
    for package in ("boltzlabs_gym", "boltzlabs"):
        for path in sorted((ROOT / package).rglob("*.py")):
            found[path.name].append(path.parent.relative_to(ROOT).as_posix())
    return found


def test_no_two_modules_share_a_basename_unless_they_mirror_across_processes():
    clashes = {
        name: folders
        for name, folders in _modules_by_basename().items()
        if len(folders) > 1 and name not in ALWAYS_ALLOWED and set(folders) != MIRRORED
    }
    assert not clashes, f"modules sharing a basename (rename one to say what it is): {clashes}"


def test_test_folders_differ_by_more_than_one_letter():
    folders = sorted(p.name for p in (ROOT / "tests").iterdir() if p.is_dir() and not p.name.startswith((".", "_")))
    for a in folders:
        for b in folders:
            if a < b:
                assert a.rstrip("s") != b.rstrip("s"), f"tests/{a} and tests/{b} differ by one letter"
