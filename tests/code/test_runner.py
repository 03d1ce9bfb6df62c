"""The code runner on a real local pool: languages, limits, files, a clean sandbox per program."""

from __future__ import annotations

import asyncio
import base64
import json
import re
import shutil
import subprocess
import sys
import time

import pytest

from boltzlabs_gym.code import AsyncCodeRunner, CodeRunner, QueueFullError, RunRequest
from conftest import ISOLATION

CAP = 4096


@pytest.fixture(scope="module")
def runner():
    with CodeRunner(envs_per_lane=4, lanes=1, isolation=ISOLATION, max_output_bytes=CAP, max_run_timeout=10) as r:
        yield r


def test_python_stdin_stdout_and_exit_codes(runner):
    ok, exc, exit3, syntax = runner.run_many(
        [
            {"code": "print(input()[::-1])", "stdin": "abc"},
            "raise ValueError('nope')",
            "import sys; print('out'); sys.exit(3)",
            "def f(:\n",
        ]
    )
    assert (ok.status, ok.run_result.stdout, ok.run_result.return_code) == ("Success", "cba\n", 0)
    assert exc.status == "Failed" and exc.run_result.return_code == 1
    assert "ValueError: nope" in exc.stderr and "main.py" in exc.stderr
    assert (exit3.status, exit3.run_result.return_code, exit3.stdout) == ("Failed", 3, "out\n")
    assert syntax.status == "Failed" and "SyntaxError" in syntax.stderr
    assert ok.isolation == runner.isolation.backend


START_STATE = r"""
import atexit, json, os, signal, sys, threading, time
state = {
    "sigint": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
    "sigpipe": signal.getsignal(signal.SIGPIPE) == signal.SIG_DFL,
    "mask": sorted(signal.pthread_sigmask(signal.SIG_BLOCK, [])),
    "umask": os.umask(0o22), "cwd_is_home": os.getcwd() == os.environ["HOME"], "env": sorted(os.environ),
    "stdout_seekable": sys.stdout.seekable(), "stdin": sys.stdin.read(),
}
print(json.dumps(state))
def late():
    time.sleep(0.2); print("thread joined", flush=True)
threading.Thread(target=late).start()
atexit.register(lambda: print("atexit ran", flush=True))
"""


def test_a_python_program_starts_as_a_fresh_interpreter_would_and_exits_as_one(runner):
    """What the zygote sets up once for every program (handlers, mask, umask, cwd, environment,
    streams) is what a fresh ``python main.py`` has; its threads are joined and its atexit run."""
    for _ in range(2):  # (the second program of an env too)
        r = runner.run(START_STATE, stdin="in")
        assert r.ok, r
        first, *rest = r.run_result.stdout.splitlines()
        state = json.loads(first)
        assert state == {
            "sigint": True, "sigpipe": True, "mask": [], "umask": 0o22, "cwd_is_home": True,
            "env": ["HOME", "LANG", "PATH", "PYTHONDONTWRITEBYTECODE", "PYTHONUNBUFFERED"],
            "stdout_seekable": False, "stdin": "in",
        }, state  # fmt: skip
        assert rest == ["thread joined", "atexit ran"], r.run_result.stdout


THREADS_AND_FORKS = """
import logging, os, threading
print(threading.active_count(), threading.current_thread() is threading.main_thread())
stop = threading.Event()
t = threading.Thread(target=stop.wait)
t.start()
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    os.write(w, str(threading.active_count()).encode())
    os._exit(0)
os.waitpid(pid, 0)
print(threading.active_count(), os.read(r, 10).decode())
stop.set(); t.join()
logging.warning("logged")
print(threading.active_count())
"""


def test_a_python_program_runs_threads_and_forks_as_under_a_fresh_interpreter(runner):
    """Programs are forked without the standard library's thread bookkeeping (their zygote or env
    has one thread); each puts it back first, so a fork it makes while a thread runs rebuilds the
    registry (the child sees one thread) as under ``python main.py``."""
    with CodeRunner(envs_per_lane=1, lanes=1, isolation=ISOLATION, wipe=False) as hard_reset:
        # forked by the zygote (wiped envs), and by the env itself (a hard reset after each program)
        for which in (runner, runner, hard_reset, hard_reset):
            r = which.run(THREADS_AND_FORKS)
            assert r.ok, r
            assert r.run_result.stdout.splitlines() == ["1 True", "2 1", "1"], r.run_result.stdout
            assert "WARNING:root:logged" in r.run_result.stderr, r.run_result.stderr


