"""Soak env: a deterministic LCG walk (see lcg.py) that misbehaves when its action says so.

A normal action is an int. A fault action is ``{"fault": kind, ...}``:
  hang         never answer                        -> straggler at the deadline
  abort        os.abort()                          -> killed by signal 6
  exit         os._exit(code)                      -> exited with status code
  garbage      a non-JSON line on the real stdout  -> malformed reply
  notobject    a JSON array line on the real stdout -> malformed reply
  badbin       a reply announcing a bad _bin       -> malformed reply
  huge         a reply line of ``mib`` MiB          -> reply line too long
  oom          allocate past the memory limit       -> killed (cgroup OOM) or MemoryError
  forkbomb     spawn processes past the pids limit  -> an exception transition
  raise        raise inside step                    -> an exception transition
  unjsonable   return an obs json cannot encode     -> an exception transition (encode)
  print        print() junk to stdout, then step normally   -> nothing to report
  leak         leave a setsid child behind, then step normally -> nothing to report
"""

import os
import subprocess
import sys
import time

import lcg
from boltzlabs_gym.env import ENV_INDEX, serve

_REAL_STDOUT = os.dup(1)  # before serve() takes the channel: lets the env corrupt it on purpose
state = {"x": 0, "t": 0, "seed": 0}


def reset(seed):
    seed = int(seed or 0)
    state.update(x=lcg.initial(seed, ENV_INDEX), t=0, seed=seed)
    return lcg.reset_obs(seed, ENV_INDEX)


def _fault(action: dict):
    kind = action["fault"]
    if kind == "hang":
        while True:
            time.sleep(1)
    if kind == "abort":
        os.abort()
    if kind == "exit":
        os._exit(action["code"])
    if kind == "garbage":
        os.write(_REAL_STDOUT, b"\x00\xffgarbage, not json\n")
    elif kind == "notobject":
        os.write(_REAL_STDOUT, b"[1, 2, 3]\n")
    elif kind == "badbin":
        os.write(_REAL_STDOUT, b'{"obs": 1, "_bin": ["lots"]}\n')
    elif kind == "huge":
        os.write(_REAL_STDOUT, b'{"obs":"' + b"x" * (action["mib"] << 20) + b'"}\n')
    elif kind == "oom":
        hog = []
        for _ in range(action["mib"]):
            hog.append(b"\x01" * (1 << 20))  # filled, so every page is really resident
        return None
    elif kind == "forkbomb":
        kids = []
        try:
            for _ in range(action["n"]):
                kids.append(subprocess.Popen(["sleep", "30"]))
        finally:
            for k in kids:
                k.kill()
                k.wait()
        return None
    elif kind == "raise":
        raise ValueError(f"soak fault {action['tag']}")
    elif kind == "unjsonable":
        return "unjsonable"
    elif kind == "print":
        print('{"obs": "forged by print"}')
        print("junk\n" * 3, end="")
        sys.stdout.flush()
        return None
    elif kind == "leak":
        subprocess.Popen(["sleep", str(action["s"])], start_new_session=True,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return None
    time.sleep(30)  # a corrupted channel: the worker kills us long before this
    return None


def step(action):
    special = None
    if isinstance(action, dict):
        special = _fault(action)
        action = action.get("a", 0)
    state["t"] += 1
    state["x"] = lcg.advance(state["x"], action)
    obs = lcg.step_obs(state["x"], state["t"], ENV_INDEX, state["seed"])
    if special == "unjsonable":
        obs = {"bad": {1, 2}}
    return obs, lcg.reward(state["x"]), state["t"] >= lcg.episode_length(state["seed"]), {"t": state["t"]}


serve(reset=reset, step=step)
