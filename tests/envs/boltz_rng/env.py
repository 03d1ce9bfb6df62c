"""Boltz-mode checks: module-level state and RNG streams of forked envs.

Reset (without a seed) returns draws from Python's ``random``, numpy's global RNG and
``os.urandom``, plus module-level state that steps mutate. Imported once per template.
"""

import os
import random

import numpy as np

from boltzlabs_gym.env import ENV_INDEX, serve

IMPORTED_AT = random.random()  # drawn once, in the template: the same in every forked env
state = {"t": 0, "touched": []}


def reset(seed, options=None):
    state["t"] = 0
    return {
        "index": ENV_INDEX,
        "py": random.random(),
        "np": float(np.random.random()),
        "urandom": os.urandom(8).hex(),
        "imported_at": IMPORTED_AT,
        "touched": list(state["touched"]),
        "pid": os.getpid(),
    }


def step(action):
    state["t"] += 1
    state["touched"].append(action)
    return {"t": state["t"], "touched": list(state["touched"])}, 0.0, False, {}


serve(reset=reset, step=step)
