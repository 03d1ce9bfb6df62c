"""The pool engine end to end: real worker, real env processes, real sockets."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import psutil
import pytest

from boltzlabs_gym import EnvStartError, PoolClosedError, RLPool
from boltzlabs_gym.errors import AsyncStateError
from boltzlabs_gym.testing import alive, pids_gone, wait_until
from conftest import CODE_ENV, COUNTER, ENVS, FAULTY, ISOLATION

pytestmark = pytest.mark.usefixtures("no_leaks")


def test_counter_quickstart_loop():
    with RLPool(COUNTER, n=8, isolation=ISOLATION) as pool:
        obs = pool.reset(seed=0)
        assert obs == [{"t": 0}] * 8
        finished = 0
        for t in range(150):
            obs, rewards, dones, infos = pool.step([1] * 8)
            assert rewards.dtype == np.float32 and rewards.shape == (8,)
            assert dones.dtype == np.bool_ and dones.shape == (8,)
            assert np.all(rewards == 1.0)
            if dones.any():
                finished += int(dones.sum())
                assert all(o["t"] == 100 for o in obs)
                obs = pool.reset(where=dones)
                assert obs == [{"t": 0}] * 8
        assert finished == 8
        assert obs[0]["t"] == 50
        timing = pool.timing
        assert timing.worker_ms > 0 and timing.roundtrip_ms >= timing.worker_ms
        assert timing.stragglers == () and timing.total_stragglers == 0
        pss = pool.memory()
        assert len(pss) == 8 and all(p > 0 for p in pss)
        assert 1 < pool.envs_per_gb() < 10_000


def test_order_preserved_under_random_delays():
    rng = np.random.default_rng(0)
    n = 16
    with RLPool(FAULTY, n=n, isolation=ISOLATION) as pool:
        pool.reset(seed=100)
        for _ in range(3):
            delays = rng.uniform(0, 0.05, size=n)
            obs, rewards, dones, infos = pool.step([{"sleep": float(d)} for d in delays])
            assert [o["index"] for o in obs] == list(range(n))
            assert [i["t"] for i in infos] == [infos[0]["t"]] * n


def test_seeds_and_partial_reset_splice():
    n = 6
    with RLPool(FAULTY, n=n, isolation=ISOLATION) as pool:
        obs = pool.reset(seed=10)
        assert [o["seed"] for o in obs] == [10 + i for i in range(n)]
        obs = pool.reset(seed=[5, None, 7, 8, 9, 1])
        assert [o["seed"] for o in obs] == [5, None, 7, 8, 9, 1]
        for _ in range(3):
            pool.step([0] * n)
        mask = np.array([True, False, True, False, False, True])
        obs = pool.reset(seed=50, where=mask)
        assert [o["t"] for o in obs] == [0, None, 0, None, None, 0] or [o.get("t") for o in obs]
        # unselected envs keep the last observation they returned
        obs2, *_ = pool.step([0] * n)
        assert [o["t"] for o in obs2] == [1, 4, 1, 4, 4, 1]
        assert [obs[i]["seed"] for i in (0, 2, 5)] == [50, 52, 55]


def test_hard_reset_is_byte_identical_and_wipes_workspace():
    with RLPool(FAULTY, n=2, isolation=ISOLATION) as pool:
        first = pool.reset(seed=3)
        obs, *_ = pool.step([{"write": "junk.txt"}, {"write": "other.txt"}])
        assert obs[0]["workspace"] == ["junk.txt"]
        soft = pool.reset(seed=3)
        assert soft[0]["workspace"] == ["junk.txt"]  # soft reset keeps the process and its files
        hard = pool.reset(seed=3, hard=True)
        assert hard == first
        assert hard[0]["workspace"] == [] and hard[1]["workspace"] == []


def test_straggler_killed_within_deadline_others_correct():
    n = 64
    with RLPool(FAULTY, n=n, isolation=ISOLATION, step_timeout=1.0) as pool:
        pool.reset(seed=0)
        actions = [1] * n
        actions[13] = {"hang": True}
        t0 = time.monotonic()
        obs, rewards, dones, infos = pool.step(actions)
        elapsed = time.monotonic() - t0
        assert elapsed < 1.0 + 1.5, elapsed
        assert obs[13] is None and rewards[13] == 0 and dones[13]
        assert "boltzlabs_straggler" in infos[13] and "deadline" in infos[13]["boltzlabs_straggler"]["reason"]
        assert pool.timing.stragglers == (13,)
        for i in range(n):
            if i != 13:
                assert obs[i] == {"t": 1, "index": i} and rewards[i] == 1.0 and not dones[i]
                assert "boltzlabs_straggler" not in infos[i]
        # respawned: the next reset finds it ready and it steps normally again
        obs = pool.reset(seed=0, where=np.arange(n) == 13)
        assert obs[13]["t"] == 0
        obs, rewards, dones, infos = pool.step([1] * n)
        assert obs[13] == {"t": 1, "index": 13} and pool.timing.stragglers == ()
        assert pool.timing.total_stragglers == 1


@pytest.mark.parametrize(
    "action, expect",
    [
        ({"crash": True}, "signal"),
        ({"exit": 7}, "status 7"),
        ({"garbage": True}, "not a JSON line"),
        ({"huge_mib": 100}, "longer than"),
    ],
    ids=["abort", "os_exit", "garbage_line", "100MiB_line"],
)
def test_env_failures_are_reported_and_respawned(action, expect):
    n = 4
    with RLPool(FAULTY, n=n, isolation=ISOLATION, step_timeout=10.0) as pool:
        pool.reset(seed=0)
        obs, rewards, dones, infos = pool.step([1, action, 1, 1])
        err = infos[1].get("boltzlabs_error")
        assert err is not None, infos[1]
        assert expect in err["reason"] or expect in err.get("stderr", ""), err
        assert obs[1] is None and rewards[1] == 0 and dones[1]
        assert [o["t"] for i, o in enumerate(obs) if i != 1] == [1, 1, 1]
        assert all("boltzlabs_error" not in infos[i] for i in (0, 2, 3))
        assert pool.timing.errors == (1,)
        obs = pool.reset(seed=0)
        assert obs[1]["t"] == 0
        obs, *_ = pool.step([1] * n)
        assert obs[1] == {"t": 1, "index": 1}


def test_exception_in_step_and_reset_is_a_terminal_transition():
    with RLPool(FAULTY, n=2, isolation=ISOLATION) as pool:
        pool.reset(seed=0)
        obs, rewards, dones, infos = pool.step([{"raise": "boom"}, 1])
        exc = infos[0]["boltzlabs_exception"]
        assert exc["where"] == "step" and "ValueError: boom" in exc["traceback"]
        assert dones[0] and rewards[0] == 0 and not dones[1]
        obs = pool.reset(seed=0, options={"raise": True})
        assert obs == [None, None]
        assert "reset exploded on purpose" in pool.reset_infos[0]["boltzlabs_exception"]["traceback"]
        obs = pool.reset(seed=0)  # the same processes keep serving
        assert obs[0]["t"] == 0


def test_print_in_user_code_does_not_corrupt_the_channel():
    with RLPool(FAULTY, n=2, isolation=ISOLATION) as pool:
        pool.reset()
        obs, rewards, *_ = pool.step([{"print": '{"obs": "fake"}'}, 1])
        assert obs[0] == {"t": 1, "index": 0} and rewards.tolist() == [1.0, 1.0]
        assert pool.timing.errors == ()


def test_wrong_actions_raise_before_sending():
    with RLPool(COUNTER, n=4, isolation=ISOLATION) as pool:
        pool.reset()
        with pytest.raises(ValueError, match="exactly 4 actions"):
            pool.step([1, 1, 1])
        with pytest.raises(ValueError, match="env 2 is not JSON"):
            pool.step([1, 1, object(), 1])
        with pytest.raises(ValueError, match="boolean mask"):
            pool.reset(where=[1, 0, 1, 0])
        with pytest.raises(ValueError, match="4 seeds"):
            pool.reset(seed=[1, 2])
        obs, *_ = pool.step([1] * 4)  # nothing half-sent: the pool still works
        assert obs == [{"t": 1}] * 4


def test_async_step_state_machine():
    with RLPool(COUNTER, n=2, isolation=ISOLATION) as pool:
        pool.reset()
        with pytest.raises(AsyncStateError):
            pool.step_wait()
        pool.step_async([1, 1])
        with pytest.raises(AsyncStateError):
            pool.step_async([1, 1])
        obs, *_ = pool.step_wait()
        assert obs == [{"t": 1}] * 2


def test_failed_start_names_env_and_leaves_nothing():
    with pytest.raises(EnvStartError) as info:
        RLPool(os.path.join(ENVS, "bad_start"), n=4, isolation=ISOLATION)
    assert info.value.index == 2
    assert "cannot load the simulator for env 2" in info.value.stderr_tail
    assert "env 2" in str(info.value)


def test_start_deadline():
    t0 = time.monotonic()
    with pytest.raises(EnvStartError, match="deadline"):
        RLPool(os.path.join(ENVS, "slow_start"), n=2, isolation=ISOLATION, start_timeout=1.0)
    assert time.monotonic() - t0 < 10


def test_hosted_service_import_name_works():
    with RLPool(os.path.join(ENVS, "hello"), n=2, isolation=ISOLATION) as pool:
        assert pool.reset(seed=1) == [{"hello": 1}, {"hello": 2}]
        obs, rewards, dones, infos = pool.step(["a", "b"])
        assert obs == [{"echo": "a"}, {"echo": "b"}] and infos[0] == {"via": "boltzlabs"}


def test_code_env_grades_programs():
    good = (
        "def add(a, b):\n    return a + b\n"
        "def fizzbuzz(n):\n"
        "    return 'FizzBuzz' if n % 15 == 0 else 'Fizz' if n % 3 == 0 else 'Buzz' if n % 5 == 0 else str(n)\n"
    )
    bad = "def add(a, b):\n    return a - b\ndef fizzbuzz(n):\n    return str(n)\n"
    with RLPool(CODE_ENV, n=4, isolation=ISOLATION) as pool:
        obs = pool.reset()
        assert "fizzbuzz" in obs[0]["task"]
        obs, rewards, dones, infos = pool.step([good, bad, "def add(:", good])
        assert rewards.tolist() == [1.0, 0.0, 0.0, 1.0]
        assert dones.all() and [i["passed"] for i in infos] == [True, False, False, True]


def test_serialize_measurement_runs_steps_one_at_a_time():
    n = 4
    with RLPool(FAULTY, n=n, isolation=ISOLATION, serialize_measurement=True) as pool:
        pool.reset()
        t0 = time.monotonic()
        pool.step([{"sleep": 0.5}] * n)
        serial = time.monotonic() - t0
        assert serial >= 0.5 * n * 0.95
        t0 = time.monotonic()
        pool.reset()  # resets stay concurrent
        assert time.monotonic() - t0 < 0.5 * n
    with RLPool(FAULTY, n=n, isolation=ISOLATION) as pool:
        pool.reset()
        t0 = time.monotonic()
        pool.step([{"sleep": 0.5}] * n)
        # concurrent: about 0.5 s; the bound leaves 0.7 s for a loaded machine and is still
        # far below the 2 s the steps take one at a time
        assert time.monotonic() - t0 < 0.5 * n * 0.6


def test_close_is_idempotent_and_closed_pool_refuses():
    pool = RLPool(COUNTER, n=2, isolation=ISOLATION)
    worker = psutil.Process(pool._links[0].process.pid)
    envs = worker.children(recursive=True)
    assert len(envs) >= 2
    pool.close()
    pool.close()
    assert pool.closed
    with pytest.raises(PoolClosedError):
        pool.step([1, 1])
    assert not worker.is_running() or worker.status() == psutil.STATUS_ZOMBIE
    # SIGKILLed by the worker as it closed; a loaded machine may take a moment to finish them
    assert wait_until(lambda: not alive(envs), 10), f"env processes outlived close(): {alive(envs)}"


def test_background_process_of_an_env_dies_with_it():
    with RLPool(FAULTY, n=2, isolation=ISOLATION, step_timeout=1.0) as pool:
        pool.reset()
        marker = f"{60 + os.getpid() % 1000 / 1000:.3f}"  # unique: other runs' daemons must not count
        pool.step([{"daemon": marker}, 1])
        worker = psutil.Process(pool._links[0].process.pid)
        sleepers = [p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] == ["sleep", marker]]
        assert sleepers
        pool.reset(hard=True)
        if pool.isolation.properties.get("pid_namespace") or pool.isolation.properties.get("tree_kill") == "cgroup":
            # the hard reset answers once the new env is up, not once the old tree has died
            assert wait_until(lambda: not alive(sleepers), 10), f"daemons outlived the hard reset: {alive(sleepers)}"
        else:
            pytest.skip(f"{pool.isolation.backend} cannot kill a setsid daemon (no pid namespace or cgroup)")
        assert worker.is_running()


def _run_trainer_and_kill(tmp_path, sig):
    script = tmp_path / "trainer.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import signal, sys, time
            # Python's own SIGINT handler, even if whatever started the tests ignored SIGINT (a
            # background job of a non-interactive shell does, and exec passes that on).
            signal.signal(signal.SIGINT, signal.default_int_handler)
            from boltzlabs_gym import RLPool
            pool = RLPool({COUNTER!r}, n=4, isolation={ISOLATION!r})
            pool.reset()
            print("READY", pool._links[0].process.pid, flush=True)
            while True:
                pool.step([1] * 4)
                pool.reset()
            """
        )
    )
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline().split()
    assert line and line[0] == "READY", line
    worker = psutil.Process(int(line[1]))
    tree = [worker] + worker.children(recursive=True)
    time.sleep(0.3)
    proc.send_signal(sig)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        for p in [psutil.Process(proc.pid)] + tree:  # fail, but leave nothing running behind
            try:
                p.kill()
            except psutil.Error:
                pass
        proc.wait(10)
        raise AssertionError(f"the trainer did not exit within 30 s of {sig!r}") from None
    finally:
        proc.stdout.close()
    assert wait_until(lambda: not alive(tree), 15), f"worker or env processes outlived the killed trainer: {alive(tree)}"


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT], ids=["SIGKILL", "SIGINT"])
def test_killed_trainer_leaves_no_processes(tmp_path, sig):
    _run_trainer_and_kill(tmp_path, sig)


