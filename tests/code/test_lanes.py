"""A code runner's lanes on remote workers (tcp on loopback, real sandboxes): every lane pinned to
one worker; a worker killed while it runs programs costs those programs (SandboxError naming the
loss) and its own lanes, the others serve on; a LaneKeeper puts lanes back on a worker that takes
the lost one's place; with no lane left, requests are answered at once."""

from __future__ import annotations

import time

import pytest

from boltzlabs_gym.code import CodeRunner
from boltzlabs_gym.code import runner as runner_module
from boltzlabs_gym.code.placement import LaneKeeper, PinnedWorker, lanes_on_workers
from conftest import ISOLATION
from workers import WorkerProcess, wait_until

SLEEP = "import time; time.sleep({s}); print({i})"


def _settings() -> dict:
    # heartbeat_timeout: how soon a dead worker is found (the runs on it are answered then)
    return {"isolation": ISOLATION, "heartbeat_timeout": 2.0, "max_run_timeout": 10, "max_compile_timeout": 10}


def _serving(runner: CodeRunner) -> list:
    return [lane for lane in runner.lanes() if lane.lost is None]


def test_lanes_are_pinned_one_worker_each_and_both_serve(no_leaks):
    a, b = WorkerProcess(capacity=8), WorkerProcess(capacity=8)
    try:
        with CodeRunner(envs_per_lane=2, lane_workers=lanes_on_workers([a.address, b.address], 1), **_settings()) as r:
            assert [(lane.workers, lane.where) for lane in r.lanes()] == [
                ((a.address,), a.address),
                ((b.address,), b.address),
            ]
            assert r.capacity == 4
            results = r.run_many([{"code": SLEEP.format(s=0.3, i=i)} for i in range(8)])
            assert [x.run_result.stdout for x in results] == [f"{i}\n" for i in range(8)]
            assert all(lane.runs > 0 for lane in r.lanes()), r.lanes()  # both workers ran programs
            assert {lane.to_json()["state"] for lane in r.lanes()} == {"serving"}
    finally:
        a.stop()
        b.stop()


def test_a_killed_worker_costs_its_runs_and_lanes_only_then_none_left_answers_at_once():
    # (no leak check: a SIGKILLed worker leaves its temp dir, for its next start to remove)
    a, b = WorkerProcess(capacity=8), WorkerProcess(capacity=8)
    lost_lanes = []
    try:
        with CodeRunner(envs_per_lane=2, lane_workers=lanes_on_workers([a.address, b.address], 1), **_settings()) as r:
            r.on_lane_lost = lambda number, why: lost_lanes.append((number, why))
            futures = [r.submit({"code": SLEEP.format(s=3, i=i)}) for i in range(4)]
            assert wait_until(lambda: r.stats().running == 4, 10)
            b.kill()  # SIGKILL, mid-run: its envs die with it
            t0 = time.monotonic()
            results = [f.result(timeout=30) for f in futures]
            took = time.monotonic() - t0
            ok = [x for x in results if x.status == "Success"]
            lost = [x for x in results if x.status == "SandboxError"]
            assert len(ok) == 2 and len(lost) == 2, [(x.status, x.message) for x in results]
            for x in lost:
                assert "the worker running this program was lost" in x.message and b.address in x.message
                assert x.run_result is not None and x.run_result.status == "Error"
            assert took < 2.0 + 3.0, f"the lost runs were answered {took:.1f} s after the kill (heartbeat 2 s)"
            assert [n for n, _ in lost_lanes] == [1] and b.address in lost_lanes[0][1]
            # b's lane is retired: the rest are served, by a's lane, none lost
            assert wait_until(lambda: [lane.number for lane in r.lanes()] == [0], 15), r.lanes()
            assert r.capacity == 2 and r.stats().lanes_lost == 1
            later = r.run_many([f"print({i})" for i in range(6)])
            assert [x.run_result.stdout for x in later] == [f"{i}\n" for i in range(6)]
            # the last worker goes while idle: the request that finds it is lost, and then no lane is left
            a.kill()
            found = r.run("print('too late')")
            assert found.status == "SandboxError" and a.address in found.message
            t0 = time.monotonic()
            none_left = r.run("print(1)")
            assert time.monotonic() - t0 < 1.0
            assert none_left.status == "SandboxError" and "no sandbox is left" in none_left.message
            assert r.capacity == 0
    finally:
        a.stop()
        b.stop()


class _Replaceable:
    """Workers that can be replaced, as RayWorkers are (dead(), replace_dead()), made of local tcp ones."""

    def __init__(self, count: int):
        self.procs = [WorkerProcess(capacity=8) for _ in range(count)]
        self.replaced = 0

    @property
    def addresses(self) -> list[str]:
        return [p.address for p in self.procs]

    def client_keys(self, address: str):
        return None

    def dead(self, timeout: float = 5.0) -> list[int]:
        return [i for i, p in enumerate(self.procs) if p.proc.poll() is not None]

    def replace_dead(self, timeout: float = 5.0) -> list[str]:
        dead = self.dead()
        for i in dead:
            self.procs[i].stop()
            self.procs[i] = WorkerProcess(capacity=8)
            self.replaced += 1
        return [self.procs[i].address for i in dead]

    def stop(self) -> None:
        for p in self.procs:
            p.stop()


