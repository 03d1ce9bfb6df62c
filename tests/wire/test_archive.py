"""Deterministic env-dir archives: same tree, same bytes, same hash."""

from __future__ import annotations

import os
import shutil
import time

import pytest

from boltzlabs_gym.wire.archive import archive_hash, pack_dir, unpack_archive
from boltzlabs_gym.errors import ArchiveError

from conftest import CODE_ENV


def test_same_tree_same_bytes_whatever_the_mtimes_and_copies(tmp_path):
    a = tmp_path / "a"
    shutil.copytree(CODE_ENV, a)
    data1, h1 = pack_dir(a)
    time.sleep(0.01)
    b = tmp_path / "b"
    shutil.copytree(CODE_ENV, b)
    for root, _, files in os.walk(b):
        for f in files:
            os.utime(os.path.join(root, f), (1_000_000, 1_000_000))
    data2, h2 = pack_dir(b)
    assert data1 == data2 and h1 == h2 == archive_hash(data1)
    (b / "__pycache__").mkdir()
    (b / "__pycache__" / "x.pyc").write_bytes(b"junk")
    assert pack_dir(b)[1] == h1  # caches are not part of an env
    (b / "TASK.md").write_text("changed")
    assert pack_dir(b)[1] != h1


def test_round_trip_keeps_files_modes_and_inner_links(tmp_path):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "env.py").write_text("print('hi')\n")
    (src / "run.sh").write_text("#!/bin/sh\n")
    os.chmod(src / "run.sh", 0o755)
    (src / "sub" / "data.txt").write_text("data")
    os.symlink("sub/data.txt", src / "link.txt")
    data, digest = pack_dir(src)
    dest = tmp_path / "dest"
    unpack_archive(data, str(dest), expected_hash=digest)
    assert (dest / "env.py").read_text() == "print('hi')\n"
    assert os.access(dest / "run.sh", os.X_OK) and not os.access(dest / "env.py", os.X_OK)
    assert os.readlink(dest / "link.txt") == "sub/data.txt" and (dest / "link.txt").read_text() == "data"


def test_hash_mismatch_and_missing_dir_refused(tmp_path):
    data, digest = pack_dir(CODE_ENV)
    with pytest.raises(ArchiveError, match="does not match"):
        unpack_archive(data, str(tmp_path / "x"), expected_hash="0" * 64)
    with pytest.raises(ArchiveError, match="does not exist"):
        pack_dir(tmp_path / "nope")
