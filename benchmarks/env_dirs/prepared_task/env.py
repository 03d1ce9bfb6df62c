"""A task prepared over several steps, in the function form (module globals, no state hooks).

``{"setup": ms}`` stands for one step of preparing a task (a build, an index, a data set
generated): it computes for ``ms`` milliseconds of CPU and writes a file into the workspace. ``{"program": code}`` writes
``solution.py`` and reports how many set-up files it sees; the episode ends. A memory snapshot
copies the module's ``state`` whole; that is what ``benchmarks/group_fork.py`` forks.
"""

import os
import time

from boltzlabs_gym.env import WORKSPACE, serve

state = {"steps": 0}


def reset(seed):
    state["steps"] = 0
    for name in os.listdir(WORKSPACE):
        os.unlink(os.path.join(WORKSPACE, name))
    return {"steps": 0}


def step(action):
    if "setup" in action:
        end = time.process_time() + float(action["setup"]) / 1e3
        while time.process_time() < end:
            pass
        state["steps"] += 1
        with open(os.path.join(WORKSPACE, f"setup_{state['steps']:02d}.txt"), "w") as f:
            f.write("prepared\n")
        return {"steps": state["steps"]}, 0.0, False, {}
    with open(os.path.join(WORKSPACE, "solution.py"), "w") as f:
        f.write(str(action.get("program", "")))
    files = sorted(n for n in os.listdir(WORKSPACE) if n.startswith("setup_"))
    return {"steps": state["steps"]}, float(len(files)), True, {"files": files}


serve(reset=reset, step=step)
