"""Snapshot, restore and fork of live envs (portable snapshots): exact copies, isolated copies,
reseeding, every refusal, snapshots that outlive their source, files, moves between workers,
accounting and clean-up. Real workers, real sandboxes, real processes; both modes.
"""

from __future__ import annotations

import json
import os
from contextlib import closing

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.vector import AutoresetMode
from workers import WorkerProcess, worker_status

import boltzlabs_gym
from boltzlabs_gym import RLPool, Snapshot, SnapshotError
from conftest import COUNTER, ENVS, ISOLATION

pytestmark = pytest.mark.usefixtures("no_leaks")

SNAP = os.path.join(ENVS, "snap")
SNAP_HOOKS = os.path.join(ENVS, "snap_hooks")
MODES = ["default", "boltz"]


def _cartpole(n: int, mode: str, **kw):
    return boltzlabs_gym.make_vec("CartPole-v1", num_envs=n, mode=mode, isolation=ISOLATION, **kw)


def _run(envs, actions_for, steps: int) -> list[tuple]:
    """Step ``envs`` ``steps`` times; each step's (obs, reward, terminated, truncated, infos) copied."""
    out = []
    for t in range(steps):
        obs, rew, term, trunc, info = envs.step(actions_for(t))
        out.append((obs.copy(), rew.copy(), term.copy(), trunc.copy(), info))
    return out


@pytest.mark.parametrize("mode", MODES)
def test_restored_cartpole_replays_its_source_exactly(mode):
    """Snapshot, step 50, restore into other slots, replay the same actions: identical, episode
    ends and autoresets included (a CartPole episode under random actions lasts ~20 steps)."""
    n = 4
    with closing(_cartpole(n, mode, autoreset_mode=AutoresetMode.NEXT_STEP)) as envs:
        envs.reset(seed=1)
        rng = np.random.default_rng(0)
        for _ in range(7):
            envs.step(rng.integers(0, 2, n))
        snap = envs.snapshot(0)
        memory = envs.pool.isolation.backend == "namespaces"  # the memory kind where it can be taken
        assert snap.kind == ("memory" if memory else "portable") and snap.source == 0 and snap.nbytes > 0
        assert snap.saveable is not memory
        acts = rng.integers(0, 2, 50)
        source = _run(envs, lambda t: np.array([acts[t], 0, 0, 0]), 50)
        assert any(s[2][0] or s[3][0] for s in source), "no episode ended: autoreset not exercised"
        obs, infos = envs.restore(snap, [2, 3])
        assert obs.shape == (n, 4) and np.array_equal(obs[2], obs[3])
        copies = _run(envs, lambda t: np.array([0, 0, acts[t], acts[t]]), 50)
        for t, (s, c) in enumerate(zip(source, copies)):
            for j in (2, 3):
                np.testing.assert_array_equal(c[0][j], s[0][0], err_msg=f"obs of copy {j} at step {t}")
                assert (c[1][j], c[2][j], c[3][j]) == (s[1][0], s[2][0], s[3][0]), (t, j)
        snap.release()


@pytest.mark.parametrize("mode", MODES)
def test_copies_carry_global_generators_and_workspace_files(mode):
    """The env's object, Python's and NumPy's global generators and the workspace files all travel."""
    with RLPool(SNAP, n=3, mode=mode, isolation=ISOLATION) as pool:
        pool.reset(seed=[5, 6, 7])
        pool.step([["write", "notes.txt", "from env 0"], 0, 0])
        pool.step([1, 1, 1])
        snap = pool.snapshot(0)
        acts = [1, ["write", "later.txt", "x"], 1, "files", 2]
        source = [pool.step([a, 0, 0])[0][0] for a in acts]
        pool.restore(snap, where=[1])
        copy = [pool.step([0, a, 0])[0][1] for a in acts]
        assert copy == source
        assert source[3]["files"] == {"notes.txt": "from env 0", "later.txt": "x"}
        # a copy's workspace is a copy: the source's later file was not in the snapshot
        pool.restore(snap, where=[2])
        assert pool.step([0, 0, "files"])[0][2]["files"] == {"notes.txt": "from env 0"}
        snap.release()


