"""Without the wipe (``wipe=False``): each program, of any language, in namespaces and places made for
it alone. Hostile programs, and the next program on the same env finds nothing of them (one lane of
one env, so every program lands on the same env); nothing is wiped and nothing is hard-reset.
(``test_languages.py`` runs every language's programs this way too.)"""

from __future__ import annotations

import base64
import errno
import json

import pytest
from test_wipe import HOSTILE, MEMORY_SCAN, SURVEY, kept

from boltzlabs_gym.code import CodeRunner
from conftest import ISOLATION


@pytest.fixture(scope="module")
def runner():
    with CodeRunner(envs_per_lane=1, lanes=1, isolation=ISOLATION, max_run_timeout=10, wipe=False) as r:
        if r.fresh_unavailable is not None:
            pytest.skip(f"no fresh namespaces per program under {r.isolation.backend}: {r.fresh_unavailable}")
        assert r.isolation.properties.get("nested_user_namespaces") is True, r.isolation
        assert r.run("print(1)").ok and r.stats().fresh == 1, r.stats()  # (said it can: it must)
        yield r


def survey(runner) -> dict:
    r = runner.run(SURVEY)
    assert r.ok, r
    return json.loads(r.stdout)


def counts(runner) -> tuple[int, int, int]:
    s = runner.stats()
    return s.fresh, s.wipes, s.hard_resets


def test_hostile_program_leaves_nothing_for_the_next_one(runner):
    before = counts(runner)
    # (its PID 2 is itself here: the program's own namespace holds its PID 1 and the program)
    r = runner.run(HOSTILE.replace("for pid in (1, 2):", "for pid in (1,):"), run_timeout=5)
    assert r.ok, r
    out = json.loads(r.stdout)
    assert min(out["shm"], out["msg"], out["sem"]) >= 0, out  # it did make them
    assert out["mq"] >= 0, out  # a POSIX message queue too: its IPC namespace dies with it
    assert out["inet"] == out["inet6"] == out["netlink"] == errno.EAFNOSUPPORT, out
    assert out["1/mem"] == out["1/fd/0"] == out["1/oom_score_adj"] == "PermissionError", out
    s = survey(runner)
    assert s["pids"] == [1, 2] and s["me"] == 2, s  # its PID 1, and itself: nothing left, nothing of the env
    assert s["workspace"] == ["main.py"] and s["workspace_mode"] == "0o700", s
    assert s["tmp"] == sorted([".boltzlabs_runner", ".boltzlabs_runner/stdin", *kept("/tmp")]), s
    assert s["shm"] == kept("/dev/shm"), s
    for place in ("mnt", "data", "home"):
        assert s[place] == kept(f"/{place}"), s
    assert s["ipc"] == {"shm": [], "msg": [], "sem": []} and s["sockets"] == [], s
    assert (s["umask"], s["cwd"], s["env"]) == (0o22, "/workspace", []), s
    mq_open = "ctypes.CDLL(None, use_errno=True).syscall(240, b'leak', 2, 0, None)"
    mq = runner.run(f"import ctypes\nprint({mq_open}, ctypes.get_errno())")
    assert mq.stdout.split() == ["-1", str(errno.ENOENT)], mq  # the queue is gone
    fresh, wipes, hard_resets = counts(runner)
    assert (fresh - before[0], wipes, hard_resets) == (3, before[1], before[2]), runner.stats()


def test_a_timed_out_program_leaves_nothing_either(runner):
    before = counts(runner)
    r = runner.run(
        "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(600)\nopen('x', 'w')\ntime.sleep(600)\n",
        run_timeout=0.5,
    )
    assert r.run_result.status == "TimeLimitExceeded" and 0.5 <= r.run_result.execution_time < 2, r
    s = survey(runner)
    assert s["pids"] == [1, 2] and s["workspace"] == ["main.py"], s
    assert counts(runner)[2] == before[2]  # no hard reset


def test_the_next_program_finds_no_memory_of_the_last(runner):
    secret = "boltz-secret-4e1d8b"
    assert runner.run(
        f"print(input() + {secret!r})", stdin=secret, files={"s.txt": base64.b64encode(secret.encode()).decode()}
    ).ok
    r = runner.run(MEMORY_SCAN % (bytes(b + 1 for b in secret.encode()),))
    assert r.ok and r.stdout == "0\n", r


