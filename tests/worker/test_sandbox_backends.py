"""Isolation backends against real processes: every check runs code inside the env and looks at
what actually happened (no mocks). Every payload is bounded and stops by itself; the only
network used is loopback. Backends the host cannot provide are skipped with the reason."""

from __future__ import annotations

import os
import select
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import time

import psutil
import pytest

import boltzlabs
import boltzlabs_gym
from boltzlabs_gym.worker.memory_snapshots.gate import shared_gate
from boltzlabs_gym.worker.sandbox import LaunchSpec, Limits, select_backend
from boltzlabs_gym.worker.sandbox.base import CONTROL_FD, wipe_workspace
from boltzlabs_gym.worker.sandbox.bwrap import BwrapBackend
from boltzlabs_gym.worker.sandbox.namespaces import NamespaceBackend
from boltzlabs_gym.worker.sandbox.process import ProcessBackend
from conftest import our_cgroups

RUNTIME = {
    "boltzlabs_gym": os.path.dirname(os.path.abspath(boltzlabs_gym.__file__)),
    "boltzlabs": os.path.dirname(os.path.abspath(boltzlabs.__file__)),
}
# The namespaces backend as a worker makes it: with the gate that answers its envs' gated syscalls
# (as root, each env gets the worker's control socket and the filter that hands those calls over).
_BACKENDS = {"namespaces": NamespaceBackend(gate=shared_gate()), "bwrap": BwrapBackend(), "process": ProcessBackend()}
SANDBOXES = ("namespaces", "bwrap")


def _backend(name: str):
    backend = _BACKENDS[name]
    ok, why = backend.available()
    if not ok:
        if name == "namespaces" and os.environ.get("CI") and os.geteuid() == 0:
            pytest.fail(f"CI runs as root and must run the namespace backend: {why}")
        pytest.skip(f"{name} backend unavailable here: {why}")
    return backend


@pytest.fixture(params=["namespaces", "bwrap", "process"])
def backend(request):
    return _backend(request.param)


@pytest.fixture(params=SANDBOXES)
def sandbox(request):
    return _backend(request.param)


@pytest.fixture(autouse=True)
def no_leaks():
    """Every test must leave no child process and no per-env cgroup behind."""
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    cgroups_before = our_cgroups()  # (an in-process worker's, test_deadlines, are checked there)
    yield
    deadline = time.monotonic() + 5
    left = []
    while time.monotonic() < deadline:
        left = [p for p in me.children(recursive=True) if p.pid not in before and _running(p)]
        if not left:
            break
        time.sleep(0.05)
    left_cmdlines = [(p.pid, _cmdline(p)) for p in left]
    for p in left:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    while True:  # reap any zombie children we made
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                break
        except ChildProcessError:
            break
    cgs = sorted(our_cgroups() - cgroups_before)
    assert not left, f"leaked processes: {left_cmdlines}"
    assert not cgs, f"leaked cgroups: {cgs}"


