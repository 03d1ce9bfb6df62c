"""Fault soak: 64 envs, random hangs/crashes/garbage/huge replies/limit breaches, nothing lost.

The driver is ``benchmarks/soak.py`` (``python benchmarks/soak.py --steps 100000`` prints the
counts); this test runs it at ``BOLTZLABS_SOAK_STEPS`` env-steps (default 100k: about 2 min
on the shared 2-core box) in the default mode and at ``BOLTZLABS_SOAK_BOLTZ_STEPS`` (default
50k) in boltz mode, and fails on any mismatch with the fault-free reference, any misreported
or unreported fault, any spurious report and any leak.
"""

from __future__ import annotations

import os
import sys

import pytest

from conftest import ISOLATION, ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import soak  # noqa: E402

pytestmark = pytest.mark.usefixtures("no_leaks")

STEPS = {
    "default": int(os.environ.get("BOLTZLABS_SOAK_STEPS", 100_000)),
    "boltz": int(os.environ.get("BOLTZLABS_SOAK_BOLTZ_STEPS", 50_000)),
}


def test_reference_model_is_a_fault_free_run(capsys):
    """With no faults injected the pool's trajectories equal the model the soak compares against."""
    result = soak.run_soak(steps=3_000, n=64, seed=11, fault_rate=0.0, hang_rate=0.0, isolation=ISOLATION,
                           log=lambda *_: None)
    assert result["faults_injected"] == result["faults_reported"] == 0
    assert result["mismatches"] == 0 and result["spurious_reports"] == 0, result["problems"]
    assert result["healthy_steps_checked"] == result["steps"] >= 3_000
    assert result["leaks"] == 0, result["leak_details"]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["default", "boltz"])
def test_fault_soak(capsys, mode):
    steps = STEPS[mode]
    result = soak.run_soak(steps=steps, n=64, seed=int(os.environ.get("BOLTZLABS_SOAK_SEED", 0)),
                           step_timeout=0.5, isolation=ISOLATION, mode=mode)
    with capsys.disabled():
        print(f"\n[{mode}] " + soak.format_counts(result))
    assert result["steps"] >= steps
    assert result["mismatches"] == 0, result["problems"]
    assert result["spurious_reports"] == 0, result["problems"]
    assert result["faults_reported"] == result["faults_expected_reported"] > 0, result["problems"]
    assert result["faults_injected"] > steps * 0.003
    assert result["healthy_steps_checked"] > steps * 0.9
    assert result["leaks"] == 0, result["leak_details"]