@pytest.mark.parametrize("backend", ["bwrap", "process"])
def test_snapshots_work_under_every_isolation_backend(backend):
    """Nothing about a portable snapshot depends on the sandbox: the same exact copy under bwrap
    (exec only, no boltz mode) and the process fallback."""
    from boltzlabs_gym.worker.sandbox import select_backend

    try:
        select_backend(backend)
    except boltzlabs_gym.SandboxUnavailable as exc:
        pytest.skip(f"{backend} is not available here: {exc}")
    with RLPool(SNAP, n=2, isolation=backend) as pool:
        pool.reset(seed=1)
        pool.step([["write", "w", "1"], 0])
        snap = pool.snapshot(0)
        source = [pool.step([a, 0])[0][0] for a in (1, "files", 2)]
        pool.restore(snap, where=[1])
        assert [pool.step([0, a])[0][1] for a in (1, "files", 2)] == source
        snap.release()


@pytest.mark.parametrize("mode", MODES)
def test_copies_are_separate_sandboxes(mode):
    """Files one copy writes are seen by no other copy nor the source; each copy is its own process,
    and (with PID namespaces) sees no process but its own."""
    with RLPool(SNAP, n=3, mode=mode, isolation=ISOLATION) as pool:
        pool.reset(seed=0)
        pool.step([["write", "shared.txt", "before"], 0, 0])
        pool.fork(0, into=[1, 2])
        pool.step([0, ["write", "mine.txt", "copy 1"], ["write", "shared.txt", "copy 2"]])
        files = pool.step(["files"] * 3)[0]
        assert files[0]["files"] == {"shared.txt": "before"}
        assert files[1]["files"] == {"shared.txt": "before", "mine.txt": "copy 1"}
        assert files[2]["files"] == {"shared.txt": "copy 2"}
        who = pool.step(["who"] * 3)[0]
        assert len({(w["token"], w["pidns"]) for w in who}) == 3, "a copy shares a process with another env"
        if pool.isolation is not None and pool.isolation.backend in ("namespaces", "bwrap"):
            for w in who:
                assert len(w["pids"]) <= 2, f"a copy sees other processes: {w['pids']}"


@pytest.mark.parametrize("mode", MODES)
def test_reseed_gives_each_copy_its_own_repeatable_streams(mode):
    with RLPool(SNAP, n=5, mode=mode, isolation=ISOLATION) as pool:
        pool.reset(seed=3)
        pool.step([1] * 5)
        with pool.snapshot(0) as snap:
            pool.restore(snap, where=[1, 2, 3, 4], reseed=[11, 12, 11, 13])
            first = pool.step([0] * 5)[0]
            pool.restore(snap, where=[1], reseed=[11])
            again = pool.step([0] * 5)[0]
        assert first[1] == first[3] == again[1], "the same seed must give the same streams"
        assert first[1]["r"] != first[2]["r"] and first[1]["n"] != first[4]["n"]
        assert first[1]["t"] == first[0]["t"], "reseeding must not change the env's own state"
        assert first[0]["r"] not in (first[1]["r"], first[2]["r"])


def test_reseed_reaches_a_gymnasium_envs_own_generator():
    """A reseeded CartPole copy's next seedless reset draws from its own np_random."""
    with closing(_cartpole(4, "boltz")) as envs:
        envs.reset(seed=0)
        envs.fork(0, into=[1, 2, 3], reseed=[21, 22, 21])
        obs, _ = envs.reset(options={"reset_mask": np.array([False, True, True, True])})
        np.testing.assert_array_equal(obs[1], obs[3])
        assert not np.array_equal(obs[1], obs[2])
        # reseeding gives the generator reset(seed=21) would: its first reset draws the same
        np.testing.assert_array_equal(obs[1], gym.make("CartPole-v1").reset(seed=21)[0])
        assert envs.np_random_seed[1:] == (21, 22, 21)


def test_function_form_with_hooks_snapshots_and_reseeds():
    with RLPool(SNAP_HOOKS, n=3, isolation=ISOLATION) as pool:
        pool.reset()
        pool.step(["a", "a", "a"])
        pool.step(["b", "b", "b"])
        snap = pool.snapshot(0)
        source = [pool.step([a, 0, 0])[0][0] for a in "cde"]
        pool.restore(snap, where=[1])
        assert [pool.step([0, a, 0])[0][1] for a in "cde"] == source
        pool.restore(snap, where=[2], reseed=[9])
        assert pool.step([0, 0, "z"])[0][2]["reseeded"] == 9
        snap.release()