UNCAUGHT = {
    "chained": "try:\n    1/0\nexcept ZeroDivisionError as e:\n    raise KeyError('k') from e\n",
    "own hook": "import sys\nsys.excepthook = lambda t, v, tb: print('hook', t.__name__, v, file=sys.stderr)\nraise OSError(5)\n",
    "failing hook": "import sys\ndef hook(t, v, tb):\n    raise TypeError('hook broke')\nsys.excepthook = hook\nraise OSError(5)\n",
    # (its traceback counts the repeated frames: as many as python main.py's only at the same depth)
    "endless recursion": "def r(n):\n    return r(n + 1)\nr(0)\n",
}


def test_an_uncaught_exception_is_reported_as_the_interpreter_reports_it(runner, tmp_path):
    """Through ``sys.excepthook`` (the program's own where it set one) and from the program's own
    first frame: the same stderr, byte for byte, as ``python main.py`` in a directory of its own."""
    results = runner.run_many(list(UNCAUGHT.values()))
    for (name, code), r in zip(UNCAUGHT.items(), results):
        expected = _as_python_runs_it(runner.python or sys.executable, code, tmp_path / name.replace(" ", "_"))
        assert _as_ran(r) == expected, name
    assert "hook OSError 5" in results[1].run_result.stderr


RECURSION = "n = 0\ndef r():\n    global n\n    n += 1\n    r()\ntry:\n    r()\nexcept RecursionError:\n    pass\n"
#: programs whose output depends on how deep they start: the runner's frames below them must not count
DEPTH = {
    "deepest": "import sys\n" + RECURSION + "print(n, sys.getrecursionlimit())\n",
    "own limit": "import sys\nsys.setrecursionlimit(50)\n" + RECURSION + "print(n, sys.getrecursionlimit())\n",
    "limit too low": "import sys\ndef f(k):\n    if k:\n        return f(k - 1)\n    sys.setrecursionlimit(5)\nf(20)\n",
    "bad limits": "import sys\nfor bad in (0, 2.5, 'x'):\n    try:\n        sys.setrecursionlimit(bad)\n"
    "    except Exception as e:\n        print(type(e).__name__, e)\nprint(sys.getrecursionlimit())\n",
}


def _as_python_runs_it(python: str, code: str, where, name: str = "main.py", *args: str) -> tuple[int, str, str]:
    """``python [args] main.py``'s exit status, stdout and stderr, in a directory of its own."""
    where.mkdir()
    (where / name).write_text(code)
    ran = subprocess.run([python, *args, name], cwd=where, capture_output=True, text=True)
    return ran.returncode, ran.stdout, re.sub(r'File "[^"]*main\.py"', 'File "main.py"', ran.stderr)


def _as_ran(r) -> tuple[int, str, str]:
    """A run's exit status, stdout and stderr, its script named as :func:`_as_python_runs_it` names it."""
    return (
        r.run_result.return_code,
        r.run_result.stdout,
        re.sub(r'File "[^"]*main\.py"', 'File "main.py"', r.run_result.stderr),
    )


def test_a_program_recurses_as_deep_as_under_python_main_py_on_both_paths(runner, tmp_path):
    """The runner's own frames below a program (about twenty levels: its env's, its zygote's) do not
    count against the program's recursion limit, forked by the zygote or by a fresh env: how deep it
    gets, the limit it reads and sets, and what the interpreter says, as under ``python main.py``."""
    python = runner.python or sys.executable
    expected = [_as_python_runs_it(python, code, tmp_path / name.replace(" ", "_")) for name, code in DEPTH.items()]
    assert expected[0][1].split()[1] == "1000"
    with CodeRunner(envs_per_lane=1, lanes=1, isolation=ISOLATION, wipe=False) as hard_reset:
        for which in (runner, hard_reset):
            for name, r, theirs in zip(DEPTH, which.run_many(list(DEPTH.values())), expected):
                assert _as_ran(r) == theirs, name


def test_a_pytest_program_recurses_as_deep_as_under_python_m_pytest(runner, tmp_path):
    """The same for a program run as a module (``python -m pytest``), from a warm zygote; without
    the wipe, from a warm zygote that clones each program's namespaces (its own calibration)."""
    if runner.languages.get("pytest") is not None:
        pytest.skip(f"pytest cannot run on this host: {runner.languages['pytest']}")
    code = (
        "n = 0\ndef r():\n    global n\n    n += 1\n    r()\n"
        "def test_deep():\n    try:\n        r()\n    except RecursionError:\n        pass\n"
        "    assert n < 0, f'depth {n}'\n"
    )
    python = runner.python or sys.executable
    _, expected, _ = _as_python_runs_it(python, code, tmp_path / "t", "main_test.py", "-m", "pytest")
    assert re.search(r"depth \d+", expected), expected
    with CodeRunner(envs_per_lane=1, lanes=1, isolation=ISOLATION, wipe=False) as fresh:
        for which in (runner, fresh):
            r = which.run(code, language="pytest")
            assert re.findall(r"depth \d+", r.run_result.stdout) == re.findall(r"depth \d+", expected), which.wipe
        assert fresh.fresh_unavailable is not None or fresh.stats().fresh == 1, fresh.stats()


