"""Write the CartPole snapshot file and the steps it must replay, for tests/client/test_snapshots.py.

    python tests/data/make_cartpole_snapshot.py

A make_vec CartPole env, reset with seed 3 and stepped twice, is snapshotted (the portable kind) and saved to
``cartpole-v1-0.1.0.snapshot``; three more steps of the source go to
``cartpole-v1-0.1.0.expected.json``. The file names the hash of the env directory make_vec
writes (the factories' pickle and its ``env.py``): rerun this when that directory changes, and
the test that loads the file in another process then restores it exactly again.
"""

from __future__ import annotations

import json
import os
from contextlib import closing

import numpy as np

import boltzlabs_gym

HERE = os.path.dirname(os.path.abspath(__file__))
ACTIONS = [1, 0, 1]


def main() -> None:
    isolation = os.environ.get("BOLTZLABS_TEST_ISOLATION", "auto")
    with closing(boltzlabs_gym.make_vec("CartPole-v1", num_envs=1, isolation=isolation)) as envs:
        envs.reset(seed=3)
        for action in (0, 1):
            envs.step(np.array([action]))
        snap = envs.snapshot(0, kind="portable")  # a memory snapshot cannot leave its worker
        snap.save(os.path.join(HERE, "cartpole-v1-0.1.0.snapshot"))
        snap.release()
        obs = [envs.step(np.array([action]))[0][0].tolist() for action in ACTIONS]
    with open(os.path.join(HERE, "cartpole-v1-0.1.0.expected.json"), "w") as f:
        json.dump({"actions": ACTIONS, "obs": obs}, f)


if __name__ == "__main__":
    main()