@pytest.mark.parametrize("mode", MODES)
def test_refusals_name_the_env_and_change_nothing(mode):
    with RLPool(SNAP, n=3, mode=mode, isolation=ISOLATION) as pool:
        pool.reset(seed=0)
        before = pool.step([1, 1, 1])[0]
        # an env that cannot be pickled: the env's message names the hooks to add
        pool.step(["lock", 0, 0])
        with pytest.raises(SnapshotError, match=r"env 0.*get_state\(\) and set_state"):
            pool.snapshot(0, kind="portable")
        snap = pool.snapshot(1)
        for bad, match in [
            (lambda: pool.fork(1, into=[1]), "into itself"),
            (lambda: pool.restore(snap, where=[3]), r"\[0, 3\)"),
            (lambda: pool.restore(snap, where=[]), "no env"),
            (lambda: pool.restore(snap, where=[2, 2]), "twice"),
            (lambda: pool.restore(snap, where=[2], reseed=[1, 2]), "one seed per env"),
            (lambda: pool.restore(snap, where=[2], reseed=[-1]), "non-negative"),
            (lambda: pool.snapshot(7), r"\[0, 3\)"),
        ]:
            with pytest.raises(SnapshotError, match=match):
                bad()
        snap.release()
        with pytest.raises(SnapshotError, match="released"):
            pool.restore(snap, where=[2])
        with pytest.raises(SnapshotError, match="released"):
            snap.save("/nonexistent/never-written")
        # nothing moved: every env steps on from where it was
        after = pool.step([1, 1, 1])[0]
        assert [a["t"] for a in after] == [b["t"] + 2 - (i == 0) for i, b in enumerate(before)]


@pytest.mark.parametrize("mode", MODES)
def test_workspace_modes_are_copied_and_an_unreadable_workspace_refuses_without_harm(mode):
    """Modes travel exactly (a 0o500 directory, a 0o640 file); a file the env cannot read refuses
    the snapshot (it would not be exact) and the env serves on unharmed."""
    with RLPool(SNAP, n=2, mode=mode, isolation=ISOLATION) as pool:
        pool.reset(seed=0)
        pool.step([["mkdir", "d"], 0])
        pool.step([["write", "d/f", "x"], 0])
        pool.step([["chmod", "d/f", 0o640], 0])
        pool.step([["chmod", "d", 0o500], 0])
        modes = pool.step(["modes", 0])[0][0]["modes"]
        pool.fork(0, into=[1])
        assert pool.step([0, "modes"])[0][1]["modes"] == modes == {"d": 0o500, "d/f": 0o640}
        if pool.isolation is not None and pool.isolation.backend == "process" and os.geteuid() == 0:
            return  # an env running as root reads a mode-0 file: nothing is unreadable to it
        pool.step([["write", "secret", "s"], 0])
        pool.step([["chmod", "secret", 0], 0])
        t = pool.step([1, 0])[0][0]["t"]
        with pytest.raises(SnapshotError, match="env 0.*workspace cannot be read"):
            pool.snapshot(0, kind="portable")  # (the worker copies a memory snapshot's workspace itself)
        assert pool.step([1, 0])[0][0]["t"] == t + 1, "a refused snapshot must leave the env as it was"


def test_function_form_without_hooks_is_refused_with_the_fix():
    """The portable kind cannot see module globals (the memory kind can: tests/worker/test_memory_snapshots.py)."""
    with RLPool(COUNTER, n=2, isolation=ISOLATION) as pool:
        pool.reset()
        with pytest.raises(SnapshotError, match=r"env 1.*get_state= and set_state="):
            pool.snapshot(1, kind="portable")
        assert pool.step([1, 1])[0] == [{"t": 1}, {"t": 1}]
    with RLPool(COUNTER, n=1, isolation="process") as pool:  # no memory kind here: "auto" says why for both
        pool.reset()
        with pytest.raises(SnapshotError, match=r"env 0.*get_state= and set_state=.*namespaces backend"):
            pool.snapshot(0)
        assert pool.step([1])[0] == [{"t": 1}]


