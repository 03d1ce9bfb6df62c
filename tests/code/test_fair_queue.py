"""The code runner's fair queue alone: turns between clients, bounds, removal, giving back, closing, threads."""

from __future__ import annotations

import queue
import threading
import time

import pytest

from boltzlabs_gym.code import QueueFullError
from boltzlabs_gym.code.fair_queue import FairQueue, QueueClosedError


def drain(q: FairQueue) -> list:
    out = []
    while (item := q.get_nowait()) is not None:
        out.append(item)
    return out


def test_a_burst_waits_behind_a_later_clients_few():
    q: FairQueue[str] = FairQueue()
    for i in range(40):
        q.put("a", f"a{i}")
    assert [q.get_nowait() for _ in range(3)] == ["a0", "a1", "a2"]  # alone, a client is a plain FIFO
    for i in range(4):
        q.put("b", f"b{i}")
    order = drain(q)
    assert [order.index(f"b{i}") for i in range(4)] == [1, 3, 5, 7]  # every other turn, not after a's 37
    assert [x for x in order if x.startswith("a")] == [f"a{i}" for i in range(3, 40)]  # each line in order


def test_turns_go_round_every_client_and_a_client_that_returns_joins_at_the_end():
    q: FairQueue[str] = FairQueue()
    for client, n in (("a", 3), ("b", 1), ("c", 2)):
        for i in range(n):
            q.put(client, f"{client}{i}")
    assert [q.get_nowait() for _ in range(4)] == ["a0", "b0", "c0", "a1"]
    q.put("b", "b1")  # b had left the round (nothing waiting): it comes after c and a
    assert drain(q) == ["c1", "a2", "b1"]
    assert q.get_nowait() is None and len(q) == 0 and q.depths() == {}


def test_bounds_per_client_and_in_all_refuse_without_queueing():
    q: FairQueue[int] = FairQueue(max_total=3, max_per_client=2)
    q.put("a", 1)
    q.put("a", 2)
    with pytest.raises(QueueFullError) as own:
        q.put("a", 3)
    assert own.value.per_client and own.value.client == "a"
    q.put("b", 4)  # a's bound does not keep b out
    with pytest.raises(QueueFullError) as total:
        q.put("c", 5)
    assert not total.value.per_client and "max_queue=3" in str(total.value)
    assert q.depths() == {"a": 2, "b": 1} and len(q) == 3
    q.max_total = None  # bounds are read at each put
    q.put("c", 5)
    assert len(q) == 4


def test_remove_takes_one_item_out_of_its_line_and_the_round():
    q: FairQueue[str] = FairQueue()
    q.put("a", "a0")
    q.put("b", "b0")
    q.put("a", "a1")
    assert q.remove(lambda x: x == "b0") == "b0"
    assert q.remove(lambda x: x == "b0") is None
    assert q.depths() == {"a": 2}
    assert drain(q) == ["a0", "a1"]


def test_put_front_undoes_a_take_the_client_keeps_its_place_in_line_and_its_turn():
    q: FairQueue[str] = FairQueue(max_total=3, max_per_client=2)
    for client, item in (("a", "a0"), ("b", "b0"), ("a", "a1")):
        q.put(client, item)
    taken = q.get_nowait()
    assert taken == "a0"  # a is now behind b in the round
    q.put_front("a", taken)  # given back: at the head of a's line, a at the head of the round
    assert q.depths() == {"a": 2, "b": 1} and len(q) == 3
    assert drain(q) == ["a0", "b0", "a1"]  # as if it had never been taken
    # a client whose line emptied with the take comes back at the head, ahead of those waiting
    q.put("c", "c0")
    q.put("b", "b1")
    q.put("d", "d0")
    assert q.get_nowait() == "c0"
    q.put_front("c", "c0")
    assert drain(q) == ["c0", "b1", "d0"]
    # the bounds let a given-back item in: it was let in once
    q.put("a", "a2")
    q.put("a", "a3")
    q.put("b", "b2")
    q.put_front("a", "a1")
    assert q.depths() == {"a": 3, "b": 1}
    assert q.close() == ["a1", "b2", "a2", "a3"]
    with pytest.raises(QueueClosedError):
        q.put_front("a", "late")


def test_put_front_wakes_a_taker_that_waits():
    q: FairQueue[str] = FairQueue()
    got: list = []
    taker = threading.Thread(target=lambda: got.append(q.get()))
    taker.start()
    q.put_front("a", "a0")
    taker.join(5)
    assert got == ["a0"]


def test_get_with_a_timeout_raises_empty_when_nothing_came_and_none_when_closed():
    q: FairQueue[str] = FairQueue()
    t0 = time.monotonic()
    with pytest.raises(queue.Empty):
        q.get(timeout=0.05)
    assert time.monotonic() - t0 >= 0.04
    q.put("a", "a0")
    assert q.get(timeout=0.05) == "a0"
    got: list = []
    waiter = threading.Thread(target=lambda: got.append(q.get(timeout=30)))
    waiter.start()
    wait_until(lambda: waiter.is_alive())
    time.sleep(0.05)
    q.close()
    waiter.join(5)
    assert not waiter.is_alive() and got == [None]
    assert q.get(timeout=0.01) is None  # closed: None at once, not Empty


def test_close_hands_back_what_waited_wakes_the_waiting_and_refuses_more():
    q: FairQueue[str] = FairQueue()
    got: list = []
    waiters = [threading.Thread(target=lambda: got.append(q.get())) for _ in range(3)]
    for t in waiters:
        t.start()
    q.put("a", "a0")  # one waiter takes it; the others wait on
    wait_until(lambda: got == ["a0"])
    assert q.close() == []
    for t in waiters:
        t.join(5)
        assert not t.is_alive()
    assert got == ["a0", None, None]
    with pytest.raises(QueueClosedError):
        q.put("a", "late")
    full: FairQueue[str] = FairQueue()
    for client, item in (("a", "a0"), ("a", "a1"), ("b", "b0")):
        full.put(client, item)
    assert full.close() == ["a0", "b0", "a1"] and full.get() is None and len(full) == 0


def test_threads_putting_and_taking_lose_and_repeat_nothing():
    q: FairQueue[tuple[str, int]] = FairQueue()
    taken: list = []
    lock = threading.Lock()

    def take() -> None:
        while (item := q.get()) is not None:
            with lock:
                taken.append(item)

    def put(client: str) -> None:
        for i in range(500):
            q.put(client, (client, i))

    takers = [threading.Thread(target=take) for _ in range(3)]
    putters = [threading.Thread(target=put, args=(c,)) for c in "abcd"]
    for t in takers + putters:
        t.start()
    for t in putters:
        t.join(10)
    wait_until(lambda: len(q) == 0)
    assert q.close() == []
    for t in takers:
        t.join(10)
    assert sorted(taken) == sorted((c, i) for c in "abcd" for i in range(500))


def wait_until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)
