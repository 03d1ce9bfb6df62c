"""An env for snapshot tests: its state lives in the env object, the process's global generators
and the workspace's files, so an exact copy must carry all three.

Actions (JSON): an int steps (the observation carries a draw from ``random`` and one from NumPy's
global generator, and the step count); ``["write", name, text]`` writes a workspace file;
``"files"`` returns the workspace's files and their contents; ``"who"`` returns this process's
token (made at start), its pid and the pids it can see; ``"hang"`` sleeps past any deadline;
``"crash"`` exits; ``"lock"`` gives the env an attribute that cannot be pickled; ``["chmod", name,
mode]`` and ``["mkdir", name]`` change the workspace, ``"modes"`` returns its entries' modes; ``["link", a, b]`` hard-links a file, ``["sparse",
size]`` makes a sparse file that large, ``"exit_soon"`` exits while idle after answering.
"""

import os
import random
import threading
import time

import numpy as np

from boltzlabs_gym.env import WORKSPACE, serve

# This process's own token, made when the first env is built (after a boltz fork, so that every
# forked env has its own); a restored copy keeps its process's token.
_TOKEN = None


def _files():
    out = {}
    for root, _dirs, files in os.walk(WORKSPACE):
        for name in files:
            path = os.path.join(root, name)
            with open(path) as f:
                out[os.path.relpath(path, WORKSPACE)] = f.read()
    return out


class Env:
    def __init__(self):
        global _TOKEN
        if _TOKEN is None:
            _TOKEN = os.urandom(8).hex()
        self.t = 0
        self.total = 0.0

    def reset(self, seed, options=None):
        if seed is not None:
            random.seed(seed)
            np.random.seed(seed)
        self.t, self.total = 0, 0.0
        return {"t": 0, "r": random.random(), "n": float(np.random.random())}

    def step(self, action):
        if action == "hang":
            time.sleep(3600)
        if action == "crash":
            os._exit(3)
        if action == "lock":
            self.lock = threading.Lock()
            return {"t": self.t}, 0.0, False, {}
        if action == "files":
            return {"files": _files()}, 0.0, False, {}
        if action == "who":
            pids = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
            # the PID namespace tells processes apart where the token cannot: a memory snapshot's copy
            # is a fork of its source, token and all
            pidns = os.stat("/proc/self/ns/pid").st_ino
            return {"token": _TOKEN, "pid": os.getpid(), "pids": pids, "pidns": pidns}, 0.0, False, {}
        if isinstance(action, list) and action[:1] == ["chmod"]:
            os.chmod(os.path.join(WORKSPACE, action[1]), action[2])
            return {"t": self.t}, 0.0, False, {}
        if isinstance(action, list) and action[:1] == ["mkdir"]:
            os.mkdir(os.path.join(WORKSPACE, action[1]))
            return {"t": self.t}, 0.0, False, {}
        if isinstance(action, list) and action[:1] == ["link"]:
            os.link(os.path.join(WORKSPACE, action[1]), os.path.join(WORKSPACE, action[2]))
            return {"t": self.t}, 0.0, False, {}
        if isinstance(action, list) and action[:1] == ["sparse"]:
            with open(os.path.join(WORKSPACE, "sparse"), "wb") as f:
                f.truncate(action[1])
            return {"t": self.t}, 0.0, False, {}
        if action == "exit_soon":  # dies while idle, after its reply is out
            threading.Timer(0.2, os._exit, (7,)).start()
            return {"t": self.t}, 0.0, False, {}
        if action == "modes":
            modes = {}
            for root, dirs, files in os.walk(WORKSPACE):
                for name in dirs + files:
                    path = os.path.join(root, name)
                    modes[os.path.relpath(path, WORKSPACE)] = os.lstat(path).st_mode & 0o7777
            return {"modes": modes}, 0.0, False, {}
        if isinstance(action, list) and action[:1] == ["write"]:
            with open(os.path.join(WORKSPACE, action[1]), "w") as f:
                f.write(action[2])
            action = 0
        self.t += 1
        self.total += random.random() + float(np.random.random())
        obs = {"t": self.t, "r": random.random(), "n": float(np.random.random()), "total": self.total}
        return obs, float(action), self.t >= 500, {"t": self.t}


serve(factory=Env)
