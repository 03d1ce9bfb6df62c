"""RLPool.send/recv: envs that don't wait for each other (client/async_steps.py, worker/partial_replies.py).

Real pools of the fault-injection env: on the direct lane, through the worker, on two remote
workers, with two envs per sandbox. Small n, one pool per route, shared by the tests.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from conftest import FAULTY, ISOLATION
from workers import WorkerProcess

from boltzlabs_gym import RLPool
from boltzlabs_gym.errors import AsyncStateError, PoolClosedError, WorkerLost, WorkerTimeout

ROUTES = ["lane", "worker", "remote"]


@pytest.fixture(scope="module")
def remote_workers():
    workers = [WorkerProcess(insecure=True) for _ in range(2)]
    yield [w.address for w in workers]
    for w in workers:
        w.stop()


@pytest.fixture(scope="module", params=ROUTES)
def pool(request):
    options = {"lane": {}, "worker": {"direct": False}}.get(request.param)
    if options is None:
        options = {"workers": request.getfixturevalue("remote_workers")}
    with RLPool(FAULTY, n=4, isolation=ISOLATION, step_timeout=1.5, **options) as p:
        p.reset(seed=0)
        yield p


def test_first_finished_come_first_and_a_hung_env_delays_only_itself(pool):
    t0 = time.monotonic()
    pool.send([{"sleep": 0.4}, 1, 2, {"hang": True}], env_ids=[0, 1, 2, 3])
    first = pool.recv(batch_size=2)
    assert sorted(first.env_ids.tolist()) == [1, 2]
    assert time.monotonic() - t0 < 0.35  # not held back by env 0's sleep, nor env 3's hang
    assert first.rewards.tolist() == [float(i) for i in first.env_ids]
    pool.send([5, 6], env_ids=first.env_ids)  # stepped again while 0 and 3 are in flight
    again = pool.recv(batch_size=2)
    assert sorted(again.env_ids.tolist()) == [1, 2] and not again.dones.any()
    slow = pool.recv(batch_size=1)
    assert slow.env_ids.tolist() == [0] and slow.obs[0]["t"] == 1
    hung = pool.recv()  # the rest: env 3, killed at its deadline
    assert hung.env_ids.tolist() == [3] and hung.dones[0] and hung.obs[0] is None
    assert "boltzlabs_straggler" in hung.infos[0]
    pool.send(None, [3], reset=True, seed=7)
    reset = pool.recv()
    assert reset.obs[0]["seed"] == 10 and reset.rewards[0] == 0 and not reset.dones[0]
    obs, rewards, _, _ = pool.step([1, 1, 1, 1])  # lockstep still works after
    assert [o["t"] for o in obs] == [2, 3, 3, 1] and rewards.tolist() == [1.0] * 4


def test_crash_and_exception_stay_in_their_env(pool):
    pool.send([{"crash": True}, {"raise": "boom"}, 1, 1], env_ids=[0, 1, 2, 3])
    got = pool.recv()
    by_id = {int(i): k for k, i in enumerate(got.env_ids)}
    assert "boltzlabs_error" in got.infos[by_id[0]] and got.dones[by_id[0]]
    assert got.dones[by_id[1]]  # serve() turns the exception into a terminal transition
    assert got.rewards[by_id[2]] == 1.0 and not got.dones[by_id[2]]
    pool.reset(seed=0)


def test_bad_input_is_refused_naming_what_was_wrong_with_nothing_lost(pool):
    with pytest.raises(AsyncStateError, match="nothing in flight"):
        pool.recv()
    with pytest.raises(IndexError, match="env id 9 out of range"):
        pool.send([1], env_ids=[9])
    with pytest.raises(TypeError, match="env id must be an int"):
        pool.send([1], env_ids=["a"])
    with pytest.raises(ValueError, match="env id 1 appears twice"):
        pool.send([1, 1], env_ids=[1, 1])
    with pytest.raises(ValueError, match="expected exactly 2 actions"):
        pool.send([1], env_ids=[0, 1])
    pool.send([{"sleep": 0.2}, 1], env_ids=[0, 1])
    with pytest.raises(AsyncStateError, match="env 0 is still in flight"):
        pool.send([1, 1], env_ids=[2, 0])
    with pytest.raises(AsyncStateError, match="recv\\(\\) them before a lockstep call"):
        pool.step([1, 1, 1, 1])
    with pytest.raises(ValueError, match=r"batch_size=3\), but only 2 envs have calls to receive"):
        pool.recv(batch_size=3)
    with pytest.raises(WorkerTimeout, match="nothing is lost"):
        pool.recv(batch_size=2, timeout=0.05)
    got = pool.recv(batch_size=2)  # the refused calls lost nothing, sent nothing twice
    assert sorted(got.env_ids.tolist()) == [0, 1]
    # An env whose result waits for recv() is not idle: a second send would queue a second result.
    pool.send([1, 1], env_ids=[2, 3])
    time.sleep(0.5)  # both finish; recv() takes in both and hands out one
    [first] = pool.recv(batch_size=1).env_ids.tolist()
    other = 5 - first
    with pytest.raises(AsyncStateError, match=f"env {other} is still in flight"):
        pool.send([1], env_ids=[other])
    assert pool.recv().env_ids.tolist() == [other]  # once, and the refused send sent nothing
    pool.reset(seed=0)


def test_answered_calls_do_not_pile_up_on_the_lanes_deadline_heap(pool):
    """Calls sent as others finish never leave the lane empty, which is when its heap of deadlines
    is cleared: answered calls' entries are dropped as they pile up, not kept until they expire."""
    lane = pool._links[0].lane
    if lane is None:
        pytest.skip("this route has no direct lane")
    pool.send([1] * 4, env_ids=range(4))
    for _ in range(60):
        got = pool.recv(batch_size=2)
        pool.send([1] * 2, env_ids=got.env_ids)
        assert len(lane._deadlines) <= 4 * lane.in_flight + 65
    assert len(pool.recv().env_ids) == 4
    pool.reset(seed=0)