def test_each_program_draws_its_own_random_numbers_as_a_fresh_interpreter_does(runner):
    """Programs are forked from one warm interpreter, so they would all repeat its random state;
    ``random``'s own at-fork hook gives each a fresh one (the runner does not seed it again)."""
    code = "import random; print(random.getrandbits(64), random.random())"
    with CodeRunner(envs_per_lane=1, lanes=1, isolation=ISOLATION, wipe=False) as hard_reset:
        for which in (runner, hard_reset):  # forked by the zygote, and by a fresh env itself
            draws = [r.run_result.stdout for r in which.run_many([code] * 6)]
            assert all(d.count(" ") == 1 for d in draws), draws
            assert len(set(draws)) == len(draws), draws


def test_timeout_kills_the_tree_and_the_next_program_finds_nothing_left(runner):
    r = runner.run(
        "import subprocess, time\n"
        "subprocess.Popen(['sleep', '600'], start_new_session=True)\n"
        "while True: time.sleep(0.01)\n",
        run_timeout=1,
    )
    assert r.status == "Failed"
    assert r.run_result.status == "TimeLimitExceeded" and r.run_result.return_code is None
    assert 1.0 <= r.run_result.execution_time < 2.0
    after = runner.run_many(
        ["import os\nprint(sorted(open(f'/proc/{p}/cmdline').read() for p in os.listdir('/proc') if p.isdigit()))"] * 4
    )
    for a in after:
        assert a.ok and "sleep" not in a.stdout, a


def test_files_in_fetched_out_and_gone_for_the_next_program(runner):
    data = base64.b64encode(b"hello").decode()
    r = runner.run(
        "print(open('in/data.txt').read()); open('out.bin', 'wb').write(bytes(range(4)))",
        files={"in/data.txt": data},
        fetch_files=["out.bin", "missing.txt"],
    )
    assert r.ok and r.stdout == "hello\n"
    assert r.files == {"out.bin": base64.b64encode(bytes(range(4))).decode()}
    again = runner.run_many(["import os; print(sorted(os.listdir('.')), os.listdir('/tmp'))"] * 4)
    for a in again:
        assert a.stdout.startswith("['main.py']"), a.stdout


def test_output_is_cut_and_says_so_binary_output_decodes(runner):
    big, garbage, closed = runner.run_many(
        [
            f"import sys; sys.stdout.write('x' * {CAP * 3}); sys.stderr.write('e' * 10)",
            "import os; os.write(1, bytes(range(256)) * 4)",
            "import os; os.close(1); os.close(2); print('lost')",
        ]
    )
    assert big.ok and len(big.stdout) == CAP and big.run_result.truncated == {"stdout": CAP * 2}
    assert big.stderr == "e" * 10
    assert garbage.ok and len(garbage.stdout) > 0 and "\ufffd" in garbage.stdout
    assert closed.status == "Failed" and closed.run_result.status == "Finished"


def test_memory_limit_and_fork_bomb(runner):
    hog, bomb = runner.run_many(
        [
            {"code": "x = bytearray(512 << 20); print(len(x))", "memory_limit_mb": 128},
            {"code": "import os\nwhile True:\n    try: os.fork()\n    except OSError: pass\n", "run_timeout": 1},
        ]
    )
    if runner.memory_limit_by == "rlimit":  # RLIMIT_AS: the allocation fails
        assert hog.status == "Failed" and "MemoryError" in hog.stderr
    else:  # the cgroup: the kernel's OOM killer ends the program, as SandboxFusion's cgroup would
        assert hog.status == "Failed" and (hog.run_result.status, hog.run_result.return_code) == ("Finished", -9)
    assert bomb.status == "Failed" and bomb.run_result.status == "TimeLimitExceeded"
    assert runner.run("print(2)").stdout == "2\n"


