"""boltzlabs_gym.aio without a reader thread: the event loop's own waiting on the pool (its
descriptors, ZeroMQ's edge-like signal, the timer for lane deadlines)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import zmq
from conftest import FAULTY, ISOLATION
from workers import WorkerProcess

from boltzlabs_gym import RLPool
from boltzlabs_gym.aio import AsyncPool


def test_a_hung_lent_env_is_killed_at_its_deadline_with_nothing_else_to_wake_the_loop():
    """The only call in flight hangs on the direct lane: the loop's timer for the lane's deadline
    (no reader thread, no other traffic) kills and reports it on time."""

    async def main():
        async with AsyncPool(FAULTY, n=2, isolation=ISOLATION, step_timeout=0.5) as face:
            assert not [t for t in threading.enumerate() if "aio" in t.name]
            async with face.env() as env:
                await env.reset(seed=0)
                hung = asyncio.ensure_future(env.step({"hang": True}))
                await asyncio.sleep(0.1)
                assert any(link.lane is not None and link.lane.in_flight for link in face.pool._links)
                t0 = time.monotonic()
                obs, reward, terminated, truncated, info = await asyncio.wait_for(hung, 10.0)
                assert truncated and "boltzlabs_straggler" in info
                assert time.monotonic() - t0 < 3.0  # its deadline was 0.4 s away
                await env.reset(seed=1)  # respawned
                assert (await env.step(2))[1] == 2

    asyncio.run(main())


@pytest.fixture(scope="module")
def remote_address():
    worker = WorkerProcess(insecure=True)
    yield worker.address
    worker.stop()


def test_a_reply_that_came_in_during_a_send_on_a_zeromq_socket_is_taken_at_once(remote_address):
    """A remote worker's reply arrives while the loop is busy, and the loop then sends on the same
    ZeroMQ socket before it looks at the socket's descriptor: the send takes in the signal, so
    only the EVENTS check after the send finds the reply. (Without it the reply would wait for
    the next heartbeat, 15 s here, or the next reply, 2 s here.)"""
    with RLPool(
        FAULTY, n=2, workers=[remote_address], step_timeout=10.0, heartbeat_interval=30.0, heartbeat_timeout=120.0
    ) as pool:
        assert all(isinstance(link.sock, zmq.Socket) for link in pool._links)

        async def main():
            loop = asyncio.get_running_loop()
            async with AsyncPool(pool) as face, face.env() as a, face.env() as b:
                await asyncio.gather(a.reset(seed=0), b.reset(seed=0))
                a_step = asyncio.ensure_future(a.step({"sleep": 0.2}))
                await asyncio.sleep(0.05)  # a's step is out

                async def block_then_step():
                    loop.call_soon(time.sleep, 0.6)  # the next tick blocks while a's reply comes in...
                    return await b.step({"sleep": 2.0})  # ...then sends this, in that tick

                b_step = asyncio.ensure_future(block_then_step())
                obs, reward, *_ = await asyncio.wait_for(a_step, 1.5)
                assert obs["t"] == 1 and not b_step.done()
                assert (await b_step)[0]["t"] == 1

        asyncio.run(main())


def test_a_lost_worker_is_found_by_the_loops_heartbeats_and_reported_to_its_coroutine():
    """The only call in flight is on a remote worker that is killed: nothing will ever signal its
    socket, and the loop's heartbeat timer finds the loss within the heartbeat timeout
    (``worker_loss="report"``: the step comes back truncated with the error)."""
    worker = WorkerProcess(insecure=True)
    try:
        with RLPool(
            FAULTY,
            n=1,
            workers=[worker.address],
            worker_loss="report",
            heartbeat_interval=0.5,
            heartbeat_timeout=2.0,
            step_timeout=30.0,
        ) as pool:

            async def main():
                async with AsyncPool(pool) as face, face.env() as env:
                    await env.reset(seed=0)
                    slow = asyncio.ensure_future(env.step({"sleep": 30}))
                    await asyncio.sleep(0.1)
                    worker.kill()
                    t0 = time.monotonic()
                    obs, reward, terminated, truncated, info = await asyncio.wait_for(slow, 10.0)
                    assert time.monotonic() - t0 < 2.0 + 3.0  # the heartbeat timeout, not the step's 30 s
                    assert truncated and obs is None and "is lost" in info["boltzlabs_error"]["reason"]

            asyncio.run(main())
    finally:
        worker.stop()