def test_many_failing_launches_fail_cleanly(tmp_path):
    """Hundreds of envs on one worker, then a wave of failing launches.

    With 400 envs the worker holds more fds than an env's RLIMIT_NOFILE (this once made
    every start past env ~334 fail with EMFILE); a respawn wave whose launches all raise
    must give each env a clear error, leak no fds and leave the worker serving.
    """
    sock = tmp_path / "w.sock"
    script = tmp_path / "worker.py"
    n = 400
    script.write_text(textwrap.dedent(f"""
        import dataclasses
        from boltzlabs_gym.worker import ops, router
        from boltzlabs_gym.worker.sandbox import select_backend

        ECHO = ["/bin/sh", "-c", "while read l; do echo '{{\\"obs\\":0,\\"info\\":{{}}}}'; done"]

        class FailsAfterStart:
            name = "fails-after-start"
            launches = 0
            def available(self): return True, "test"
            def report(self): return select_backend("process").report()
            def launch(self, spec):
                FailsAfterStart.launches += 1
                if FailsAfterStart.launches > {n}:
                    raise OSError("no more forks today")
                return select_backend("process").launch(dataclasses.replace(spec, argv=ECHO))

        ops.select_backend = lambda isolation, **_: FailsAfterStart()  # the create handler's
        w = router.Worker(["ipc://{sock}"], capacity=5000)
        w.install_signal_handlers()
        print("READY", flush=True)
        w.serve_forever()
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "READY"
        with RLPool(COUNTER, n=n, workers=[f"ipc://{sock}"], isolation="process") as pool:
            fds_before = len(os.listdir(f"/proc/{proc.pid}/fd"))
            pool.reset(hard=True)  # every respawn's launch fails, in one wave
            errors = [info.get("boltzlabs_error", {}).get("reason", "") for info in pool.reset_infos]
            assert all("could not launch: OSError: no more forks today" in e for e in errors), errors[:3]
            assert proc.poll() is None, "the worker died"
            assert len(os.listdir(f"/proc/{proc.pid}/fd")) <= fds_before
    finally:
        proc.terminate()
        proc.wait(30)
        proc.stdout.close()


def _start_pool_with_stderr(tmp_path, use_pty: bool) -> str:
    import pty

    script = tmp_path / "start.py"
    script.write_text(f"from boltzlabs_gym import RLPool\nRLPool({COUNTER!r}, n=48, isolation={ISOLATION!r}).close()\n")
    if use_pty:
        parent, child = pty.openpty()
        proc = subprocess.Popen([sys.executable, str(script)], stderr=child, stdout=subprocess.DEVNULL)
        os.close(child)
        chunks = []
        while True:
            try:
                data = os.read(parent, 4096)
            except OSError:  # EIO: the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        os.close(parent)
        proc.wait(120)
        return b"".join(chunks).decode(errors="replace")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    return out.stderr


def test_start_up_progress_bar_on_a_terminal_only(tmp_path):
    on_tty = _start_pool_with_stderr(tmp_path, use_pty=True)
    assert "starting envs [" in on_tty and "48/48" in on_tty
    assert "starting envs" not in _start_pool_with_stderr(tmp_path, use_pty=False)
    with RLPool(COUNTER, n=48, isolation=ISOLATION) as pool:
        assert pool.start_progress == (48, 48)


def test_interpreter_exit_without_close_leaves_nothing(tmp_path):
    script = tmp_path / "forgetful.py"
    script.write_text(textwrap.dedent(f"""
        from boltzlabs_gym import RLPool
        pool = RLPool({COUNTER!r}, n=4, isolation={ISOLATION!r})
        pool.reset()
        worker = pool._links[0].process.pid
        import psutil
        print(worker, *[p.pid for p in psutil.Process(worker).children(recursive=True)], flush=True)
        # no close(): interpreter exit must clean up
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    pids = [int(x) for x in out.stdout.split()]
    assert len(pids) >= 5, out.stderr
    assert wait_until(lambda: pids_gone(pids), 10)


class _EchoLink:
    """A stand-in for a WorkerLink whose worker answers each batch item with its op, tagged with
    the worker's name (no sockets, no envs): enough to test how routes split and splice batches."""

    def __init__(self, address, start, count):
        self.address, self.start, self.count = address, start, count
        self.sent = []
        self.regions = None  # a remote worker's: no shared observation regions

    def send(self, header, frames=()):
        self.sent.append(header)
        return len(self.sent)

    def recv(self, seq, timeout):
        items = self.sent[seq - 1]["items"]
        lines = [f'{{"w": "{self.address}", "i": {local}, "op": "{op["op"]}"}}'.encode() for local, op, _ in items]
        results = [[local, "ok", [len(line)]] for (local, _, _), line in zip(items, lines)]
        return {"ok": True, "results": results, "worker_ms": float(self.start)}, [b"".join(lines)]

    def raise_for_error(self, header):
        pass


def test_split_route_sends_one_request_per_worker_and_splices_replies_in_item_order():
    from boltzlabs_gym.client.routes import SplitRoute, WorkerRoute

    links = [_EchoLink("a", 0, 3), _EchoLink("b", 3, 2), _EchoLink("c", 5, 2)]
    route = SplitRoute([WorkerRoute(link, 7) for link in links], 7)
    order = [4, 0, 6, 3, 1]  # nothing for env 2 and 5; "c" gets env 6 only
    route.send([(i, {"op": f"op{i}"}, ()) for i in order])
    assert [len(link.sent) for link in links] == [1, 1, 1]
    assert links[1].sent[0]["items"] == [[1, {"op": "op4"}, 0], [0, {"op": "op3"}, 0]]
    results, per_worker_ms = route.wait(5.0, raw=False)
    assert [r.index for r in results] == order
    assert [r.reply["op"] for r in results] == [f"op{i}" for i in order]
    assert [r.reply["w"] for r in results] == ["b", "a", "c", "b", "a"]
    assert per_worker_ms == {"a": 0.0, "b": 3.0, "c": 5.0}


def test_routes_refuse_a_bad_env_index_before_sending_anything():
    from boltzlabs_gym.client.routes import SplitRoute, WorkerRoute

    def one_worker(links):
        return WorkerRoute(links[0], 3)

    def two_workers(links):
        return SplitRoute([WorkerRoute(x, 3) for x in links], 3)

    for make in (one_worker, two_workers):
        links = [_EchoLink("a", 0, 2), _EchoLink("b", 2, 1)]
        route = make(links)
        with pytest.raises(IndexError, match="env index 3 out of range for a pool of 3"):
            route.send([(0, {"op": "step"}, ()), (3, {"op": "step"}, ())])
        with pytest.raises(TypeError, match="env index must be an int, got str"):
            route.send([("0", {"op": "step"}, ())])
        assert all(not link.sent for link in links)
        route.send([(np.int64(2), {"op": "step"}, ())])  # numpy ints are indices too


def test_an_empty_batch_sends_nothing_and_returns_nothing():
    from boltzlabs_gym.client.routes import SplitRoute, WorkerRoute

    links = [_EchoLink("a", 0, 2), _EchoLink("b", 2, 1)]
    for route in (WorkerRoute(links[0], 2), SplitRoute([WorkerRoute(x, 3) for x in links], 3)):
        route.send([])
        assert route.wait(5.0, raw=False) == ([], {})
    assert all(not link.sent for link in links)  # the worker refuses an empty batch
