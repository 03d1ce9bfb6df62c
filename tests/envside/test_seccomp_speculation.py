"""Our seccomp filters force no speculation mitigation on the processes they confine.

Installing a seccomp filter without ``SECCOMP_FILTER_FLAG_SPEC_ALLOW`` makes kernels before 5.16
(and any kernel booted with ``spec_store_bypass_disable=seccomp`` or ``spectre_v2_user=seccomp``)
force Speculative Store Bypass Disable and STIBP on the process for good, which slows CPU-bound
Python and simulators by up to half; runc and crun pass the flag by default. On a kernel whose
mode is ``prctl`` or ``off`` (or a CPU without the controls) these tests pass either way; on one
whose mode is ``seccomp`` they fail without the flag.
"""

from __future__ import annotations

import os
from contextlib import closing

import numpy as np
import psutil
import pytest

import boltzlabs_gym
from boltzlabs_gym.envside import seccomp
from boltzlabs_gym.envside import syscalls as L
from boltzlabs_gym.worker.sandbox.bwrap import BwrapBackend
from boltzlabs_gym.worker.sandbox.namespaces import NamespaceBackend
from boltzlabs_gym.worker.sandbox.speculation import (
    SPEC_ALLOW_SINCE,
    kernel_release,
    kernel_ssb_report,
    speculation_property,
)

pytestmark = pytest.mark.skipif(not seccomp.supported(), reason="no seccomp filters on this architecture/kernel")

PR_SPEC_FORCE_DISABLE = 8
STATUS_KEYS = ("Seccomp", "Speculation_Store_Bypass", "SpeculationIndirectBranch")


def _controls_in_a_child_with_filters(filters: int) -> tuple[int, int, bool]:
    """The store-bypass control of a forked child before and after it installs ``filters`` of ours,
    and whether the kernel refused ``SECCOMP_FILTER_FLAG_SPEC_ALLOW``."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.close(r)
            before = L.store_bypass_control()
            for _ in range(filters):
                seccomp.install(seccomp.build_filter())
            os.write(w, f"{before} {L.store_bypass_control()} {int(L.spec_allow_refused)}".encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    os.waitpid(pid, 0)
    before, after, refused = (int(x) for x in data.split())
    return before, after, bool(refused)


def _status(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/status") as f:
        fields = dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)
    return {key: fields.get(key, "").strip() for key in STATUS_KEYS}


def test_our_filters_leave_the_speculation_controls_as_they_were():
    before, after, refused = _controls_in_a_child_with_filters(2)  # (stacked, as the code runner's programs have them)
    assert refused == (kernel_release() < SPEC_ALLOW_SINCE)
    assert after == before
    assert after == -1 or not after & PR_SPEC_FORCE_DISABLE


@pytest.mark.usefixtures("no_leaks")
@pytest.mark.parametrize("mode", ["default", "boltz"])
def test_sandboxed_envs_have_the_speculation_controls_of_an_unfiltered_process(mode):
    mine = _status(os.getpid())
    with closing(boltzlabs_gym.make_vec("CartPole-v1", num_envs=2, mode=mode, isolation="namespaces")) as envs:
        envs.reset(seed=0)
        envs.step(np.zeros(2, dtype=np.int64))
        filtered = []
        for p in psutil.Process().children(recursive=True):
            try:
                status = _status(p.pid)
            except OSError:  # (gone meanwhile)
                continue
            if status["Seccomp"] == "2":
                filtered.append((p.pid, status))
        assert len(filtered) >= 2, filtered  # the envs (and, in boltz mode, their template and spare)
        for pid, status in filtered:
            assert (status["Speculation_Store_Bypass"], status["SpeculationIndirectBranch"]) == (
                mine["Speculation_Store_Bypass"],
                mine["SpeculationIndirectBranch"],
            ), pid


SEC_MODE = "Mitigation: Speculative Store Bypass disabled via prctl and seccomp"
PRCTL_MODE = "Mitigation: Speculative Store Bypass disabled via prctl"


@pytest.mark.parametrize("report", [PRCTL_MODE, "Vulnerable", "Not affected", None])
def test_a_kernel_that_forces_nothing_on_filters_is_reported_as_such_for_both_backends(report):
    for passes_flag in (True, False):
        prop, warning = speculation_property(report, passes_flag, (5, 4))
        assert prop.startswith("not forced") and warning is None


def test_a_kernel_in_seccomp_mode_is_warned_about_where_the_filter_goes_without_the_flag():
    assert speculation_property(SEC_MODE, True, (5, 4)) == (
        "not forced: filters installed with SECCOMP_FILTER_FLAG_SPEC_ALLOW",
        None,
    )
    prop, warning = speculation_property(SEC_MODE, False, (5, 4))  # bwrap
    assert prop.startswith("forced on every env") and "bubblewrap" in prop
    assert SEC_MODE in warning and "isolation='namespaces'" in warning
    prop, warning = speculation_property(SEC_MODE, True, (4, 14))  # too old for the flag
    assert prop.startswith("forced on every env") and "4.14" in warning


def test_the_sandbox_reports_say_what_this_kernel_does():
    report = kernel_ssb_report()
    expected, _ = speculation_property(report, True)
    assert NamespaceBackend().report().properties["speculation"] == expected
    bwrap = BwrapBackend().report()
    if bwrap.properties.get("available") is not False:
        assert bwrap.properties["speculation"] == speculation_property(report, False)[0]
