"""The wipe between two programs of one env: hostile programs, and the next program on the same env
finds nothing of them (one lane of one env, so every program lands on the same env)."""

from __future__ import annotations

import errno
import json
import sys

import pytest

from boltzlabs_gym.code import CodeRunner
from boltzlabs_gym.envside.confine import python_paths
from conftest import ISOLATION


@pytest.fixture(scope="module")
def runner():
    with CodeRunner(envs_per_lane=1, lanes=1, isolation=ISOLATION, max_run_timeout=10) as r:
        if r.wipe_unavailable is not None:
            pytest.skip(f"no wipe under {r.isolation.backend}: {r.wipe_unavailable}")
        assert r.run("print(1)").ok and r.stats().wipes == 1, r.stats()  # (said it can wipe: it must)
        yield r


HOSTILE = r"""
import ctypes, json, os, signal, socket, time
libc = ctypes.CDLL(None, use_errno=True)
out = {}
# a double-forked, setsid'd daemon with an abstract socket, and a child that stops itself
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        s = socket.socket(socket.AF_UNIX); s.bind("\0boltz-leak"); s.listen()
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        while True:
            open("/workspace/daemon.txt", "a").write("x"); time.sleep(0.01)
    os._exit(0)
if os.fork() == 0:
    os.kill(os.getpid(), signal.SIGSTOP); os._exit(0)
# files everywhere it can write, under directories it made unreadable
for root in ("/workspace", "/tmp", "/dev/shm", "/mnt", "/data", "/home"):
    os.makedirs(f"{root}/d/e", exist_ok=True)
    open(f"{root}/d/e/f", "w").write("left")
    open(f"{root}/.hidden", "w").write("left")
    os.symlink("/usr", f"{root}/link")
    os.chmod(f"{root}/d/e", 0); os.chmod(f"{root}/d", 0)
os.chmod("/workspace", 0o500)
# SysV IPC
out["shm"] = libc.shmget(0x1234, 4096, 0o1666)
out["msg"] = libc.msgget(0x1235, 0o1666)
out["sem"] = libc.semget(0x1236, 1, 0o1666)
# POSIX message queues cannot be listed, so programs may not make one
out["mq"] = libc.syscall(240, b"leak", 0o100 | 2, 0o600, None)
# network state: no socket but AF_UNIX (no interface, route or port to change or leave bound)
for name, family in (("inet", socket.AF_INET), ("inet6", socket.AF_INET6), ("netlink", socket.AF_NETLINK)):
    try:
        socket.socket(family, socket.SOCK_DGRAM if family != socket.AF_NETLINK else socket.SOCK_RAW).close()
        out[name] = "made"
    except OSError as exc:
        out[name] = exc.errno
# the env (PID 1) and the zygote: their memory, fds and OOM score; signals
for pid in (1, 2):
    for what, mode in (("mem", "r+b"), ("fd/0", "rb"), ("oom_score_adj", "w")):
        try:
            open(f"/proc/{pid}/{what}", mode); out[f"{pid}/{what}"] = "opened"
        except OSError as exc:
            out[f"{pid}/{what}"] = type(exc).__name__
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP):
        try:
            os.kill(pid, sig)
        except OSError:
            pass
# its own umask, cwd, environment
os.umask(0); os.chdir("/tmp"); os.environ["LEAK"] = "1"; os.putenv("LEAK2", "1")
time.sleep(0.1)
print(json.dumps(out))
"""

#: A program that counts copies of a needle (``%r``: bytes, each shifted by one so that the scan's own
#: copy never matches) in its own writable memory
MEMORY_SCAN = (
    "needle = %r\n"
    "back = bytes(range(1, 256)) + b'\\0'\n"
    "found = 0\n"
    "mem = open('/proc/self/mem', 'rb', 0)\n"
    "for line in open('/proc/self/maps'):\n"
    "    addr, perms = line.split()[:2]\n"
    "    if not perms.startswith('rw'):\n"
    "        continue\n"
    "    lo, hi = (int(x, 16) for x in addr.split('-'))\n"
    "    try:\n"
    "        mem.seek(lo); chunk = mem.read(hi - lo)\n"
    "    except OSError:\n"
    "        continue\n"
    "    found += chunk.translate(back).count(needle)\n"
    "print(found)\n"
)

