"""``benchmarks/training.py --smoke``: both training workloads run on every vectorizer and report finite returns."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import pytest

for _module, _package, _install in (
    ("torch", "torch", "install a CPU build of torch, as README.md says"),
    ("stable_baselines3", "stable-baselines3", "pip install stable-baselines3"),
    ("ale_py", "ale-py", 'pip install -e ".[real-envs]"'),
    ("mujoco", "mujoco", 'pip install -e ".[real-envs]"'),
):
    pytest.importorskip(_module, reason=f"{_package} is not installed ({_install})")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "training.py")
ISOLATION = os.environ.get("BOLTZLABS_TEST_ISOLATION", "auto")
KINDS = {
    "sb3": ["dummy", "subproc", "boltzlabs", "boltzlabs_boltz-k2"],
    "atari": ["sync", "async", "boltzlabs", "boltzlabs_boltz-k2"],
}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("training")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--smoke", "--isolation", ISOLATION, "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=420,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    return out, proc.stdout


def _fields(line: str) -> dict[str, str]:
    return dict(re.findall(r"(\w+)=(\S+)", line))


@pytest.mark.timeout(480)
def test_every_vectorizer_trains_and_reports_finite_returns(smoke):
    _, stdout = smoke
    results = [_fields(line) for line in stdout.splitlines() if line.startswith("RESULT ")]
    for workload, kinds in KINDS.items():
        ran = {r["kind"]: r for r in results if r["workload"] == workload}
        assert sorted(ran) == sorted(kinds), (workload, stdout[-3000:])
        for kind, r in ran.items():
            assert math.isfinite(float(r["ret_last"])), (workload, kind, r)
            assert float(r["sps"]) > 0 and int(r["episodes"]) > 0, (workload, kind, r)
            if workload == "sb3":
                assert math.isfinite(float(r["eval_ret"])), (kind, r)
    randoms = {_fields(line)["workload"]: _fields(line) for line in stdout.splitlines() if line.startswith("RANDOM ")}
    assert set(randoms) == set(KINDS)
    assert all(math.isfinite(float(r["mean_return"])) for r in randoms.values())


@pytest.mark.timeout(480)
def test_record_holds_command_machine_and_every_row(smoke):
    out, _ = smoke
    (path,) = out.glob("training-*-smoke.json")
    record = json.loads(path.read_text())
    assert "--smoke" in record["command"] and record["machine"]["git_commit"] and record["machine"]["date"]
    assert record["config"]["smoke"] is True
    rows = record["rows"]
    assert {(r["workload"], r["kind"]) for r in rows} == {(w, k) for w, ks in KINDS.items() for k in ks}
    assert all(r["status"] == "ok" and math.isfinite(r["ret_last"]) and r["wall_s"] > 0 for r in rows)
    assert path.with_suffix(".md").read_text().startswith("# Training, not just stepping")
