"""The local worker's busy-poll after a batch reply: when it spins, when it sleeps."""

from __future__ import annotations

import os
import select
import socket
import time

import psutil
import pytest

from boltzlabs_gym import RLPool
from boltzlabs_gym.worker import router
from boltzlabs_gym.worker.router import Worker

from conftest import COUNTER, ISOLATION


@pytest.fixture
def worker(tmp_path):
    ours, theirs = socket.socketpair()
    w = Worker([f"ipc://{tmp_path}/w.sock"], capacity=4, local_channel=theirs, busy_poll_us=50_000)
    yield w
    w.shutdown()
    ours.close()


class _Clock:
    """The worker module's ``time``, with a ``perf_counter`` the test moves (no scheduler in the way)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now

    def __getattr__(self, name):
        return getattr(time, name)


def test_spins_only_after_a_pool_that_came_back_within_the_window(worker, monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(router, "time", clock)
    worker._local_replied()
    assert not worker._spin_until, "nothing known yet about this pool: sleep"
    clock.now += 0.001
    worker._local_request_arrived()  # came back at once
    worker._local_replied()
    assert worker._spin_until == pytest.approx(clock.now + 0.05), "it came back fast: stay awake for it"
    worker._spin_until = 0.0
    clock.now += 0.2  # a slow learner: longer than the 50 ms window
    worker._local_request_arrived()
    worker._local_replied()
    assert not worker._spin_until, "the last gap was longer than the window: sleep"
    clock.now += 0.049
    worker._local_request_arrived()
    worker._local_replied()
    assert worker._spin_until == pytest.approx(clock.now + 0.05), "fast again (49 ms): spin again"
    worker._spin_until = 0.0
    clock.now += 0.051
    worker._local_request_arrived()
    worker._local_replied()
    assert not worker._spin_until, "51 ms: past the window, sleep"


def test_zero_window_never_spins(worker):
    worker.busy_poll_us = 0.0
    for _ in range(3):
        worker._local_request_arrived()
        worker._local_replied()
        assert not worker._spin_until


def test_spinning_poll_returns_events_at_once_and_otherwise_waits_out_the_timeout(worker):
    for fd in (worker._zmq_fd, worker._local_fd):
        worker.poller.unwatch(fd)  # only the pipe below can wake this poll
    r, w = os.pipe()
    try:
        worker.poller.watch(r)
        worker._spin_until = time.perf_counter() + 0.05
        t0 = time.perf_counter()
        assert worker._poll_spinning(0.3) == [], "nothing came: spin, then sleep out the timeout"
        assert time.perf_counter() - t0 >= 0.29
        assert not worker._spin_until, "one spin per reply"
        os.write(w, b"x")
        worker._spin_until = time.perf_counter() + 0.05
        t0 = time.perf_counter()
        assert worker._poll_spinning(5.0) == [(r, select.EPOLLIN)]
        assert time.perf_counter() - t0 < 1.0
        os.read(r, 1)
        worker._spin_until = time.perf_counter() + 10.0
        t0 = time.perf_counter()
        assert worker._poll_spinning(0.05) == []
        assert time.perf_counter() - t0 < 1.0, "a deadline due sooner than the spin window ends the spin"
    finally:
        os.close(r)
        os.close(w)


def _worker_args(pool):
    return psutil.Process(pool._links[0].process.pid).cmdline()


def test_worker_checks_its_busy_poll_window_as_the_pool_does(tmp_path):
    for bad in (-1, 2e6, "fast", None, True, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="busy_poll_us"):
            Worker([f"ipc://{tmp_path}/w.sock"], busy_poll_us=bad)


def test_pool_hands_its_busy_poll_to_its_worker():
    with RLPool(COUNTER, n=1, isolation=ISOLATION, busy_poll_us=0) as pool:
        args = _worker_args(pool)
        assert args[args.index("--busy-poll-us") + 1] == "0.0"
        pool.reset(seed=0)
        assert pool.step([1])[0] == [{"t": 1}]
    with RLPool(COUNTER, n=1, isolation=ISOLATION) as pool:
        args = _worker_args(pool)
        assert float(args[args.index("--busy-poll-us") + 1]) == pool.busy_poll_us == 300.0
    for bad in (-1, 2e6, "fast", None, True, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="busy_poll_us"):
            RLPool(COUNTER, n=1, busy_poll_us=bad)
