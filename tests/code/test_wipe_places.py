"""The wipe wherever Python lives: the project run from an interpreter under ``/tmp``, ``/dev/shm``,
``/home`` or the home directory, places the sandbox binds read-only at their own path, some of them
inside the writable places the wipe empties (``/home`` is one of the sandbox's private tmpfs places
for SandboxFusion's absolute file paths, with ``/mnt`` and ``/data``).

Each case makes a venv there (no pip: a ``.pth`` gives it this interpreter's packages), runs a
code runner of one env from it in a subprocess, and has hostile programs write around, into and
over the interpreter's tree. The next program must find only the way to the interpreter, and every
program must have been wiped in place, not hard-reset.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import site
import subprocess
import sys
import tempfile
import venv

import pytest

from conftest import ISOLATION

PLACES = {
    "tmp": "/tmp",
    "dev-shm": "/dev/shm",
    "home": os.path.expanduser("~"),
    "slash-home": "/home",  # (made for the test where the host has none)
}
PRIVATE = ("/tmp", "/dev/shm", "/mnt", "/data", "/home")

# Run by the venv's interpreter: one env, so every program lands on it; prints one JSON line.
DRIVER = r"""
import json, os, sys
from boltzlabs_gym.code import CodeRunner

venv_dir = sys.argv[1]
passage = os.path.dirname(venv_dir)  # the directory that leads to the interpreter's tree
out = {}
# python=None: programs run under this venv's interpreter (the worker's own), wherever it lives,
# not under the code runtime's (which lives under /usr)
with CodeRunner(envs_per_lane=1, lanes=1, isolation=os.environ["ISOLATION"], max_run_timeout=10, python=None) as r:
    out["backend"] = r.isolation.backend
    out["unavailable"] = r.wipe_unavailable
    if r.wipe_unavailable is None:
        LOOK = (
            "import json, os, sys\n"
            f"passage = {passage!r}\n"
            "lists = [sorted(os.listdir(p)) for p in (passage, '/tmp', '/dev/shm', '/mnt', '/data', '/home')]\n"
            "print(json.dumps([*lists, oct(os.stat(passage).st_mode & 0o7777), sys.prefix]))\n"
        )
        before = r.run(LOOK)
        out["before"] = [before.status, before.run_result.stdout, before.run_result.stderr[-500:]]
        hostile = r.run(
            "import os, sys\n"
            f"passage = {passage!r}\n"
            "tried = {}\n"
            "for target in (sys.prefix + '/leak', sys.prefix + '/bin/leak'):\n"
            "    try:\n"
            "        open(target, 'w'); tried[target] = 'written'\n"
            "    except OSError as exc:\n"
            "        tried[target] = exc.errno\n"
            "for root in ('/tmp', '/dev/shm', '/mnt', '/data', '/home', passage):\n"
            "    try:\n"
            "        os.makedirs(root + '/left/deep', exist_ok=True); open(root + '/left/deep/f', 'w').write('x')\n"
            "        os.chmod(root + '/left', 0)\n"
            "    except OSError:\n"
            "        pass\n"
            "try:\n"
            "    os.chmod(passage, 0o700)\n"
            "except OSError:\n"
            "    pass\n"
            "print(tried)\n"
        )
        out["hostile"] = [hostile.status, hostile.run_result.stdout, hostile.run_result.stderr[-500:]]
        look = r.run(LOOK)
        out["look"] = [look.status, look.run_result.stdout, look.run_result.stderr[-500:]]
        # a request's file inside the interpreter's tree: refused (read-only), with the path in the message
        into = r.run("print('ran')", files={venv_dir + "/bin/leak": "eA=="})
        out["into_venv"] = [into.status, into.message]
        # a program that moves the way to the interpreter away gets its env hard-reset, and the next one runs
        if passage not in ("/tmp", "/dev/shm", "/home") and passage.startswith(("/tmp/", "/dev/shm/", "/home/")):
            moved = r.run(f"import os; os.rename({passage!r}, {passage!r} + '-moved')")
            out["moved"] = [moved.status, moved.run_result.stderr[-300:]]
            out["after_moved"] = r.run("print('fine')").run_result.stdout
    s = r.stats()
    out["wipes"], out["hard_resets"] = s.wipes, s.hard_resets
