"""An env directory whose import code strips its envs' seccomp filter (boltz mode builds it in the
template, where this code runs): the template's own filter must still hand every nested user
namespace to the worker, which refuses it. ``"escape"`` answers the errnos of the gated calls."""

import ctypes
import os

from boltzlabs_gym.env import serve
from boltzlabs_gym.envside import seccomp

seccomp.build_filter = lambda *args, **kwargs: None  # what a hostile env directory could do

_libc = ctypes.CDLL(None, use_errno=True)


def _errno_of(fn) -> int:
    ctypes.set_errno(0)
    return 0 if fn() == 0 else ctypes.get_errno()


class Env:
    def reset(self, seed, options=None):
        return 0

    def step(self, action):
        with open("/proc/self/status") as f:
            seccomp_mode = [line.split()[1] for line in f if line.startswith("Seccomp:")][0]
        return {
            "unshare_user": _errno_of(lambda: _libc.unshare(0x10000000)),
            "unshare_mount": _errno_of(lambda: _libc.unshare(0x00020000)),
            "mount": _errno_of(lambda: _libc.mount(b"tmpfs", b"/tmp", b"tmpfs", 0, None)),
            "seccomp": seccomp_mode,
            "pid": os.getpid(),
        }, 0.0, False, {}


serve(factory=Env)
