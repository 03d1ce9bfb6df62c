"""Env interpreters share one address-space layout unless the pool asks for randomization."""

from __future__ import annotations

import os

import pytest

from boltzlabs_gym import RLPool
from boltzlabs_gym.worker.session import SessionConfig

from conftest import ENVS, ISOLATION

LAYOUT = os.path.join(ENVS, "layout")
ADDR_NO_RANDOMIZE = 0x0040000

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/personality"), reason="Linux only")


def _kernel_randomizes() -> bool:
    try:
        with open("/proc/sys/kernel/randomize_va_space") as f:
            return f.read().strip() != "0"
    except OSError:
        return False


def _layouts(**kwargs) -> list[dict]:
    with RLPool(LAYOUT, n=3, **kwargs) as pool:
        first = pool.reset(seed=0)
        pool.reset(hard=True)  # a respawned env gets the same treatment
        again = pool.step([0, 0, 0])[0]
    return first + again


@pytest.mark.parametrize("isolation", sorted({ISOLATION, "process"}))
def test_fresh_interpreters_share_one_layout_by_default(isolation, no_leaks):
    layouts = _layouts(isolation=isolation)
    assert all(o["personality"] & ADDR_NO_RANDOMIZE for o in layouts), layouts
    assert len({o["none_at"] for o in layouts}) == 1, layouts


@pytest.mark.skipif(not _kernel_randomizes(), reason="this kernel randomizes no layout (randomize_va_space=0)")
@pytest.mark.parametrize("isolation", sorted({ISOLATION, "process"}))
def test_env_aslr_gives_every_interpreter_its_own_layout(isolation, no_leaks):
    layouts = _layouts(isolation=isolation, env_aslr=True)
    assert not any(o["personality"] & ADDR_NO_RANDOMIZE for o in layouts), layouts
    assert len({o["none_at"] for o in layouts}) == len(layouts), layouts


def test_boltz_template_follows_the_option(no_leaks):
    forked = _layouts(isolation=ISOLATION, mode="boltz")
    assert all(o["personality"] & ADDR_NO_RANDOMIZE for o in forked), forked
    assert len({o["none_at"] for o in forked}) == 1, "forks share their template's layout"
    randomized = _layouts(isolation=ISOLATION, mode="boltz", env_aslr=True)
    assert not any(o["personality"] & ADDR_NO_RANDOMIZE for o in randomized), randomized


def test_bad_env_aslr_is_refused_by_pool_and_worker():
    with pytest.raises(ValueError, match="env_aslr"):
        RLPool(LAYOUT, n=1, env_aslr="no")
    with pytest.raises(ValueError, match="env_aslr"):
        SessionConfig.from_header({"n": 1, "env_aslr": 1})
    assert SessionConfig.from_header({"n": 1}).env_aslr is False
    assert SessionConfig.from_header({"n": 1, "env_aslr": True}).env_aslr is True


def test_make_vec_passes_env_aslr_to_the_pool(no_leaks):
    import boltzlabs_gym

    for flag in (False, True):
        envs = boltzlabs_gym.make_vec("CartPole-v1", num_envs=1, isolation=ISOLATION, env_aslr=flag)
        try:
            assert envs.pool.env_aslr is flag
            with open(f"/proc/{_env_pid(envs.pool)}/personality") as f:
                assert bool(int(f.read(), 16) & ADDR_NO_RANDOMIZE) is not flag
        finally:
            envs.close()


def _env_pid(pool) -> int:
    import psutil

    worker = psutil.Process(pool._links[0].process.pid)
    (env,) = [p for p in worker.children(recursive=True) if "python" in p.name() or p.name().startswith("boltz")]
    return env.pid


@pytest.mark.parametrize("inherited", [False, True])
@pytest.mark.parametrize("randomize", [False, True])
def test_set_layout_randomization_decides_whatever_the_worker_inherited(inherited, randomize):
    from boltzlabs_gym.worker.sandbox import base

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: as a backend does between fork and exec
        try:
            os.dup2(w, 1)
            if inherited:  # a worker started under `setarch -R`
                base._personality(base._personality(0xFFFFFFFF) | ADDR_NO_RANDOMIZE)
            base.set_layout_randomization(randomize)
            os.execv("/bin/cat", ["cat", "/proc/self/personality"])
        finally:
            os._exit(127)
    os.close(w)
    with os.fdopen(r) as f:
        out = f.read()
    assert os.waitpid(pid, 0)[1] == 0
    assert bool(int(out, 16) & ADDR_NO_RANDOMIZE) is not randomize, out
