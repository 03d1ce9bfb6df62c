"""The function form with state hooks: its state is a module global, handed to snapshots by
``get_state``/``set_state``; ``reseed`` records the seed it was given."""

import random

from boltzlabs_gym.env import serve

state = {"t": 0, "seen": [], "reseeded": None}


def reset(seed):
    state.update(t=0, seen=[], reseeded=None)
    return {"t": 0}


def step(action):
    state["t"] += 1
    state["seen"].append(action)
    return {"t": state["t"], "seen": list(state["seen"]), "r": random.random(), "reseeded": state["reseeded"]}, 1.0, False, {}


def get_state():
    return {"t": state["t"], "seen": list(state["seen"]), "reseeded": state["reseeded"]}


def set_state(saved):
    state.update(saved)


def reseed(seed):
    state["reseeded"] = seed
    random.seed(seed)


serve(reset=reset, step=step, get_state=get_state, set_state=set_state, reseed=reseed)
