"""A :class:`~boltzlabs_gym.code.CodeRunner` whose lanes run on a Ray cluster: what
``boltzlabs-gym code-server --ray`` serves (needs ``pip install "boltzlabs-gym[ray]"``).

One boltzlabs worker per node (:class:`~boltzlabs_gym.ray.RayWorkers`: an actor each, placed
``SPREAD``, reserving ``cpus_per_worker``), lanes pinned to each
(:func:`~boltzlabs_gym.code.placement.lanes_on_workers`), so the server's sandboxes scale with the
nodes it finds. Programs go server to worker over ZeroMQ with CURVE, as any remote worker's
steps; Ray only places and watches the workers. A :class:`~boltzlabs_gym.code.placement.LaneKeeper`
retires the lanes of a worker that died (a killed actor, a lost node), replaces the worker and puts
its lanes back on the new one; where Ray has no room for it, the server serves with fewer lanes
and tries again later.

Usage (needs a Ray cluster, so not run as a doctest)::

    with RayLanes(address="auto", lanes_per_worker=2, envs_per_lane=4) as lanes:
        lanes.runner.run("print(1)")
        [(lane.number, lane.where) for lane in lanes.runner.lanes()]
"""

from __future__ import annotations

import logging
from typing import Any

import ray
from typing_extensions import Unpack

from ..code.placement import LaneKeeper, lanes_on_workers, lanes_per_worker_for
from ..code.runner import CodeRunner, RunnerSettings
from .workers import RayWorkers

log = logging.getLogger("boltzlabs_gym.code")

__all__ = ["RayLanes", "connect_ray", "nodes_with_cpus"]


def connect_ray(address: str) -> bool:
    """Connect this process to the Ray cluster at ``address`` (``"auto"``: the one running here);
    whether this call connected it (and so should shut it down). Already connected: nothing."""
    if ray.is_initialized():
        return False
    try:
        ray.init(address=address, log_to_driver=False)
    except ConnectionError as exc:
        raise ConnectionError(
            f"no Ray cluster found at {address!r} ({exc}); start one (`ray start --head`) or name its "
            "head with --ray-address HOST:PORT"
        ) from exc
    return True


def nodes_with_cpus(cpus: float) -> list[dict[str, Any]]:
    """The cluster's live nodes with at least ``cpus`` CPUs (where a worker reserving them fits)."""
    return [n for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get("CPU", 0) >= cpus]


class RayLanes:
    """Workers on a Ray cluster's nodes, a :class:`~boltzlabs_gym.code.CodeRunner` with lanes pinned
    to them, and the :class:`~boltzlabs_gym.code.placement.LaneKeeper` that puts lost lanes back.

    Args:
        address: the Ray cluster (``"auto"``: the one running on this host; ``HOST:PORT``: its
            head). Ray already initialised in this process is used as it is.
        num_workers: workers (one Ray actor each); default: one per live node with
            ``cpus_per_worker`` CPUs.
        lanes_per_worker: lanes on each worker (each ``envs_per_lane`` sandboxes, a runner
            setting); default: ``total_lanes`` spread over the workers, at least one each.
        total_lanes: how many lanes at least, where ``lanes_per_worker`` is not given.
        cpus_per_worker: CPUs each worker's actor reserves (its sandboxes use the node's cores
            whatever it reserves: this only places the actors).
        placement_timeout: seconds Ray has to place the workers (at the start and for each
            replacement) before :class:`~boltzlabs_gym.errors.PlacementTimeout`.
        poll_s, retry_s: the keeper's (how often it asks whether the workers live; how long after a
            failed replacement it tries again).
        **settings: the runner's settings (``max_run_timeout``, ``heartbeat_timeout``,
            ``isolation``...: see :class:`~boltzlabs_gym.code.runner.RunnerSettings`); pools on Ray
            workers default to ``isolation="strict"``.

    :attr:`runner` serves; :meth:`close` stops the keeper, the runner and the workers (and Ray, if
    this object connected it).
    """

    def __init__(
        self,
        *,
        address: str = "auto",
        num_workers: int | None = None,
        lanes_per_worker: int | None = None,
        total_lanes: int = 4,
        cpus_per_worker: float = 1.0,
        placement_timeout: float = 60.0,
        poll_s: float = 1.0,
        retry_s: float = 30.0,
        **settings: Unpack[RunnerSettings],
    ):
        own = sorted(set(settings) & {"lanes", "workers", "lane_workers"})
        if own:
            raise TypeError(f"RayLanes places the lanes itself: {', '.join(own)} cannot be given")
        self.connected_ray = connect_ray(address)
        self.runner: CodeRunner | None = None
        self.keeper: LaneKeeper | None = None
        try:
            if num_workers is None:
                num_workers = len(nodes_with_cpus(cpus_per_worker))
                if num_workers < 1:
                    raise ValueError(
                        f"the Ray cluster has no live node with {cpus_per_worker:g} CPU(s) to place a worker "
                        "on; add nodes, or ask for fewer CPUs per worker (--ray-cpus-per-worker)"
                    )
            if lanes_per_worker is None:
                lanes_per_worker = lanes_per_worker_for(total_lanes, num_workers)
            # Room on each worker for its lanes twice over: lanes put back on a live worker start while
            # the lost ones' sessions still close.
            capacity = 2 * lanes_per_worker * settings.get("envs_per_lane", 4)
            #: The workers, one Ray actor each.
            self.workers = RayWorkers(
                num_workers,
                capacity,
                resources={"CPU": cpus_per_worker},
                address=address,
                placement_timeout=placement_timeout,
            ).start()
            lane_workers = lanes_on_workers(self.workers, lanes_per_worker, self.where)
            #: The runner the server serves.
            placed: RunnerSettings = {**settings, "lane_workers": lane_workers}
            self.runner = CodeRunner(**placed)
            positions = {lane.number: lane.number % num_workers for lane in self.runner.lanes()}
            #: Puts lost lanes back on replacement workers.
            self.keeper = LaneKeeper(
                self.runner, self.workers, positions, where=self.where, poll_s=poll_s, retry_s=retry_s
            ).start()
        except BaseException:
            self.close()
            raise

    def where(self, position: int) -> str:
        """Where worker ``position`` runs: its Ray node (id, shortened, and IP) and address."""
        w = self.workers.workers[position]
        return f"node {(w.node_id or '?')[:12]} ({w.node_ip}) {w.address}"

    def close(self) -> None:
        """Stop the keeper, the runner, the workers; disconnect from Ray if this object connected."""
        if self.keeper is not None:
            self.keeper.close()
        if self.runner is not None:
            self.runner.close()
        workers = getattr(self, "workers", None)
        if workers is not None:
            workers.close()
        if self.connected_ray and ray.is_initialized():
            ray.shutdown()
        self.connected_ray = False

    def __enter__(self) -> RayLanes:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