def _running(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return ["(gone)"]


@pytest.fixture
def dirs():
    """A world-readable env dir with one file, and a fresh workspace per call of ``make_ws``."""
    top = tempfile.mkdtemp(prefix="sbxtest-")
    os.chmod(top, 0o755)
    env_dir = os.path.join(top, "env")
    os.mkdir(env_dir, 0o755)
    with open(os.path.join(env_dir, "envfile.txt"), "w") as f:
        f.write("ENV-CONTENT")
    os.chmod(os.path.join(env_dir, "envfile.txt"), 0o644)
    made = []

    def make_ws(name="ws"):
        ws = os.path.join(top, f"{name}{len(made)}")
        os.mkdir(ws, 0o700)
        made.append(ws)
        return ws

    yield env_dir, make_ws, top
    for ws in made:
        if os.path.isdir(ws):
            wipe_workspace(ws)
    subprocess.run(["rm", "-rf", top], check=False)


class Env:
    """One env started through a backend with three pipes."""

    def __init__(self, backend, code: str, env_dir: str, workspace: str, limits: Limits | None = None,
                 index: int = 0, env: dict | None = None, args: tuple = (), at: dict[int, int] | None = None):
        in_r, self.stdin = os.pipe()
        self.stdout, out_w = os.pipe()
        self.stderr, err_w = os.pipe()
        ends = [in_r, out_w, err_w]
        for role, number in (at or {}).items():  # hand the child's end of pipe ``role`` over as fd ``number``
            os.dup2(ends[role], number, inheritable=False)
            os.close(ends[role])
            ends[role] = number
        in_r, out_w, err_w = ends
        spec = LaunchSpec(
            argv=[sys.executable, "-B", "-s", "-c", textwrap.dedent(code), *args],
            env_dir=env_dir, workspace=workspace, stdin_fd=in_r, stdout_fd=out_w, stderr_fd=err_w,
            env={"BOLTZLABS_ENV_INDEX": str(index), **(env or {})},
            limits=limits or Limits(), index=index, runtime=RUNTIME,
        )
        try:
            self.launched = backend.launch(spec)
        finally:
            for fd in (in_r, out_w, err_w):
                os.close(fd)
        self.status = None
        self.out = b""
        self.err = b""

    def send(self, line: str) -> None:
        os.write(self.stdin, line.encode() + b"\n")

    def read_line(self, timeout: float = 20) -> str:
        deadline = time.monotonic() + timeout
        while b"\n" not in self.out:
            left = deadline - time.monotonic()
            assert left > 0, f"no line from env; stderr: {self.err.decode(errors='replace')}"
            ready, _, _ = select.select([self.stdout, self.stderr], [], [], left)
            for fd in ready:
                chunk = os.read(fd, 65536)
                if fd == self.stdout:
                    assert chunk, f"env closed stdout; stderr: {self._drain_err()}"
                    self.out += chunk
                else:
                    self.err += chunk
        line, self.out = self.out.split(b"\n", 1)
        return line.decode()

    def _drain_err(self) -> str:
        while select.select([self.stderr], [], [], 0.5)[0]:
            chunk = os.read(self.stderr, 65536)
            if not chunk:
                break
            self.err += chunk
        return self.err.decode(errors="replace")

    def wait(self, timeout: float = 30):
        """Collect all output and the exit status; kill the tree when the timeout passes."""
        os.close(self.stdin)
        self.stdin = -1
        open_fds = [self.stdout, self.stderr]
        deadline = time.monotonic() + timeout
        while open_fds and time.monotonic() < deadline:
            ready, _, _ = select.select(open_fds, [], [], max(0.0, deadline - time.monotonic()))
            for fd in ready:
                chunk = os.read(fd, 65536)
                if not chunk:
                    open_fds.remove(fd)
                elif fd == self.stdout:
                    self.out += chunk
                else:
                    self.err += chunk
        if open_fds:
            self.launched.kill_tree()
        self.status = self._reap(deadline + 5)
        self.close()
        return self

    def _reap(self, deadline: float):
        while True:
            pid, status = os.waitpid(self.launched.pid, os.WNOHANG)
            if pid:
                return status
            if time.monotonic() > deadline:
                self.launched.kill_tree()
                return os.waitpid(self.launched.pid, 0)[1]
            time.sleep(0.005)

    def kill(self):
        self.launched.kill_tree()
        if self.status is None:
            self.status = os.waitpid(self.launched.pid, 0)[1]
        self.close()

    def close(self):
        self.launched.kill_tree()
        self.launched.cleanup()
        for name in ("stdin", "stdout", "stderr"):
            fd = getattr(self, name)
            if fd >= 0:
                os.close(fd)
                setattr(self, name, -1)

    @property
    def text(self) -> str:
        return self.out.decode(errors="replace")

    @property
    def exit_code(self) -> int:
        return os.waitstatus_to_exitcode(self.status)


def killed_by(env: Env, sig: int) -> bool:
    """Killed by ``sig``; a keeper process (bwrap, the userns keeper) reports it as exit 128+sig."""
    return (os.WIFSIGNALED(env.status) and os.WTERMSIG(env.status) == sig) or env.exit_code == 128 + sig


def run(backend, code, dirs, **kw) -> Env:
    env_dir, make_ws, _ = dirs
    return Env(backend, code, env_dir, kw.pop("workspace", None) or make_ws(), **kw).wait()


# ------------------------------------------------------------------------------------------------ tests
def test_select_backend_and_report():
    for name in ("namespaces", "bwrap", "process"):
        backend = _BACKENDS[name]
        ok, why = backend.available()
        assert isinstance(why, str) and why
        report = backend.report()
        assert report.backend == name
        if ok:
            for key in ("readonly_env_dir", "no_network", "pid_namespace", "memory_limit", "tree_kill"):
                assert key in report.properties
    assert select_backend("process").name == "process"
    if _BACKENDS["namespaces"].available()[0]:
        assert select_backend("auto").name == "namespaces"
        assert select_backend("strict").report().properties["pid_namespace"] is True


def test_environment_paths_and_runtime(backend, dirs, monkeypatch):
    monkeypatch.setenv("BOLTZLABS_TEST_SECRET", "hunter2")
    env = run(backend, """
        import os, json, boltzlabs_gym, boltzlabs.env
        print(json.dumps({"environ": dict(os.environ), "cwd": os.getcwd(), "pkg": boltzlabs_gym.__file__,
                          "envfile": open(os.path.join(os.environ["BOLTZLABS_ENV_DIR"], "envfile.txt")).read(),
                          "proc_environ": open("/proc/self/environ", "rb").read().decode(errors="replace")}))
    """, dirs)
    import json

    assert env.exit_code == 0, env.err
    got = json.loads(env.text)
    environ = got["environ"]
    assert "BOLTZLABS_TEST_SECRET" not in environ and "hunter2" not in got["proc_environ"]
    assert environ["BOLTZLABS_ENV_INDEX"] == "0"
    assert got["envfile"] == "ENV-CONTENT"
    if backend.name == "process":
        assert environ["BOLTZLABS_WORKSPACE"] == os.path.realpath(got["cwd"])
        assert environ["PYTHONPATH"] == os.path.dirname(RUNTIME["boltzlabs_gym"])
    else:
        assert environ["BOLTZLABS_ENV_DIR"] == "/env"
        assert environ["BOLTZLABS_WORKSPACE"] == "/workspace" == got["cwd"]
        assert environ["PYTHONPATH"] == "/opt/boltzlabs"
        assert got["pkg"].startswith("/opt/boltzlabs/boltzlabs_gym/")


def test_host_files_hidden_and_env_dir_readonly(sandbox, dirs):
    _, _, top = dirs
    bait = os.path.join(top, "host_secret.txt")
    with open(bait, "w") as f:
        f.write("HOST-SECRET")
    os.chmod(bait, 0o644)
    env = run(sandbox, f"""
        import os
        def attempt(fn):
            try:
                return "OK " + repr(fn())[:60]
            except OSError as e:
                return "denied " + type(e).__name__
        print("bait", attempt(lambda: open({bait!r}).read()))
        print("root", attempt(lambda: [n for n in os.listdir("/root") if n != ".pyenv"]))
        print("shadow", attempt(lambda: open("/etc/shadow").read()))
        print("write_env", attempt(lambda: open("/env/pwned", "w").write("x")))
        print("write_root", attempt(lambda: open("/pwned", "w").write("x")))
        print("write_usr", attempt(lambda: open("/usr/pwned", "w").write("x")))
        print("write_ws", attempt(lambda: open("/workspace/ok", "w").write("x")))
        print("write_tmp", attempt(lambda: open("/tmp/ok", "w").write("x")))
    """, dirs)
    assert env.exit_code == 0, env.err
    res = dict(line.split(" ", 1) for line in env.text.splitlines())
    assert res["bait"].startswith("denied"), res
    assert res["root"].startswith("denied") or res["root"] == "OK []", res
    assert res["shadow"].startswith("denied"), res
    assert res["write_env"].startswith("denied") and not os.path.exists(os.path.join(dirs[0], "pwned"))
    assert res["write_root"].startswith("denied") and res["write_usr"].startswith("denied")
    assert res["write_ws"].startswith("OK") and res["write_tmp"].startswith("OK")


def test_device_nodes_work_but_their_times_are_not_the_sandboxs_to_set(dirs):
    """The host's device nodes are bound into the sandbox: read and written as usual, but their
    times are the host's (every sandbox reads them), so setting them fails (a read-only bind).
    (bubblewrap binds them writable: it makes every read-only bind ``nodev``, so it cannot.)"""
    sandbox = _backend("namespaces")
    before = {node: os.stat(f"/dev/{node}").st_mtime_ns for node in ("null", "zero")}
    env = run(sandbox, """
        import os
        for node in ("null", "zero", "full", "random", "urandom"):
            path = "/dev/" + node
            with open(path, "rb") as f:
                data = f.read(4) if node != "null" else f.read()
            try:
                with open(path, "wb") as f:
                    f.write(b"x")
                    f.flush()
                wrote = "wrote"
            except OSError as e:
                wrote = type(e).__name__
            try:
                os.utime(path)
                touched = "touched"
            except OSError as e:
                touched = type(e).__name__ + str(e.errno)
            print(node, len(data), wrote, touched)
    """, dirs)
    assert env.exit_code == 0, env.err
    seen = {line.split()[0]: line.split()[1:] for line in env.text.splitlines()}
    assert seen["null"] == ["0", "wrote", "OSError30"] and seen["zero"] == ["4", "wrote", "OSError30"], seen
    assert seen["urandom"][:2] == ["4", "wrote"] and seen["full"][1] == "OSError", seen  # (ENOSPC: /dev/full's)
    assert all(touched == "OSError30" for *_, touched in seen.values()), seen  # EROFS
    assert {node: os.stat(f"/dev/{node}").st_mtime_ns for node in ("null", "zero")} == before


def test_no_network_to_host_loopback(sandbox, dirs):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    port = listener.getsockname()[1]
    try:
        env = run(sandbox, f"""
            import socket
            for fam, addr in ((socket.AF_INET, ("127.0.0.1", {port})), (socket.AF_INET6, ("::1", {port}))):
                try:
                    s = socket.socket(fam)
                    s.settimeout(2)
                    s.connect(addr)
                    print("CONNECTED")
                except OSError as e:
                    print("blocked", type(e).__name__)
        """, dirs)
        assert env.exit_code == 0, env.err
        assert "CONNECTED" not in env.text and env.text.count("blocked") == 2
        assert not select.select([listener], [], [], 0)[0], "the host listener saw a connection"
    finally:
        listener.close()


def test_host_processes_invisible_and_unkillable(sandbox, dirs):
    victim = subprocess.Popen(["sleep", "60"])
    try:
        env = run(sandbox, f"""
            import os, signal
            pids = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
            print("visible", len(pids), {victim.pid} in pids)
            try:
                os.kill({victim.pid}, signal.SIGKILL)
                print("kill SENT")
            except OSError as e:
                print("kill", type(e).__name__)
            try:
                os.kill(-1, signal.SIGKILL) if False else None
            except OSError:
                pass
        """, dirs)
        assert env.exit_code == 0, env.err
        lines = env.text.splitlines()
        assert lines[0].split()[2] == "False" and int(lines[0].split()[1]) <= 3, lines
        assert lines[1] != "kill SENT"
        time.sleep(0.05)
        assert victim.poll() is None, "the host process was killed from inside the sandbox"
    finally:
        victim.kill()
        victim.wait()


def test_fork_bomb_stopped_by_pid_limit(backend, dirs):
    if backend.report().properties.get("process_limit") is False:
        pytest.skip(f"{backend.name} has no process limit here (root without cgroup: RLIMIT_NPROC ignored)")
    env = run(backend, """
        import os, time
        kids, err = [], None
        t0 = time.time()
        while len(kids) < 400 and time.time() - t0 < 10:
            try:
                pid = os.fork()
            except OSError as e:
                err = type(e).__name__
                break
            if pid == 0:
                time.sleep(3)
                os._exit(0)
            kids.append(pid)
        print(len(kids), err, flush=True)
        for pid in kids:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
    """, dirs, limits=Limits(pids=32))
    assert env.exit_code == 0, env.err
    forks, err = env.text.split()
    assert err != "None" and int(forks) < 40, env.text


def test_memory_hog_dies_alone(backend, dirs):
    env_dir, make_ws, _ = dirs
    limits = Limits(memory_bytes=256 << 20)
    sibling = Env(backend, """
        import sys
        print("ready", flush=True)
        line = sys.stdin.readline()
        print("pong" if line.strip() == "ping" else "bad", flush=True)
    """, env_dir, make_ws(), limits=limits, index=1)
    try:
        assert sibling.read_line() == "ready"
        hog = run(backend, """
            try:
                block = bytearray(4 << 30)
                for i in range(0, len(block), 4096):
                    block[i] = 1
                print("ALLOCATED", flush=True)
            except MemoryError:
                print("MemoryError", flush=True)
        """, dirs, limits=limits, index=2)
        assert "ALLOCATED" not in hog.text
        assert "MemoryError" in hog.text or killed_by(hog, signal.SIGKILL), (hog.text, hog.err, hog.status)
        sibling.send("ping")
        assert sibling.read_line() == "pong"
    finally:
        sibling.wait(timeout=10)


def test_file_size_limit(backend, dirs):
    env_dir, make_ws, _ = dirs
    ws = make_ws()
    env = run(backend, """
        import os
        path = os.path.join(os.environ["BOLTZLABS_WORKSPACE"], "big")
        try:
            with open(path, "wb") as f:
                for _ in range(4):
                    f.write(b"x" * (1 << 20))
            print("WROTE")
        except OSError as e:
            print("stopped", type(e).__name__, e.errno)
    """, dirs, workspace=ws, limits=Limits(file_size_bytes=1 << 20))
    assert "WROTE" not in env.text, env.text
    assert os.path.getsize(os.path.join(ws, "big")) <= 1 << 20


def test_background_daemon_gone_after_kill_tree(sandbox, dirs):
    env_dir, make_ws, _ = dirs
    token = f"sbx-daemon-{os.getpid()}-{time.monotonic_ns()}"
    env = Env(sandbox, f"""
        import os, sys, time
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(60)", {token!r}])
            os._exit(0)
        os.wait()
        print("started", flush=True)
        time.sleep(60)
    """, env_dir, make_ws())

    def daemons():
        found = []
        for p in psutil.process_iter(["cmdline"]):
            if token in (p.info["cmdline"] or []):
                found.append(p)
        return found

    try:
        assert env.read_line() == "started"
        deadline = time.monotonic() + 5
        while not daemons() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert daemons(), "the daemon never started"
        env.kill()
        deadline = time.monotonic() + 5
        while daemons() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not daemons(), "a setsid daemon survived kill_tree"
    finally:
        for p in daemons():
            p.kill()
        env.close()


def test_workspaces_are_private(sandbox, dirs):
    env_dir, make_ws, _ = dirs
    ws_a, ws_b = make_ws("a"), make_ws("b")
    a = Env(sandbox, """
        import sys
        open("/workspace/secret_a", "w").write("A-SECRET")
        print("written", flush=True)
        sys.stdin.readline()
    """, env_dir, ws_a, index=3)
    try:
        assert a.read_line() == "written"
        b = run(sandbox, f"""
            import os
            print(sorted(os.listdir("/workspace")))
            for p in ({ws_a!r} + "/secret_a", "/proc/2/root/workspace/secret_a"):
                try:
                    print("READ", open(p).read())
                except OSError as e:
                    print("denied", type(e).__name__)
        """, dirs, workspace=ws_b, index=4)
        assert b.exit_code == 0, b.err
        assert b.text.splitlines()[0] == "[]"
        assert "A-SECRET" not in b.text
    finally:
        a.wait(timeout=10)


def test_cpu_backstop_kills(backend, dirs):
    env = run(backend, """
        import time
        t = time.time()
        while time.time() - t < 20:
            pass
        print("survived")
    """, dirs, limits=Limits(cpu_seconds_total=1))
    assert "survived" not in env.text
    assert killed_by(env, signal.SIGKILL) or killed_by(env, signal.SIGXCPU), env.status


def test_wipe_workspace_removes_readonly_things(backend, dirs):
    env_dir, make_ws, _ = dirs
    ws = make_ws()
    env = run(backend, """
        import os
        os.chdir(os.environ["BOLTZLABS_WORKSPACE"])
        os.makedirs("a/b/c")
        open("a/b/c/f", "w").write("x")
        os.chmod("a/b/c/f", 0o400)
        os.chmod("a/b/c", 0o000)
        os.chmod("a/b", 0o500)
        os.mkdir("locked"); open("locked/g", "w").write("y"); os.chmod("locked", 0o000)
        open("ro", "w").write("z"); os.chmod("ro", 0o444)
        os.symlink("/etc", "etc_link")
        print("done")
    """, dirs, workspace=ws)
    assert env.text.strip() == "done", env.err
    owner = os.stat(ws).st_uid, os.stat(ws).st_gid
    assert os.listdir(ws)
    wipe_workspace(ws)
    assert os.listdir(ws) == []
    st = os.stat(ws)
    assert (st.st_uid, st.st_gid) == owner and stat.S_IMODE(st.st_mode) == 0o700
    assert os.path.isdir("/etc")


@pytest.mark.parametrize("role", [0, 1, 2], ids=["stdin", "stdout", "stderr"])
def test_a_pipe_handed_over_at_the_control_fd_number_still_reaches_the_env(role, dirs):
    """A worker with a few hundred envs gives a child pipe ends numbered 200 and up: one at
    CONTROL_FD (where the env keeps its memory-snapshot control socket) must not be replaced by that
    socket. (It was: the env's stdout became the socket, and every restart of that slot failed.)"""
    env_dir, make_ws, _ = dirs
    backend = _backend("namespaces")
    if backend.mode()[0] != "root":
        pytest.skip("only root mode gives an exec'd env a control socket")
    with pytest.raises(OSError):
        os.fstat(CONTROL_FD)  # free in this process, so the pipe can be put there
    env = Env(backend, """
        import os, stat, sys
        line = sys.stdin.readline()
        sys.stderr.write("err " + line)
        sys.stderr.flush()
        print("out", line.strip(), stat.S_ISSOCK(os.fstat(200).st_mode), flush=True)
    """, env_dir, make_ws(), at={role: CONTROL_FD})
    env.send("hello")
    assert env.read_line() == "out hello True"
    env.wait()
    assert env.exit_code == 0 and env.err == b"err hello\n", env.err


def test_setup_failure_is_reported(sandbox, dirs):
    env_dir, make_ws, _ = dirs
    env = Env(sandbox, "print('never')", env_dir + "-does-not-exist", make_ws())
    env.wait(timeout=10)
    assert env.exit_code != 0
    assert env.launched.setup_error or env.err, "a failed sandbox start must say why"
