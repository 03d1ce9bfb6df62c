"""The code server on a Ray cluster (``code-server --ray``): a local cluster of two nodes
(ray.cluster_utils.Cluster, one CPU each), a boltzlabs worker on each, lanes pinned to them, real
sandboxes; then the failures: a worker's actor killed and a node lost while programs run on them."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

ray = pytest.importorskip("ray", reason='Ray is not installed (pip install "boltzlabs-gym[ray]")')
pytest.importorskip("fastapi", reason="the server extra is not installed (pip install 'boltzlabs-gym[server]')")
requests = pytest.importorskip("requests")
uvicorn = pytest.importorskip("uvicorn")

from boltzlabs_gym.code.server import create_app  # noqa: E402
from boltzlabs_gym.ray.code_lanes import RayLanes  # noqa: E402
from conftest import ISOLATION  # noqa: E402
from ray_clusters import boltzlabs_processes, local_cluster  # noqa: E402
from workers import wait_until  # noqa: E402

SLEEP = "import time; time.sleep({s}); print({i} * {i})"


@pytest.fixture(scope="module")
def cluster(request):
    """Two Ray nodes on this host, one CPU each, shut down whatever the tests did."""
    return local_cluster(request, 2)


@pytest.fixture
def nothing_left(cluster):
    before = boltzlabs_processes()
    yield
    assert wait_until(lambda: not (boltzlabs_processes() - before), 30), boltzlabs_processes() - before


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_ping(url: str, timeout: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the server exited ({proc.returncode}): {proc.stdout.read()[-3000:]}")
        try:
            if requests.get(url + "/v1/ping", timeout=1).json() == "pong":
                return
        except requests.ConnectionError:
            time.sleep(0.2)
    raise AssertionError(f"no server at {url} within {timeout} s")


def _post_all(url: str, codes: list[str]) -> list[dict]:
    """POST every program at once (one client thread each); the answers, in order."""

    def post(code: str) -> dict:
        r = requests.post(url + "/run_code", json={"code": code, "language": "python", "run_timeout": 10}, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()

    with concurrent.futures.ThreadPoolExecutor(len(codes)) as pool:
        return list(pool.map(post, codes))


def _status(url: str) -> dict:
    return requests.get(url + "/v1/status", timeout=10).json()


class _Served:
    """A RayLanes runner behind the HTTP app, in this process (so the test can reach its workers)."""

    def __init__(self, cluster, **settings):
        self.lanes = RayLanes(address=cluster.address, isolation=ISOLATION, max_run_timeout=10, **settings)
        port = _free_port()
        app = create_app(self.lanes.runner)
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{port}"
        _wait_for_ping(self.url, 30)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.lanes.close()


def _node_ids() -> set[str]:
    return {n["NodeID"] for n in ray.nodes() if n["Alive"]}


def test_code_server_ray_spreads_its_lanes_over_the_nodes_and_runs_programs(cluster, nothing_left):
    port = _free_port()
    argv = [sys.executable, "-m", "boltzlabs_gym.cli", "code-server", "--ray", "--ray-address", cluster.address]
    argv += ["--port", str(port), "--lanes-per-worker", "1", "--envs-per-lane", "2", "--isolation", ISOLATION]
    argv += ["--max-run-timeout", "10", "--memory-mb", "512"]
    # the server finds the cluster by its flag, so not RAY_ADDRESS; it keeps the rest: RAY_AUTH_MODE is
    # among them (ray.init sets it to "token", and a cluster started after that one wants the token)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_for_ping(url, 120, proc)
        placement = _status(url)["lane_placement"]
        assert len(placement) == 2 and {lane["state"] for lane in placement} == {"serving"}
        nodes = {lane["where"].split()[1] for lane in placement}  # "node <id> (<ip>) <address>"
        assert len(nodes) == 2 and all(any(n.startswith(short) for n in _node_ids()) for short in nodes), placement
        answers = _post_all(url, [SLEEP.format(s=0.5, i=i) for i in range(8)])
        assert [a["status"] for a in answers] == ["Success"] * 8, answers
        assert [a["run_result"]["stdout"] for a in answers] == [f"{i * i}\n" for i in range(8)]
        status = _status(url)
        assert all(lane["runs"] > 0 for lane in status["lane_placement"]), status["lane_placement"]  # both nodes ran
        assert status["lanes"] == 2 and status["runs"] == {"python/Success": 8} and status["lanes_lost"] == 0
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    # uvicorn shuts down, then raises the SIGTERM again; Ray's driver handler makes that exit(15)
    assert proc.returncode in (0, signal.SIGTERM), out[-3000:]
    assert "lane 0: 2 sandboxes on node " in out and "lane 1: 2 sandboxes on node " in out, out[-3000:]
    # the server's workers let go of their CPUs (their actors are gone)
    assert wait_until(lambda: ray.available_resources().get("CPU") == 2.0, 30), ray.available_resources()


def test_a_killed_worker_actor_costs_its_runs_then_its_lane_comes_back(cluster, nothing_left):
    served = _Served(cluster, lanes_per_worker=1, envs_per_lane=2, heartbeat_timeout=3.0, retry_s=5.0)
    try:
        workers = served.lanes.workers
        with concurrent.futures.ThreadPoolExecutor(1) as one:
            answers = one.submit(_post_all, served.url, [SLEEP.format(s=4, i=i) for i in range(4)])
            assert wait_until(lambda: _status(served.url)["running"] == 4, 20)
            victim = workers.addresses[1]
            ray.kill(workers._actors[1], no_restart=True)  # its worker and sandboxes go with it
            answers = answers.result(timeout=60)
        ok = [a for a in answers if a["status"] == "Success"]
        lost = [a for a in answers if a["status"] == "SandboxError"]
        assert len(ok) == 2 and len(lost) == 2, answers
        assert all("the worker running this program was lost" in a["message"] and victim in a["message"] for a in lost)
        # the lane comes back on the worker that replaced the killed one
        assert wait_until(
            lambda: len([la for la in _status(served.url)["lane_placement"] if la["state"] == "serving"]) == 2, 60
        )
        status = _status(served.url)
        assert status["lanes_lost"] == 1 and workers.addresses[1] != victim
        assert workers.addresses[1] in [la["workers"][0] for la in status["lane_placement"]]
        answers = _post_all(served.url, [SLEEP.format(s=0.3, i=i) for i in range(8)])
        assert [a["status"] for a in answers] == ["Success"] * 8, answers
        assert all(la["runs"] > 0 for la in _status(served.url)["lane_placement"])  # the new lane serves too
    finally:
        served.close()


@pytest.mark.slow
def test_a_lost_node_costs_its_runs_and_its_lane_is_put_back_on_another_node(cluster, nothing_left):
    extra = cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    extra_id = next(
        n["NodeID"] for n in ray.nodes() if n["Alive"] and n["RayletSocketName"] == extra.raylet_socket_name
    )
    # Half a CPU per worker: the lost node's worker has room on the others (with a whole one, its lanes
    # would stay retired; tests/code/test_lanes.py covers that).
    served = _Served(cluster, lanes_per_worker=1, envs_per_lane=2, cpus_per_worker=0.5, heartbeat_timeout=3.0)
    try:
        placement = _status(served.url)["lane_placement"]
        on_extra = [la for la in placement if la["where"].startswith(f"node {extra_id[:12]}")]
        assert len(placement) == 3 and len(on_extra) == 1, placement
        with concurrent.futures.ThreadPoolExecutor(1) as one:
            answers = one.submit(_post_all, served.url, [SLEEP.format(s=4, i=i) for i in range(6)])
            assert wait_until(lambda: _status(served.url)["running"] == 6, 20)
            cluster.remove_node(extra, allow_graceful=False)
            answers = answers.result(timeout=60)
        lost = [a for a in answers if a["status"] == "SandboxError"]
        assert len(lost) == 2 and sum(a["status"] == "Success" for a in answers) == 4, answers
        assert all(on_extra[0]["workers"][0] in a["message"] for a in lost)
        # served by the other two meanwhile
        assert [a["status"] for a in _post_all(served.url, ["print(1)"] * 4)] == ["Success"] * 4

        # and the lost lane comes back on a live node
        def three_serving() -> bool:
            return len([la for la in _status(served.url)["lane_placement"] if la["state"] == "serving"]) == 3

        assert wait_until(three_serving, 90), _status(served.url)["lane_placement"]
        placement = _status(served.url)["lane_placement"]
        assert not [la for la in placement if la["where"].startswith(f"node {extra_id[:12]}")]
        assert [a["status"] for a in _post_all(served.url, ["print(2)"] * 6)] == ["Success"] * 6
    finally:
        served.close()
