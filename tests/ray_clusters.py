"""What the tests that run Ray share: a local multi-node cluster, and the boltzlabs processes it holds.

Imported by the test modules only after they ``pytest.importorskip("ray")``.
"""

from __future__ import annotations

import psutil
import ray
from ray.cluster_utils import Cluster


def local_cluster(request, nodes: int) -> Cluster:
    """``nodes`` Ray nodes on this host (one CPU each) with this process connected as the driver;
    shut down (driver and cluster) when ``request``'s scope ends, whatever the tests did."""
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    request.addfinalizer(c.shutdown)
    for _ in range(nodes - 1):
        c.add_node(num_cpus=1)
    c.wait_for_nodes()
    ray.init(address=c.address, log_to_driver=False)
    request.addfinalizer(ray.shutdown)
    return c


def boltzlabs_processes() -> set[int]:
    """Live boltzlabs workers and env processes among our descendants (Ray's own processes aside)."""
    out = set()
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
            cmd = " ".join(p.cmdline())
            # env processes run `python -c "...BOLTZLABS_ENV_DIR..."` (spawned) or are named boltz-* (forked)
            if "boltzlabs_gym.worker" in cmd or "BOLTZLABS_ENV_DIR" in cmd or "boltz" in p.name():
                out.add(p.pid)
        except psutil.Error:
            pass
    return out
