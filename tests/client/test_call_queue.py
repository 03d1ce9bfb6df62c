"""CallQueue, the engine under AsyncPool and EnvCalls, on real pools: one env's calls in order,
different envs overlapping, sandbox turns with K > 1, every waiting call failed when the pool is
lost, a cancelled caller's unsent call dropped."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import time

import pytest
from conftest import ENVS, FAULTY, ISOLATION
from workers import WorkerProcess

from boltzlabs_gym import RLPool
from boltzlabs_gym.aio import AsyncPool
from boltzlabs_gym.client.call_queue import CallQueue
from boltzlabs_gym.client.env_calls import EnvCalls
from boltzlabs_gym.client.results import read_reset, read_step
from boltzlabs_gym.errors import PoolClosedError, WorkerLost

SANDBOXED = os.path.join(ENVS, "sandboxed")
Future = concurrent.futures.Future


def _engine(pool: RLPool) -> tuple[CallQueue[Future], list[int]]:
    """A queue over ``pool`` with thread-style futures, driven by the test itself; how often it
    asked to be woken."""
    wakes: list[int] = []
    return CallQueue(pool.async_steps, pool.envs_per_sandbox, wake=lambda: wakes.append(1), new_future=Future), wakes


def _put(calls: CallQueue[Future], env_id: int, op: dict) -> Future:
    future: Future = Future()
    calls.queue(future, env_id, op)
    return future


def _step(action) -> dict:
    return {"op": "step", "action": action}


def _drive(calls: CallQueue[Future], futures: list[Future], limit: float = 20.0) -> None:
    """What a face does: flush, wait for results, deliver, until ``futures`` are done."""
    steps, deadline = calls.steps, time.monotonic() + limit
    while not all(f.done() for f in futures):
        assert time.monotonic() < deadline, "calls did not finish"
        calls.flush()
        if steps.in_flight:
            steps.pump(min(deadline, time.monotonic() + 0.5))
        calls.deliver()


def _obs(future: Future) -> dict:
    return read_step(future.result(timeout=0).result, 5.0).obs


def test_one_envs_calls_go_out_one_after_another_in_order_while_other_envs_overlap():
    with RLPool(FAULTY, n=2, isolation=ISOLATION, step_timeout=5.0) as pool:
        pool.reset(seed=0)
        calls, wakes = _engine(pool)
        slow = _put(calls, 0, _step({"sleep": 0.5}))
        behind = [_put(calls, 0, _step(1)), _put(calls, 0, _step(1))]
        other = _put(calls, 1, _step(1))
        assert len(wakes) == 1 and len(calls) == 4  # one wake-up for what piled up
        assert calls.flush()
        assert set(pool.async_steps.in_flight) == {0, 1}  # env 0's later calls wait for its first

        _drive(calls, [other])
        assert not slow.done() and _obs(other)["t"] == 1  # env 1 did not wait for env 0's sleep
        _drive(calls, [slow, *behind])
        assert [_obs(f)["t"] for f in (slow, *behind)] == [1, 2, 3]
        assert len(calls) == 0 and not pool.async_steps.in_flight
        assert calls.pending(0) is None and not calls.flush()


def test_a_sandbox_of_several_envs_takes_one_call_at_a_time_and_its_waiting_calls_go_out_together():
    with RLPool(SANDBOXED, n=4, envs_per_sandbox=2, isolation=ISOLATION, step_timeout=5.0) as pool:
        pool.reset(seed=0)
        calls, _ = _engine(pool)
        slow = _put(calls, 0, {"op": "reset", "seed": 1, "options": {"sleep": 0.4}})
        calls.flush()
        neighbour = _put(calls, 1, _step(4))  # sandbox 0 is busy: waits its turn, never refused
        elsewhere = _put(calls, 2, _step(5))  # sandbox 1 is free
        calls.flush()
        assert set(pool.async_steps.in_flight) == {0, 2}

        _drive(calls, [elsewhere])
        assert not neighbour.done() and not slow.done()
        _drive(calls, [neighbour])
        obs, _, _ = read_reset(slow.result(timeout=0).result, 5.0)
        assert obs["seed"] == 1 and _obs(neighbour)["t"] == 1
        assert read_step(neighbour.result(timeout=0).result, 5.0).reward == 4.0

        # Both envs of an idle sandbox, queued together: one call, both in flight at once.
        pair = [_put(calls, 0, _step(1)), _put(calls, 1, _step(2))]
        calls.flush()
        assert set(pool.async_steps.in_flight) == {0, 1}
        _drive(calls, pair)
        assert [_obs(f)["t"] for f in pair] == [1, 2] and _obs(pair[0])["pid"] == _obs(pair[1])["pid"]


def test_env_calls_wait_for_a_busy_sandbox_instead_of_failing():
    with RLPool(SANDBOXED, n=2, envs_per_sandbox=2, isolation=ISOLATION, step_timeout=5.0) as pool:
        pool.reset(seed=0)
        with EnvCalls(pool) as env_calls:
            slow = env_calls.submit(0, {"op": "reset", "seed": 3, "options": {"sleep": 0.4}})
            time.sleep(0.1)  # out: its sandbox is busy
            neighbour = env_calls.submit(1, _step(2))
            assert read_step(neighbour.result(timeout=10).result, 5.0).obs["t"] == 1
            assert slow.done() and read_reset(slow.result().result, 5.0)[0]["seed"] == 3
            assert env_calls.in_flight == 0


def test_a_cancelled_callers_call_is_dropped_if_it_has_not_gone_out_and_runs_on_if_it_has():
    with RLPool(FAULTY, n=2, isolation=ISOLATION, step_timeout=5.0) as pool:
        pool.reset(seed=0)
        calls, _ = _engine(pool)
        unsent = _put(calls, 1, _step(1))
        calls.cancelled(1, unsent)  # still in the outbox: it never goes out
        first = _put(calls, 0, _step({"sleep": 0.3}))
        calls.flush()
        assert set(pool.async_steps.in_flight) == {0}
        dropped, last = _put(calls, 0, _step(1)), _put(calls, 0, _step(1))
        calls.cancelled(0, dropped)  # waiting in env 0's line
        calls.cancelled(0, first)  # out already: it runs on, its result goes to a new future
        stand_in = calls.pending(0)
        assert stand_in is not None and stand_in is not first
        _drive(calls, [stand_in, last])
        assert _obs(stand_in)["t"] == 1 and _obs(last)["t"] == 2  # the dropped call never ran
        assert not first.done() and not dropped.done() and not unsent.done()  # their callers left
        again = _put(calls, 1, _step(1))
        _drive(calls, [again])
        assert _obs(again)["t"] == 1  # env 1's cancelled call never ran either


@pytest.fixture
def doomed_worker():
    worker = WorkerProcess(insecure=True)
    yield worker
    worker.stop()


def _losable_pool(worker: WorkerProcess) -> RLPool:
    return RLPool(
        FAULTY, n=2, workers=[worker.address], heartbeat_interval=0.5, heartbeat_timeout=2.0, step_timeout=30.0
    )


def test_a_lost_pool_fails_every_waiting_thread_call_and_refuses_later_ones(doomed_worker):
    with _losable_pool(doomed_worker) as pool:
        pool.reset(seed=0)
        with EnvCalls(pool) as env_calls:
            waiting = [
                env_calls.submit(0, _step({"sleep": 30})),
                env_calls.submit(0, _step(1)),  # in env 0's line
                env_calls.submit(1, _step({"sleep": 30})),
            ]
            time.sleep(0.3)
            doomed_worker.kill()
            for future in waiting:
                with pytest.raises(WorkerLost):
                    future.result(timeout=10)
            with pytest.raises(PoolClosedError, match="WorkerLost"):
                env_calls.submit(1, _step(1))


def test_a_lost_pool_fails_every_waiting_coroutine_and_refuses_later_calls(doomed_worker):
    with _losable_pool(doomed_worker) as pool:

        async def main():
            async with AsyncPool(pool) as face, face.env() as a, face.env() as b:
                await asyncio.gather(a.reset(seed=0), b.reset(seed=0))
                steps = [asyncio.ensure_future(a.step({"sleep": 30})), asyncio.ensure_future(b.step({"sleep": 30}))]
                await asyncio.sleep(0.3)
                doomed_worker.kill()
                t0 = time.monotonic()
                outcomes = await asyncio.wait_for(asyncio.gather(*steps, return_exceptions=True), 10.0)
                assert all(isinstance(o, WorkerLost) for o in outcomes), outcomes
                assert time.monotonic() - t0 < 2.0 + 3.0  # the heartbeat timeout, not the steps' 30 s
                with pytest.raises(WorkerLost):
                    await a.reset(seed=1)

        asyncio.run(main())