PID_1 = r"""
import ctypes, json, os, resource
out = {}
HARD = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
attempts = {
    "prlimit": lambda: resource.prlimit(1, resource.RLIMIT_NOFILE, (0, 0)),
    "prlimit read": lambda: resource.prlimit(1, resource.RLIMIT_NOFILE),
    "nice": lambda: os.setpriority(os.PRIO_PROCESS, 1, 19),
    "nice group": lambda: os.setpriority(os.PRIO_PGRP, 0, 19),
    "nice user": lambda: os.setpriority(os.PRIO_USER, 0, 19),
    "affinity": lambda: os.sched_setaffinity(1, {0}),
    "scheduler": lambda: os.sched_setscheduler(1, os.SCHED_IDLE, os.sched_param(0)),
    "param": lambda: os.sched_setparam(1, os.sched_param(0)),
    # its own: as under python main.py
    "own nice": lambda: os.nice(1),
    "own limit": lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (256, HARD)),
    "own affinity": lambda: os.sched_setaffinity(0, os.sched_getaffinity(0)),
    "own prlimit": lambda: resource.prlimit(0, resource.RLIMIT_CORE, (0, 0)),
}
for name, attempt in attempts.items():
    try:
        attempt()
        out[name] = "done"
    except OSError as exc:
        out[name] = type(exc).__name__
libc = ctypes.CDLL(None, use_errno=True)
out["hostname"] = [libc.sethostname(b"leak", 4), ctypes.get_errno()]  # (no capability in its namespaces)
print(json.dumps(out))
"""


def test_a_program_changes_nothing_of_its_pid_1(runner):
    """Its PID 1 is the only process of the runner it can name (the env and the zygote are in the
    namespace above), and it has the program's uid: the programs' filter refuses the calls that
    would change its limits, priority, scheduling or CPUs (which could starve it past the program's
    deadline, or keep it from reporting); the same calls on the program itself work."""
    r = runner.run(PID_1)
    assert r.ok, r
    out = json.loads(r.stdout)
    refused = ["prlimit", "prlimit read", "nice", "nice group", "nice user", "affinity", "scheduler", "param"]
    assert {k: out[k] for k in refused} == dict.fromkeys(refused, "PermissionError"), out
    assert [out[k] for k in ("own nice", "own limit", "own affinity", "own prlimit")] == ["done"] * 4, out
    assert out["hostname"] == [-1, errno.EPERM], out
    s = survey(runner)
    assert s["nice"] == 0 and s["pids"] == [1, 2], s


def test_a_programs_files_go_in_and_come_out(runner):
    """A request's files land where SandboxFusion puts them (relative: the workspace; absolute: the
    sandbox's places), the program's own writes are fetched (through a symlink that stays in the
    places too), and none of it is there for the next program."""
    files = {"in/a.txt": "YQ==", "/tmp/b.txt": "Yg==", "/mnt/data/c.csv": "Yw=="}
    code = (
        "import os\n"
        "print(open('in/a.txt').read(), open('/tmp/b.txt').read(), open('/mnt/data/c.csv').read(), input())\n"
        "open('out.txt', 'w').write('o'); open('/home/h.txt', 'w').write('h'); os.symlink('/home/h.txt', 'link')\n"
    )
    r = runner.run(
        code, files=files, stdin="s", fetch_files=["out.txt", "/home/h.txt", "link", "missing", "/tmp/b.txt"]
    )
    assert r.ok and r.stdout == "a b c s\n", r
    got = {k: base64.b64decode(v).decode() for k, v in r.files.items()}
    assert got == {"out.txt": "o", "/home/h.txt": "h", "link": "h", "/tmp/b.txt": "b"}, got
    s = survey(runner)
    assert s["workspace"] == ["main.py"] and s["home"] == kept("/home") and "b.txt" not in s["tmp"], s


