"""The worker's busy-polls: for the local pool's next request after a batch reply, and for
a batch's env replies after handing it out. When each spins, and when it sleeps."""

from __future__ import annotations

import os
import select
import socket
import time

import psutil
import pytest

from boltzlabs_gym import RLPool
from boltzlabs_gym.worker.server import Worker

from conftest import COUNTER, FAULTY, ISOLATION


@pytest.fixture
def worker(tmp_path):
    ours, theirs = socket.socketpair()
    w = Worker([f"ipc://{tmp_path}/w.sock"], capacity=4, local_channel=theirs, local_spin_s=0.05)
    yield w
    w.shutdown()
    ours.close()


def test_spins_only_after_a_pool_that_came_back_within_the_window(worker):
    worker._local_replied()
    assert not worker._spin_until, "nothing known yet about this pool: sleep"
    worker._local_request_arrived()  # came back at once
    worker._local_replied()
    assert worker._spin_until > time.perf_counter(), "it came back fast: stay awake for it"
    worker._spin_until = 0.0
    time.sleep(0.2)  # a slow learner: longer than the 50 ms window
    worker._local_request_arrived()
    worker._local_replied()
    assert not worker._spin_until, "the last gap was longer than the window: sleep"
    worker._local_request_arrived()
    worker._local_replied()
    assert worker._spin_until, "fast again: spin again"


def test_zero_window_never_spins(worker):
    worker.local_spin_s = 0.0
    for _ in range(3):
        worker._local_request_arrived()
        worker._local_replied()
        assert not worker._spin_until


def test_spinning_poll_returns_events_at_once_and_otherwise_waits_out_the_timeout(worker):
    for fd in (worker._zmq_fd, worker._local_fd):
        worker.epoll.unregister(fd)  # only the pipe below can wake this poll
    r, w = os.pipe()
    try:
        worker.epoll.register(r, select.EPOLLIN)
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


def test_pool_hands_its_busy_poll_to_its_worker():
    with RLPool(COUNTER, n=1, isolation=ISOLATION, busy_poll_us=0) as pool:
        args = _worker_args(pool)
        assert args[args.index("--local-spin-us") + 1] == "0.0"
        pool.reset(seed=0)
        assert pool.step([1])[0] == [{"t": 1}]
    with RLPool(COUNTER, n=1, isolation=ISOLATION) as pool:
        args = _worker_args(pool)
        assert float(args[args.index("--local-spin-us") + 1]) == pool.busy_poll_us == 300.0
    for bad in (-1, 2e6, "fast", None):
        with pytest.raises(ValueError, match="busy_poll_us"):
            RLPool(COUNTER, n=1, busy_poll_us=bad)


class _CountingEpoll:
    """The worker's epoll, counting the polls that did not sleep (timeout 0)."""

    def __init__(self, epoll):
        self.epoll, self.nonblocking = epoll, 0

    def poll(self, timeout=-1):
        self.nonblocking += timeout == 0
        return self.epoll.poll(timeout)

    def __getattr__(self, name):
        return getattr(self.epoll, name)


def test_reply_spin_spans_polls_within_its_window_and_then_ends(worker):
    """A batch's reply window is not used up by one poll (the replies come one by one): the
    worker keeps polling without sleeping through it, and once it has passed it sleeps."""
    for fd in (worker._zmq_fd, worker._local_fd):
        worker.epoll.unregister(fd)
    r, w = os.pipe()
    worker.epoll = counting = _CountingEpoll(worker.epoll)
    try:
        worker.epoll.register(r, select.EPOLLIN)
        worker._reply_spin_until = time.perf_counter() + 0.2
        os.write(w, b"x")
        assert worker._poll_spinning(5.0) == [(r, select.EPOLLIN)]
        os.read(r, 1)
        assert worker._reply_spin_until, "a reply came, the others may follow: keep the window"
        counting.nonblocking = 0
        t0 = time.perf_counter()
        assert worker._poll_spinning(0.3) == [], "nothing came: spin out the window, then sleep"
        assert time.perf_counter() - t0 >= 0.29
        assert counting.nonblocking >= 20, f"only {counting.nonblocking} polls in a 0.2 s window: it slept"
        assert not worker._reply_spin_until, "the window has passed: the next poll sleeps"
    finally:
        worker.epoll = counting.epoll
        os.close(r)
        os.close(w)


def _worker_cpu(pool) -> float:
    t = psutil.Process(pool._links[0].process.pid).cpu_times()
    return t.user + t.system


@pytest.mark.parametrize("reply_poll_us", [0, 2_000, 300_000])
def test_the_worker_spins_for_env_replies_at_most_its_window_per_batch(reply_poll_us):
    """Envs that take 150 ms per step: the worker spins at most about its reply window per
    batch (never through a whole step with 2 ms), and not at all once the batch is answered."""
    steps, sleep_s = 6, 0.15
    with RLPool(FAULTY, n=2, isolation=ISOLATION, reply_poll_us=reply_poll_us, busy_poll_us=0) as pool:
        assert float(_worker_args(pool)[_worker_args(pool).index("--reply-poll-us") + 1]) == reply_poll_us
        pool.reset(seed=0)
        cpu0 = _worker_cpu(pool)
        for _ in range(steps):
            obs, _, _, infos = pool.step([{"sleep": sleep_s}] * 2)
            assert [o["t"] for o in obs] == [obs[0]["t"]] * 2, (obs, infos)
        spent = _worker_cpu(pool) - cpu0
        time.sleep(0.5)
        idle = _worker_cpu(pool) - cpu0 - spent
    # A batch answered ends its window: no spinning once the trainer has its results.
    assert idle < 0.05, f"worker used {idle:.3f} s of CPU while no batch was in flight"
    window = reply_poll_us * 1e-6
    # One window per batch, plus the loop's own work (a few ms per step, more on a loaded box).
    assert spent <= steps * (window + 0.04), f"worker used {spent:.3f} s of CPU for {steps} batches"
    if reply_poll_us == 300_000:
        # Envs asleep, a CPU free: the worker spun through much of each 150 ms step (yielding
        # to whatever else ran; 0.1 s of the 0.9 s leaves room for a loaded machine).
        assert spent >= 0.1, f"worker used only {spent:.3f} s of CPU: it did not spin"


def test_pool_hands_its_reply_poll_to_its_worker_and_refuses_bad_values():
    with RLPool(COUNTER, n=1, isolation=ISOLATION) as pool:
        args = _worker_args(pool)
        assert float(args[args.index("--reply-poll-us") + 1]) == pool.reply_poll_us == 1000.0
        pool.reset(seed=0)
        assert pool.step([1])[0] == [{"t": 1}]
    for bad in (-1, 2e6, "fast", None, True):
        with pytest.raises(ValueError, match="reply_poll_us"):
            RLPool(COUNTER, n=1, reply_poll_us=bad)
    with pytest.raises(ValueError, match="busy_poll_us"):
        RLPool(COUNTER, n=1, busy_poll_us=True)
