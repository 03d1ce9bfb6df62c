"""mode="boltz": envs forked from a warm template, end to end (real worker, real processes).

The pool scenarios of test_pool.py that matter for a different start path run in both modes;
the rest checks what only boltz mode has: shared import, independent state and RNG streams,
the forked env's own sandbox, template death and restart, clear errors.
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import psutil
import pytest

from boltzlabs_gym import EnvStartError, RLPool

from conftest import ENVS, FAULTY, ISOLATION

pytestmark = pytest.mark.usefixtures("no_leaks")

RNG_ENV = os.path.join(ENVS, "boltz_rng")
ATTEST_ENV = os.path.join(ENVS, "boltz_attest")
MODES = ["default", "boltz"]


def _templates() -> list[psutil.Process]:
    """Boltz template processes below this test process (forked envs share their argv, not their name).

    A process forked by the template a moment ago still has its name until it renames itself:
    only a stable answer counts.
    """
    deadline = time.monotonic() + 3
    while True:
        out = []
        for p in psutil.Process().children(recursive=True):
            try:
                if p.name() == "boltz-template" and p.status() != psutil.STATUS_ZOMBIE:
                    if p.parent() is not None and p.parent().name() != "boltz-template":
                        out.append(p)
            except psutil.Error:
                pass
        if len(out) <= 1 or time.monotonic() > deadline:
            return out
        time.sleep(0.05)


# ------------------------------------------------------------------ pool scenarios, both modes
@pytest.mark.parametrize("mode", MODES)
def test_order_preserved_under_random_delays(mode):
    rng = np.random.default_rng(0)
    n = 16
    with RLPool(FAULTY, n=n, isolation=ISOLATION, mode=mode) as pool:
        pool.reset(seed=100)
        for _ in range(3):
            delays = rng.uniform(0, 0.05, size=n)
            obs, rewards, dones, infos = pool.step([{"sleep": float(d)} for d in delays])
            assert [o["index"] for o in obs] == list(range(n))
            assert [i["t"] for i in infos] == [infos[0]["t"]] * n


@pytest.mark.parametrize("mode", MODES)
def test_seeds_and_partial_reset_splice(mode):
    n = 6
    with RLPool(FAULTY, n=n, isolation=ISOLATION, mode=mode) as pool:
        obs = pool.reset(seed=10)
        assert [o["seed"] for o in obs] == [10 + i for i in range(n)]
        assert [o["index"] for o in obs] == list(range(n))
        for _ in range(3):
            pool.step([0] * n)
        mask = np.array([True, False, True, False, False, True])
        obs = pool.reset(seed=50, where=mask)
        obs2, *_ = pool.step([0] * n)
        assert [o["t"] for o in obs2] == [1, 4, 1, 4, 4, 1]
        assert [obs[i]["seed"] for i in (0, 2, 5)] == [50, 52, 55]


@pytest.mark.parametrize("mode", MODES)
def test_hard_reset_is_byte_identical_and_wipes_workspace(mode):
    with RLPool(FAULTY, n=2, isolation=ISOLATION, mode=mode) as pool:
        first = pool.reset(seed=3)
        obs, *_ = pool.step([{"write": "junk.txt"}, {"write": "other.txt"}])
        assert obs[0]["workspace"] == ["junk.txt"]
        soft = pool.reset(seed=3)
        assert soft[0]["workspace"] == ["junk.txt"]
        hard = pool.reset(seed=3, hard=True)
        assert hard == first
        assert hard[0]["workspace"] == [] and hard[1]["workspace"] == []


@pytest.mark.parametrize("mode", MODES)
def test_straggler_killed_within_deadline_others_correct(mode):
    n = 32
    with RLPool(FAULTY, n=n, isolation=ISOLATION, step_timeout=1.0, mode=mode) as pool:
        pool.reset(seed=0)
        actions = [1] * n
        actions[13] = {"hang": True}
        t0 = time.monotonic()
        obs, rewards, dones, infos = pool.step(actions)
        assert time.monotonic() - t0 < 1.0 + 1.5
        assert obs[13] is None and rewards[13] == 0 and dones[13]
        assert "deadline" in infos[13]["boltzlabs_straggler"]["reason"]
        assert pool.timing.stragglers == (13,)
        assert all(obs[i] == {"t": 1, "index": i} for i in range(n) if i != 13)
        obs = pool.reset(seed=0, where=np.arange(n) == 13)  # respawned in the background
        assert obs[13]["t"] == 0 and obs[13]["index"] == 13
        obs, *_ = pool.step([1] * n)
        assert obs[13] == {"t": 1, "index": 13} and pool.timing.stragglers == ()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "action, expect",
    [({"crash": True}, "signal"), ({"exit": 7}, "status 7"), ({"garbage": True}, "not a JSON line")],
    ids=["abort", "os_exit", "garbage_line"],
)
def test_env_failures_are_reported_and_respawned(mode, action, expect):
    n = 4
    with RLPool(FAULTY, n=n, isolation=ISOLATION, step_timeout=10.0, mode=mode) as pool:
        pool.reset(seed=0)
        obs, rewards, dones, infos = pool.step([1, action, 1, 1])
        err = infos[1].get("boltzlabs_error")
        assert err is not None, infos[1]
        assert expect in err["reason"] or expect in err.get("stderr", ""), err
        assert obs[1] is None and rewards[1] == 0 and dones[1]
        assert [o["t"] for i, o in enumerate(obs) if i != 1] == [1, 1, 1]
        assert pool.timing.errors == (1,)
        obs = pool.reset(seed=0)
        assert obs[1]["t"] == 0
        obs, *_ = pool.step([1] * n)
        assert obs[1] == {"t": 1, "index": 1}


@pytest.mark.parametrize("mode", MODES)
def test_failed_start_names_env_and_leaves_nothing(mode):
    # default mode fails env 2 (its import checks ENV_INDEX); boltz mode imports once, in the
    # template, so an import failure fails the first env started, with the template's output
    env = "bad_start" if mode == "default" else "boltz_bad_import"
    with pytest.raises(EnvStartError) as info:
        RLPool(os.path.join(ENVS, env), n=4, isolation=ISOLATION, mode=mode)
    if mode == "default":
        assert info.value.index == 2 and "cannot load the simulator for env 2" in info.value.stderr_tail
    else:
        # the first env whose failure the worker sees is named (they all fail the same way)
        assert 0 <= info.value.index < 4 and f"env {info.value.index} failed to start" in str(info.value)
        assert "could not import the env" in info.value.stderr_tail
        assert "boltz_bad_import: cannot load the simulator" in info.value.stderr_tail


# ------------------------------------------------------------------ boltz only
def test_forked_envs_have_independent_state_and_rng_streams():
    n = 6
    with RLPool(RNG_ENV, n=n, isolation=ISOLATION, mode="boltz") as pool:
        obs = pool.reset()
        assert [o["index"] for o in obs] == list(range(n))
        # module-level code ran once, in the template: every env shares its result
        assert len({o["imported_at"] for o in obs}) == 1
        for key in ("py", "np", "urandom"):
            assert len({o[key] for o in obs}) == n, (key, [o[key] for o in obs])
        pool.step([[i] for i in range(n)])
        obs, *_ = pool.step([["x"]] * n)
        assert [o["touched"] for o in obs] == [[[i], ["x"]] for i in range(n)]  # no state shared
        again = pool.reset(hard=True)
        assert [o["touched"] for o in again] == [[]] * n  # a fresh fork: the template's clean state
        # and a hard reset draws new streams too (not a replay of the first fork's)
        assert {o["py"] for o in again}.isdisjoint({o["py"] for o in obs if "py" in o})
        assert len({o["np"] for o in again}) == n


def test_hard_reset_fork_gives_byte_identical_first_observation():
    with RLPool(FAULTY, n=3, isolation=ISOLATION, mode="boltz") as pool:
        first = pool.reset(seed=11)
        for _ in range(4):
            pool.step([{"write": "f"}, 1, 1])
        for _ in range(2):
            assert pool.reset(seed=11, hard=True) == first


def test_killed_template_is_detected_and_restarted_envs_live_on():
    with RLPool(FAULTY, n=3, isolation=ISOLATION, mode="boltz") as pool:
        pool.reset(seed=1)
        templates = _templates()
        assert len(templates) == 1, templates
        old = templates[0]
        env_pids = {p.pid for p in psutil.Process().children(recursive=True)} - {old.pid}
        old.send_signal(signal.SIGKILL)
        old.wait(5)
        # the envs it forked are not its children: they keep serving
        obs, *_ = pool.step([1, 1, 1])
        assert [o["t"] for o in obs] == [1, 1, 1]
        # the next fork (a hard reset) notices the dead template and starts a new one
        obs = pool.reset(seed=1, hard=True)
        assert [o["index"] for o in obs] == [0, 1, 2] and all(o["t"] == 0 for o in obs)
        new = _templates()
        assert len(new) == 1 and new[0].pid != old.pid
        obs, *_ = pool.step([1, {"exit": 3}, 1])  # a crash respawns through the new template too
        assert pool.timing.errors == (1,)
        assert pool.reset(seed=1)[1]["t"] == 0
        assert env_pids  # sanity: there were env processes to begin with


def test_forked_env_sandbox_matches_a_spawned_one():
    with RLPool(ATTEST_ENV, n=3, isolation=ISOLATION, mode="boltz") as pool:
        report = pool.isolation
        obs = pool.reset()
        with RLPool(ATTEST_ENV, n=1, isolation=ISOLATION, mode="default") as ref_pool:
            ref = ref_pool.reset()[0]
        ws = [o["workspace"] for o in obs]
        assert ws == [[f"mine-{i}"] for i in range(3)]  # private workspaces, not shared
        assert report.properties.get("boltz_template") is True
        assert report.properties.get("boltz_env_fork") == "clone"  # one clone per env, no double fork
        if report.backend != "namespaces":
            pytest.skip(f"no namespace sandbox here ({report}): boltz mode is plain fork")
        for o in obs:
            assert o["pid"] == 1 == ref["pid"]  # PID 1 of its own PID namespace
            assert o["visible_pids"] == 1
            assert o["uid"] != 0
            assert o["hostname"] == ref["hostname"]
            assert o["tcp"] == ref["tcp"] and o["tcp"] != "ok"
            assert o["write_env"] == ref["write_env"] and o["write_env"] != "ok"
            assert o["status"]["CapEff"] == "0000000000000000" and o["status"]["CapBnd"] == "0000000000000000"
            assert o["status"]["NoNewPrivs"] == "1" and o["status"]["Seccomp"] == "2"
            assert o["status"]["Threads"] == "1"
            assert o["fds"] == ref["fds"]  # nothing of the template's leaks in
            assert o["env_keys"] == ref["env_keys"]
            # the values too (the fork rewrites only what differs from the template's): all but its index
            assert {**o["environ"], "BOLTZLABS_ENV_INDEX": "0"} == ref["environ"], o["index"]
            assert o["environ"]["BOLTZLABS_ENV_INDEX"] == str(o["index"])
            assert o["mounts_ws"][-1] == "/workspace"  # its own, over the template's (covered, locked)
        # a sibling's workspace and the template's are nowhere to be seen
        obs, *_ = pool.step(["/workspace", "/proc/1/root/workspace", "/sys/fs/cgroup"])
        assert obs[0]["listdir"] == "ok"
        assert obs[1]["listdir"] == "ok"  # its own (pid 1 is itself)
        assert obs[2]["listdir"] != "ok"


def test_template_with_threads_is_a_clear_error():
    with pytest.raises(EnvStartError) as info:
        RLPool(os.path.join(ENVS, "boltz_threads"), n=2, isolation=ISOLATION, mode="boltz")
    assert "threads" in info.value.stderr_tail and "mode='default'" in info.value.stderr_tail


def test_a_double_forking_template_is_reported_once(tmp_path, caplog):
    from boltzlabs_gym.worker.template import TemplateLauncher

    class Process:
        name = "process"

        def report(self):
            from boltzlabs_gym.wire.limits import IsolationReport

            return IsolationReport(backend="process", properties={})

    launcher = TemplateLauncher(Process(), env_dir=str(tmp_path), root=str(tmp_path), runtime={})
    try:
        assert launcher.report().properties["boltz_env_fork"] == "clone"
        with caplog.at_level("WARNING", logger="boltzlabs_gym.worker.template"):
            for _ in range(3):  # what each env's first message says (forkserver._first_message)
                launcher._note_double_fork("[Errno 1] clone(CLONE_PARENT): refused")
        warnings = [r for r in caplog.records if "refused to clone envs" in r.getMessage()]
        assert len(warnings) == 1 and "[Errno 1] clone(CLONE_PARENT): refused" in warnings[0].getMessage()
        assert launcher.report().properties["boltz_env_fork"] == "double fork ([Errno 1] clone(CLONE_PARENT): refused)"
    finally:
        launcher.close()


def test_boltz_mode_never_falls_back_silently():
    from boltzlabs_gym.worker.sandbox import SandboxUnavailable
    from boltzlabs_gym.worker.template import TemplateLauncher

    class Bwrap:
        name = "bwrap"

    with pytest.raises(SandboxUnavailable, match="cannot run with isolation='bwrap'"):
        TemplateLauncher(Bwrap(), env_dir="/nonexistent", root="/nonexistent", runtime={})


def test_gymnasium_factories_in_boltz_mode():
    gym = pytest.importorskip("gymnasium")
    from boltzlabs_gym import BoltzLabsVecEnv

    envs = BoltzLabsVecEnv([lambda: gym.make("CartPole-v1")] * 4, mode="boltz", isolation=ISOLATION)
    try:
        obs, _ = envs.reset(seed=0)
        ref = gym.make("CartPole-v1")
        for i in range(4):
            assert np.array_equal(obs[i], ref.reset(seed=i)[0])
        for _ in range(5):
            obs, rew, term, trunc, infos = envs.step(np.ones(4, dtype=np.int64))
        assert obs.shape == (4, 4) and np.all(rew == 1.0)
        again, _ = envs.reset(seed=0)
        assert np.array_equal(again[0], ref.reset(seed=0)[0])
    finally:
        envs.close()


def test_serve_forks_only_through_the_hook_the_template_bootstrap_installs(tmp_path):
    """The env side imports no worker code: with BOLTZLABS_TEMPLATE set but no fork loop installed
    (not started by the template's bootstrap), serve() says so and exits instead of serving or forking."""
    import subprocess
    import sys

    (tmp_path / "env.py").write_text(
        "from boltzlabs_gym.env import serve\nserve(reset=lambda seed: 0, step=lambda a: (0, 1.0, False, {}))\n"
    )
    env = dict(os.environ, BOLTZLABS_TEMPLATE="process", BOLTZLABS_ENV_DIR=str(tmp_path), BOLTZLABS_ENV_INDEX="0")
    run = [sys.executable, str(tmp_path / "env.py")]
    proc = subprocess.run(run, env=env, input=b"", capture_output=True, timeout=60)
    assert proc.returncode == 1
    assert b"no fork loop installed" in proc.stderr
    imports = "import sys, boltzlabs_gym.env, boltzlabs_gym.envside.gym_start; print(sorted(sys.modules))"
    loaded = subprocess.run([sys.executable, "-c", imports], env=env, capture_output=True, timeout=60, check=True)
    assert b"boltzlabs_gym.worker" not in loaded.stdout
