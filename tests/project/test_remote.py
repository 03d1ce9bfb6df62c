"""Remote workers: several real workers over tcp, CURVE keys, failures named, leases."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import textwrap
import time
import uuid

import numpy as np
import psutil
import pytest
import zmq

from boltzlabs_gym import CapacityError, RLPool, WorkerError
from boltzlabs_gym.wire.archive import archive_hash
from boltzlabs_gym.wire.keys import generate_keys
from boltzlabs_gym.wire.protocol import PROTOCOL_VERSION, decode_header, encode_header

from conftest import COUNTER, FAULTY, ISOLATION
from workers import WorkerProcess, alive, wait_until

pytestmark = pytest.mark.usefixtures("no_leaks")


@pytest.fixture
def two_workers():
    workers = [WorkerProcess(capacity=32), WorkerProcess(capacity=32)]
    yield workers
    for w in workers:
        w.stop()


@pytest.fixture
def keys(tmp_path):
    d = tmp_path / "keys"
    generate_keys(str(d))
    return str(d)


def status(address: str, keys_dir: str | None = None) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "boltzlabs_gym.cli", "status", address, *(["--keys", keys_dir] if keys_dir else [])],
        capture_output=True, text=True, timeout=30,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_one_pool_over_two_workers_keeps_index_order(two_workers):
    addresses = [w.address for w in two_workers]
    rng = np.random.default_rng(1)
    with RLPool(FAULTY, n=10, workers=addresses, isolation=ISOLATION) as pool:
        assert pool.workers == addresses
        obs = pool.reset(seed=0)
        assert [o["index"] for o in obs] == list(range(10))
        assert [o["seed"] for o in obs] == list(range(10))
        for _ in range(3):
            delays = rng.uniform(0, 0.05, 10)
            obs, rewards, dones, infos = pool.step([{"sleep": float(d)} for d in delays])
            assert [o["index"] for o in obs] == list(range(10))
        assert set(pool.timing.per_worker_ms) == set(addresses)
        assert all(ms > 0 for ms in pool.timing.per_worker_ms.values())
        st = [status(a) for a in addresses]
        assert [s["in_use"] for s in st] == [5, 5]
        assert st[0]["sessions"][0]["envs_per_gib"] > 0


def test_explicit_split_and_capacity_errors(two_workers):
    addresses = [w.address for w in two_workers]
    with RLPool(COUNTER, n=6, workers=addresses, split=[1, 5], isolation=ISOLATION) as pool:
        assert [s["in_use"] for s in (status(a) for a in addresses)] == [1, 5]
        assert pool.reset() == [{"t": 0}] * 6
    with pytest.raises(CapacityError, match="64 free slots"):
        RLPool(COUNTER, n=65, workers=addresses, isolation=ISOLATION)
    with pytest.raises(CapacityError, match="asked 40"):
        RLPool(COUNTER, n=41, workers=addresses, split=[1, 40], isolation=ISOLATION)
    # Nothing half-started: both workers are empty again.
    assert [s["in_use"] for s in (status(a) for a in addresses)] == [0, 0]


def test_upload_is_cached_by_content_hash(two_workers, tmp_path):
    env_dir = tmp_path / "env"
    shutil.copytree(COUNTER, env_dir)
    (env_dir / "marker.txt").write_text(uuid.uuid4().hex)  # a hash no worker has seen
    addresses = [w.address for w in two_workers]
    with RLPool(env_dir, n=2, workers=addresses, isolation=ISOLATION) as pool:
        assert pool.uploads == {a: True for a in addresses}
    with RLPool(env_dir, n=2, workers=addresses, isolation=ISOLATION) as pool:
        assert pool.uploads == {a: False for a in addresses}


def _raw_request(address: str, header: dict, frames=()) -> dict:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        sock.send_multipart([encode_header(dict(header, seq=1)), *frames])
        assert sock.poll(10_000), "worker did not answer"
        return decode_header(sock.recv_multipart()[0])
    finally:
        sock.close(0)
        ctx.term()


def _tar(members: list[tuple[tarfile.TarInfo, bytes | None]]) -> bytes:
    import gzip

    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return gzip.compress(raw.getvalue())


def _file(name: str, data: bytes = b"x") -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    return info, data


def _link(name: str, target: str) -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type = tarfile.SYMTYPE
    info.linkname = target
    return info, None


@pytest.mark.parametrize(
    "members, why",
    [
        ([_file("../escape.py")], "'..'"),
        ([_file("/etc/evil")], "absolute"),
        ([_link("env.py", "/etc/passwd")], "outside"),
        ([_link("up", "../../x")], "outside"),
    ],
    ids=["dotdot", "absolute", "abs_symlink", "rel_symlink_escape"],
)
def test_bad_archives_are_refused(two_workers, members, why):
    data = _tar(members)
    reply = _raw_request(two_workers[0].address, {"v": PROTOCOL_VERSION, "op": "upload", "hash": archive_hash(data)}, [data])
    assert reply["ok"] is False and reply["error"]["kind"] == "archive"
    assert why in reply["error"]["message"]
    # the worker is still serving
    assert _raw_request(two_workers[0].address, {"v": PROTOCOL_VERSION, "op": "ping"})["ok"] is True


def test_killed_worker_gives_clear_error_within_heartbeat(two_workers):
    addresses = [w.address for w in two_workers]
    pool = RLPool(COUNTER, n=4, workers=addresses, isolation=ISOLATION, heartbeat_timeout=3.0)
    try:
        pool.reset()
        envs = psutil.Process(two_workers[1].pid).children(recursive=True)
        two_workers[1].kill()
        t0 = time.monotonic()
        with pytest.raises(WorkerError, match=addresses[1].replace("*", r"\*")) as info:
            pool.step([1] * 4)
        assert time.monotonic() - t0 < 3.0 + 2.0
        assert "unreachable" in str(info.value) and info.value.worker == addresses[1]
        # the killed worker's envs died with it: no orphans
        assert wait_until(lambda: not alive(envs), 10), f"the killed worker's envs outlived it: {alive(envs)}"
    finally:
        pool.close()
    # a restarted worker sweeps the dead one's temp dir (and cgroups)
    WorkerProcess().stop()


def test_killed_client_envs_are_reclaimed_after_lease(two_workers, tmp_path):
    address = two_workers[0].address
    script = tmp_path / "client.py"
    script.write_text(textwrap.dedent(f"""
        from boltzlabs_gym import RLPool
        pool = RLPool({COUNTER!r}, n=3, workers=[{address!r}], isolation={ISOLATION!r}, lease=6.0)
        pool.reset()
        print("READY", flush=True)
        import time; time.sleep(600)
    """))
    client = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert client.stdout.readline().strip() == "READY"
        envs = psutil.Process(two_workers[0].pid).children(recursive=True)
        assert status(address)["in_use"] == 3
        client.kill()
        client.wait(10)
        assert wait_until(lambda: status(address)["in_use"] == 0, 30)
        assert wait_until(lambda: not alive(envs), 10), f"reclaimed envs still run: {alive(envs)}"
    finally:
        client.kill()
        client.wait()
        client.stdout.close()


def test_the_first_request_after_the_lease_is_refused_whenever_housekeeping_runs(two_workers):
    """The lease decides, not the worker's housekeeping tick (about once a second when idle): the
    first request after a session's lease ran out is refused as reclaimed, and its envs go."""
    address = two_workers[0].address
    with RLPool(COUNTER, n=2, workers=[address], isolation=ISOLATION, lease=1.0) as pool:
        # the first request after the create is the one that finds the lease run out, so nothing
        # before it can be late on a loaded machine
        time.sleep(1.5)
        with pytest.raises(WorkerError, match=r"reclaimed after 1 s without a request \(its lease\)"):
            pool.reset()
        assert status(address)["in_use"] == 0


