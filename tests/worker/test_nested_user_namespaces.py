"""``PoolOptions.nested_user_namespaces``: a boltz session's envs may make user namespaces of their own
(what the code runner's ``wipe=False`` mode needs); without it the worker's gate refuses them."""

from __future__ import annotations

import errno

import pytest

from boltzlabs_gym import RLPool
from conftest import ISOLATION

ENV = '''
import ctypes, os
from boltzlabs_gym.env import serve

def attempt(flags):
    """unshare(flags) in a child (one thread: a user namespace needs it); 0 or the errno."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        libc = ctypes.CDLL(None, use_errno=True)
        os.write(w, str(0 if libc.unshare(flags) == 0 else ctypes.get_errno()).encode())
        os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    return int(os.read(r, 16))

def reset(seed, options=None):
    # a user namespace alone, and one with PID, mount, IPC, net and UTS namespaces under it
    others = 0x20000000 | 0x20000 | 0x8000000 | 0x40000000 | 0x4000000
    return {"user": attempt(0x10000000), "user+others": attempt(0x10000000 | others)}

def step(action):
    return {}, 0.0, True, {}

serve(reset=reset, step=step)
'''


@pytest.mark.parametrize("nested", [False, True])
def test_boltz_envs_make_user_namespaces_only_where_the_session_lets_them(tmp_path, nested):
    (tmp_path / "env.py").write_text(ENV)
    with RLPool(str(tmp_path), n=2, isolation=ISOLATION, mode="boltz", nested_user_namespaces=nested) as pool:
        if pool.isolation is None or pool.isolation.backend != "namespaces":
            pytest.skip(f"boltz envs get no sandbox of their own under {pool.isolation}: nothing to gate")
        got = pool.reset()
        assert pool.isolation.properties.get("nested_user_namespaces", False) is nested, pool.isolation
    want = 0 if nested else errno.EPERM
    assert got == [{"user": want, "user+others": want}] * 2, got
