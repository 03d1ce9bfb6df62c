"""The worker's plumbing on its host: what dead workers left behind is removed, once."""

import multiprocessing
import os
import subprocess
import sys

import pytest

from boltzlabs_gym.worker.host import sweep_stale_workers


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _worker_dir(workdir: str, name: str, owner: int, files: int = 0) -> str:
    path = os.path.join(workdir, f"boltzlabs-worker-{name}")
    os.makedirs(path)
    with open(os.path.join(path, "owner.pid"), "w") as f:
        f.write(str(owner))
    for d in range(files // 50):
        sub = os.path.join(path, "archives", f"a{d}", "pkg")
        os.makedirs(sub)
        for k in range(50):
            with open(os.path.join(sub, f"m{k}.py"), "w") as f:
                f.write("x = 1\n")
        os.chmod(sub, 0o555)  # as an unpacked archive is left: read-only
    return path


def _sweep_after(barrier, workdir: str) -> None:
    barrier.wait()
    sweep_stale_workers(workdir)


def test_workers_starting_together_sweep_each_dead_workers_dir_once(tmp_path):
    """Replacement workers start at the same time and all sweep: none may fail (a lost race once
    killed a replacement at start with ENOENT), and every dead worker's tree goes, live ones stay."""
    workdir = str(tmp_path)
    dead = [_worker_dir(workdir, f"dead{i}", _dead_pid(), files=400) for i in range(6)]
    live = _worker_dir(workdir, "live", os.getpid(), files=50)
    starting = os.path.join(workdir, "boltzlabs-worker-starting")  # no pid file yet
    os.makedirs(starting)
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(4)
    sweepers = [ctx.Process(target=_sweep_after, args=(barrier, workdir)) for _ in range(4)]
    for p in sweepers:
        p.start()
    for p in sweepers:
        p.join(60)
    assert [p.exitcode for p in sweepers] == [0] * 4
    assert sorted(os.listdir(workdir)) == sorted(os.path.basename(p) for p in (live, starting))
    assert not any(os.path.exists(p) for p in dead)
    assert os.path.exists(os.path.join(live, "archives", "a0", "pkg", "m0.py"))


def test_a_sweep_cut_short_is_finished_by_the_next_worker(tmp_path):
    """A worker killed while removing a dead worker's dir leaves it claimed; once the claimant is
    dead too, the next worker removes it, pid file or not. A live claimant's dir is left to it."""
    workdir = str(tmp_path)
    cut_short = _worker_dir(workdir, f"a.swept-by-{_dead_pid()}", _dead_pid(), files=50)
    os.unlink(os.path.join(cut_short, "owner.pid"))
    in_progress = _worker_dir(workdir, f"b.swept-by-{os.getpid()}", _dead_pid(), files=50)
    sweep_stale_workers(workdir)
    assert os.listdir(workdir) == [os.path.basename(in_progress)]


def test_a_local_pools_worker_loads_neither_numpy_nor_gymnasium(tmp_path):
    """The worker process (``python -m boltzlabs_gym.worker``) makes no env and decodes no
    observation: it registers no Gymnasium envs and imports neither library, which would be most of
    its memory, while its pool steps envs whose observations and infos are arrays."""
    import gymnasium as gym
    import numpy as np
    import psutil

    from boltzlabs_gym import BoltzLabsVecEnv

    env = BoltzLabsVecEnv([lambda: gym.make("CartPole-v1")] * 4, envs_per_sandbox=2)
    try:
        env.reset(seed=0)
        for _ in range(20):
            env.step(np.zeros(4, dtype=np.int64))
        workers = [
            p for p in psutil.Process().children(recursive=True) if "boltzlabs_gym.worker" in " ".join(p.cmdline())
        ]
        assert len(workers) == 1, workers
        mapped = {os.path.basename(m.path) for m in workers[0].memory_maps()}
        # (NumPy's core extension: Gymnasium cannot be imported without it)
        assert not any("_multiarray_umath" in name for name in mapped), sorted(mapped)
    finally:
        env.close()


@pytest.mark.parametrize("started_by", ["boltzlabs-gym worker", "python -m boltzlabs_gym.cli worker"])
def test_a_remote_worker_started_by_the_command_loads_neither_numpy_nor_gymnasium(started_by):
    """How remote workers start: the ``boltzlabs-gym`` command's ``worker``. Its process builds no
    other command's flags (the code server's import NumPy and Gymnasium) and registers no
    Gymnasium envs, while a pool steps envs with array observations through it."""
    import gymnasium as gym
    import numpy as np
    import psutil

    from boltzlabs_gym import BoltzLabsVecEnv
    from boltzlabs_gym.testing import WorkerProcess

    if started_by == "boltzlabs-gym worker":
        script = os.path.join(os.path.dirname(sys.executable), "boltzlabs-gym")
        if not os.path.exists(script):
            pytest.skip(f"no boltzlabs-gym console script beside {sys.executable} (the package is not installed)")
        command = [sys.executable, script, "worker"]
    else:
        command = [sys.executable, "-m", "boltzlabs_gym.cli", "worker"]
    worker = WorkerProcess(insecure=True, capacity=4, command=command)
    try:
        env = BoltzLabsVecEnv([lambda: gym.make("CartPole-v1")] * 4, workers=[worker.address])
        try:
            env.reset(seed=0)
            for _ in range(20):
                env.step(np.zeros(4, dtype=np.int64))
            mapped = {os.path.basename(m.path) for m in psutil.Process(worker.pid).memory_maps()}
            assert not any("_multiarray_umath" in name for name in mapped), sorted(mapped)
        finally:
            env.close()
    finally:
        worker.stop()


def test_the_worker_is_known_by_the_module_the_interpreter_runs():
    from boltzlabs_gym import _running_module

    assert _running_module(["python", "-m", "boltzlabs_gym.worker"]) == "boltzlabs_gym.worker"
    assert _running_module(["python", "-X", "importtime", "-W", "ignore", "-B", "-m", "x.y", "-v"]) == "x.y"
    assert _running_module(["python", "script.py", "-m", "boltzlabs_gym.worker"]) is None
    assert _running_module(["python", "-c", "import x", "-m", "y"]) is None
    assert _running_module(["python"]) is None


def test_the_worker_command_is_known_however_the_interpreter_is_started():
    from boltzlabs_gym import _starts_a_worker

    assert _starts_a_worker(["python", "-m", "boltzlabs_gym.worker", "--bind", "x"])
    assert _starts_a_worker(["/venv/bin/python3", "/venv/bin/boltzlabs-gym", "worker", "--bind", "x"])
    assert _starts_a_worker(["python", "-X", "importtime", "/venv/bin/boltzlabs-gym", "worker"])
    assert _starts_a_worker(["python", "-m", "boltzlabs_gym.cli", "worker"])
    assert not _starts_a_worker(["/venv/bin/python3", "/venv/bin/boltzlabs-gym", "code-server"])
    assert not _starts_a_worker(["python", "-m", "boltzlabs_gym.cli", "status", "worker"])
    assert not _starts_a_worker(["python", "train.py", "worker"])
    assert not _starts_a_worker(["python", "-c", "import x", "/venv/bin/boltzlabs-gym", "worker"])
    assert not _starts_a_worker(["python"])
    assert not _starts_a_worker(["python", "-m"])
