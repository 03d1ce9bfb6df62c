"""Fault soak: 64 envs, random hangs/crashes/garbage/huge replies/limit breaches, nothing lost.

The driver is ``benchmarks/soak.py`` (run it by hand for the full 100k env-steps); this test
runs it at ``BOLTZLABS_SOAK_STEPS`` env-steps (default sized for a 2-core CI box) and fails on
any mismatch with the fault-free reference, any misreported fault and any leak.
"""

from __future__ import annotations

import os
import sys

import pytest

from conftest import ISOLATION, ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import soak  # noqa: E402

pytestmark = pytest.mark.usefixtures("no_leaks")

STEPS = int(os.environ.get("BOLTZLABS_SOAK_STEPS", 100_000))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fault_soak(capsys):
    result = soak.run_soak(steps=STEPS, n=64, seed=int(os.environ.get("BOLTZLABS_SOAK_SEED", 0)),
                           step_timeout=0.5, isolation=ISOLATION)
    with capsys.disabled():
        print("\n" + soak.format_counts(result))
    assert result["steps"] >= STEPS
    assert result["mismatches"] == 0, result["problems"]
    assert result["spurious_reports"] == 0, result["problems"]
    assert result["faults_reported"] == result["faults_expected_reported"] > 0, result["problems"]
    assert result["faults_injected"] > STEPS * 0.003
    assert result["healthy_steps_checked"] > STEPS * 0.9
    assert result["leaks"] == 0, result["leak_details"]
