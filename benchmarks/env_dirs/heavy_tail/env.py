"""A counter whose step time is heavy-tailed: lognormal, median 2 ms, p99 50 ms.

``HEAVY_TAIL_MODE=sleep`` (default) sleeps that long; ``burn`` spins the CPU instead.
"""

import math
import os
import random
import time

from boltzlabs_gym.env import serve

MEDIAN_S = 0.002
SIGMA = math.log(0.050 / MEDIAN_S) / 2.326  # p99 = median * exp(2.326 sigma) = 50 ms
BURN = os.environ.get("HEAVY_TAIL_MODE") == "burn"
state = {"t": 0, "rng": random.Random()}


def reset(seed, options=None):
    state["t"], state["rng"] = 0, random.Random(seed)
    return {"t": 0}


def step(action):
    state["t"] += 1
    pause = min(MEDIAN_S * math.exp(SIGMA * state["rng"].gauss(0.0, 1.0)), 1.0)
    if BURN:
        end = time.perf_counter() + pause
        while time.perf_counter() < end:
            pass
    else:
        time.sleep(pause)
    return {"t": state["t"]}, float(action), False, {}


serve(reset=reset, step=step)