def test_envs_per_sandbox_above_one_is_refused():
    with closing(_cartpole(4, "default", envs_per_sandbox=2)) as envs:
        envs.reset(seed=0)
        with pytest.raises(SnapshotError, match="envs_per_sandbox=1"):
            envs.snapshot(0)


def test_a_snapshot_of_another_env_directory_is_refused(tmp_path):
    with RLPool(SNAP, n=1, isolation=ISOLATION) as pool:
        pool.reset(seed=0)
        pool.snapshot(0, kind="portable").save(tmp_path / "snap.blz")
    with RLPool(SNAP_HOOKS, n=1, isolation=ISOLATION) as other:
        other.reset()
        with pytest.raises(SnapshotError, match="another env directory"):
            other.restore(Snapshot.load(tmp_path / "snap.blz"), where=[0])


@pytest.mark.parametrize("mode", MODES)
def test_a_snapshot_outlives_its_source(mode):
    """It restores after its source was stepped, soft- and hard-reset, killed as a straggler and
    crashed; and a dead env's state cannot be snapshotted until it is reset."""
    with RLPool(SNAP, n=2, mode=mode, isolation=ISOLATION, step_timeout=1.0) as pool:
        pool.reset(seed=4)
        pool.step([["write", "f", "kept"], 0])
        snap = pool.snapshot(0)
        expected = pool.step([1, 0])[0][0]
        pool.reset(where=np.array([True, False]))
        pool.reset(where=np.array([True, False]), hard=True)
        _, _, _, infos = pool.step(["hang", 0])
        assert "boltzlabs_straggler" in infos[0]
        with pytest.raises(SnapshotError, match=r"env 0.*has not been reset since its process was.*reset it"):
            pool.snapshot(0)
        obs = pool.restore(snap, where=[0])
        assert obs[0] is not None, pool.reset_infos[0]
        assert pool.step([1, 0])[0][0] == expected
        _, _, _, infos = pool.step(["crash", 0])
        assert "boltzlabs_error" in infos[0]
        obs = pool.restore(snap, where=[0, 1])
        assert obs[0] is not None and obs[1] is not None, pool.reset_infos
        assert pool.step([1, 1])[0] == [expected, expected]
        assert pool.step(["files", 0])[0][0]["files"] == {"f": "kept"}
        pool.snapshot(0).release()  # restored, so its state is its own again


def test_save_load_into_a_new_pool(tmp_path):
    path = tmp_path / "state.blz"
    with closing(_cartpole(2, "default")) as envs:
        envs.reset(seed=9)
        for _ in range(5):
            envs.step(np.array([1, 0]))
        envs.snapshot(1, kind="portable").save(path)
        acts = np.random.default_rng(1).integers(0, 2, 30)
        source = _run(envs, lambda t: np.array([0, acts[t]]), 30)
    snap = Snapshot.load(path)
    assert snap.kind == "portable" and snap.source == 1 and snap.worker is None
    with closing(_cartpole(3, "boltz")) as envs:
        envs.reset(seed=0)
        envs.restore(snap, [2])
        copy = _run(envs, lambda t: np.array([0, 0, acts[t]]), 30)
    for s, c in zip(source, copy):
        np.testing.assert_array_equal(c[0][2], s[0][1])
        assert c[1][2] == s[1][1]
    # a file that is not a snapshot, or one cut short, is refused before anything is sent
    (tmp_path / "bad.blz").write_bytes(b"not a snapshot")
    with pytest.raises(SnapshotError, match="not a boltzlabs_gym snapshot"):
        Snapshot.load(tmp_path / "bad.blz")
    (tmp_path / "short.blz").write_bytes(path.read_bytes()[:-10])
    with pytest.raises(SnapshotError, match="cut short"):
        Snapshot.load(tmp_path / "short.blz")