HOSTILE_BASH = r"""
echo left > /tmp/x; echo left > /dev/shm/y; echo left > z; mkdir -p /home/h /mnt/m; echo left > /home/h/f
ipcmk -M 4096 >/dev/null && ipcmk -Q >/dev/null && echo ipc
setsid sleep 300 < /dev/null > /dev/null 2>&1 &
(trap '' TERM HUP; exec -a lingering sleep 300) &
hostname sneaky 2>/dev/null || echo "no hostname"
kill -KILL 1; kill -TERM 1; echo "PID 1 signalled"
echo "pid $$"
"""


def test_a_bash_program_runs_in_fresh_namespaces_and_leaves_nothing(runner):
    """Any language runs as Python does: its PID 1 kills what it left running; its files, IPC
    objects and hostname die with its namespaces and places; the next program sees none of it."""
    before = counts(runner)
    r = runner.run(HOSTILE_BASH, language="bash")
    assert r.ok, r
    # (the kernel drops a signal its namespace's PID 1 has no handler for: P lives on and reports)
    assert r.stdout.split("\n")[-3:] == ["PID 1 signalled", "pid 2", ""] and "ipc" in r.stdout, r.stdout
    s = survey(runner)
    assert s["pids"] == [1, 2] and s["me"] == 2, s  # no sleep left, nothing of the env
    assert s["workspace"] == ["main.py"] and s["shm"] == kept("/dev/shm"), s
    assert s["tmp"] == sorted([".boltzlabs_runner", ".boltzlabs_runner/stdin", *kept("/tmp")]), s
    assert s["home"] == kept("/home") and s["mnt"] == kept("/mnt"), s
    assert s["ipc"] == {"shm": [], "msg": [], "sem": []} and s["sockets"] == [], s
    hostname = runner.run("hostname", language="bash")
    assert hostname.stdout.strip() != "sneaky", hostname
    fresh, wipes, hard_resets = counts(runner)
    assert (fresh - before[0], wipes, hard_resets) == (3, before[1], before[2]), runner.stats()


def test_a_bash_program_gets_its_signals_files_and_stdin_as_usual(runner):
    """Its PID 1 blocks every signal; what it starts gets the usual mask back (``yes`` ends on
    SIGPIPE, a trap runs). Files go in and come out, stdin is the request's."""
    r = runner.run(
        "yes | head -n 1\ntrap 'echo trapped' USR1; kill -USR1 $$\ncat in.txt; cat > out.txt",
        language="bash",
        stdin="from stdin",
        files={"in.txt": base64.b64encode(b"brought\n").decode()},
        fetch_files=["out.txt"],
    )
    assert r.ok and r.stdout == "y\ntrapped\nbrought\n" and r.stderr == "", r
    assert base64.b64decode(r.files["out.txt"]) == b"from stdin", r.files


def test_a_compiled_program_runs_in_fresh_namespaces_too(runner):
    """A C++ program is compiled and run by its PID 1: compile errors, timeouts and a daemon it
    starts behave as with a hard reset after it, and nothing is reset."""
    if runner.languages.get("cpp") is not None:
        pytest.skip(f"no C++ toolchain here: {runner.languages['cpp']}")
    before = counts(runner)
    broken = runner.run("int main() { return undefined_name; }", language="cpp")
    assert broken.status == "Failed" and broken.run_result is None, broken
    assert broken.compile_result.return_code != 0 and "undefined_name" in broken.stderr, broken
    daemon = (
        "#include <cstdio>\n#include <unistd.h>\nint main() { if (fork() == 0) { setsid(); sleep(300); }"
        ' FILE *f = fopen("/tmp/left", "w"); fputs("x", f); fclose(f); puts("hi"); fflush(stdout); sleep(300); }'
    )
    r = runner.run(daemon, language="cpp", run_timeout=1)
    assert r.run_result.status == "TimeLimitExceeded" and r.stdout == "hi\n", r
    s = survey(runner)
    assert s["pids"] == [1, 2] and "left" not in s["tmp"] and s["workspace"] == ["main.py"], s
    assert counts(runner)[2] == before[2], runner.stats()  # no hard reset


