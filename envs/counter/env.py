"""The counter env: the smallest env a pool can run (JSON protocol, no dependencies).

Each step adds one to a counter; the reward is the action; the episode ends at 100.
"""

from boltzlabs_gym.env import serve

state = {"t": 0}


def reset(seed):
    state["t"] = 0
    return {"t": 0}


def step(action):
    state["t"] += 1
    return {"t": state["t"]}, float(action), state["t"] >= 100, {}


serve(reset=reset, step=step)
