"""The soak env's dynamics, shared by the env and the test's fault-free reference model.

Deterministic in (seed, actions): an LCG whose state the env keeps in process memory,
so a respawned process, a reply routed to the wrong slot or a lost step all show up as
a trajectory mismatch.
"""

M = (1 << 61) - 1
A = 6364136223846793005 % M
C = 1442695040888963407 % M


def initial(seed: int, index: int) -> int:
    return (seed * 2654435761 + index * 40503 + 12345) % M


def advance(x: int, action: int) -> int:
    return (A * x + C + int(action)) % M


def episode_length(seed: int) -> int:
    return 20 + seed % 61


def reward(x: int) -> float:
    return float(x % 1000) / 1000.0


def reset_obs(seed: int, index: int) -> dict:
    return {"x": initial(seed, index), "t": 0, "i": index, "seed": seed}


def step_obs(x: int, t: int, index: int, seed: int) -> dict:
    return {"x": x, "t": t, "i": index, "seed": seed}
