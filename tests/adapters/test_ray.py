"""Workers placed by Ray: a local multi-node cluster (ray.cluster_utils.Cluster, one per module),
real workers, real sandboxes, real failures (killed actors, a removed node, a killed trainer)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import gymnasium as gym
import numpy as np
import psutil
import pytest
import zmq

ray = pytest.importorskip("ray", reason='Ray is not installed (pip install "boltzlabs-gym[ray]")')


import boltzlabs_gym  # noqa: E402
from boltzlabs_gym import RLPool, WorkerError  # noqa: E402
from boltzlabs_gym.errors import PlacementTimeout  # noqa: E402
from boltzlabs_gym.wire.keys import ClientKeys  # noqa: E402
from boltzlabs_gym.ray import RayWorkers  # noqa: E402

from conftest import COUNTER, ENVS, FAULTY, ISOLATION  # noqa: E402
from ray_clusters import boltzlabs_processes, local_cluster  # noqa: E402
from workers import pids_gone, wait_until  # noqa: E402

ATTEST = os.path.join(ENVS, "boltz_attest")
NODES = 3


@pytest.fixture(scope="module")
def cluster(request):
    """Three Ray nodes on the local host (one CPU each), shut down whatever the tests did."""
    return local_cluster(request, NODES)


def _tree(pids) -> set[int]:
    out = set()
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            out.add(pid)
            out.update(c.pid for c in proc.children(recursive=True))
        except psutil.Error:
            pass
    return out


@pytest.fixture
def no_boltz_left(cluster):
    before = boltzlabs_processes()
    yield
    left = lambda: boltzlabs_processes() - before  # noqa: E731
    assert wait_until(lambda: not left(), 20), f"left behind: {left()}"


pytestmark = pytest.mark.usefixtures("no_boltz_left")


def test_pool_spreads_over_nodes_in_index_order(cluster):
    with RayWorkers(num_workers=NODES, capacity=16) as workers:
        assert len({w.node_id for w in workers.workers}) == NODES  # one worker per node
        assert all(a.startswith("tcp://") and not a.endswith(":0") for a in workers.addresses)
        with RLPool(FAULTY, n=7, workers=workers, isolation=ISOLATION) as pool:
            assert pool.workers == workers.addresses
            obs = pool.reset(seed=0)
            assert [o["index"] for o in obs] == list(range(7))
            obs, *_ = pool.step([{"sleep": 0.01 * (7 - i)} for i in range(7)])
            assert [o["index"] for o in obs] == list(range(7))
            assert set(pool.timing.per_worker_ms) == set(workers.addresses)
        # make_vec spliced over three nodes gives what Gymnasium's SyncVectorEnv gives
        ours = boltzlabs_gym.make_vec("CartPole-v1", num_envs=6, workers=workers, isolation=ISOLATION)
        ref = gym.make_vec("CartPole-v1", num_envs=6, vectorization_mode="sync")
        try:
            o1, _ = ours.reset(seed=3)
            o2, _ = ref.reset(seed=3)
            np.testing.assert_allclose(o1, o2)
            rng = np.random.default_rng(0)
            for _ in range(30):
                a = rng.integers(0, 2, 6)
                r1, r2 = ours.step(a), ref.step(a)
                for x, y in zip(r1[:4], r2[:4]):
                    np.testing.assert_allclose(x, y)
        finally:
            ours.close()
            ref.close()


def test_envs_never_see_ray_and_keys_travel_in_memory(cluster, tmp_path):
    with RayWorkers(num_workers=1, capacity=4) as workers:
        worker = psutil.Process(workers.workers[0].pid)
        assert "--keys-stdin" in worker.cmdline() and "--keys" not in worker.cmdline()
        assert not [k for k in worker.environ() if k.startswith("RAY")]
        with RLPool(ATTEST, n=2, workers=workers, isolation=ISOLATION) as pool:
            for o in pool.reset():
                assert not [k for k in o["env_keys"] if "RAY" in k], o["env_keys"]
            assert pool.isolation is not None
            # RayWorkers.status(): envs, PSS and isolation per node, through the worker's own op
            (row,) = workers.status()
            assert row["envs"] == row["in_use"] == 2 and row["node_id"] == workers.workers[0].node_id
            assert row["isolation"] == [pool.isolation.backend] and row["pss_bytes"] > 0 and "error" not in row
            # boltzlabs-gym status with the saved in-memory keys
            dirs = workers.save_client_keys(str(tmp_path / "keys"))
            keydir = dirs[workers.addresses[0]]
            assert os.stat(os.path.join(keydir, "client.key_secret")).st_mode & 0o077 == 0
            out = subprocess.run(
                [sys.executable, "-m", "boltzlabs_gym.cli", "status", workers.addresses[0], "--keys", keydir],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert out.returncode == 0, out.stderr
            assert json.loads(out.stdout)["authenticated"] is True


def test_unauthenticated_and_unknown_clients_are_refused(cluster):
    with RayWorkers(num_workers=1, capacity=4) as workers:
        address = workers.addresses[0]
        # no keys: the CURVE server never answers a plain client
        with pytest.raises(WorkerError, match="unreachable"):
            RLPool(COUNTER, n=1, workers=[address], heartbeat_timeout=2.0, isolation=ISOLATION)
        # a key pair the worker was not given, pinned to the right server key
        public, secret = zmq.curve_keypair()
        stranger = ClientKeys(public, secret, workers.workers[0].public_key)
        with pytest.raises(WorkerError, match="rejected this client's key"):
            RLPool(COUNTER, n=1, workers=[address], keys=stranger, heartbeat_timeout=3.0, isolation=ISOLATION)
        # the trainer's own keys, in memory, get in
        with RLPool(COUNTER, n=1, workers=[address], keys=workers.client_keys(address), isolation=ISOLATION) as p:
            assert p.reset() == [{"t": 0}]


def test_killed_actor_is_reported_in_its_slots_then_replaced(cluster):
    with RayWorkers(num_workers=NODES, capacity=16) as workers:
        with RLPool(COUNTER, n=6, workers=workers, isolation=ISOLATION, heartbeat_timeout=3.0) as pool:
            pool.reset()
            victim = workers.workers[1]
            doomed = _tree([victim.pid])
            lost_envs = [i for i in range(6) if pool._links[1].start <= i < pool._links[1].start + pool._links[1].count]
            ray.kill(workers._actors[1], no_restart=True)
            # the actor's worker and its envs die with it (PDEATHSIG, then the worker's own clean-up)
            assert wait_until(lambda: pids_gone(doomed), 15)
            t0 = time.monotonic()
            obs, rewards, dones, infos = pool.step([1] * 6)
            assert time.monotonic() - t0 < 3.0 + 3.0
            for i in range(6):
                if i in lost_envs:
                    assert obs[i] is None and dones[i] and "is lost" in infos[i]["boltzlabs_error"]["reason"]
                else:
                    assert obs[i] == {"t": 1}
            assert list(pool.lost_workers) == [victim.address]
            # still lost until replaced: errors again, at once
            obs, *_ = pool.step([1] * 6)
            assert all(obs[i] is None for i in lost_envs)
            assert workers.dead() == [1]
            (new,) = workers.replace_dead()
            assert new != victim.address and workers.addresses[1] == new
            obs = pool.reset(hard=True)
            assert obs == [{"t": 0}] * 6 and not pool.lost_workers
            assert pool.workers[1] == new
            obs, *_ = pool.step([1] * 6)
            assert obs == [{"t": 1}] * 6


def test_lost_node_is_reported_without_a_hang(cluster):
    extra = cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    head_id = ray.get_runtime_context().get_node_id()
    extra_id = next(
        n["NodeID"]
        for n in ray.nodes()
        if n["Alive"]
        and n["NodeManagerAddress"]
        and n["NodeID"] != head_id
        and n["RayletSocketName"] == extra.raylet_socket_name
    )
    with RayWorkers(node_ids=[head_id, extra_id], capacity=8, resources={"CPU": 0.1}) as workers:
        assert [w.node_id for w in workers.workers] == [head_id, extra_id]
        doomed = _tree([workers.workers[1].pid])
        with RLPool(COUNTER, n=4, workers=workers, isolation=ISOLATION, heartbeat_timeout=3.0) as pool:
            pool.reset()
            cluster.remove_node(extra, allow_graceful=False)
            # the node's processes go: its actor, so its worker, so its envs
            assert wait_until(lambda: pids_gone(doomed), 20)
            t0 = time.monotonic()
            obs, _, dones, infos = pool.step([1] * 4)
            assert time.monotonic() - t0 < 3.0 + 3.0
            assert obs[:2] == [{"t": 1}] * 2 and obs[2:] == [None, None] and dones[2:].all()
            (new,) = workers.replace_dead(timeout=3.0)  # node affinity falls back to a live node
            assert workers.workers[1].node_id != extra_id
            assert pool.reset(hard=True) == [{"t": 0}] * 4
            assert pool.step([1] * 4)[0] == [{"t": 1}] * 4


def test_leaving_with_and_a_killed_trainer_leave_no_process(cluster, tmp_path):
    with RayWorkers(num_workers=2, capacity=8) as workers:
        with RLPool(COUNTER, n=4, workers=workers, isolation=ISOLATION) as pool:
            pool.reset()
            procs = _tree(w.pid for w in workers.workers)
            assert len(procs) >= 2 + 4  # two workers and (at least) their four envs
    assert wait_until(lambda: pids_gone(procs), 20)
    # A trainer that dies without closing anything: Ray kills its actors, the workers follow.
    script = tmp_path / "trainer.py"
    script.write_text(
        textwrap.dedent(f"""
        import json, ray
        from boltzlabs_gym import RLPool
        from boltzlabs_gym.ray import RayWorkers
        ray.init(address={cluster.address!r}, log_to_driver=False)
        workers = RayWorkers(num_workers=2, capacity=8).start()
        pool = RLPool({COUNTER!r}, n=4, workers=workers, isolation={ISOLATION!r})
        pool.reset()
        print(json.dumps([w.pid for w in workers.workers]), flush=True)
        import time; time.sleep(600)
    """)
    )
    trainer = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        line = trainer.stdout.readline()
        pids = _tree(json.loads(line))
        assert len(pids) >= 2 + 4
    finally:
        trainer.kill()
        trainer.wait(10)
        trainer.stdout.close()
    assert wait_until(lambda: pids_gone(pids), 30), [psutil.Process(p).cmdline() for p in pids if not pids_gone([p])]


def test_pending_actors_time_out_saying_what_was_asked_and_what_there_is(cluster):
    with pytest.raises(PlacementTimeout) as info:
        RayWorkers(num_workers=1, capacity=4, resources={"CPU": 64}, placement_timeout=2.0).start()
    message = str(info.value)
    assert "{'CPU': 64}" in message and "CPU: " in message and "live node(s)" in message
    with pytest.raises(PlacementTimeout, match="STRICT_SPREAD"):
        RayWorkers(
            num_workers=NODES + 2, capacity=4, resources={"CPU": 0.1}, strategy="STRICT_SPREAD", placement_timeout=2.0
        ).start()
    # nothing placed stays reserved: a fitting request goes through at once
    with RayWorkers(num_workers=1, capacity=4, placement_timeout=10.0) as workers:
        assert len(workers.addresses) == 1


def test_a_refusal_is_raised_not_taken_for_a_lost_worker(cluster):
    with RayWorkers(num_workers=1, capacity=4) as workers:
        with RLPool(COUNTER, n=2, workers=workers, isolation=ISOLATION, lease=1.0) as pool:
            assert pool.worker_loss == "report"
            # No request after the create: the worker reclaims the envs when the lease runs out.
            # (The pool's first request is the one that finds it, so nothing before it can be late.)
            time.sleep(2.5)
            with pytest.raises(WorkerError, match="reclaimed") as info:
                pool.reset()
            assert not isinstance(info.value, boltzlabs_gym.WorkerLost) and not pool.lost_workers


def test_two_lost_workers_found_in_one_heartbeat_and_replaced_before_noticed(cluster):
    """Several lost workers cost one heartbeat timeout, not one each; a replacement made before any
    call noticed the loss is picked up by the next hard reset; snapshots refuse lost workers at once;
    the actors leave no temp dirs behind."""
    import glob
    import tempfile

    from boltzlabs_gym import SnapshotError

    temp = tempfile.gettempdir()
    before_dirs = set(glob.glob(os.path.join(temp, "boltzlabs-ray-*")))
    with RayWorkers(num_workers=NODES, capacity=16) as workers:
        with RLPool(
            os.path.join(ENVS, "snap"), n=6, workers=workers, isolation=ISOLATION, heartbeat_timeout=3.0
        ) as pool:
            pool.reset(seed=0)
            snap = pool.snapshot(0)  # held by worker 0
            for i in (0, 2):
                ray.kill(workers._actors[i], no_restart=True)
            assert wait_until(lambda: workers.dead() == [0, 2], 15)
            t0 = time.monotonic()
            obs, *_ = pool.step([1] * 6)
            took = time.monotonic() - t0
            assert took < 3.0 * 1.7, f"two lost workers took {took:.1f} s to find (heartbeat 3 s)"
            assert sorted(pool.lost_workers) == sorted([workers.workers[0].address, workers.workers[2].address])
            t0 = time.monotonic()
            with pytest.raises(SnapshotError, match="lost"):
                pool.restore(snap, where=[3])
            with pytest.raises(SnapshotError, match="env 5 is on worker .* which is lost"):
                pool.snapshot(5)
            assert time.monotonic() - t0 < 1.0, "a snapshot call that needs a lost worker must not wait"
            workers.replace_dead()
            assert pool.reset(hard=True, seed=0) is not None and not pool.lost_workers
            assert all(o is not None for o in pool.step([1] * 6)[0])
            # a worker replaced before the pool noticed its loss
            ray.kill(workers._actors[1], no_restart=True)
            assert wait_until(lambda: workers.dead() == [1], 15)
            workers.replace_dead()
            pool.reset(hard=True, seed=0)
            assert all(o is not None for o in pool.step([1] * 6)[0]) and not pool.lost_workers
    assert set(glob.glob(os.path.join(temp, "boltzlabs-ray-*"))) <= before_dirs


def test_closed_workers_do_not_start_again_and_the_secret_does_not_travel(cluster):
    import pickle

    workers = RayWorkers(num_workers=1, capacity=4)
    with pytest.raises(TypeError, match="secret key"):
        pickle.dumps(workers)
    with workers:
        keys = workers.client_keys(workers.addresses[0])
        assert "secret" not in repr(keys) and keys.secret not in repr(keys).encode()
    with pytest.raises(WorkerError, match="closed"):
        workers.start()
