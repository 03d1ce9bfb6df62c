"""Several envs per sandbox (``envs_per_sandbox=K``): the same envs, step for step, as with K = 1 and
as SyncVectorEnv; and the honest failure semantics of envs that share a sandbox.

Real worker, real sandboxes, real pipes. The failure table these tests pin is the README's
("Several envs per sandbox").
"""

from __future__ import annotations

import os
import signal
import time

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.vector import AutoresetMode
from vector_envs import DictTupleEnv
from workers import WorkerProcess

import boltzlabs_gym
from boltzlabs_gym import BoltzLabsVecEnv, RLPool
from boltzlabs_gym.errors import EnvStartError
from boltzlabs_gym.wire.codec import MAX_INFO_DEPTH
from conftest import ENVS, ISOLATION

pytestmark = pytest.mark.usefixtures("no_leaks")

SANDBOXED = os.path.join(ENVS, "sandboxed")
COUNTER = os.path.join(os.path.dirname(ENVS), "..", "envs", "counter")


def _compare_with_sync(ours, n: int, autoreset_mode: AutoresetMode, steps: int = 150, seed: int = 3) -> None:
    """Step ``ours`` and a SyncVectorEnv of CartPole alike; every output must be equal."""
    ref = gym.vector.SyncVectorEnv([lambda: gym.make("CartPole-v1")] * n, autoreset_mode=autoreset_mode)
    try:
        o1, i1 = ours.reset(seed=seed)
        o2, i2 = ref.reset(seed=seed)
        np.testing.assert_array_equal(o1, o2)
        assert i1.keys() == i2.keys()
        rng = np.random.default_rng(seed)
        ends = 0
        for t in range(steps):
            actions = rng.integers(0, 2, n)
            got, want = ours.step(actions), ref.step(actions)
            for name, a, b in zip(("obs", "reward", "terminated", "truncated"), got[:4], want[:4]):
                np.testing.assert_array_equal(a, b, err_msg=f"{name} differs at step {t}")
                assert a.dtype == b.dtype, name
            assert got[4].keys() == want[4].keys(), t
            if "final_obs" in want[4]:
                mask = want[4]["_final_obs"]
                np.testing.assert_array_equal(got[4]["_final_obs"], mask)
                for i in np.flatnonzero(mask):
                    np.testing.assert_array_equal(got[4]["final_obs"][i], want[4]["final_obs"][i])
            ends += int(np.logical_or(got[2], got[3]).sum())
        assert ends > 0, "no episode ended: autoreset was not exercised"
    finally:
        ref.close()


