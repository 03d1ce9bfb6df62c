"""RayWorkers with no Ray cluster running: it starts a local one and says so (its own module:
tests/adapters/test_ray.py keeps a cluster up for its whole module)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("ray", reason='Ray is not installed (pip install "boltzlabs-gym[ray]")')

from conftest import COUNTER, ISOLATION  # noqa: E402
from workers import pids_gone, wait_until  # noqa: E402



def test_without_a_cluster_a_local_one_is_started_and_said_so(tmp_path):
    script = tmp_path / "alone.py"
    script.write_text(textwrap.dedent(f"""
        import logging, ray
        logging.basicConfig(level=logging.WARNING)
        from boltzlabs_gym import RLPool
        from boltzlabs_gym.ray import RayWorkers
        with RayWorkers(num_workers=1, capacity=2, init_kwargs={{"num_cpus": 1, "include_dashboard": False}}) as w:
            assert w.local_cluster and w.started_ray
            with RLPool({COUNTER!r}, n=2, workers=w, isolation={ISOLATION!r}) as pool:
                assert pool.reset() == [{{"t": 0}}] * 2
            print("PIDS", w.workers[0].pid, w.workers[0].actor_pid, flush=True)
        assert not ray.is_initialized()
    """))
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "no running Ray cluster found" in out.stderr and "starting a local one" in out.stderr
    pids = [int(p) for p in out.stdout.split("PIDS")[1].split()]
    assert wait_until(lambda: pids_gone(pids), 20)
