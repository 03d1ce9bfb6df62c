"""The direct lane: a local pool steps idle envs on pipes its worker lent it (boltzlabs_gym.client.direct_lane).

Every other pool test runs through the lane too (it is the local default); these check what
is the lane's own: that envs are lent and stay lent, that a failure seen on the pool's side
is reported with the worker's details and the env comes back lent, that nothing is lost
to a wait that times out, and that no descriptor is left behind. Each runs the same
scenario with ``direct=False`` (everything through the worker, as for a remote pool) and
compares.
"""

from __future__ import annotations

import os
import resource
import stat
import subprocess
import sys
import textwrap
import time

import gymnasium as gym
import numpy as np
import pytest

from boltzlabs_gym import RLPool, WorkerError
from boltzlabs_gym.wire.protocol import LENT_FAULT
from boltzlabs_gym.testing import WorkerProcess

from conftest import FAULTY, ISOLATION

pytestmark = pytest.mark.usefixtures("no_leaks")


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _lane(pool: RLPool):
    return pool._links[0].lane


def _lent(pool: RLPool) -> int:
    lane = _lane(pool)
    return len(lane) if lane is not None else 0


def test_a_local_pool_steps_every_env_on_lent_pipes():
    fds = _fds()
    with RLPool(FAULTY, n=4, isolation=ISOLATION) as pool:
        assert _lent(pool) == 4  # lent with the create reply
        pool.reset(seed=0)
        for t in range(1, 4):
            obs, rewards, dones, _ = pool.step([1, 2, 3, 4])
            assert [o["t"] for o in obs] == [t] * 4 and rewards.tolist() == [1, 2, 3, 4]
        assert _lent(pool) == 4
        assert pool.timing.worker_ms > 0 and pool.timing.roundtrip_ms >= pool.timing.worker_ms
        pipes = [fd for env in _lane(pool)._envs.values() for fd in (env.stdin_w, env.stdout_r)]
        assert len(set(pipes)) == 8 and all(stat.S_ISFIFO(os.fstat(fd).st_mode) for fd in pipes)
    assert _fds() == fds
    for fd in pipes:
        with pytest.raises(OSError):
            os.fstat(fd)


def test_direct_false_and_remote_style_pools_lend_nothing():
    with RLPool(FAULTY, n=2, isolation=ISOLATION, direct=False) as pool:
        assert _lane(pool) is None
        obs, *_ = pool.step([1, 1])
        assert [o["t"] for o in obs] == [1, 1]
    with RLPool(FAULTY, n=2, isolation=ISOLATION, serialize_measurement=True) as pool:
        pool.step([1, 1])
        assert _lent(pool) == 0  # the worker must see every step to serialize it
    with pytest.raises(ValueError, match="direct"):
        RLPool(FAULTY, n=1, direct="yes")


def _faults_then_recovery(direct: bool):
    """Hang, crash, garbage and two replies, on the lane; then every env steps again."""
    out = []
    with RLPool(FAULTY, n=5, isolation=ISOLATION, step_timeout=1.0, direct=direct) as pool:
        pool.reset(seed=0)
        actions = [1, {"hang": True}, {"exit": 7}, {"garbage": True}, {"twice": True}]
        t0 = time.monotonic()
        obs, rewards, dones, infos = pool.step(actions)
        took = time.monotonic() - t0
        assert 0.9 < took < 5.0, took
        assert obs[0]["t"] == 1 and not dones[0]
        assert "missed the 1 s deadline for 'step'" in infos[1]["boltzlabs_straggler"]["reason"]
        assert infos[2]["boltzlabs_error"]["reason"] == "the env exited with status 7"
        assert "not a JSON line" in infos[3]["boltzlabs_error"]["reason"]
        # Two replies at once: the first answers the step, the second gets the env restarted.
        assert obs[4] == {"t": -1} and infos[4] == {}
        out.append([sorted(i) for i in infos])
        # Respawned in the background; the next step waits for them, then they are lent again.
        obs, rewards, dones, infos = pool.step([1] * 5)
        assert [o["t"] for o in obs] == [2, 1, 1, 1, 1] and not dones.any() and infos[1:] == [{"t": 1}] * 4
        out.append([o["t"] for o in obs])
        if direct:
            assert _lent(pool) == 5
            assert pool.timing.total_errors == 2 and pool.timing.total_stragglers == 1
    return out


def test_failures_on_the_lane_are_reported_as_the_worker_reports_them():
    fds = _fds()
    assert _faults_then_recovery(True) == _faults_then_recovery(False)
    assert _fds() == fds