def test_other_languages(runner):
    requests = [RunRequest("echo hi; echo err >&2; exit 4", language="bash")]
    # Where the runner can run them (g++ without Boost cannot run SandboxFusion's cpp: it says so).
    cpp_runs = runner.languages.get("cpp") is None
    node_runs = runner.languages.get("nodejs") is None
    if cpp_runs:
        requests += [
            RunRequest(
                '#include <cstdio>\nint main(){int a; scanf("%d",&a); printf("%d\\n", a*2);}', "cpp", stdin="21"
            ),
            RunRequest("int main( {", "cpp"),
        ]
    if node_runs:
        requests.append(RunRequest("console.log(6 * 7)", "nodejs"))
    results = runner.run_many(requests)
    bash = results[0]
    assert (bash.status, bash.stdout, bash.stderr, bash.run_result.return_code) == ("Failed", "hi\n", "err\n", 4)
    if cpp_runs:
        cpp, broken = results[1], results[2]
        assert cpp.ok and cpp.stdout == "42\n" and cpp.compile_result.return_code == 0
        assert broken.status == "Failed" and broken.run_result is None and broken.compile_result.return_code != 0
    if node_runs:
        assert results[-1].ok and results[-1].stdout == "42\n"


@pytest.mark.skipif(not shutil.which("mcs"), reason="no Mono (mono-mcs)")
def test_csharp_runs_as_sandboxfusions_dotnet_run(runner):
    """dotnet's implicit usings (``Console`` without ``using System;``), and a failed ``Debug.Assert``
    ending the program as it does in dotnet's Debug build (C# test harnesses assert with it)."""
    bare = "class P { static void Main() { Console.WriteLine(Convert.ToInt32(Console.ReadLine()) + 1); } }"
    asserting = 'using System.Diagnostics;\nclass P {\n static void Main() { Debug.Assert(1 == 2, "no"); }\n}'
    ok, failed = runner.run_many([RunRequest(bare, "csharp", stdin="41"), RunRequest(asserting, "csharp")])
    assert ok.ok and ok.stdout == "42\n"
    assert failed.status == "Failed" and failed.run_result.return_code == 134
    assert "Assertion failed.\nno\n" in failed.stderr and "Program.cs:3" in failed.stderr


def test_grading_helpers_and_async_face(runner):
    g = runner.grade_stdio("print(int(input()) * 2)", ["1", "2", "x"], ["2", "5", "0"])
    assert g.passed == [True, False, False] and g.score == pytest.approx(1 / 3)
    a = runner.grade_asserts("def f(x):\n    return x + 1", ["assert f(1) == 2", "assert f(2) == 4"])
    assert a.passed == [True, False] and "AssertionError" in a.results[1].stderr

    async def main():
        aio = AsyncCodeRunner(runner=runner)
        one = await aio.run("print('a')")
        many = await aio.run_many(["print('b')", {"code": "echo c", "language": "bash"}])
        grade = await aio.grade_asserts("x = 1", ["assert x == 1"])
        return one, many, grade

    one, many, grade = asyncio.run(main())
    assert one.stdout == "a\n" and [m.stdout for m in many] == ["b\n", "c\n"] and grade.all_passed


def test_cancelling_a_running_task_kills_its_program_at_once(runner):
    before = runner.stats()

    async def main():
        aio = AsyncCodeRunner(runner=runner)
        task = asyncio.ensure_future(aio.run("import time\nwhile True: time.sleep(0.01)", run_timeout=10))
        while runner.stats().running == 0:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        cancelled_at = time.monotonic()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        while runner.stats().running:  # the lane's batch ends when the worker has killed the env
            await asyncio.sleep(0.01)
        return time.monotonic() - cancelled_at

    assert asyncio.run(main()) < 2.0
    after = runner.stats()
    assert after.cancelled == before.cancelled + 1 and after.hard_resets == before.hard_resets + 1
    assert after.timeouts == before.timeouts and after.runs == before.runs  # not a run that ended
    assert runner.run("print(3)").stdout == "3\n"


def test_bad_requests_are_refused_before_running(runner):
    with pytest.raises(ValueError, match="supported: python, pytest, bash, cpp, nodejs, .*, verilog"):
        runner.submit({"code": "x", "language": "cobol"})
    with pytest.raises(ValueError, match="run_timeout"):
        runner.submit({"code": "x", "run_timeout": 11})
    limit, runner.max_queue = runner.max_queue, 0
    try:
        with pytest.raises(QueueFullError):
            runner.submit("print(1)")
    finally:
        runner.max_queue = limit
    stats = runner.stats()
    assert stats.runs[("python", "Success")] > 0 and stats.timeouts >= 2 and stats.queued == 0