def test_the_keeper_retires_a_dead_workers_idle_lanes_and_puts_them_back_on_its_replacement():
    workers = _Replaceable(2)
    try:
        lane_workers = lanes_on_workers(workers, 2)
        assert all(isinstance(w, PinnedWorker) for w in lane_workers)
        with CodeRunner(envs_per_lane=1, lane_workers=lane_workers, **_settings()) as r:
            positions = {lane.number: lane.number % 2 for lane in r.lanes()}
            keeper = LaneKeeper(r, workers, positions, poll_s=0.2).start()
            try:
                old = workers.addresses[1]
                workers.procs[1].kill()  # idle: only the keeper's watch can tell
                # its two lanes are retired before any request goes there, then put back on the new worker
                assert wait_until(lambda: workers.replaced == 1 and len(_serving(r)) == 4, 20), r.lanes()
                assert keeper.lanes_replaced == 2 and not keeper.last_failure
                on_new = [lane for lane in r.lanes() if lane.workers == (workers.addresses[1],)]
                assert len(on_new) == 2 and workers.addresses[1] != old
                results = r.run_many([{"code": SLEEP.format(s=0.2, i=i)} for i in range(12)])
                assert all(x.status == "Success" for x in results), [x.message for x in results]
                on_new = [lane for lane in r.lanes() if lane.workers == (workers.addresses[1],)]  # (reports are copies)
                assert len(on_new) == 2 and all(lane.runs > 0 for lane in on_new), on_new
                assert r.stats().runs == {("python", "Success"): 12}  # no request was lost to the dead worker
            finally:
                keeper.close()
    finally:
        workers.stop()


def test_a_lane_on_a_worker_the_keeper_cannot_replace_stays_retired():
    class NoRoom(_Replaceable):
        def replace_dead(self, timeout: float = 5.0) -> list[str]:
            raise TimeoutError("no room for a replacement (as Ray's PlacementTimeout)")

    workers = NoRoom(2)
    try:
        with CodeRunner(envs_per_lane=1, lane_workers=lanes_on_workers(workers, 1), **_settings()) as r:
            keeper = LaneKeeper(r, workers, {0: 0, 1: 1}, poll_s=0.2, retry_s=60).start()
            try:
                workers.procs[0].kill()
                assert wait_until(lambda: [lane.number for lane in r.lanes()] == [1], 20), r.lanes()
                assert "no room" in keeper.last_failure
                assert [x.status for x in r.run_many(["print(1)"] * 3)] == ["Success"] * 3
            finally:
                keeper.close()
    finally:
        workers.stop()


def test_a_request_a_retired_lane_took_goes_back_to_the_head_of_its_clients_line(monkeypatch):
    # The retired lane waits on (no poll within the test), so the next request wakes it: it takes
    # that request, finds itself lost and gives it back to its client's line, at the head.
    monkeypatch.setattr(runner_module, "LOST_LANE_POLL_S", 60.0)
    with CodeRunner(envs_per_lane=1, lanes=2, isolation=ISOLATION, max_run_timeout=10) as r:
        order: list[str] = []
        r.on_result = lambda request, result, *_: order.append(result.run_result.stdout.strip())
        given_back: list[tuple[str, str]] = []
        put_front = r._queue.put_front

        def spy(client, job):
            given_back.append((client, job.request.code))
            put_front(client, job)

        monkeypatch.setattr(r._queue, "put_front", spy)
        busy = r.submit(SLEEP.format(s=5, i="'busy'"), client="a")
        assert wait_until(lambda: r.stats().running == 1, 10)
        busy_lane = r._running[busy][0].number
        r.retire_lane(next(lane.number for lane in r.lanes() if lane.number != busy_lane), "retired by the test")
        b = [r.submit(f"print('b{i}')", client="b") for i in range(2)]
        assert wait_until(lambda: [lane.number for lane in r.lanes()] == [busy_lane], 10), r.lanes()
        assert given_back == [("b", "print('b0')")]
        s = r.stats()
        assert s.queued_by_client == {"b": 2} and s.queued == 2 and s.lanes_lost == 1 and s.running == 1
        c = r.submit("print('c0')", client="c")  # c joins the round behind b, whose turn was given back
        results = [f.result(timeout=30) for f in [busy, *b, c]]
        assert [x.status for x in results] == ["Success"] * 4, [x.message for x in results]
        assert order == ["busy", "b0", "c0", "b1"]  # b0 kept its place in b's line and b its turn
        assert r.stats().runs == {("python", "Success"): 4} and r.stats().queued_by_client == {}


def test_lane_workers_and_workers_do_not_mix():
    with pytest.raises(ValueError, match="lane_workers"):
        CodeRunner(workers=["tcp://127.0.0.1:1"], lane_workers=[["tcp://127.0.0.1:1"]])
    with pytest.raises(ValueError, match="lanes_per_worker"):
        lanes_on_workers(["tcp://a:1"], 0)