def test_a_snapshot_moves_between_remote_workers_through_the_trainer():
    workers = [WorkerProcess(capacity=2), WorkerProcess(capacity=2)]
    try:
        addresses = [w.address for w in workers]
        with RLPool(SNAP, n=4, workers=addresses, split=[2, 2], isolation=ISOLATION) as pool:
            pool.reset(seed=2)
            pool.step([1, 1, 1, 1])
            snap = pool.snapshot(1, kind="portable")
            assert snap.worker == addresses[0]
            expected = [pool.step([0, a, 0, 0])[0][1] for a in (1, 2, 3)]
            pool.restore(snap, where=[0, 3])  # one copy on its own worker, one moved to the other
            got = [pool.step([a, 0, 0, a])[0] for a in (1, 2, 3)]
            assert [g[0] for g in got] == expected and [g[3] for g in got] == expected
            status = worker_status(addresses[1])
            assert status["snapshot_bytes"] == 0, "the moved copy must be released after the restore"
            assert [s["snapshots"] for s in worker_status(addresses[0])["sessions"]][0][0]["source"] == 1
            snap.release()
            assert worker_status(addresses[0])["snapshot_bytes"] == 0
    finally:
        for w in workers:
            w.stop()


def test_the_worker_budget_refuses_and_accounting_counts_held_snapshots():
    worker = WorkerProcess(capacity=4, extra_args=["--snapshot-budget", "30000"])
    try:
        with RLPool(SNAP, n=2, workers=[worker.address], isolation=ISOLATION) as pool:
            pool.reset(seed=0)
            pool.memory()
            assert pool.snapshot_bytes == 0
            held = [pool.snapshot(0, kind="portable")]
            nbytes = held[0].nbytes
            while sum(s.nbytes for s in held) + nbytes <= 30000:
                held.append(pool.snapshot(0, kind="portable"))
            with pytest.raises(SnapshotError, match=r"env 0.*budget is 30000 bytes.*release snapshots"):
                pool.snapshot(0, kind="portable")
            pool.memory()
            assert pool.snapshot_bytes == sum(s.nbytes for s in held)
            total = sum(pool.memory()) + pool.template_pss + pool.snapshot_bytes
            assert pool.envs_per_gb() == pytest.approx(2 / (total / 2**30), rel=0.2)
            listed = worker_status(worker.address)["sessions"][0]["snapshots"]
            assert len(listed) == len(held) and {s["kind"] for s in listed} == {"portable"}
            for s in held:
                s.release()
            pool.memory()
            assert pool.snapshot_bytes == 0
            pool.snapshot(0, kind="portable").release()  # room again
            snap = pool.snapshot(1, kind="portable")
        # closing the pool let go of what it held
        assert worker_status(worker.address)["snapshot_bytes"] == 0
        with pytest.raises(SnapshotError, match="closed"):
            snap.save("/tmp/never")
    finally:
        worker.stop()


def test_a_dropped_handle_is_released_at_the_next_snapshot_call():
    import gc

    worker = WorkerProcess(capacity=2)
    try:
        with RLPool(SNAP, n=1, workers=[worker.address], isolation=ISOLATION) as pool:
            pool.reset(seed=0)
            pool.snapshot(0, kind="portable")  # dropped at once
            gc.collect()
            pool.snapshot(0, kind="portable").release()
            assert worker_status(worker.address)["snapshot_bytes"] == 0
    finally:
        worker.stop()


def test_vector_env_bookkeeping_follows_the_copied_env():
    """A copy of an env due an autoreset is due one too; RecordEpisodeStatistics inside the env
    counts the copy's episode from the source's start."""
    with closing(
        boltzlabs_gym.make_vec(
            "CartPole-v1",
            num_envs=2,
            isolation=ISOLATION,
            wrappers=[gym.wrappers.RecordEpisodeStatistics],
            autoreset_mode=AutoresetMode.NEXT_STEP,
        )
    ) as envs:
        envs.reset(seed=0)
        for t in range(200):
            _, _, term, trunc, infos = envs.step(np.array([0, 0]))
            if term[0] or trunc[0]:
                break
        assert infos["episode"]["l"][0] == t + 1
        snap = envs.snapshot(0)
        assert snap.meta["autoreset"] is True
        envs.restore(snap, [1])
        obs, rew, term, trunc, infos = envs.step(np.array([0, 0]))
        np.testing.assert_array_equal(obs[0], obs[1])  # both reset now, from the same generator
        assert rew[1] == 0.0 and not term[1]
        for _ in range(3):
            envs.step(np.array([0, 1]))
        envs.fork(0, into=[1])
        for t in range(200):
            _, _, term, trunc, infos = envs.step(np.array([0, 0]))
            if term[1] or trunc[1]:
                break
        # the copy's episode counts from the source's start: 3 steps before the fork, t + 1 after
        assert term[0] and infos["episode"]["l"][0] == infos["episode"]["l"][1] == 3 + t + 1


