"""The worker's deadline heap: sandboxed entries, stale entries dropped, bounded size."""

from __future__ import annotations

import threading

import pytest

from boltzlabs_gym import RLPool
from boltzlabs_gym.testing import wait_until
from boltzlabs_gym.worker.deadlines import Deadlines
from boltzlabs_gym.worker.router import Worker
from conftest import COUNTER, FAULTY, ISOLATION, our_cgroups


def test_calls_sent_together_share_one_entry_and_expire_together():
    live = {("s", i, i) for i in range(64)}
    d = Deadlines(is_live=live.__contains__)
    for key in sorted(live):
        d.add(0.5, key)
    d.add(2.0, ("s", 99, 99))
    live.add(("s", 99, 99))
    d.seal(now=10.0)
    assert len(d) == 2, "one entry per (turn, timeout), not per call"
    assert d.next_deadline() == 10.5
    assert list(d.pop_expired(now=10.4)) == []
    live.discard(("s", 3, 3))  # answered in time: never reported
    expired = list(d.pop_expired(now=10.5))
    assert expired == [("s", i, i) for i in range(64) if i != 3]
    assert d.next_deadline() == 12.0
    assert list(d.pop_expired(now=12.0)) == [("s", 99, 99)]
    assert d.next_deadline() is None


def test_unsealed_calls_have_no_deadline_yet():
    d = Deadlines(is_live=lambda key: True)
    d.add(0.1, "a")
    assert d.next_deadline() is None
    assert list(d.pop_expired(now=1e9)) == []
    d.seal(now=5.0)
    assert list(d.pop_expired(now=5.1)) == ["a"]


def test_stale_entries_do_not_pile_up():
    """A busy pool with a long timeout: every call answers in time, and the heap stays small
    (it held rate x timeout entries, tens of MB at 10k steps/s and 30 s, before)."""
    live: set = set()
    d = Deadlines(is_live=live.__contains__)
    peak = 0
    for turn in range(20_000):
        key = ("s", 0, turn)
        live.add(key)
        d.add(30.0, key)
        d.seal(now=turn * 1e-3)
        live.discard(("s", 0, turn - 1))  # the previous call answered
        peak = max(peak, len(d))
    assert peak <= 257
    assert list(d.pop_expired(now=1e9)) == [("s", 0, 19_999)], "the live call is never dropped"


def test_a_handler_that_seals_while_expiring_loses_nothing():
    live = {1, 2, 3}
    d = Deadlines(is_live=live.__contains__)
    for k in (1, 2):
        d.add(1.0, k)
    d.seal(now=0.0)
    got = []
    for key in d.pop_expired(now=1.0):
        got.append(key)
        live.discard(key)
        if key == 1:  # handling a fault sends a respawn's first reset
            d.add(0.5, 3)
            d.seal(now=1.0)
    assert got == [1, 2]
    assert list(d.pop_expired(now=1.5)) == [3]


@pytest.fixture
def worker_in_thread(tmp_path):
    worker = Worker([f"ipc://{tmp_path}/w.sock"], capacity=64)
    thread = threading.Thread(target=worker.serve_forever, daemon=True)
    thread.start()
    yield worker, f"ipc://{tmp_path}/w.sock"
    worker.stop()
    thread.join(10)
    assert not thread.is_alive()
    assert wait_until(lambda: not our_cgroups(), 5), f"leaked cgroups: {sorted(our_cgroups())}"


def test_worker_heap_stays_bounded_and_stragglers_are_still_caught(worker_in_thread):
    worker, endpoint = worker_in_thread
    with RLPool(COUNTER, n=8, workers=[endpoint], isolation=ISOLATION, step_timeout=30.0) as pool:
        pool.reset(seed=0)
        for _ in range(600):
            _, _, dones, _ = pool.step([1] * 8)
            if dones.any():
                pool.reset(where=dones)
        assert len(worker._deadlines) <= 257, "600 batches of 8 calls, all answered in time"
    with RLPool(FAULTY, n=2, workers=[endpoint], isolation=ISOLATION, step_timeout=0.5) as pool:
        pool.reset(seed=0)
        _, _, dones, infos = pool.step([{"hang": True}, 1])
        assert infos[0].get("boltzlabs_straggler") and not infos[1].get("boltzlabs_straggler")
