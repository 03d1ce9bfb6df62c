"""An env for memory-snapshot tests: it probes its own sandbox and tries what a copy must not do.

Actions (JSON): an int steps (the observation carries a draw from ``random`` and one from NumPy's
global generator, and the step count); ``"who"`` returns the process's PID namespace, the pids it
can see, its uid, cgroup and hostname; ``"escape"`` tries the calls the env filter hands to the
worker (a user namespace, a mount namespace, a mount) and returns their errnos;
``["unshare_loop", seconds]`` starts a child process that keeps trying to make a user namespace
for that long and writes how often it succeeded to ``/workspace/escaped``; ``["signal_all"]``
tries to signal every other process it can see; ``"thread"`` starts a thread, ``"open"`` keeps a
workspace file open, ``"spawn"`` starts a child process, ``"tidy"`` undoes those three;
``["write", name, text]`` writes a workspace file and ``"files"`` returns them; ``["itimer", s]``
runs a SIGALRM handler every ``s`` seconds (0: stops) that appends to ``/workspace/alarms`` "1" if
it runs with the collector off (as a memory snapshot's swap and holder have it), else "0";
``"block_sigchld"`` blocks SIGCHLD.
"""

import ctypes
import gc
import os
import random
import signal
import socket
import threading
import time

import numpy as np

from boltzlabs_gym.env import WORKSPACE, serve

_libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWNS, CLONE_NEWUSER = 0x00020000, 0x10000000


def _errno_of(fn) -> int:
    ctypes.set_errno(0)
    return 0 if fn() == 0 else ctypes.get_errno()


def _escape() -> dict:
    return {
        "unshare_user": _errno_of(lambda: _libc.unshare(CLONE_NEWUSER)),
        "unshare_mount": _errno_of(lambda: _libc.unshare(CLONE_NEWNS)),
        "mount": _errno_of(lambda: _libc.mount(b"tmpfs", b"/tmp", b"tmpfs", 0, None)),
    }


def _unshare_loop(seconds: float) -> None:
    if os.fork():
        return
    ok = tries = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if os.fork() == 0:  # each try in a new process: a success changes the trying process
            os._exit(0 if _libc.unshare(CLONE_NEWUSER) == 0 else 1)
        _pid, status = os.wait()
        ok += os.waitstatus_to_exitcode(status) == 0
        tries += 1
    # written then renamed: the test polls for the file and must never see it empty
    with open(os.path.join(WORKSPACE, ".escaped"), "w") as f:
        f.write(f"{ok} {tries}")
    os.rename(os.path.join(WORKSPACE, ".escaped"), os.path.join(WORKSPACE, "escaped"))
    os._exit(0)


def _on_alarm(_sig, _frame) -> None:
    fd = os.open(os.path.join(WORKSPACE, "alarms"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.write(fd, b"0" if gc.isenabled() else b"1")
    os.close(fd)


class Env:
    def __init__(self):
        self.t = 0
        self.held = []

    def reset(self, seed, options=None):
        if seed is not None:
            random.seed(seed)
            np.random.seed(seed)
        self.t = 0
        return {"t": 0, "r": random.random(), "n": float(np.random.random())}

    def step(self, action):
        if action == "who":
            with open("/proc/self/cgroup") as f:
                cgroup = f.read()
            return (
                {
                    "pidns": os.stat("/proc/self/ns/pid").st_ino,
                    "netns": os.stat("/proc/self/ns/net").st_ino,
                    "pids": sorted(int(p) for p in os.listdir("/proc") if p.isdigit()),
                    "uid": os.getuid(),
                    "cgroup": cgroup,
                    "hostname": socket.gethostname(),
                },
                0.0,
                False,
                {},
            )
        if action == "escape":
            return _escape(), 0.0, False, {}
        if isinstance(action, list) and action[:1] == ["unshare_loop"]:
            _unshare_loop(float(action[1]))
            return {"t": self.t}, 0.0, False, {}
        if action == "signal_all":
            hit = []
            for p in os.listdir("/proc"):
                if p.isdigit() and int(p) != os.getpid():
                    try:
                        os.kill(int(p), signal.SIGKILL)
                        hit.append(int(p))
                    except OSError:
                        pass
            return {"signalled": hit}, 0.0, False, {}
        if action == "thread":
            t = threading.Thread(target=time.sleep, args=(3600,), daemon=True)
            t.start()
            self.held.append(t)
            return {"t": self.t}, 0.0, False, {}
        if action == "open":
            self.held.append(open(os.path.join(WORKSPACE, "log.txt"), "a"))  # noqa: SIM115 - kept open
            return {"t": self.t}, 0.0, False, {}
        if action == "spawn":
            pid = os.fork()
            if pid == 0:
                time.sleep(3600)
                os._exit(0)
            self.held.append(pid)
            return {"t": self.t}, 0.0, False, {}
        if action == "tidy":
            for h in self.held:
                if isinstance(h, int):
                    os.kill(h, signal.SIGKILL)
                    os.waitpid(h, 0)
                elif hasattr(h, "close"):
                    h.close()
            self.held = [h for h in self.held if isinstance(h, threading.Thread)]
            return {"t": self.t}, 0.0, False, {}
        if isinstance(action, list) and action[:1] == ["itimer"]:
            signal.signal(signal.SIGALRM, _on_alarm)
            signal.setitimer(signal.ITIMER_REAL, float(action[1]), float(action[1]))
            return {"t": self.t}, 0.0, False, {}
        if action == "block_sigchld":
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
            return {"t": self.t}, 0.0, False, {}
        if action == "files":
            out = {}
            for name in sorted(os.listdir(WORKSPACE)):
                try:
                    with open(os.path.join(WORKSPACE, name)) as f:
                        out[name] = f.read()
                except FileNotFoundError:  # renamed meanwhile (the unshare loop's report)
                    pass
            return {"files": out}, 0.0, False, {}
        if isinstance(action, list) and action[:1] == ["write"]:
            with open(os.path.join(WORKSPACE, action[1]), "w") as f:
                f.write(action[2])
            action = 0
        self.t += 1
        obs = {"t": self.t, "r": random.random(), "n": float(np.random.random())}
        return obs, float(action), False, {}


serve(factory=Env)