@pytest.mark.parametrize("direct", [True, False])
def test_an_env_that_died_while_idle_is_not_snapshotted_until_reset(direct):
    """The worker respawns an env that exited between calls; its state died with it, whichever way
    (the lane or the worker) its steps go."""
    import time

    with RLPool(SNAP, n=2, isolation=ISOLATION, direct=direct) as pool:
        pool.reset(seed=0)
        pool.step(["exit_soon", 0])
        time.sleep(2.5)  # the env exits 0.2 s after answering; the margin is for a loaded machine
        pool.step([0, 0])  # whatever this step finds, the env's episode is gone
        with pytest.raises(SnapshotError, match=r"env 0.*has not been reset since"):
            pool.snapshot(0)
        pool.reset(where=np.array([True, False]), seed=[3, None])
        pool.snapshot(0).release()


def test_hard_links_and_read_only_directories_restore_again_and_again():
    with RLPool(SNAP, n=2, isolation=ISOLATION) as pool:
        pool.reset(seed=0)
        pool.step([["write", "a", "A"], 0])
        pool.step([["link", "a", "b"], 0])
        pool.step([["mkdir", "ro"], 0])
        pool.step([["write", "ro/x", "X"], 0])
        pool.step([["chmod", "ro", 0o500], 0])
        files = pool.step(["files", 0])[0][0]["files"]
        for kind in ("portable", "memory") if pool.isolation.backend == "namespaces" else ("portable",):
            with pool.snapshot(0, kind=kind) as snap:
                for _ in range(3):  # each restore empties a workspace that holds a read-only directory
                    pool.restore(snap, where=[1])
                    assert pool.step([0, "files"])[0][1]["files"] == files == {"a": "A", "b": "A", "ro/x": "X"}
            pool.fork(0, into=[1], kind=kind)
            pool.step([0, ["write", "a", "changed"]])
            b = pool.step([0, "files"])[0][1]["files"]["b"]
            # the portable kind's tar makes a hard link two files; the worker's copy keeps it a link
            assert b == ("A" if kind == "portable" else "changed"), kind
            pool.step([0, ["write", "a", "A"]])


def test_a_restore_that_fails_changes_nothing():
    """A blob the target cannot load (here: of another pool's env class) leaves its env, generators
    and files as they were."""
    with RLPool(SNAP_HOOKS, n=1, isolation=ISOLATION) as other:
        other.reset()
        other.step(["x"])
        foreign = other.snapshot(0, kind="portable")
        blob = foreign.blob()
    with RLPool(SNAP, n=2, isolation=ISOLATION) as pool:
        pool.reset(seed=0)
        pool.step([0, ["write", "mine", "1"]])
        with pool.snapshot(1, kind="portable") as mine:
            expected = [pool.step([0, a])[0][1] for a in (1, "files")]
            pool.restore(mine, where=[1])
            forged = Snapshot.from_blob(blob, env=pool.archive_hash)  # a hooks state for an env without hooks
            obs = pool.restore(forged, where=[1])
            assert obs[1] is None and "restore failed" in str(pool.reset_infos[1])
            assert [pool.step([0, a])[0][1] for a in (1, "files")] == expected


