"""Writes fuzzed bytes onto its real stdout (the reply channel) when its action says so.

Action: an int (a plain counter step) or ``{"hex": "<bytes as hex>", "then": "reply"|"exit"|"hang"}``:
the decoded bytes go straight to fd 1 as it was before serve() took it, then the env
replies normally, exits (status 0), or stops answering.
"""

import os
import time

from boltzlabs_gym.env import ENV_INDEX, serve

_REAL_STDOUT = os.dup(1)
state = {"t": 0}


def reset(seed):
    state["t"] = 0
    return {"t": 0, "i": ENV_INDEX}


def step(action):
    if isinstance(action, dict):
        data = bytes.fromhex(action["hex"])
        view = memoryview(data)
        while view:
            view = view[os.write(_REAL_STDOUT, view):]
        then = action.get("then", "reply")
        if then == "exit":
            os._exit(0)
        if then == "hang":
            time.sleep(3600)
        action = 0
    state["t"] += 1
    return {"t": state["t"], "i": ENV_INDEX}, float(action), False, {}


serve(reset=reset, step=step)