print(json.dumps(out))
"""


def _make_home(parent: str) -> bool:
    """Make ``/home`` where the host has none (it is removed after the test); whether it was made."""
    if parent != "/home" or os.path.exists(parent):
        return False
    try:
        os.mkdir(parent, 0o755)
    except OSError:
        return False  # (then not writable: the test skips)
    return True


def _venv_in(parent: str) -> str:
    """A venv under ``parent/<random>/`` whose interpreter imports what this one imports."""
    holder = tempfile.mkdtemp(prefix="blg-wipe-", dir=parent)
    path = os.path.join(holder, "venv")
    venv.create(path, system_site_packages=True, with_pip=False, symlinks=True)
    (site_dir,) = glob.glob(os.path.join(path, "lib", "python*", "site-packages"))
    here = [p for p in sys.path if p and os.path.isdir(p)]
    with open(os.path.join(site_dir, "outer.pth"), "w") as f:
        f.write("\n".join([*site.getsitepackages(), *here]) + "\n")
    return path


def run_in_venv(path: str, driver: str, *args: str) -> dict:
    """Run ``driver`` by the venv at ``path`` (then removed with its holder); the JSON line it printed last."""
    try:
        done = subprocess.run(
            [os.path.join(path, "bin", "python"), "-c", driver, *args],
            capture_output=True,
            text=True,
            timeout=180,
            env={**os.environ, "ISOLATION": ISOLATION},
            cwd=os.path.dirname(path),
        )
    finally:
        shutil.rmtree(os.path.dirname(path), ignore_errors=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("place", sorted(PLACES))
def test_programs_are_wiped_with_the_interpreter_under(place):
    parent = PLACES[place]
    made = _make_home(parent)
    if not os.access(parent, os.W_OK):
        pytest.skip(f"{parent} is not writable here")
    path = _venv_in(parent)
    try:
        out = run_in_venv(path, DRIVER, path)
    finally:
        if made:
            os.rmdir(parent)
    if out["unavailable"] is not None:
        pytest.skip(f"no wipe under {out['backend']}: {out['unavailable']}")
    status, stdout, stderr = out["hostile"]
    assert status == "Success", (stdout, stderr)
    assert "written" not in stdout, stdout  # the interpreter's tree is read-only
    assert out["before"][0] == "Success", out["before"]
    status, stdout, stderr = out["look"]
    assert status == "Success", stderr
    assert stdout == out["before"][1]  # the passage's mode too: a chmod of it is undone
    passage_list, *private_lists, passage_mode, prefix = json.loads(stdout)
    assert prefix == path
    assert passage_list == ["venv"], stdout  # the way to the interpreter, nothing a program left
    for root, names in zip(PRIVATE, private_lists):  # each private place: only the way to the interpreter
        way = [os.path.relpath(path, root).split("/")[0]] if path.startswith(root + "/") else []
        assert names == sorted([".boltzlabs_runner", *way] if root == "/tmp" else way), (root, stdout)
    status, message = out["into_venv"]
    private = any(path.startswith(root + "/") for root in PRIVATE)  # (else refused for where it is)
    why = "Read-only file system" if private else "outside the places a program may write"
    assert status == "SandboxError" and repr(path + "/bin/leak") in message and why in message, out
    moved = out.get("moved", ["", ""])
    if moved[0] == "Success":  # the way to the interpreter moved: found, the env hard-reset
        assert out["after_moved"] == "fine\n", out
        assert (out["wipes"], out["hard_resets"]) == (5, 1), out
    else:
        assert "PermissionError" in moved[1] or not moved[0], out
        assert (out["wipes"], out["hard_resets"]) == (4 + bool(moved[0]) * 2, 0), out