def test_a_state_over_the_size_limit_is_refused_and_the_env_lives_on():
    from boltzlabs_gym.envside import state as envstate
    from boltzlabs_gym.wire.protocol import MAX_ENV_PAYLOAD_BYTES

    assert envstate.MAX_BLOB_BYTES < MAX_ENV_PAYLOAD_BYTES  # what the env may send, what the worker reads
    with RLPool(SNAP, n=1, isolation=ISOLATION, limits=boltzlabs_gym.Limits(file_size_bytes=1 << 30)) as pool:
        pool.reset(seed=0)
        pool.step([["sparse", envstate.MAX_BLOB_BYTES + 1]])
        t = pool.step([1])[0][0]["t"]
        with pytest.raises(SnapshotError, match=r"env 0.*over the 255 MiB one snapshot may hold.*get_state"):
            pool.snapshot(0, kind="portable")
        assert pool.step([1])[0][0]["t"] == t + 1


def test_saving_while_a_call_is_in_flight_is_refused(tmp_path):
    from boltzlabs_gym.errors import AsyncStateError

    with RLPool(SNAP, n=1, isolation=ISOLATION, direct=False) as pool:
        pool.reset(seed=0)
        snap = pool.snapshot(0, kind="portable")
        pool.step_async([1])
        with pytest.raises(AsyncStateError, match="in flight"):
            snap.save(tmp_path / "s.blz")
        assert pool.step_wait()[0][0]["t"] == 1
        snap.save(tmp_path / "s.blz")
        snap.meta["bad"] = object()
        with pytest.raises(SnapshotError, match="JSON"):
            snap.save(tmp_path / "t.blz")
        assert sorted(os.listdir(tmp_path)) == ["s.blz"]
        snap.release()


def test_a_local_pool_sets_its_workers_snapshot_budget():
    with RLPool(SNAP, n=1, isolation=ISOLATION, snapshot_budget=100) as pool:
        pool.reset(seed=0)
        with pytest.raises(SnapshotError, match=r"budget is 100 bytes.*RLPool\(snapshot_budget=...\)"):
            pool.snapshot(0, kind="portable")
    with pytest.raises(ValueError, match="snapshot_budget"):
        RLPool(SNAP, n=1, snapshot_budget=-1)


@pytest.mark.parametrize("mode", MODES)
def test_a_fresh_restore_puts_each_copy_in_a_new_process(mode):
    """By default a copy is loaded into its slot's process; fresh=True hard-resets the slot first, so
    the copy runs in a new process (a new sandbox), exactly as the source would have gone on."""
    with closing(_cartpole(3, mode)) as envs:
        envs.reset(seed=0)
        with RLPool(SNAP, n=3, mode=mode, isolation=ISOLATION) as pool:
            pool.reset(seed=0)
            before = [w["token"] for w in pool.step(["who"] * 3)[0]]
            pool.fork(0, into=[1], kind="portable")
            pool.fork(0, into=[2], fresh=True, kind="portable")
            after = [w["token"] for w in pool.step(["who"] * 3)[0]]
            assert after[1] == before[1], "a plain restore loads into the slot's own process"
            assert after[2] != before[2], "a fresh restore starts a new process"
            got = pool.step([1, 1, 1])[0]
            assert got[0] == got[1] == got[2]
        envs.step(np.array([1, 1, 1]))
        snap = envs.snapshot(0)
        obs, _ = envs.restore(snap, [2], fresh=True)
        np.testing.assert_array_equal(obs[2], obs[0])
        a, *_ = envs.step(np.array([0, 1, 0]))
        np.testing.assert_array_equal(a[2], a[0])
        snap.release()


def test_a_snapshot_file_saved_by_another_process_restores_exactly():
    """tests/data holds a CartPole snapshot saved to a file by another process
    (tests/data/make_cartpole_snapshot.py, rerun when the env directory make_vec writes changes):
    it loads, restores into a make_vec env of this process, and the restored env steps as the
    source did after it was saved."""
    data = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")
    with open(os.path.join(data, "cartpole-v1-0.1.0.expected.json")) as f:
        expected = json.load(f)
    snap = Snapshot.load(os.path.join(data, "cartpole-v1-0.1.0.snapshot"))
    with closing(boltzlabs_gym.make_vec("CartPole-v1", num_envs=2, isolation=ISOLATION)) as envs:
        envs.reset(seed=0)
        envs.restore(snap, [1])
        for action, obs in zip(expected["actions"], expected["obs"]):
            got = envs.step(np.array([0, action]))[0][1]
            np.testing.assert_array_equal(got, np.array(obs, dtype=np.float32))