def test_a_request_p_could_not_write_fails_before_it_and_keeps_the_env(runner):
    """Code that cannot be written as UTF-8 (a lone surrogate) fails the run in the env, before any
    process runs, as a Python program's does: no hard reset follows."""
    before = counts(runner)
    for language in ("bash", "python"):
        r = runner.run("echo '\ud800'", language=language)
        assert r.status == "SandboxError" and "surrogates not allowed" in r.message, r
    assert counts(runner)[2] == before[2], runner.stats()


def test_no_import_looks_in_the_programs_workspace(runner):
    """The namespaces' PID 1 works in the program's workspace: the current directory is not on its
    import path (a planted ``json.py`` is never run), and a Python program's path is that of
    ``python main.py``: its own directory first, no current directory."""
    planted = {name: base64.b64encode(b"raise SystemExit(9)\n").decode() for name in ("json.py", "base64.py", "shutil.py")}
    for language, code in (("bash", "echo hi"), ("cpp", "int main() { return undefined; }")):
        r = runner.run(code, language=language, files=planted, fetch_files=["json.py"])
        assert r.status in ("Success", "Failed") and "json.py" in r.files, r
    path = json.loads(runner.run("import json, sys; print(json.dumps(sys.path))").stdout)
    assert path[0] == "/workspace" and "" not in path and "." not in path, path


def hard_reset(runner) -> None:
    """Have the env hard-reset: a program that leaves a socket alive past it (see below)."""
    before = counts(runner)[2]
    assert runner.run(SOCKET_CYCLES["no name"]).stdout == "left\n"
    assert counts(runner)[2] == before + 1, runner.stats()


FROM_A_VENV = r"""
import json, os, sys
from boltzlabs_gym.code import CodeRunner

with CodeRunner(envs_per_lane=1, lanes=1, isolation=os.environ["ISOLATION"], python=None, wipe=False) as r:
    out = {"backend": r.isolation.backend, "unavailable": r.fresh_unavailable}
    if r.fresh_unavailable is None:
        runs = r.run_many(["import sys; open('/tmp/x', 'w'); print(sys.prefix)"] * 3)
        out["runs"] = [(x.status, x.stdout, x.run_result.stderr[-300:]) for x in runs]
        s = r.stats()
        out["fresh"], out["hard_resets"] = s.fresh, s.hard_resets
print(json.dumps(out))
"""


@pytest.mark.parametrize("place", ["/tmp", "/dev/shm"])
def test_programs_run_fresh_with_the_interpreter_under(place):
    """The project run from a venv under a place that gets a fresh tmpfs per program: the
    interpreter's tree (bound read-only by the sandbox) is carried onto each program's own mount."""
    import os

    from test_wipe_places import _venv_in, run_in_venv

    if not os.access(place, os.W_OK):
        pytest.skip(f"{place} is not writable here")
    path = _venv_in(place)
    out = run_in_venv(path, FROM_A_VENV)
    if out["unavailable"] is not None:
        pytest.skip(f"no fresh namespaces per program under {out['backend']}: {out['unavailable']}")
    assert out["runs"] == [["Success", path + "\n", ""]] * 3, out
    assert (out["fresh"], out["hard_resets"]) == (3, 0), out


def test_where_fresh_namespaces_cannot_be_made_it_says_why_once_at_start_up(caplog):
    """The ``process`` backend gives an env no PID namespace of its own to make them in: every
    program is followed by a hard reset, and the runner says so once, naming the cause."""
    with (
        caplog.at_level("WARNING", logger="boltzlabs_gym.code"),
        CodeRunner(envs_per_lane=2, lanes=1, isolation="process", wipe=False) as r,
    ):
        assert r.fresh_unavailable is not None and "not PID 1 of its own PID namespace" in r.fresh_unavailable
        assert not r.fresh_in_force
        said = [m for m in caplog.messages if "fresh namespaces" in m]
        assert len(said) == 1 and r.fresh_unavailable in said[0], caplog.messages
        assert [x.stdout for x in r.run_many(["print(1)"] * 4)] == ["1\n"] * 4
        assert (r.stats().fresh, r.stats().hard_resets) == (0, 4)
    assert len([m for m in caplog.messages if "fresh namespaces" in m]) == 1, caplog.messages