def test_output_between_steps_restarts_the_env_as_the_worker_does(tmp_path):
    results = {}
    for direct in (True, False):
        with RLPool(FAULTY, n=2, isolation=ISOLATION, direct=direct) as pool:
            pool.reset(seed=0)
            obs, *_ = pool.step([{"late_garbage": 0.2}, 1])  # answers, then writes a stray line
            assert [o["t"] for o in obs] == [1, 1]
            time.sleep(2.0)  # the env's timer thread fires at 0.2 s; the margin is for a loaded machine
            obs, _, dones, infos = pool.step([1, 1])
            # The env was killed for it and started afresh: its step is the new env's first.
            results[direct] = ([o["t"] for o in obs], dones.tolist(), infos)
            if direct:
                obs, *_ = pool.step([1, 1])
                assert _lent(pool) == 2 and [o["t"] for o in obs] == [2, 3]
    assert results[True] == results[False] == ([1, 2], [False, False], [{"t": 1}, {"t": 2}])


@pytest.mark.parametrize("direct", [True, False])
def test_a_wait_that_times_out_leaves_the_lane_consistent(direct):
    with RLPool(FAULTY, n=3, isolation=ISOLATION, step_timeout=3.0, direct=direct) as pool:
        pool.reset(seed=0)
        t0 = time.monotonic()
        pool.step_async([{"sleep": 0.8}, 1, {"hang": True}])
        with pytest.raises(TimeoutError):
            pool.step_wait(timeout=0.3)
        # The calls nobody waits for now still run out: the sleeping env's late reply is
        # dropped, the hung env keeps its deadline (3 s from its step) and is restarted, and
        # the next step of each queues behind them.
        obs, _, dones, infos = pool.step([1, 1, 1])
        assert 2.9 < time.monotonic() - t0 < 8.0
        assert [o["t"] for o in obs] == [2, 2, 1] and not dones.any() and infos == [{"t": 2}, {"t": 2}, {"t": 1}]
        obs, *_ = pool.step([1, 1, 1])
        assert [o["t"] for o in obs] == [3, 3, 2]
        assert _lent(pool) == (3 if direct else 0)


def test_worker_ops_take_envs_back_and_lend_them_again():
    with RLPool(FAULTY, n=3, isolation=ISOLATION) as pool:
        pool.reset(seed=0)
        pool.step([{"write": "a"}, 1, 1])
        obs = pool.reset(hard=True, where=np.array([True, False, False]))  # the worker's op
        assert obs[0]["workspace"] == [] and obs[1]["t"] == 1
        assert _lent(pool) == 3
        obs, *_ = pool.step([1, 1, 1])
        assert [o["t"] for o in obs] == [1, 2, 2]


def test_only_envs_the_local_pool_holds_can_be_handed_back():
    with RLPool(FAULTY, n=1, isolation=ISOLATION, direct=False) as pool:
        link = pool._links[0]
        # Over the local channel, but nothing is lent with direct=False: the env is not killed.
        header = link.call({"op": "batch", "items": [[0, {"op": LENT_FAULT, "reason": "x"}, 0]]})
        assert header["results"][0][1] == "error"
        pool.step([1])
        obs, *_ = pool.step([1])
        assert obs[0]["t"] == 2
        with pytest.raises(WorkerError, match="bad_request"):
            link.call({"op": "batch", "items": [[0, {"op": LENT_FAULT}, 0]]})
        with pytest.raises(WorkerError, match="bad_request"):
            link.call({"op": "batch", "items": [], "faults": [[0, 5]]})
    worker = WorkerProcess(capacity=4)
    try:
        with RLPool(FAULTY, n=1, isolation=ISOLATION, workers=[worker.address]) as pool:
            assert _lane(pool) is None
            with pytest.raises(WorkerError, match="bad_request.*local pool"):
                pool._links[0].call({"op": "batch", "items": [[0, {"op": LENT_FAULT, "reason": "x"}, 0]]})
            obs, *_ = pool.step([1])
            assert obs[0]["t"] == 1
    finally:
        worker.stop()


def test_the_lane_stays_off_when_the_descriptor_limit_is_too_low(tmp_path):
    script = textwrap.dedent(f"""
        import resource, sys
        resource.setrlimit(resource.RLIMIT_NOFILE, (96, 96))
        from boltzlabs_gym import RLPool
        with RLPool({FAULTY!r}, n=16, isolation={ISOLATION!r}) as pool:
            obs, *_ = pool.step([1] * 16)
            print(pool._links[0].lane is None, sorted({{o["t"] for o in obs}}))
    """)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert hard >= 96
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "[1]"]