def test_close_with_steps_in_flight_warns_naming_them():
    pool = RLPool(FAULTY, n=2, isolation=ISOLATION)
    pool.reset()
    pool.send([{"sleep": 5}], env_ids=[1])
    with pytest.warns(RuntimeWarning, match=r"1 envs' send\(\) calls not received \(env ids \[1\]\)"):
        pool.close()
    with pytest.raises(PoolClosedError):
        pool.recv()


def test_a_sandbox_of_several_envs_takes_one_call_and_finishes_together():
    sandboxed = FAULTY.replace("faulty", "sandboxed")
    with RLPool(sandboxed, n=4, isolation=ISOLATION, envs_per_sandbox=2, step_timeout=1.0) as pool:
        pool.reset(seed=0)
        pool.send(["hang", 1, 2], env_ids=[0, 1, 2])
        with pytest.raises(AsyncStateError, match="env 3 shares sandbox 1 with env 2"):
            pool.send([1], env_ids=[3])
        first = pool.recv(batch_size=1)
        assert first.env_ids.tolist() == [2] and first.rewards.tolist() == [2.0]
        rest = pool.recv()  # sandbox 0's two envs, in one reply: killed at the deadline together
        assert sorted(rest.env_ids.tolist()) == [0, 1] and rest.dones.all()
        assert any("boltzlabs_straggler" in info for info in rest.infos)


def test_a_lost_worker_reports_its_envs_with_worker_loss_report_and_raises_without():
    """A remote worker killed with steps in flight: with ``worker_loss="report"`` its envs come back
    done with the error a lockstep step gives them (then and on every later send) while the other
    worker's envs go on; by default recv() raises WorkerLost."""
    workers = [WorkerProcess(insecure=True) for _ in range(2)]
    try:
        options = {
            "workers": [w.address for w in workers],
            "isolation": ISOLATION,
            "heartbeat_interval": 0.5,
            "heartbeat_timeout": 2.0,
            "step_timeout": 10.0,
        }
        with (
            RLPool(FAULTY, n=4, worker_loss="report", **options) as reporting,
            RLPool(FAULTY, n=2, **options) as raising,
        ):
            reporting.reset(seed=0)
            raising.reset(seed=0)
            reporting.send([1, 2, {"sleep": 5}, {"sleep": 5}], env_ids=[0, 1, 2, 3])  # envs 2, 3: worker 1
            raising.send([1, {"sleep": 5}], env_ids=[0, 1])
            workers[1].kill()
            t0 = time.monotonic()
            first = reporting.recv(batch_size=2)
            assert sorted(first.env_ids.tolist()) == [0, 1] and first.rewards.tolist() == [
                float(i + 1) for i in first.env_ids
            ]
            lost = reporting.recv()
            assert time.monotonic() - t0 < 2.0 + 3.0  # found within the heartbeat timeout, not the step's 5 s
            assert sorted(lost.env_ids.tolist()) == [2, 3] and lost.dones.all() and lost.obs == [None, None]
            assert all("is lost" in info["boltzlabs_error"]["reason"] for info in lost.infos), lost.infos
            assert list(reporting.lost_workers) == [workers[1].address]
            reporting.send([1, 1, 1, 1], env_ids=[0, 1, 2, 3])  # the lost worker's envs report at once
            again = reporting.recv()
            by_id = {int(i): k for k, i in enumerate(again.env_ids)}
            assert [again.rewards[by_id[i]] for i in (0, 1)] == [1.0, 1.0]
            assert all(again.dones[by_id[i]] and "boltzlabs_error" in again.infos[by_id[i]] for i in (2, 3))
            _, _, dones, infos = reporting.step([1, 1, 1, 1])  # lockstep reports them in the same words
            assert dones[2:].all() and infos[2:] == [again.infos[by_id[i]] for i in (2, 3)] == lost.infos
            assert raising.recv(batch_size=1).env_ids.tolist() == [0]
            with pytest.raises(WorkerLost, match=r"unreachable: nothing heard"):
                raising.recv()
            with pytest.warns(RuntimeWarning, match="not received"):
                raising.close()
    finally:
        for w in workers:
            w.stop()
