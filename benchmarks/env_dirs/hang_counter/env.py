"""Benchmark env dir: the counter env, except that action 2 wedges the env forever."""

import time

from boltzlabs_gym.env import serve

state = {"t": 0}


def reset(seed):
    state["t"] = 0
    return {"t": 0}


def step(action):
    if action == 2:
        while True:
            time.sleep(3600)
    state["t"] += 1
    return {"t": state["t"]}, float(action), False, {}


serve(reset=reset, step=step)
