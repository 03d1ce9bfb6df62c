"""Cancelling a pool's calls in flight from another thread: ``RLPool.cancels`` and the worker's
``cancel`` op (the code server's disconnects use it; see tests/code for that end)."""

from __future__ import annotations

import threading
import time

import pytest

from boltzlabs_gym import RLPool
from boltzlabs_gym.client.results import read_step
from boltzlabs_gym.testing import WorkerProcess
from boltzlabs_gym.wire.keys import generate_keys
from conftest import FAULTY, ISOLATION


@pytest.fixture(scope="module")
def pool():
    with RLPool(FAULTY, 2, isolation=ISOLATION, direct=False, step_timeout=30) as p:
        p.reset(seed=0)
        yield p


def test_a_hung_call_is_cancelled_at_once_and_only_by_its_tag(pool):
    pool.batch_async(
        [(0, {"op": "step", "action": {"hang": True}, "tag": "a"}, ()), (1, {"op": "step", "action": 2, "tag": 7}, ())]
    )
    answers: list = []

    def cancel_later():
        time.sleep(0.3)
        answers.append(pool.cancels.cancel([(0, "not-a"), (1, 7)]))  # a wrong tag; a call that finished
        answers.append(pool.cancels.cancel([(0, "a")]))

    canceller = threading.Thread(target=cancel_later)
    started = time.monotonic()
    canceller.start()
    hung, plain = (read_step(r, pool.step_timeout) for r in pool.batch_wait())
    waited = time.monotonic() - started
    canceller.join()
    assert answers == [[], [0]]
    assert waited < 5.0, f"the batch waited {waited:.1f} s for a cancelled call"
    assert hung.failure is not None and "cancelled by the client" in hung.failure.reason
    assert plain.failure is None and plain.reward == 2
    _, rewards, _, _ = pool.step([3, 4])  # env 0 was respawned; env 1 went on
    assert rewards.tolist() == [3.0, 4.0]


def test_cancelling_nothing_in_flight_finds_nothing(pool):
    assert pool.cancels.cancel([(0, "a"), (1, 7)]) == []
    with pytest.raises(IndexError):
        pool.cancels.cancel([(2, "a")])


def test_a_call_on_a_lent_env_is_cancelled_with_lent():
    with RLPool(FAULTY, 2, isolation=ISOLATION, step_timeout=30) as pool:  # direct: envs lent to the pool
        pool.reset(seed=0)
        hang, two = {"op": "step", "action": {"hang": True}, "tag": 1}, {"op": "step", "action": 2, "tag": 2}
        pool.batch_async([(0, hang, ()), (1, two, ())])
        answers: list = []
        timer = threading.Timer(0.3, lambda: answers.append(pool.cancels.cancel([(0, 1)], lent=True)))
        started = time.monotonic()
        timer.start()
        hung, plain = (read_step(r, pool.step_timeout) for r in pool.batch_wait())
        waited = time.monotonic() - started
        timer.join()
        assert answers == [[0]] and waited < 5.0
        assert hung.failure is not None and plain.failure is None and plain.reward == 2
        # the pool stepped env 0 itself: it saw the pipe close when the worker killed the env
        assert "closed its stdout" in hung.failure.reason and "worker restarted it" in hung.failure.reason
        pool.reset(where=[True, False], hard=True)
        _, rewards, _, _ = pool.step([3, 4])
        assert rewards.tolist() == [3.0, 4.0]


def test_a_remote_workers_call_is_cancelled_over_its_curve_keys(tmp_path):
    keys = str(tmp_path / "keys")
    generate_keys(keys)
    worker = WorkerProcess(keys=keys, capacity=2)
    try:
        with RLPool(FAULTY, 1, workers=[worker.address], keys=keys, isolation=ISOLATION, step_timeout=30) as pool:
            pool.reset(seed=0)
            pool.batch_async([(0, {"op": "step", "action": {"hang": True}, "tag": "r"}, ())])
            answers: list = []
            timer = threading.Timer(0.3, lambda: answers.append(pool.cancels.cancel([(0, "r")])))
            timer.start()
            (hung,) = (read_step(r, pool.step_timeout) for r in pool.batch_wait(timeout=10))
            timer.join()
            assert answers == [[0]] and "cancelled by the client" in hung.failure.reason
    finally:
        worker.stop()