def test_sessions_are_isolated_between_clients(two_workers):
    address = two_workers[0].address
    with RLPool(COUNTER, n=2, workers=[address], isolation=ISOLATION) as pool:
        pool.reset()
        sid = pool._links[0].session
        reply = _raw_request(address, {"v": PROTOCOL_VERSION, "op": "batch", "session": sid, "items": [[0, {"op": "step", "action": 1}, 0]]})
        assert reply["ok"] is False and "no open session" in reply["error"]["message"]
        obs, *_ = pool.step([1, 1])
        assert obs == [{"t": 1}, {"t": 1}]  # the intruder's step never reached the env


def test_curve_keys_admit_only_allowed_clients(keys, tmp_path):
    worker = WorkerProcess(keys=keys)
    try:
        with RLPool(COUNTER, n=2, workers=[worker.address], keys=keys, isolation=ISOLATION) as pool:
            assert pool.reset() == [{"t": 0}, {"t": 0}]
            assert status(worker.address, keys)["authenticated"] is True
        # a client with a key the worker does not know
        stranger = tmp_path / "stranger"
        generate_keys(str(stranger))
        shutil.copy(os.path.join(keys, "worker.key"), stranger / "worker.key")
        t0 = time.monotonic()
        with pytest.raises(WorkerError, match="rejected this client's key"):
            RLPool(COUNTER, n=1, workers=[worker.address], keys=str(stranger), heartbeat_timeout=3.0, isolation=ISOLATION)
        assert time.monotonic() - t0 < 6
        # no keys at all: nothing gets through, the pool says so instead of hanging
        with pytest.raises(WorkerError, match="unreachable"):
            RLPool(COUNTER, n=1, workers=[worker.address], heartbeat_timeout=2.0, isolation=ISOLATION)
        assert status(worker.address, keys)["in_use"] == 0
    finally:
        worker.stop()