@pytest.mark.parametrize(
    "k, n, mode, autoreset_mode",
    [
        (2, 8, "default", AutoresetMode.NEXT_STEP),
        (3, 8, "default", AutoresetMode.SAME_STEP),  # uneven: the last sandbox hosts 2
        (8, 8, "default", AutoresetMode.NEXT_STEP),
        (2, 8, "boltz", AutoresetMode.SAME_STEP),
        (3, 8, "boltz", AutoresetMode.NEXT_STEP),
        (8, 8, "boltz", AutoresetMode.SAME_STEP),
    ],
)
def test_steps_like_sync_vector_env(k, n, mode, autoreset_mode):
    envs = boltzlabs_gym.make_vec(
        "CartPole-v1",
        num_envs=n,
        envs_per_sandbox=k,
        mode=mode,
        isolation=ISOLATION,
        autoreset_mode=autoreset_mode,
    )
    try:
        assert envs.pool.layout.sandboxes == -(-n // k)
        assert envs.isolation.envs_per_sandbox == k
        _compare_with_sync(envs, n, autoreset_mode)
    finally:
        envs.close()


def test_disabled_autoreset_with_reset_masks_like_sync_vector_env():
    n = 7
    ours = boltzlabs_gym.make_vec(
        "CartPole-v1", num_envs=n, envs_per_sandbox=3, isolation=ISOLATION, autoreset_mode=AutoresetMode.DISABLED
    )
    ref = gym.vector.SyncVectorEnv([lambda: gym.make("CartPole-v1")] * n, autoreset_mode=AutoresetMode.DISABLED)
    try:
        np.testing.assert_array_equal(ours.reset(seed=5)[0], ref.reset(seed=5)[0])
        rng = np.random.default_rng(5)
        partial_resets = 0
        for t in range(150):
            actions = rng.integers(0, 2, n)
            got, want = ours.step(actions), ref.step(actions)
            for a, b in zip(got[:4], want[:4]):
                np.testing.assert_array_equal(a, b, err_msg=f"step {t}")
            done = np.logical_or(want[2], want[3])
            if done.any():
                partial_resets += 1
                np.testing.assert_array_equal(
                    ours.reset(options={"reset_mask": done})[0], ref.reset(options={"reset_mask": done})[0]
                )
        assert partial_resets > 0
        with pytest.raises(ValueError, match="DISABLED"):
            for _ in range(600):  # a finished env stepped again without its reset is refused, naming it
                ours.step(np.zeros(n, dtype=np.int64))
    finally:
        ours.close()
        ref.close()


@pytest.mark.parametrize("direct", [True, False])
def test_through_the_worker_and_the_lane_alike(direct):
    envs = boltzlabs_gym.make_vec("CartPole-v1", num_envs=7, envs_per_sandbox=3, isolation=ISOLATION, direct=direct)
    try:
        _compare_with_sync(envs, 7, AutoresetMode.NEXT_STEP, steps=100)
    finally:
        envs.close()


def test_remote_worker_steps_like_sync_vector_env():
    worker = WorkerProcess(capacity=8)
    try:
        envs = boltzlabs_gym.make_vec(
            "CartPole-v1",
            num_envs=8,
            envs_per_sandbox=3,
            workers=[worker.address],
            isolation=ISOLATION,
            autoreset_mode=AutoresetMode.SAME_STEP,
        )
        try:
            _compare_with_sync(envs, 8, AutoresetMode.SAME_STEP, steps=100)
        finally:
            envs.close()
    finally:
        worker.stop()


def test_remote_split_must_keep_sandboxes_whole():
    with pytest.raises(ValueError, match="multiples of envs_per_sandbox"):
        RLPool(COUNTER, n=8, envs_per_sandbox=4, workers=["tcp://127.0.0.1:1", "tcp://127.0.0.1:2"], split=[3, 5])


def test_two_workers_split_by_sandboxes():
    workers = [WorkerProcess(capacity=2), WorkerProcess(capacity=2)]
    try:
        envs = boltzlabs_gym.make_vec(
            "CartPole-v1",
            num_envs=7,
            envs_per_sandbox=2,
            workers=[w.address for w in workers],
            isolation=ISOLATION,
        )
        try:
            assert [link.count for link in envs.pool._links] == [2, 2]  # 4 sandboxes of 2, 2, 2, 1 envs
            _compare_with_sync(envs, 7, AutoresetMode.NEXT_STEP, steps=60)
        finally:
            envs.close()
    finally:
        for w in workers:
            w.stop()


def test_partial_resets_and_seeds_per_env():
    n, k = 7, 3
    ours = boltzlabs_gym.make_vec("CartPole-v1", num_envs=n, envs_per_sandbox=k, isolation=ISOLATION)
    ref = gym.vector.SyncVectorEnv([lambda: gym.make("CartPole-v1")] * n)
    try:
        np.testing.assert_array_equal(ours.reset(seed=11)[0], ref.reset(seed=11)[0])
        for _ in range(5):
            a = np.ones(n, dtype=np.int64)
            np.testing.assert_array_equal(ours.step(a)[0], ref.step(a)[0])
        mask = np.array([False, True, False, False, True, True, False])
        options = {"reset_mask": mask}
        seeds = [None, 5, None, None, 6, 7, None]
        got, want = ours.reset(seed=seeds, options=options), ref.reset(seed=seeds, options=dict(options))
        np.testing.assert_array_equal(got[0], want[0])
        assert options == {"reset_mask": mask}  # never modified
        assert ours.np_random_seed == ref.np_random_seed
        assert ours.call("get_wrapper_attr", "_elapsed_steps") == ref.call("get_wrapper_attr", "_elapsed_steps")
    finally:
        ours.close()
        ref.close()


def test_dict_observations_tuple_actions_and_env_methods_per_env():
    """Observations that are not one array travel as each env's own reply; Box parts of actions
    as each env's payloads; call/get_attr/set_attr/render reach each env."""
    n, k = 7, 3
    fns = [lambda: DictTupleEnv(render_mode="rgb_array")] * n
    ours = BoltzLabsVecEnv(fns, envs_per_sandbox=k, isolation=ISOLATION)
    ref = gym.vector.SyncVectorEnv(fns)
    try:
        got, want = ours.reset(seed=1), ref.reset(seed=1)
        _assert_tree_equal(got, want)
        ours.action_space.seed(2)
        for _ in range(30):
            actions = ours.action_space.sample()
            _assert_tree_equal(ours.step(actions), ref.step(actions))
        ours.set_attr("level", list(range(n)))
        ref.set_attr("level", list(range(n)))
        assert ours.call("double_level", 3) == ref.call("double_level", 3) == tuple(3 * i for i in range(n))
        assert ours.get_attr("level") == tuple(3 * i for i in range(n))
        for a, b in zip(ours.render(), ref.render()):
            np.testing.assert_array_equal(a, b)
        with pytest.raises(AttributeError):
            ours.get_attr("no_such_attribute")
    finally:
        ours.close()
        ref.close()


def _assert_tree_equal(a, b) -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            _assert_tree_equal(a[key], b[key])
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_tree_equal(x, y)
    else:
        np.testing.assert_array_equal(a, b)


def test_sb3_adapter_with_several_envs_per_sandbox():
    from boltzlabs_gym.sb3 import make_sb3_vec_env

    vec = make_sb3_vec_env("CartPole-v1", n_envs=6, envs_per_sandbox=4, isolation=ISOLATION, seed=0)
    try:
        obs = vec.reset()
        assert obs.shape == (6, 4)
        dones_seen = 0
        for _ in range(60):
            obs, rewards, dones, infos = vec.step(np.ones(6, dtype=np.int64))
            assert obs.shape == (6, 4) and rewards.shape == (6,)
            dones_seen += int(dones.sum())
            for i in np.flatnonzero(dones):
                assert "terminal_observation" in infos[i]
        assert dones_seen > 0
        assert vec.get_attr("render_mode", indices=[1, 5]) == [None, None]
        assert len(vec.env_method("get_wrapper_attr", "_elapsed_steps")) == 6
    finally:
        vec.close()


# ----------------------------------------------------------------------------------- env directories


def test_factory_env_dir_gives_each_env_its_own_instance():
    with RLPool(SANDBOXED, n=5, envs_per_sandbox=2, isolation=ISOLATION) as pool:
        obs = pool.reset(seed=10)
        assert [o["env"] for o in obs] == [0, 1, 2, 3, 4]
        assert [o["seed"] for o in obs] == [10, 11, 12, 13, 14]
        pids = [o["pid"] for o in obs]
        assert pids[0] == pids[1] and pids[2] == pids[3] and len(set(pids)) == 3  # 3 sandboxes
        obs, rewards, dones, _ = pool.step([1, 0, 1, 0, 1])
        assert [o["t"] for o in obs] == [1] * 5 and rewards.tolist() == [1, 0, 1, 0, 1]
        obs, _, _, _ = pool.step([1, 1, 1, 1, 1])
        assert [o["t"] for o in obs] == [2] * 5  # separate state per env, not per process
        assert len(pool.memory()) == 5
        assert pool.envs_per_gb() > 0


def test_function_form_env_dir_is_refused_with_the_fix(tmp_path):
    with pytest.raises(EnvStartError) as info:
        RLPool(COUNTER, n=4, envs_per_sandbox=2, isolation=ISOLATION, start_timeout=30)
    message = str(info.value) + str(getattr(info.value, "stderr_tail", ""))
    assert "serve(factory=" in message and "envs_per_sandbox=2" in message


def test_envs_of_a_sandbox_share_its_workspace():
    with RLPool(SANDBOXED, n=4, envs_per_sandbox=2, isolation=ISOLATION) as pool:
        pool.reset()
        pool.step([["write", "a"], 0, ["write", "b"], 0])
        obs, *_ = pool.step(["files", "files", "files", "files"])
        names = [[f for f in o["files"] if f.endswith(".txt")] for o in obs]
        assert names == [["env0.txt"], ["env0.txt"], ["env2.txt"], ["env2.txt"]]


# ----------------------------------------------------------------------------------- failures


@pytest.mark.parametrize("direct", [True, False])
def test_a_hang_restarts_its_sandbox_and_names_the_env(direct):
    with RLPool(SANDBOXED, n=6, envs_per_sandbox=3, isolation=ISOLATION, step_timeout=1.5, direct=direct) as pool:
        before = pool.reset()
        obs, rewards, dones, infos = pool.step([1, 1, 1, 1, "hang", 1])
        assert "boltzlabs_straggler" in infos[4]
        assert infos[4]["boltzlabs_straggler"]["deadline_s"] == 1.5
        for i in (3, 5):
            err = infos[i]["boltzlabs_error"]
            assert err["kind"] == "crash"
            assert err["reason"].startswith("sandbox restarted because env 4 failed: missed the 1.5 s deadline")
        for i in (0, 1, 2):  # the other sandbox is untouched
            assert infos[i] == {} and obs[i]["t"] == 1
        assert dones[3:].all() and not dones[:3].any()
        assert pool.timing.stragglers == (4,) and set(pool.timing.errors) == {3, 5}
        after = pool.reset(where=np.array([False, False, False, True, True, True]))
        assert after[3]["pid"] != before[3]["pid"] and after[3]["pid"] == after[5]["pid"]
        obs, _, dones, infos = pool.step([1] * 6)
        assert not dones.any() and [o["t"] for o in obs] == [2, 2, 2, 1, 1, 1]


@pytest.mark.parametrize("direct", [True, False])
def test_a_crash_restarts_its_sandbox_and_names_the_env(direct):
    with RLPool(SANDBOXED, n=4, envs_per_sandbox=2, isolation=ISOLATION, direct=direct) as pool:
        pool.reset()
        _, _, dones, infos = pool.step([1, "crash", 1, 1])
        assert infos[1]["boltzlabs_error"]["kind"] == "crash"
        assert "exited with status 3" in infos[1]["boltzlabs_error"]["reason"]
        assert infos[0]["boltzlabs_error"]["reason"].startswith("sandbox restarted because env 1 failed")
        assert dones.tolist() == [True, True, False, False] and infos[2] == infos[3] == {}


def test_an_exception_stays_with_its_env():
    with RLPool(SANDBOXED, n=3, envs_per_sandbox=3, isolation=ISOLATION) as pool:
        pool.reset()
        obs, _, dones, infos = pool.step([1, "raise", 1])
        assert "boltzlabs_exception" in infos[1] and "env 1 raised" in infos[1]["boltzlabs_exception"]["traceback"]
        assert infos[0] == infos[2] == {} and obs[0]["t"] == obs[2]["t"] == 1
        assert dones.tolist() == [False, True, False]  # the env reports it terminated; no restart
        obs, _, _, _ = pool.step([1, 1, 1])
        assert obs[0]["pid"] == obs[2]["pid"] and obs[0]["t"] == 2


def test_envs_left_out_of_the_failed_request_are_told_on_their_next_step():
    with RLPool(SANDBOXED, n=3, envs_per_sandbox=3, isolation=ISOLATION, step_timeout=1.0) as pool:
        pool.reset()
        pool.batch_async([(1, {"op": "step", "action": "hang"}, ())])
        (r,) = pool.batch_wait()
        assert r.status == "straggler"
        obs, _, dones, infos = pool.step([1, 1, 1])
        for i in (0, 2):  # their process died while they were not asked anything
            assert infos[i]["boltzlabs_error"]["reason"].startswith("sandbox restarted because env 1 failed")
            assert dones[i]
        assert "boltzlabs_error" not in infos[1]  # env 1 heard about it already; it is stepped afresh
        obs = pool.reset()
        obs, _, dones, infos = pool.step([1, 1, 1])
        assert not dones.any() and all(i == {} for i in infos)


def test_hard_reset_restarts_the_whole_sandbox_and_says_so():
    with RLPool(SANDBOXED, n=4, envs_per_sandbox=2, isolation=ISOLATION) as pool:
        first = pool.reset(seed=0)
        pool.step([["write", "x"], 0, 0, 0])
        obs = pool.reset(seed=100, where=np.array([True, False, False, False]), hard=True)
        assert obs[0]["seed"] == 100 and obs[1]["seed"] is None  # env 1 came back reset too
        assert obs[0]["pid"] != first[0]["pid"] and obs[2]["pid"] == first[2]["pid"]
        assert "boltzlabs_restarted" in pool.reset_infos[1] and "boltzlabs_restarted" not in pool.reset_infos[0]
        files, *_ = pool.step(["files", "files", 0, 0])
        assert not [f for f in files[0]["files"] if f.endswith(".txt")]  # the workspace was wiped


def test_status_and_memory_count_envs_and_show_k():
    worker = WorkerProcess(capacity=4)
    try:
        with RLPool(SANDBOXED, n=7, envs_per_sandbox=2, workers=[worker.address], isolation=ISOLATION) as pool:
            link = pool._links[0]
            status = link.call({"op": "status"}, timeout=10)
            (session,) = status["sessions"]
            assert (session["envs"], session["sandboxes"], session["envs_per_sandbox"]) == (7, 4, 2)
            assert status["in_use"] == 4 and status["free"] == 0  # capacity counts sandboxes
            memory = pool.memory()
            assert len(memory) == 7 and memory[0] == memory[1] > 0
            assert pool.isolation.envs_per_sandbox == 2 and "2 envs per sandbox" in str(pool.isolation)
    finally:
        worker.stop()


def test_a_straggler_sandbox_is_reported_within_the_deadline_and_replaced():
    envs = boltzlabs_gym.make_vec("CartPole-v1", num_envs=4, envs_per_sandbox=2, isolation=ISOLATION, step_timeout=1.0)
    try:
        envs.reset(seed=0)
        os.kill(_sandbox_pid(envs.pool, 1), signal.SIGSTOP)  # sandbox 1 (envs 2, 3) stops answering
        t0 = time.monotonic()
        obs, _, _, truncated, infos = envs.step(np.zeros(4, dtype=np.int64))
        assert time.monotonic() - t0 < 10
        assert truncated.tolist() == [False, False, True, True]
        # Stopped between requests: no env of it was running, so both are reported as its stragglers.
        assert infos["_boltzlabs_straggler"].tolist() == [False, False, True, True]
        assert "which env was running is not known" in infos["boltzlabs_straggler"]["reason"][2]
        np.testing.assert_array_equal(obs[2:], 0)
        obs, *_ = envs.step(np.zeros(4, dtype=np.int64))  # the two are reset on this step, in a new sandbox
        assert obs.shape == (4, 4)
    finally:
        envs.close()


def _sandbox_pid(pool: RLPool, sandbox: int) -> int:
    """The pid of a local pool's sandbox process (its worker's child)."""
    import psutil

    worker = psutil.Process(pool._links[0].process.pid)
    children = sorted(worker.children(), key=lambda p: p.create_time())
    return children[sandbox].pid


def test_a_step_batch_with_a_slow_reset_in_it_has_both_deadlines():
    """Autoreset puts an env's reset in the same request as its neighbours' steps: the request is
    held to the step and the reset deadline together, not to the step deadline alone."""
    with RLPool(SANDBOXED, n=2, envs_per_sandbox=2, isolation=ISOLATION, step_timeout=1.0, reset_timeout=5.0) as pool:
        pool.reset()
        slow = {"op": "reset", "seed": None, "options": {"sleep": 1.5}}
        pool.batch_async([(0, slow, ()), (1, {"op": "step", "action": 1}, ())])
        first, second = pool.batch_wait()
        assert first.status == second.status == "ok"
        assert first.reply["obs"]["t"] == 0 and second.reply["obs"]["t"] == 1


def test_a_call_does_not_settle_a_restarted_neighbour():
    with RLPool(SANDBOXED, n=2, envs_per_sandbox=2, isolation=ISOLATION, step_timeout=1.0) as pool:
        pool.reset()
        pool.batch_async([(1, {"op": "step", "action": "hang"}, ())])
        pool.batch_wait()
        pool.call_envs({"op": "describe"}, [0])  # not a step, not a reset: env 0 still has to hear it
        _, _, dones, infos = pool.step([1, 1])
        assert dones[0] and infos[0]["boltzlabs_error"]["reason"].startswith("sandbox restarted because env 1")


# ----------------------------------------------------------------------------------- hostile sandbox replies


def _sandbox_result(reply: dict, payloads: list, indices: list[int], status: str = "ok", size: int = 4, first: int = 0):
    from boltzlabs_gym.client.results import EnvResult
    from boltzlabs_gym.client.sandbox_replies import SandboxPlan, SandboxResult

    plan = SandboxPlan(first // 4, list(range(len(indices))), indices)
    return SandboxResult(plan, EnvResult(indices[0], status, reply, payloads), range(first, first + size))


@pytest.mark.parametrize(
    "reply, payloads",
    [
        ({"n": 2, "replies": {"²": {}, "1": {}}}, []),  # a digit that int() refuses
        ({"n": 2, "replies": {"0": {}, "01": {}}}, []),  # not the canonical spelling
        ({"n": 2, "replies": {"0": {}}}, []),  # a position with no reply and no arrays
        (
            {
                "n": 2,
                "obs": {"__nd__": [0, "<f4", [2, 65536, 65536, 65536, 65536]]},
                "reward": {"__nd__": [1, "<f8", [2]]},
                "flags": {"__nd__": [2, "|u1", [2]]},
            },
            [b"", b"\0" * 16, b"\0\0"],
        ),  # a shape whose size wraps around in int64
        ({"n": 2, "replies": {"0": {"_bin": [5]}, "1": {}}}, [b"1234"]),  # payloads that do not follow
        ({"n": 3, "replies": {}}, []),  # the wrong number of positions
    ],
)
def test_a_malformed_sandbox_reply_is_a_bad_reply_for_every_env(reply, payloads):
    read = _sandbox_result(reply, payloads, [0, 1]).read()
    assert isinstance(read, list) and [r.reply["bad_reply"] for r in read] == [True, True]
    assert all(r.status == "error" and r.index == i for i, r in enumerate(read))


def _dict_rows(obs, reward_ref: int = 2) -> dict:
    return {
        "n": 2,
        "obs": obs,
        "reward": {"__nd__": [reward_ref, "<f8", [2]]},
        "flags": {"__nd__": [reward_ref + 1, "|u1", [2]]},
        "replies": {},
    }


_PIXELS = {"__nd__": [0, "|u1", [2, 3]]}
_STATE = {"__nd__": [1, "<f4", [2, 2]]}
_DICT_ROWS_PAYLOADS = [b"\1" * 6, b"\0" * 16, b"\0" * 16, b"\0\0"]


def _nested(depth: int) -> dict:
    node: dict = {"__nd__": [0, "|u1", [2, 3]]}
    for _ in range(depth):
        node = {"x": node}
    return node


@pytest.mark.parametrize(
    "reply, payloads",
    [
        (_dict_rows({"a": {"__nd__": [1, "|u1", [2, 3]]}, "b": {"__nd__": [0, "<f4", [2, 2]]}}), _DICT_ROWS_PAYLOADS),
        (_dict_rows({"a": _PIXELS, "b": _STATE}, reward_ref=1), _DICT_ROWS_PAYLOADS),  # rewards among the arrays
        (_dict_rows({"a": dict(_PIXELS, x=1), "b": _STATE}), _DICT_ROWS_PAYLOADS),  # a leaf with more in it
        (_dict_rows({"a": _PIXELS, "b": {"__nd__": [1, "<f4", [3, 2]]}}), _DICT_ROWS_PAYLOADS),  # 3 rows for 2
        (_dict_rows({"a": _PIXELS, "b": {}}), _DICT_ROWS_PAYLOADS),  # an empty Dict
        (_dict_rows([_PIXELS, "state"]), _DICT_ROWS_PAYLOADS),  # a Tuple with a string in it
        (_dict_rows({"a": _PIXELS, "b": _STATE}), _DICT_ROWS_PAYLOADS[:3] + [b"\0"]),  # short flags
        (_dict_rows(_nested(MAX_INFO_DEPTH + 1), reward_ref=1), [b"\1" * 6, b"\0" * 16, b"\0\0"]),  # nested too deep
    ],
    ids=[
        "refs-out-of-order",
        "reward-among-arrays",
        "leaf-with-more",
        "wrong-rows",
        "empty-dict",
        "string-leaf",
        "short-flags",
        "too-deep",
    ],
)
def test_a_malformed_dict_sandbox_reply_is_a_bad_reply_for_every_env(reply, payloads):
    """Rows of a Dict/Tuple's arrays: references from 0 in order, then rewards and flags; each
    leaf exactly one ``__nd__`` of the positions' rows; no other values in the skeleton."""
    read = _sandbox_result(reply, payloads, [0, 1]).read()
    assert isinstance(read, list) and [r.reply["bad_reply"] for r in read] == [True, True], read


def test_dict_sandbox_rows_read_as_each_envs_reply():
    """Valid rows of a Dict's arrays: each position expands to the reply a one-env sandbox sends
    (the skeleton without the rows, its own rows' bytes), which decodes against the space; a
    reader whose space has another skeleton refuses them."""
    from gymnasium import spaces

    from boltzlabs_gym.wire.codec import decode

    space = spaces.Dict({"a": spaces.Box(0, 255, (3,), np.uint8), "b": spaces.Box(-1, 1, (2,), np.float32)})
    pixels = np.arange(6, dtype=np.uint8)
    state = np.array([0.5, -0.5, 0.25, -0.25], np.float32)
    reply = _dict_rows({"a": _PIXELS, "b": _STATE})
    payloads = [pixels.tobytes(), state.tobytes(), np.array([1.0, 2.0]).tobytes(), bytes([0, 1])]
    result = _sandbox_result(reply, payloads, [4, 5], first=4)
    read = result.read({"a": {"__nd__": [0, "|u1", [3]]}, "b": {"__nd__": [1, "<f4", [2]]}})
    assert not isinstance(read, list) and len(read.leaves) == 2 and read.obs is None
    results = result.expand()
    assert [r.index for r in results] == [4, 5]
    for p, r in enumerate(results):
        obs = decode(space, r.reply["obs"], r.payloads)
        np.testing.assert_array_equal(obs["a"], pixels.reshape(2, 3)[p])
        np.testing.assert_array_equal(obs["b"], state.reshape(2, 2)[p])
        assert r.reply["reward"] == [1.0, 2.0][p] and r.reply["terminated"] == bool(p)
    other = _sandbox_result(reply, payloads, [4, 5], first=4).read({"a": {"__nd__": [0, "|u1", [3]]}})
    assert isinstance(other, list) and all(r.reply["bad_reply"] for r in other)


#: A sandbox reply of one position whose observation is one float64, with its payloads.
_ONE_ROW = {
    "n": 1,
    "obs": {"__nd__": [0, "<f8", [1, 1]]},
    "reward": {"__nd__": [1, "<f8", [1]]},
    "flags": {"__nd__": [2, "|u1", [1]]},
    "replies": {},
}
_ONE_ROW_PAYLOADS = [b"\0" * 8, b"\0" * 8, b"\0"]


def _raw_sandbox(line: bytes, payloads: list, indices: list[int]):
    """A sandbox result as the pipe's reader hands it over: the reply line unparsed."""
    from boltzlabs_gym.client.results import EnvResult
    from boltzlabs_gym.client.sandbox_replies import SandboxPlan, SandboxResult

    plan = SandboxPlan(0, list(range(len(indices))), indices)
    return SandboxResult(plan, EnvResult(indices[0], "ok", None, payloads, line), range(0, 4))


def test_a_sandbox_line_read_before_is_still_checked_against_its_reader_and_payloads():
    """An all-plain sandbox reply's line is parsed and checked once, then known by its bytes: the
    same line again reads its own payloads' numbers, and what the line cannot vouch for (the
    reader's space, the payloads that came with it) is checked every time."""
    import json

    from boltzlabs_gym.client.sandbox_replies import _KNOWN_LINES

    reply = _dict_rows({"a": _PIXELS, "b": _STATE})
    line = json.dumps(reply).encode() + b"\n"
    row_skeleton = {"a": {"__nd__": [0, "|u1", [3]]}, "b": {"__nd__": [1, "<f4", [2]]}}

    def payloads(fill: int) -> list:
        return [bytes([fill]) * 6, np.full(4, fill, np.float32).tobytes(), np.full(2, fill, float).tobytes(), b"\1\0"]

    first = _raw_sandbox(line, payloads(1), [0, 1]).read(row_skeleton)
    assert not isinstance(first, list) and _KNOWN_LINES.get(line, 2) is not None
    again = _raw_sandbox(line, payloads(7), [0, 1]).read(row_skeleton)
    assert not isinstance(again, list) and again.plain.all() and not again.others
    np.testing.assert_array_equal(again.leaves[0], np.full((2, 3), 7, np.uint8))
    np.testing.assert_array_equal(again.reward, [7.0, 7.0])
    assert list(again.flags) == [1, 0] and again.skeleton == row_skeleton
    # What leaves for other readers is their own: one that changes its reply's skeleton changes no other.
    for _ in range(2):
        expanded = _raw_sandbox(line, payloads(7), [0, 1]).expand()
        assert [r.reply["obs"] for r in expanded] == [row_skeleton] * 2
        expanded[0].reply["obs"]["a"]["__nd__"][2].append(99)
    third = _raw_sandbox(line, payloads(7), [0, 1]).read(row_skeleton)
    assert not isinstance(third, list) and third.skeleton == row_skeleton
    bad = {
        "another space": _raw_sandbox(line, payloads(7), [0, 1]).read({"a": {"__nd__": [0, "|u1", [3]]}}),
        "no array form": _raw_sandbox(line, payloads(7), [0, 1]).read(arrays=False),
        "a payload more": _raw_sandbox(line, [*payloads(7), b"x"], [0, 1]).read(row_skeleton),
        "short flags": _raw_sandbox(line, [*payloads(7)[:3], b"\0"], [0, 1]).read(row_skeleton),
        "other positions": _raw_sandbox(line, payloads(7), [0, 1, 2]).read(),
    }
    for what, read in bad.items():
        assert isinstance(read, list) and all(r.reply["bad_reply"] for r in read), what


def test_known_sandbox_lines_stay_bounded():
    """A sandbox that sends ever new valid lines only makes the reader start over."""
    import json

    from boltzlabs_gym.client.sandbox_replies import _KNOWN_LINES, _KnownLines

    for k in range(_KnownLines.LIMIT + 10):
        line = json.dumps(dict(_ONE_ROW, pad="x" * k)).encode() + b"\n"
        assert not isinstance(_raw_sandbox(line, _ONE_ROW_PAYLOADS, [0]).read(), list)
        assert len(_KNOWN_LINES._layouts) <= _KnownLines.LIMIT


def test_rows_for_a_space_without_an_array_form_are_a_bad_reply():
    read = _sandbox_result(_ONE_ROW, _ONE_ROW_PAYLOADS, [0]).read(arrays=False)
    assert isinstance(read, list) and read[0].reply["bad_reply"]


def test_a_failure_without_its_sandbox_size_marks_only_that_sandbox():
    """The sandbox's envs come from the pool's layout, never from the worker's or env's words."""
    result = _sandbox_result({"message": "env failed to restart"}, [], [9], status="error", size=4, first=8)
    read = result.read()
    assert [r.index for r in read] == [9]
    assert sorted(result.restarted) == [8, 10, 11]


def test_a_sandbox_limit_stays_bounded_however_many_envs():
    import os

    from boltzlabs_gym.wire.envpipe import MAX_SANDBOX_PAYLOAD_BYTES, EnvFault, EnvPipe

    r, w = os.pipe()
    os.set_blocking(r, False)
    pipe = EnvPipe(-1, r)
    pipe.serve_envs(4096)
    assert pipe.max_payload == MAX_SANDBOX_PAYLOAD_BYTES
    try:
        os.write(w, b'{"_bin":[%d]}\n' % (MAX_SANDBOX_PAYLOAD_BYTES + 1))
        with pytest.raises(EnvFault, match="over the limit"):
            pipe.read_replies()
    finally:
        os.close(r)
        os.close(w)


def test_writev_all_writes_more_parts_than_one_system_call_takes():
    import os
    import threading

    from boltzlabs_gym.envside.framing import writev_all

    parts = [b"%05d" % i for i in range(3000)]
    r, w = os.pipe()
    got = bytearray()

    def drain():
        while chunk := os.read(r, 1 << 16):
            got.extend(chunk)

    reader = threading.Thread(target=drain)
    reader.start()
    writev_all(w, parts)
    os.close(w)
    reader.join(10)
    os.close(r)
    assert bytes(got) == b"".join(parts)
