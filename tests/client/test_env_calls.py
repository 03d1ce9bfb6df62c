"""EnvCalls: calls on a pool's envs from many threads, each answered as its own env finishes."""

from __future__ import annotations

import threading

import pytest
from conftest import FAULTY, ISOLATION

from boltzlabs_gym import RLPool
from boltzlabs_gym.client.env_calls import EnvCalls
from boltzlabs_gym.client.results import read_step
from boltzlabs_gym.errors import PoolClosedError


def _step(index: int, action) -> tuple:
    return index, {"op": "step", "action": action}, ()


def _t(future) -> int:
    return read_step(future.result(timeout=10).result, 5.0).obs["t"]


def test_a_slow_env_holds_up_its_own_calls_only_and_one_envs_calls_keep_their_order():
    with RLPool(FAULTY, n=3, isolation=ISOLATION, step_timeout=5.0) as pool:
        pool.reset(seed=0)
        with EnvCalls(pool) as calls:
            slow = calls.submit(*_step(0, {"sleep": 1.0}))
            after_slow = calls.submit(*_step(0, 1))  # waits for env 0's first call, not refused
            fast = [calls.submit(*_step(i, 1)) for i in (1, 2)]
            assert [_t(f) for f in fast] == [1, 1] and not slow.done()
            assert _t(slow) == 1 and _t(after_slow) == 2

            # From several threads at once, each waiting for its own env; a callback may call again.
            again = threading.Event()
            calls.submit(*_step(1, 1)).add_done_callback(
                lambda f: calls.submit(*_step(1, 1)).add_done_callback(lambda g: again.set())
            )
            got: dict[int, list[int]] = {}
            threads = [
                threading.Thread(
                    target=lambda i=i: got.setdefault(i, [_t(calls.submit(*_step(i, 1))) for _ in range(3)])
                )
                for i in (0, 2)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert got == {0: [3, 4, 5], 2: [2, 3, 4]} and again.wait(10)

            with pytest.raises(IndexError, match="out of range"):
                calls.submit(*_step(3, 1))
            with pytest.raises(TypeError, match="not JSON serializable"):  # in its caller, alone
                calls.submit(*_step(1, object()))
            pending = calls.submit(*_step(0, {"sleep": 1.0}))
        with pytest.raises(PoolClosedError):
            pending.result(timeout=10)  # closed before it finished: its caller hears so
        with pytest.raises(PoolClosedError):
            calls.submit(*_step(0, 1))
