"""Where a request's files go: SandboxFusion's absolute paths (``/mnt/data/x.csv``, ``/mnt/b``) in
the namespaces sandbox's private places, wiped after every program; paths over the system, the
toolchains or the env refused with a message naming them; absolute paths refused on the
``process`` backend, whose places would be the host's. One lane of one env, so every program lands
on the same env and the next program sees what the wipe left."""

from __future__ import annotations

import base64
import json

import pytest

from boltzlabs_gym.code import CodeRunner
from conftest import ISOLATION

PRIVATE = ("/mnt", "/data", "/home")


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def unb64(data: str) -> str:
    return base64.b64decode(data).decode()


@pytest.fixture(scope="module")
def runner():
    with CodeRunner(envs_per_lane=1, lanes=1, isolation=ISOLATION, max_run_timeout=10) as r:
        if r.isolation.backend != "namespaces":
            pytest.skip(f"absolute paths need the namespaces backend, not {r.isolation.backend}")
        yield r


def listing(runner) -> dict:
    """What the next program finds in each private place (not into the mounts a place holds: an
    interpreter's tree the sandbox binds read-only under /home, say)."""
    r = runner.run(
        "import json, os\n"
        "def tree(root):\n"
        "    dev, out = os.lstat(root).st_dev, []\n"
        "    for d, ds, fs in os.walk(root):\n"
        "        out += [os.path.relpath(os.path.join(d, n), root) for n in ds + fs]\n"
        "        ds[:] = [n for n in ds if os.lstat(os.path.join(d, n)).st_dev == dev]\n"
        "    return sorted(out)\n"
        f"print(json.dumps({{p: tree(p) for p in {PRIVATE!r}}}))\n"
    )
    assert r.ok, r
    return json.loads(r.stdout)


def test_files_at_absolute_paths_are_read_written_fetched_and_wiped(runner):
    before = listing(runner)  # (what the sandbox itself holds there: the way to a venv under /home)
    r = runner.run(
        "import os\n"
        "for p in ('/mnt/data/x.csv', '/data/y', '/home/z', 'rel/w'):\n"
        "    print(p, open(p).read())\n"
        "open('/mnt/b', 'w').write('sauce')\n"
        "os.makedirs('/data/out/deep'); open('/data/out/deep/c', 'w').write('deep')\n",
        files={"/mnt/data/x.csv": b64("a,b"), "/data/y": b64("why"), "/home/z": b64("zed"), "rel/w": b64("rel")},
        fetch_files=["/mnt/b", "/data/out/deep/c", "/mnt/data/x.csv", "/home/missing"],
    )
    assert r.ok, r
    assert r.stdout.splitlines() == ["/mnt/data/x.csv a,b", "/data/y why", "/home/z zed", "rel/w rel"]
    fetched = {k: unb64(v) for k, v in r.files.items()}
    assert fetched == {"/mnt/b": "sauce", "/data/out/deep/c": "deep", "/mnt/data/x.csv": "a,b"}, fetched
    assert listing(runner) == before  # the next program on the same env finds nothing of it
    assert all(not names or place == "/home" for place, names in before.items()), before


def test_sandbox_fusion_fetch_files(runner):
    """SandboxFusion's ``test_python_fetch_files``: a relative and an absolute file, written by the program."""
    r = runner.run(
        'open("a.txt", "w").write("secret"); open("/mnt/b", "w").write("sauce");',
        run_timeout=5,
        fetch_files=["a.txt", "/mnt/b"],
    )
    assert r.status == "Success" and r.run_result.status == "Finished", r
    assert unb64(r.files["a.txt"]) == "secret" and unb64(r.files["/mnt/b"]) == "sauce"


@pytest.mark.parametrize(
    "path", ["/etc/x", "/usr/x", "/mnt/../etc/x", "/env/x", "/dev/x", "/proc/x", "/opt/x", "/x", "/mnt", "../x"]
)
@pytest.mark.parametrize("as_", ["files", "fetch_files"])
def test_paths_outside_the_private_places_are_refused(runner, path, as_):
    ask = {"files": {path: b64("no")}} if as_ == "files" else {"fetch_files": [path]}
    r = runner.run("print('ran')", **ask)
    assert r.status == "SandboxError" and r.stdout == "", r  # refused before the program ran
    assert repr(path) in r.message and "allowed: paths relative to the workspace" in r.message, r.message
    assert "/mnt, /data, /home" in r.message, r.message
    assert runner.run("print('fine')").stdout == "fine\n"  # the env goes on


def test_a_symlink_out_of_the_places_is_not_fetched_one_inside_is(runner):
    r = runner.run(
        "import os\n"
        "os.symlink('/etc/passwd', '/mnt/passwd')\n"
        "os.symlink('/proc/1/environ', 'environ')\n"  # the env's own, were the env to open it
        "os.symlink('/proc/1/fd/0', '/data/requests')\n"  # the env's stdin: its next request
        "os.symlink('/usr', '/home/usr')\n"
        "open('/data/real', 'w').write('inside')\n"
        "os.symlink('/data/real', '/mnt/inside')\n"
        "os.mkfifo('/mnt/fifo')\n",
        fetch_files=["/mnt/passwd", "environ", "/data/requests", "/home/usr/bin/env", "/mnt/inside", "/mnt/fifo"],
    )
    assert r.ok, r
    assert {k: unb64(v) for k, v in r.files.items()} == {"/mnt/inside": "inside"}
    assert runner.run("print('fine')").stdout == "fine\n"


def test_the_process_backend_refuses_absolute_paths():
    with CodeRunner(envs_per_lane=1, lanes=1, isolation="process", max_run_timeout=10) as runner:
        r = runner.run("print('ran')", files={"/mnt/data/x.csv": b64("a,b")})
        assert r.status == "SandboxError" and r.stdout == "", r
        assert "'/mnt/data/x.csv' is absolute" in r.message and "namespaces backend" in r.message, r.message
        fetched = runner.run("print('ran')", fetch_files=["/mnt/b"])
        assert fetched.status == "SandboxError" and "'/mnt/b' is absolute" in fetched.message, fetched
        relative = runner.run(
            "print(open('in/a').read()); open('b', 'w').write('B')", files={"in/a": b64("A")}, fetch_files=["b"]
        )
        assert relative.ok and relative.stdout == "A\n" and unb64(relative.files["b"]) == "B", relative
