"""``syscalls.fork_sibling``: a fork whose child is its parent's sibling, and the boltz template's
double fork where the kernel refuses that clone.

The clones run in a child interpreter (``python -c``), never in pytest's process: its sibling is
a child of this test process, which reaps it and checks its exit status.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from boltzlabs_gym.envside import syscalls

pytestmark = pytest.mark.skipif(not syscalls.SUPPORTED, reason=f"no clone syscall number for {syscalls.MACHINE}")


def _run(code: str) -> dict:
    """Run ``code`` in a child interpreter; its last stdout line, as JSON."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def _reap(pid: int) -> int:
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


SIBLING = """
import json, os, sys, threading
from boltzlabs_gym.envside import syscalls as L
r, w = os.pipe()
pid = L.fork_sibling(FLAGS)
if pid == 0:
    os.close(r)
    import decimal  # the import machinery, locks and threads work in the child
    lock = threading.Lock()
    with lock:
        t = threading.Thread(target=lambda: None)
        t.start(); t.join()
    os.write(w, json.dumps({"pid": os.getpid(), "ppid": os.getppid(), "d": str(decimal.Decimal("1.5"))}).encode())
    os._exit(7)
os.close(w)
child = json.loads(os.read(r, 4096))
try:
    os.waitpid(pid, 0)
    ours = True
except ChildProcessError:
    ours = False
other = os.fork()  # this interpreter forks as before
if other == 0:
    os._exit(0)
os.waitpid(other, 0)
print(json.dumps({"pid": pid, "me": os.getpid(), "child": child, "ours": ours}))
"""


def test_the_child_is_a_child_of_its_parents_parent():
    got = _run(SIBLING.replace("FLAGS", "0"))
    assert got["ours"] is False  # not the caller's child...
    assert got["child"]["ppid"] == os.getpid()  # ...but this test process's
    assert got["child"]["pid"] == got["pid"] and got["child"]["d"] == "1.5"
    assert _reap(got["pid"]) == 7  # its exit status comes to us


@pytest.mark.skipif(os.geteuid() != 0, reason="a new PID namespace needs CAP_SYS_ADMIN (not root here)")
def test_a_new_pid_namespace_makes_the_child_its_pid_1():
    got = _run(SIBLING.replace("FLAGS", "L.CLONE_NEWPID"))
    assert got["child"]["pid"] == 1 and got["child"]["ppid"] == 0  # its parent is outside its namespace
    assert got["ours"] is False
    assert _reap(got["pid"]) == 7


def test_a_refused_clone_raises_and_the_interpreter_goes_on():
    # CLONE_SIGHAND without CLONE_VM: the kernel refuses (EINVAL) before any process exists
    got = _run(
        "import json, os\n"
        "from boltzlabs_gym.envside import syscalls as L\n"
        "try:\n"
        "    L.fork_sibling(0x800)\n"
        "    err = None\n"
        "except OSError as exc:\n"
        "    err = [exc.errno, str(exc)]\n"
        "import decimal\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    os._exit(3)\n"
        "print(json.dumps({'err': err, 'status': os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])}))\n"
    )
    assert got["err"][0] == 22 and "clone(CLONE_PARENT" in got["err"][1]
    assert got["status"] == 3


DOUBLE_FORK = """
import errno, json, os, socket
from boltzlabs_gym.envside import forkserver, syscalls as L

def refuse(flags):
    raise OSError(errno.EPERM, "clone(CLONE_PARENT): refused by this test")

L.fork_sibling = refuse
L.prctl(L.PR_SET_CHILD_SUBREAPER, 1)  # as the worker is: the spare is re-parented to us
ctl, _ctl_peer = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
spares = []
for _ in range(2):
    got = forkserver._fork_spare(ctl, ns=False)
    if isinstance(got, tuple):  # in the spare: say who we are and what we got, then exit
        req, fds = got
        said = {"ppid": os.getppid(), "req": req, "first": forkserver._first_message().decode()}
        os.write(fds[0], json.dumps(said).encode())
        os._exit(0)
    r, w = os.pipe()
    socket.send_fds(got, [json.dumps({"n": len(spares)}).encode()], [w])
    os.close(w)
    spares.append(json.loads(os.read(r, 4096)))
    got.close()
while True:
    try:
        os.wait()
    except ChildProcessError:
        break
print(json.dumps({"me": os.getpid(), "spares": spares, "cause": forkserver._double_fork_cause}))
"""


def test_the_template_double_forks_where_the_clone_is_refused():
    got = _run(DOUBLE_FORK)
    assert got["cause"] == "[Errno 1] clone(CLONE_PARENT): refused by this test"
    for n, spare in enumerate(got["spares"]):
        assert spare["req"] == {"n": n}
        assert spare["ppid"] == got["me"]  # re-parented to the subreaper once the intermediate exited
        assert spare["first"] == "p:" + got["cause"]  # and the worker is told why
