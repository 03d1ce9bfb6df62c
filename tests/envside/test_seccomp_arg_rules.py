"""``seccomp.build_filter(arg_rules=...)``: a call refused by the value of one of its arguments only."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from boltzlabs_gym.envside import seccomp

NOT_X86 = f"the seccomp filters are written for x86_64, not {os.uname().machine}"

CHILD = r"""
import ctypes, json, os, resource
from boltzlabs_gym.envside import seccomp
libc = ctypes.CDLL(None, use_errno=True)
seccomp.install(seccomp.build_filter(deny=(), arg_rules=(
    ("prlimit64", 0, "eq", PID),  # this pid only
    ("setpriority", 0, "ne", 0),  # PRIO_PROCESS only
)))
def call(*args):
    rc = libc.syscall(*args)
    return 0 if rc == 0 else ctypes.get_errno()
old = (ctypes.c_uint64 * 2)()
print(json.dumps({
    "prlimit other": call(302, PID, resource.RLIMIT_CORE, None, ctypes.byref(old)),
    "prlimit self": call(302, 0, resource.RLIMIT_CORE, None, ctypes.byref(old)),
    "nice process": call(141, 0, 0, 0),
    "nice group": call(141, 1, 0, 0),
    "getpid": 0 if os.getpid() > 0 else -1,
}))
"""


@pytest.mark.skipif(not seccomp.supported(), reason=NOT_X86)
def test_arg_rules_refuse_a_call_by_its_argument_and_let_the_rest_through():
    import json

    pid = os.getpid()  # (a live process the child may read the limits of, as the same uid)
    ran = subprocess.run([sys.executable, "-c", CHILD.replace("PID", str(pid))], capture_output=True, text=True)
    assert ran.returncode == 0, ran.stderr
    got = json.loads(ran.stdout)
    assert got == {"prlimit other": 1, "prlimit self": 0, "nice process": 0, "nice group": 1, "getpid": 0}, got


def test_a_bad_arg_rule_is_refused():
    if not seccomp.supported():
        pytest.skip(NOT_X86)
    with pytest.raises(ValueError, match="arg rule"):
        seccomp.build_filter(arg_rules=(("prlimit64", 7, "eq", 1),))
