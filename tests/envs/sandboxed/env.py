"""An env directory in the factory form: one object per env, for sandboxes of several envs.

Actions (JSON): an int steps; ``"hang"`` sleeps far past any deadline; ``"crash"`` exits the
whole process; ``"raise"`` raises inside ``step``; ``["write", text]`` writes the env's file in
the shared workspace and ``"files"`` lists the workspace.
"""

import os
import time

from boltzlabs_gym.env import WORKSPACE, serve


# Which process an env lives in (a pid is 1 in every PID namespace): made by the first env built
# in a process, after a boltz fork.
_process = None


class Env:
    def __init__(self, index):
        global _process
        if _process is None:
            _process = os.urandom(8).hex()
        self.index, self.t = index, 0

    def reset(self, seed, options=None):
        time.sleep((options or {}).get("sleep", 0))
        self.t = 0
        return {"env": self.index, "t": 0, "seed": seed, "pid": _process}

    def step(self, action):
        if action == "hang":
            time.sleep(3600)
        if action == "crash":
            os._exit(3)
        if action == "raise":
            raise RuntimeError(f"env {self.index} raised")
        if isinstance(action, list) and action[:1] == ["write"]:
            with open(os.path.join(WORKSPACE, f"env{self.index}.txt"), "w") as f:
                f.write(action[1])
            action = 0
        if action == "files":
            return {"files": sorted(os.listdir(WORKSPACE))}, 0.0, False, {}
        self.t += 1
        return {"env": self.index, "t": self.t, "pid": _process}, float(action), self.t >= 1000, {}


serve(factory=Env)