def test_worker_refuses_public_bind_without_keys(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "boltzlabs_gym.worker", "--bind", "tcp://0.0.0.0:*"], capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 2 and "without authentication" in out.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    out = subprocess.run(
        [sys.executable, "-m", "boltzlabs_gym.worker", "--bind", "tcp://127.0.0.1:*", "--keys", str(empty)],
        capture_output=True, text=True, timeout=30,
    )
    assert out.returncode == 2 and "does not exist" in out.stderr


@pytest.fixture
def two_netns_workers(keys):
    from workers import NetnsHost, NetnsUnavailable

    hosts, workers = [], []
    try:
        for k in (1, 2):
            host = NetnsHost(k)
            hosts.append(host)
            workers.append(WorkerProcess(f"tcp://{host.inside}:5555", keys=keys, prefix=host.prefix))
    except NetnsUnavailable as exc:
        for h in hosts:
            h.close()
        pytest.skip(f"cannot make network namespaces here: {exc}")
    yield workers
    for w in workers:
        w.stop()
    for h in hosts:
        h.close()


def test_a_test_host_left_by_a_killed_run_is_replaced():
    from workers import NetnsHost, NetnsUnavailable

    def devices_on(k):
        out = subprocess.run(["ip", "-o", "addr", "show", "to", f"198.18.{k}.0/24"], capture_output=True, text=True)
        return [line.split()[1].split("@")[0] for line in out.stdout.splitlines()]

    try:
        stale = NetnsHost(9)  # never closed, as after a killed run
    except NetnsUnavailable as exc:
        pytest.skip(f"cannot make network namespaces here: {exc}")
    fresh = NetnsHost(9)
    try:
        assert devices_on(9) == [fresh._host_if], "only the new host may own the subnet's route"
        netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert stale.name not in netns and fresh.name in netns
    finally:
        fresh.close()
        stale.close()
    assert devices_on(9) == []


def test_workers_across_a_veth_link(two_netns_workers, keys):
    addresses = [w.address for w in two_netns_workers]
    assert all(a.startswith("tcp://198.18.") for a in addresses)
    with RLPool(FAULTY, n=6, workers=addresses, keys=keys, isolation=ISOLATION) as pool:
        obs = pool.reset(seed=3)
        assert [o["index"] for o in obs] == list(range(6)) and [o["seed"] for o in obs] == [3 + i for i in range(6)]
        obs, rewards, dones, infos = pool.step([{"sleep": 0.01 * (6 - i)} for i in range(6)])
        assert [o["index"] for o in obs] == list(range(6))
        assert pool.timing.roundtrip_ms >= pool.timing.worker_ms