SOCKET_CYCLES = {
    # its own fd in flight in its own queue: a cycle that outlives every process, until the kernel's
    # unix collector runs (when some unix socket is released somewhere on the host)
    "abstract name": r"""
import socket
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
s.bind(b"\0boltz-leak-in-a-name"); s.connect(b"\0boltz-leak-in-a-name")
socket.send_fds(s, [b"x"], [s.fileno()])
print("left")
""",
    "a name of blanks": r"""
import os, socket
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
s.bind(" \t "); s.connect(" \t ")
socket.send_fds(s, [b"x"], [s.fileno()])
print("left")
""",
    "no name": r"""
import socket
a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
socket.send_fds(b, [b"x"], [a.fileno(), b.fileno()])
print("left")
""",
}


@pytest.mark.parametrize("how", sorted(SOCKET_CYCLES))
def test_a_socket_kept_alive_past_its_program_gets_the_env_hard_reset(runner, how):
    """The programs of an env share its network namespace: a unix socket that outlives its program
    (a cycle of passed fds), named or not, is found by its PID 1, and the env is hard-reset before
    the next program could see it, its name, or connect to it."""
    count = "print(len(open('/proc/net/unix').read().splitlines()) - 1)"  # (the env's own are there too)
    sockets = runner.run(count).stdout
    before = counts(runner)
    r = runner.run(SOCKET_CYCLES[how])
    assert r.stdout == "left\n", r
    assert counts(runner)[2] == before[2] + 1, runner.stats()
    assert runner.run(count).stdout == sockets


def test_no_program_makes_a_user_namespace(runner):
    """The pools let the envs make user namespaces for the zygote alone: no program can, in any
    language (the programs' filter refuses them; the env refuses them to itself and all it forks)."""
    unshare = (
        "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nprint(libc.unshare(0x10000000), ctypes.get_errno())"
    )
    assert runner.run(unshare).stdout.split() == ["-1", str(errno.EPERM)]
    r = runner.run("unshare -U true && echo made || echo refused", language="bash")
    if "not found" in r.run_result.stderr:
        pytest.skip("no unshare(1) in the sandbox")
    assert r.stdout == "refused\n", r


def test_after_a_hard_reset_the_zygote_holds_no_request_either(runner):
    """An env forked afresh after a hard reset makes its zygote at its reset, before the next
    request: the Python program after it finds no copy of its request in the next one."""
    secret = "boltz-secret-91c2aa"
    hard_reset(runner)
    files = {"s.txt": base64.b64encode(secret.encode()).decode()}
    assert runner.run(f"print(input() + {secret!r})", stdin=secret, files=files).ok
    r = runner.run(MEMORY_SCAN % (bytes(b + 1 for b in secret.encode()),))
    assert r.ok and r.stdout == "0\n", r


def test_files_a_program_hides_are_not_fetched_and_stdin_may_be_a_file_too(runner):
    """Its PID 1 fetches as the program's uid, without capabilities: a file it made unreadable is
    left out, as on the wipe path. A request file where stdin goes is replaced by stdin, as there."""
    r = runner.run(
        "import os\nopen('secret', 'w').write('s'); os.chmod('secret', 0)\nopen('plain', 'w').write('p')\n",
        fetch_files=["secret", "plain"],
    )
    assert r.ok and sorted(r.files) == ["plain"], r
    r = runner.run("print(input())", stdin="in", files={"/tmp/.boltzlabs_runner/stdin": "ZmlsZQ=="})
    assert r.ok and r.stdout == "in\n", r


def test_after_a_hard_reset_a_program_still_recurses_as_under_python_main_py(runner, tmp_path):
    """An env forked after a hard reset takes the first env's calibration of the runner's levels
    instead of running a trial of its own: its programs recurse as deep as under ``python main.py``."""
    import sys

    from test_runner import DEPTH, _as_python_runs_it, _as_ran

    code = DEPTH["deepest"]
    expected = _as_python_runs_it(runner.python or sys.executable, code, tmp_path / "deepest")
    hard_reset(runner)
    assert _as_ran(runner.run(code)) == expected
