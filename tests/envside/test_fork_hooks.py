"""Forks without the standard library's thread bookkeeping (``envside.fork_hooks``): what a child
finds, in a fresh interpreter per test (the test process itself may run threads)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from boltzlabs_gym.envside import fork_hooks

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="forks as the env side does: Linux")


#: The module loaded from its file: the package's own imports (numpy) may start threads of their own.
PRELUDE = f"""
import importlib.util, logging, os, threading
spec = importlib.util.spec_from_file_location("fork_hooks", {fork_hooks.__file__!r})
fork_hooks = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fork_hooks)
"""


def run(script: str) -> str:
    """``script`` in a fresh, single-threaded interpreter with threading and logging imported; its stdout."""
    done = subprocess.run(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(script)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_suspend_swaps_the_two_hooks_for_nothing_and_restore_gives_them_back():
    out = run(
        """
        hooks = [threading._after_fork, logging._after_at_fork_child_reinit_locks]
        own = [h.__code__ for h in hooks]
        print(fork_hooks.suspend(), fork_hooks.suspended(), [h.__code__ is fork_hooks._skip.__code__ for h in hooks])
        print(fork_hooks.suspend())  # (again: nothing more to do)
        fork_hooks.restore()
        print(fork_hooks.suspended(), [h.__code__ is c for h, c in zip(hooks, own)])
        """
    )
    assert out.splitlines() == ["True True [True, True]", "True", "False [True, True]"]


def test_refused_while_another_thread_runs():
    out = run(
        """
        stop = threading.Event()
        t = threading.Thread(target=stop.wait)
        t.start()
        own = threading._after_fork.__code__
        print(fork_hooks.suspend(), fork_hooks.suspended(), threading._after_fork.__code__ is own)
        stop.set(); t.join()
        """
    )
    assert out.split() == ["False", "False", "True"]


def test_a_child_forked_with_them_suspended_runs_threads_and_logs_as_usual():
    """The child of a single-threaded parent needs none of the hooks' work: its threading registry
    and locks are right as copied. It restores them first, so that its own forks, made while it
    runs a thread, get the registry rebuilt (the grandchild sees one thread, not two)."""
    out = run(
        """
        import io, json
        assert fork_hooks.suspend()
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            fork_hooks.restore()
            report = {"main": threading.current_thread() is threading.main_thread(), "count": threading.active_count()}
            stop = threading.Event()
            t = threading.Thread(target=stop.wait)
            t.start()
            report["with_thread"] = threading.active_count()
            gr, gw = os.pipe()
            grandchild = os.fork()
            if grandchild == 0:
                os.write(gw, str(threading.active_count()).encode())
                os._exit(0)
            os.waitpid(grandchild, 0)
            report["grandchild"] = int(os.read(gr, 10))
            stop.set(); t.join()
            report["after_join"] = threading.active_count()
            stream = io.StringIO()
            log = logging.getLogger("child")
            log.addHandler(logging.StreamHandler(stream))
            log.warning("logged")
            report["logged"] = stream.getvalue()
            os.write(w, json.dumps(report).encode())
            os._exit(0)
        fork_hooks.restore()
        os.waitpid(pid, 0)
        print(os.read(r, 4096).decode())
        """
    )
    assert out.strip() == (
        '{"main": true, "count": 1, "with_thread": 2, "grandchild": 1, "after_join": 1, "logged": "logged\\n"}'
    )


def test_the_child_faults_fewer_pages_in():
    """What it is for: the child copies fewer of the parent's pages before its first line (minor
    faults, counted by the kernel; the same interpreter, the same fork, the hooks on and off)."""
    out = run(
        """
        import resource
        r, w = os.pipe()
        faults = {}
        for suspended in (False, True, False, True):
            if suspended:
                fork_hooks.suspend()
            pid = os.fork()
            if pid == 0:
                os.write(w, str(resource.getrusage(resource.RUSAGE_SELF).ru_minflt).encode())
                os._exit(0)
            fork_hooks.restore()
            os.waitpid(pid, 0)
            faults[suspended] = int(os.read(r, 32))  # (the second of each: the parent's pages settled)
        print(faults[False], faults[True])
        """
    )
    with_hooks, without = map(int, out.split())
    assert without < with_hooks - 40, (with_hooks, without)