SURVEY = r"""
import json, os, socket
def tree(root):  # (not into other file systems: an interpreter bound read-only under /tmp)
    dev, out = os.lstat(root).st_dev, []
    for d, ds, fs in os.walk(root):
        out += [os.path.relpath(os.path.join(d, n), root) for n in ds + fs]
        ds[:] = [n for n in ds if os.lstat(os.path.join(d, n)).st_dev == dev]
    return sorted(out)
def ids(kind):
    return open(f"/proc/sysvipc/{kind}").read().splitlines()[1:]
named = [r.split()[7] for r in open("/proc/net/unix").read().splitlines()[1:] if len(r.split()) > 7]
print(json.dumps({
    "pids": sorted(int(p) for p in os.listdir("/proc") if p.isdigit()),
    "me": os.getpid(),
    "workspace": tree("/workspace"), "workspace_mode": oct(os.stat("/workspace").st_mode & 0o777),
    "tmp": tree("/tmp"), "shm": tree("/dev/shm"), "mnt": tree("/mnt"), "data": tree("/data"), "home": tree("/home"),
    "ipc": {k: ids(k) for k in ("shm", "msg", "sem")},
    "sockets": named,
    "umask": os.umask(0o22), "cwd": os.getcwd(),
    "env": sorted(k for k in os.environ if "LEAK" in k),
    "nice": os.getpriority(os.PRIO_PROCESS, 0),
}))
"""


def kept(root: str) -> list[str]:
    """What the wipe leaves in ``root``: the way to each interpreter tree the sandbox binds there."""
    out = set()
    for path in python_paths(sys.executable):
        if path.startswith(root + "/"):
            parts = path[len(root) + 1 :].split("/")
            out.update("/".join(parts[: i + 1]) for i in range(len(parts)))
    return sorted(out)


def survey(runner) -> dict:
    r = runner.run(SURVEY)
    assert r.ok, r
    return json.loads(r.stdout)


def test_hostile_program_leaves_nothing_for_the_next_one(runner):
    before = runner.stats()
    r = runner.run(HOSTILE, run_timeout=5)
    assert r.ok, r
    out = json.loads(r.stdout)
    assert min(out["shm"], out["msg"], out["sem"]) >= 0, out  # it did make them
    assert out["mq"] == -1, out
    assert out["inet"] == out["inet6"] == out["netlink"] == errno.EAFNOSUPPORT, out
    for pid in (1, 2):  # neither the env nor the zygote is open to it
        assert out[f"{pid}/mem"] == out[f"{pid}/fd/0"] == out[f"{pid}/oom_score_adj"] == "PermissionError", out
    s = survey(runner)
    assert s["pids"] == [1, 2, s["me"]], s  # the env, its zygote, this program
    assert s["workspace"] == ["main.py"] and s["workspace_mode"] == "0o700", s
    assert s["tmp"] == sorted([".boltzlabs_runner", ".boltzlabs_runner/stdin", *kept("/tmp")]), s
    assert s["shm"] == kept("/dev/shm"), s
    for place in ("mnt", "data", "home"):  # SandboxFusion's places for a request's files
        assert s[place] == kept(f"/{place}"), s
    assert s["ipc"] == {"shm": [], "msg": [], "sem": []} and s["sockets"] == [], s
    assert (s["umask"], s["cwd"], s["env"]) == (0o22, "/workspace", []), s
    after = runner.stats()
    assert after.wipes - before.wipes == 2 and after.hard_resets == before.hard_resets, after


def test_a_timed_out_program_is_wiped_too(runner):
    before = runner.stats()
    r = runner.run(
        "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(600)\nopen('x', 'w')\ntime.sleep(600)\n",
        run_timeout=0.5,
    )
    assert r.run_result.status == "TimeLimitExceeded", r
    s = survey(runner)
    assert s["pids"] == [1, 2, s["me"]] and s["workspace"] == ["main.py"], s
    assert runner.stats().hard_resets == before.hard_resets


def test_the_next_program_finds_no_memory_of_the_last(runner):
    secret = "boltz-secret-7f3a9c"
    assert runner.run(f"print(input() + {secret!r})", stdin=secret).ok
    # the next program scans its own writable memory (a fork of the zygote) for the secret; the needle
    # is kept shifted by one byte so that the scan's own copy never matches
    shifted = bytes(b + 1 for b in secret.encode())
    r = runner.run(MEMORY_SCAN % (shifted,))
    assert r.ok and r.stdout == "0\n", r


def test_a_program_that_changes_the_env_or_zygote_gets_it_hard_reset(runner):
    before = runner.stats()
    r = runner.run(
        "import os, resource\n"
        "os.setpriority(os.PRIO_PROCESS, 2, 7)\n"  # the zygote's nice value
        "resource.prlimit(1, resource.RLIMIT_NOFILE, (64, 64))\n"  # the env's open-files limit
    )
    assert r.ok, r
    assert runner.stats().hard_resets == before.hard_resets + 1
    s = survey(runner)
    assert s["nice"] == 0 and s["pids"] == [1, 2, s["me"]], s
    assert runner.run("import resource; print(resource.getrlimit(resource.RLIMIT_NOFILE)[0] > 64)").stdout == "True\n"