def test_a_pool_works_when_its_descriptors_are_above_1024():
    # Several big pools hold thousands of lent pipes: a later pool's channel and worker pipe
    # get descriptors select() cannot take (it raised "filedescriptor out of range").
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1400:
        pytest.skip(f"the descriptor hard limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1400), hard))
    null = os.open(os.devnull, os.O_RDONLY)
    filler = [os.dup(null) for _ in range(1100)]
    try:
        with RLPool(FAULTY, n=2, isolation=ISOLATION) as pool:
            assert pool._links[0].sock.fileno() > 1024
            obs, *_ = pool.step([1, 1])
            assert [o["t"] for o in obs] == [1, 1] and _lent(pool) == 2
    finally:
        for fd in filler + [null]:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.parametrize("direct", [True, False])
def test_an_env_that_dies_between_steps_is_restarted_as_the_worker_does(direct):
    with RLPool(FAULTY, n=2, isolation=ISOLATION, direct=direct) as pool:
        pool.reset(seed=0)
        obs, *_ = pool.step([{"late_exit": 0.1}, 1])
        assert [o["t"] for o in obs] == [1, 1]
        time.sleep(2.0)  # the env's timer thread fires at 0.1 s; the margin is for a loaded machine
        obs, _, dones, infos = pool.step([1, 1])
        assert [o["t"] for o in obs] == [1, 2] and not dones.any() and infos == [{"t": 1}, {"t": 2}]
        obs, *_ = pool.step([1, 1])
        assert [o["t"] for o in obs] == [2, 3] and _lent(pool) == (2 if direct else 0)


class _Interrupted(Exception):
    pass


def test_an_interrupted_wait_leaves_nothing_in_flight_on_the_lane():
    import signal
    import threading

    def interrupt(*_):
        raise _Interrupted

    old = signal.signal(signal.SIGUSR1, interrupt)
    try:
        with RLPool(FAULTY, n=3, isolation=ISOLATION, step_timeout=2.0) as pool:
            pool.reset(seed=0)
            pool.step_async([{"sleep": 0.6}, 1, {"hang": True}])
            threading.Timer(0.2, signal.pthread_kill, (threading.main_thread().ident, signal.SIGUSR1)).start()
            with pytest.raises(_Interrupted):
                pool.step_wait()
            # The sleeping call is adopted by the worker, its late reply dropped; the hung env is
            # faulted at its deadline by the worker; env 1 answered and is still the pool's.
            obs, _, dones, infos = pool.step([1, 1, 1])
            assert [o["t"] for o in obs] == [2, 2, 1] and not dones.any()
    finally:
        signal.signal(signal.SIGUSR1, old)


def test_a_call_that_cannot_be_encoded_sends_nothing():
    with RLPool(FAULTY, n=2, isolation=ISOLATION) as pool:
        pool.reset(seed=0)
        with pytest.raises(TypeError):
            pool.batch_async([(0, {"op": "step", "action": 1}, ()), (1, {"op": "step", "action": object()}, ())])
        obs, *_ = pool.step([1, 1])
        assert [o["t"] for o in obs] == [1, 1] and _lent(pool) == 2


def test_faults_reported_with_a_refused_request_still_reach_the_worker():
    with RLPool(FAULTY, n=2, isolation=ISOLATION) as pool:
        pool.reset(seed=0)
        pool.step([{"late_garbage": 0.1}, 1])
        time.sleep(2.0)  # the env's timer thread fires at 0.1 s; the margin is for a loaded machine
        # Env 1's op is not an object: the worker refuses the request, but the stray output
        # env 0 wrote was reported with it and env 0 is restarted anyway.
        pool.batch_async([(0, {"op": "step", "action": 1}, ()), (1, "not an op", ())])
        with pytest.raises(WorkerError, match="op must be an object"):
            pool.batch_wait()
        obs, *_ = pool.step([1, 1])
        assert [o["t"] for o in obs] == [1, 2]


def test_the_worker_lifts_its_own_descriptor_limit():
    # It holds three pipes per env plus the copies it lends: a stock soft limit of 1024
    # would run out at a few hundred envs.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (512, hard))
    try:
        with RLPool(FAULTY, n=1, isolation=ISOLATION) as pool:
            limits = open(f"/proc/{pool._links[0].process.pid}/limits").read()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    line = next(x for x in limits.splitlines() if x.startswith("Max open files")).split()
    want = min(hard if hard != resource.RLIM_INFINITY else 1 << 16, 1 << 16)
    assert int(line[3]) == want, line


class _BigObs(gym.Env):
    """Observations of 270 KB: each reply spans several pipe-fulls."""

    observation_space = gym.spaces.Box(0, 255, (300, 300, 3), np.uint8)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self.np_random.integers(0, 256, (300, 300, 3), dtype=np.uint8), {}

    def step(self, action):
        self.t += 1
        return np.full((300, 300, 3), (self.t * 7 + int(action)) % 256, np.uint8), 1.0, False, False, {}


def test_replies_larger_than_a_pipe_arrive_whole_with_many_in_flight():
    from gymnasium.vector import SyncVectorEnv

    from boltzlabs_gym import BoltzLabsVecEnv

    n = 20  # more than the lane gathers in rounds for: its naps must not stall these
    ours, ref = BoltzLabsVecEnv([_BigObs] * n, isolation=ISOLATION), SyncVectorEnv([_BigObs] * n)
    try:
        assert _lent(ours.pool) == n
        np.testing.assert_array_equal(ours.reset(seed=3)[0], ref.reset(seed=3)[0])
        rng = np.random.default_rng(0)
        t0 = time.monotonic()
        for _ in range(5):
            actions = rng.integers(0, 2, n)
            np.testing.assert_array_equal(ours.step(actions)[0], ref.step(actions)[0])
        assert time.monotonic() - t0 < 30
    finally:
        ours.close()
        ref.close()