def test_where_the_wipe_cannot_run_it_says_why_once_at_start_up(caplog):
    """The ``process`` backend gives a boltz env no PID namespace of its own: every program is
    followed by a hard reset, and the runner says so once, naming the cause, before any program."""
    with (
        caplog.at_level("WARNING", logger="boltzlabs_gym.code"),
        CodeRunner(envs_per_lane=2, lanes=1, isolation="process") as r,
    ):
        assert r.wipe_unavailable is not None and "not PID 1 of its own PID namespace" in r.wipe_unavailable
        said = [m for m in caplog.messages if "hard-reset" in m]
        assert len(said) == 1 and r.wipe_unavailable in said[0], caplog.messages
        assert [x.run_result.stdout for x in r.run_many(["print(1)"] * 4)] == ["1\n"] * 4
        assert (r.stats().wipes, r.stats().hard_resets) == (0, 4)
    assert len([m for m in caplog.messages if "hard-reset" in m or "not clean" in m]) == 1, caplog.messages
    with CodeRunner(envs_per_lane=1, lanes=1, isolation="process", wipe=False) as r:
        assert r.wipe_unavailable is None  # (not asked for: nothing to say)


def test_clients_wait_in_lines_of_their_own_and_a_cancelled_run_leaves_its_line_at_once(runner):
    before = runner.stats()
    busy = [runner.submit("import time; time.sleep(1)", client="a") for _ in range(runner.capacity)]
    while runner.stats().running < runner.capacity:  # every env holds one of a's
        time.sleep(0.01)
    waiting = [runner.submit(f"print({i})", client="a") for i in range(2)]
    other = runner.submit("print('b')", client="b")
    assert runner.stats().queued_by_client == {"a": 2, "b": 1}
    bound, runner.max_queue_per_client = runner.max_queue_per_client, 2
    try:
        with pytest.raises(QueueFullError) as full:
            runner.submit("print(3)", client="a")
        assert full.value.per_client and full.value.client == "a"
        assert runner.cancel(waiting[1])  # its place is free at once: a may queue again
        assert runner.stats().queued_by_client == {"a": 1, "b": 1}
        again = runner.submit("print(3)", client="a")
    finally:
        runner.max_queue_per_client = bound
    assert [f.result().stdout for f in (waiting[0], other, again)] == ["0\n", "b\n", "3\n"]
    assert all(f.result().ok for f in busy)
    after = runner.stats()
    assert after.cancelled == before.cancelled + 1 and after.queued == 0 and after.queued_by_client == {}


def test_programs_running_at_once_get_their_own_stdin_on_the_process_backend():
    """Envs of the ``process`` backend share the host's /tmp: each keeps its programs' stdin (and
    C++ binary) in its own workspace, so programs running at once do not read each other's."""
    with CodeRunner(envs_per_lane=4, lanes=1, isolation="process") as r:
        runs = [{"code": "import time; time.sleep(0.05); print(input())", "stdin": f"stdin {i}"} for i in range(12)]
        assert [x.run_result.stdout for x in r.run_many(runs)] == [f"stdin {i}\n" for i in range(12)]
        if r.languages.get("cpp") is None:  # (g++ without Boost: the runner says cpp cannot run)
            cpp = "#include <iostream>\nint main(){std::cout<<%d<<std::endl;}"
            got = r.run_many([{"code": cpp % i, "language": "cpp"} for i in range(4)])
            assert [x.run_result.stdout for x in got] == [f"{i}\n" for i in range(4)], got


SPECULATION = (
    "for line in open('/proc/self/status'):\n"
    "    if line.startswith(('Seccomp:', 'Speculation')):\n"
    "        print(line.strip())\n"
)


def test_programs_run_with_the_speculation_controls_of_an_unfiltered_process(runner):
    """A program's seccomp filters (the sandbox's and the program's own, stacked) force none of the
    kernel's speculation mitigations on it: on a kernel that forces them on filtered processes
    (before 5.16), CPU-bound programs would run up to about half as fast as under ``python main.py``."""
    if runner.isolation is None or runner.isolation.properties.get("seccomp") in (None, False):
        pytest.skip(f"no seccomp filter on this host's sandbox ({runner.isolation}): nothing forces anything")
    with open("/proc/self/status") as f:
        mine = sorted(line.strip() for line in f if line.startswith("Speculation"))
    with CodeRunner(envs_per_lane=1, lanes=1, isolation=ISOLATION, wipe=False) as hard_reset:
        for which in (runner, hard_reset):  # forked by a zygote; by a fresh env
            r = which.run(SPECULATION)
            assert r.ok, r
            lines = r.run_result.stdout.splitlines()
            assert "Seccomp:\t2" in lines, lines  # (filtered)
            assert sorted(line for line in lines if line.startswith("Speculation")) == mine, lines
