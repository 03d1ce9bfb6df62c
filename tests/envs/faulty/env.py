"""A fault-injection env: the action says how to misbehave.

Actions: an int (a plain counter step, reward = action) or a dict:
  {"sleep": s}           sleep s seconds, then step normally
  {"hang": true}         never answer
  {"crash": true}        raise SystemExit-free crash: os.abort()
  {"exit": code}         os._exit(code)
  {"garbage": true}      write a non-JSON line to the real stdout fd
  {"twice": true}        write two whole replies (obs {"t": -1}) at once, then hang
  {"late_garbage": s}    answer, then write a non-JSON line s seconds later
  {"late_exit": s}       answer, then exit (status 3) s seconds later
  {"huge_mib": m}        reply with a line of m MiB
  {"raise": "msg"}       raise an exception inside step
  {"print": "text"}      print() to stdout (must not corrupt the channel)
  {"daemon": s}          leave a background process sleeping s seconds
  {"write": "name"}      write a file in the workspace, obs lists the workspace
  {"alloc_mib": m}       touch m MiB of memory (past a memory limit: the OOM killer)
Reset options {"raise": true} raise inside reset.
"""

import os
import sys
import time

from boltzlabs_gym.env import ENV_INDEX, WORKSPACE, serve

state = {"t": 0, "seed": None}
_REAL_STDOUT = os.dup(1)  # before serve() takes the channel: lets the env corrupt it on purpose


def reset(seed, options=None):
    if options and options.get("raise"):
        raise RuntimeError("reset exploded on purpose")
    state["t"] = 0
    state["seed"] = seed
    return {"t": 0, "seed": seed, "index": ENV_INDEX, "workspace": sorted(os.listdir(WORKSPACE))}


def step(action):
    state["t"] += 1
    obs = {"t": state["t"], "index": ENV_INDEX}
    if isinstance(action, dict):
        if "sleep" in action:
            time.sleep(action["sleep"])
        if action.get("hang"):
            while True:
                time.sleep(1)
        if action.get("crash"):
            os.abort()
        if "exit" in action:
            os._exit(action["exit"])
        if action.get("garbage"):
            os.write(_REAL_STDOUT, b"this is not json\n")
            time.sleep(5)
        if action.get("twice"):
            line = b'{"obs":{"t":-1},"reward":0.0,"terminated":false,"truncated":false,"info":{}}\n'
            os.write(_REAL_STDOUT, line + line)
            time.sleep(5)
        if "late_garbage" in action:
            import threading

            threading.Timer(action["late_garbage"], os.write, (_REAL_STDOUT, b"late garbage\n")).start()
        if "late_exit" in action:
            import threading

            threading.Timer(action["late_exit"], os._exit, (3,)).start()
        if "huge_mib" in action:
            os.write(_REAL_STDOUT, b'{"obs":"' + b"x" * (action["huge_mib"] << 20) + b'"}\n')
            time.sleep(5)
        if "alloc_mib" in action:
            block = bytearray(action["alloc_mib"] << 20)
            for i in range(0, len(block), 4096):
                block[i] = 1
        if "raise" in action:
            raise ValueError(action["raise"])
        if "print" in action:
            print(action["print"])
            print(action["print"], file=sys.stderr)
        if "daemon" in action:
            import subprocess

            subprocess.Popen(["sleep", str(action["daemon"])], start_new_session=True)
        if "write" in action:
            with open(os.path.join(WORKSPACE, action["write"]), "w") as f:
                f.write("data")
            obs["workspace"] = sorted(os.listdir(WORKSPACE))
        return obs, 1.0, False, {"t": state["t"]}
    return obs, float(action), state["t"] >= 10, {"t": state["t"]}


serve(reset=reset, step=step)
