""":class:`RayWorkers`: workers placed, started, watched and cleaned up by a Ray cluster."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import ray
import zmq
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from ..errors import PlacementTimeout, WorkerError
from ..wire.keys import ClientKeys, write_client_keys
from .actor import WorkerHost

log = logging.getLogger("boltzlabs_gym.ray")

__all__ = ["RayWorkers", "RayWorker", "StartupTimes"]

STRATEGIES = ("SPREAD", "STRICT_SPREAD", "PACK", "STRICT_PACK")


@dataclass(frozen=True)
class RayWorker:
    """One worker placed by Ray: where it listens, its key, where it runs."""

    address: str
    public_key: bytes
    node_id: str | None
    node_ip: str
    pid: int
    actor_pid: int


@dataclass(frozen=True)
class StartupTimes:
    """Seconds spent bringing the workers up (:attr:`RayWorkers.startup`)."""

    #: ``ray.init``: connecting to the cluster, or starting a local one.
    connect_s: float = 0.0
    #: The placement group (or node-affinity actors) placed.
    placement_s: float = 0.0
    #: The actors created and their workers started, until every worker said READY.
    workers_s: float = 0.0


class RayWorkers:
    """``num_workers`` boltzlabs workers, one Ray actor each, spread over the cluster's nodes.

    >>> from boltzlabs_gym.ray import RayWorkers                               # doctest: +SKIP
    >>> with RayWorkers(num_workers=4, capacity=256) as workers:               # doctest: +SKIP
    ...     pool = RLPool("./envs/code_env", n=1024, workers=workers)           # keys handled
    ...     envs = boltzlabs_gym.make_vec("CartPole-v1", num_envs=512, workers=workers)

    Each actor starts a real ``boltzlabs-gym worker`` on its node, bound to an ephemeral port
    of the node's IP, and returns the address it bound and its CURVE public key. The trainer's
    client key pair is made here, in memory; every worker accepts that key only. Step traffic
    goes over ZeroMQ, trainer to worker; Ray only places and watches the workers.

    Args:
        num_workers: how many workers (actors).
        capacity: env processes (sandboxes) each worker hosts at most.
        resources: Ray resources each actor reserves (default ``{"CPU": 1}``): reserve a
            node's cores for its envs with, say, ``{"CPU": 16}``.
        node_ids: place worker ``i`` on Ray node ``node_ids[i]`` (node affinity, not soft)
            instead of a placement group; ``num_workers`` defaults to its length.
        strategy: the placement group's strategy: ``"SPREAD"`` (default: over distinct nodes
            where there are enough), ``"STRICT_SPREAD"`` (one node each, or pending),
            ``"PACK"``, ``"STRICT_PACK"``.
        address: the Ray cluster (``"auto"``: the running one). Ray already initialised in
            this process is used as it is. With no cluster running, a local one is started,
            and a warning says so.
        placement_timeout: seconds to wait for Ray to place the actors before
            :class:`~boltzlabs_gym.errors.PlacementTimeout` says what was asked and what
            the cluster has.
        start_timeout: seconds each worker has to start.
        worker_args: more ``boltzlabs-gym worker`` options (``["--metrics-port", "0"]``).
        init_kwargs: more ``ray.init`` arguments for a local cluster (``num_cpus``...), used only
            when one is started.
    """

    #: Pools on these workers default to ``isolation="strict"`` (see :class:`~boltzlabs_gym.client.pool.RLPool`):
    #: unsandboxed env code would run as the Ray user, next to Ray's unauthenticated services.
    sandboxed_only = True

    def __init__(
        self,
        num_workers: int | None = None,
        capacity: int = 256,
        *,
        resources: dict[str, float] | None = None,
        node_ids: Sequence[str] | None = None,
        strategy: str = "SPREAD",
        address: str | None = "auto",
        placement_timeout: float = 60.0,
        start_timeout: float = 60.0,
        log_level: str = "WARNING",
        worker_args: Sequence[str] = (),
        init_kwargs: dict[str, Any] | None = None,
    ):
        if num_workers is None:
            num_workers = len(node_ids) if node_ids else 1
        if type(num_workers) is not int or num_workers < 1:
            raise ValueError(f"num_workers must be a positive int, got {num_workers!r}")
        if node_ids is not None and len(node_ids) != num_workers:
            raise ValueError(f"node_ids must name one node per worker ({num_workers}), got {len(node_ids)}")
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        if type(capacity) is not int or capacity < 1:
            raise ValueError(f"capacity must be a positive int, got {capacity!r}")
        self.num_workers = num_workers
        self.capacity = capacity
        self.resources = dict(resources if resources is not None else {"CPU": 1})
        if not any(v > 0 for v in self.resources.values()):
            raise ValueError(f"resources must reserve something (Ray refuses empty bundles), got {self.resources}")
        self.node_ids = list(node_ids) if node_ids is not None else None
        self.strategy = strategy
        self.ray_address = address
        self.placement_timeout = float(placement_timeout)
        self.start_timeout = float(start_timeout)
        self.log_level = log_level
        self.worker_args = list(worker_args)
        self.init_kwargs = dict(init_kwargs or {})
        #: The workers, in the order their envs take in a pool (a replacement keeps its position).
        self.workers: list[RayWorker] = []
        #: Where the start-up time went (see :class:`StartupTimes`).
        self.startup = StartupTimes()
        #: Whether this object started Ray (a local cluster, or ``ray.init``) and shuts it down.
        self.started_ray = False
        self.local_cluster = False
        self._public, self._secret = zmq.curve_keypair()  # the trainer's: the secret stays here
        self._actors: list[Any] = []
        self._pg: Any = None
        self._closed = False
        self._started_once = False

    # ------------------------------------------------------------------ the WorkerSource protocol
    @property
    def addresses(self) -> list[str]:
        """The workers' endpoints, ``tcp://NODE_IP:PORT``, as they bound them."""
        return [w.address for w in self.workers]

    def client_keys(self, address: str) -> ClientKeys:
        """The trainer's in-memory keys, pinned to the worker at ``address``."""
        for w in self.workers:
            if w.address == address:
                return ClientKeys(self._public, self._secret, w.public_key)
        raise KeyError(f"no worker at {address}; workers: {self.addresses}")

    # ------------------------------------------------------------------ start
    def start(self) -> RayWorkers:
        """Connect to Ray (or start it), place the actors and start their workers; idempotent. A
        start that failed (a placement timeout) may be tried again; a closed object may not."""
        if self._closed and self._started_once:
            raise WorkerError("these RayWorkers were closed; make a new RayWorkers to start workers again")
        if self.workers:
            return self
        self._closed = False
        self._started_once = True
        t0 = time.monotonic()
        self._connect()
        t1 = time.monotonic()
        try:
            self._place()
            t2 = time.monotonic()
            self._actors = [self._new_actor(i) for i in range(self.num_workers)]
            infos = self._start_actors(self._actors, list(range(self.num_workers)))
            self.workers = [self._worker(info) for info in infos]
        except BaseException:
            self.close()
            self._started_once = False  # nothing runs: a later start() may try again
            raise
        t3 = time.monotonic()
        self.startup = StartupTimes(connect_s=t1 - t0, placement_s=t2 - t1, workers_s=t3 - t2)
        nodes = len({w.node_id for w in self.workers})
        log.info("%d boltzlabs workers on %d Ray node(s): %s", len(self.workers), nodes, self.addresses)
        return self

    def _connect(self) -> None:
        if ray.is_initialized():
            return
        try:
            ray.init(address=self.ray_address, log_to_driver=False)
        except ConnectionError:
            if self.ray_address not in ("auto", None):
                raise
            log.warning("no running Ray cluster found (address=%r): starting a local one", self.ray_address)
            ray.init(log_to_driver=False, **self.init_kwargs)
            self.local_cluster = True
        self.started_ray = True

    def _place(self) -> None:
        if self.node_ids is not None:
            return  # node affinity: each actor is placed on its node as it is created
        bundles = [dict(self.resources) for _ in range(self.num_workers)]
        self._pg = placement_group(bundles, strategy=self.strategy, name="")
        ready, _ = ray.wait([self._pg.ready()], timeout=self.placement_timeout)
        if not ready:
            asked = f"{self.num_workers} bundle(s) of {self.resources} with strategy {self.strategy}"
            raise self._placement_timeout(f"a placement group of {asked}")

    def _actor_options(self, i: int, soft: bool = False) -> dict:
        resources = dict(self.resources)
        options: dict[str, Any] = {"num_cpus": resources.pop("CPU", 0), "max_restarts": 0}
        if "GPU" in resources:
            options["num_gpus"] = resources.pop("GPU")
        if "memory" in resources:
            options["memory"] = resources.pop("memory")
        if resources:
            options["resources"] = resources
        if self.node_ids is not None:
            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(self.node_ids[i], soft=soft)
        else:
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=i)
        return options

    def _new_actor(self, i: int, soft: bool = False) -> Any:
        actor_class = ray.remote(WorkerHost)
        return actor_class.options(**self._actor_options(i, soft)).remote(
            self._public, self.capacity, self.log_level, self.worker_args
        )

    def _start_actors(self, actors: list, positions: list[int]) -> list[dict]:
        """Start each actor's worker; its info. Actors still pending after the placement timeout
        (node affinity, or a replacement) raise :class:`PlacementTimeout`."""
        refs = [a.start.remote(None, self.start_timeout) for a in actors]
        # Placement first: an actor not yet placed answers nothing (ray.wait does not say why).
        ready, pending = ray.wait(refs, num_returns=len(refs), timeout=self.placement_timeout + self.start_timeout)
        if pending:
            waiting = [positions[refs.index(r)] for r in pending]
            where = f" on nodes {[self.node_ids[i] for i in waiting]}" if self.node_ids is not None else ""
            raise self._placement_timeout(f"actor(s) for worker(s) {waiting} with {self.resources}{where}")
        infos = []
        for ref, position in zip(refs, positions):
            try:
                infos.append(ray.get(ref))
            except ray.exceptions.RayError as exc:
                raise WorkerError(f"Ray worker {position} failed to start: {exc}") from exc
        return infos

    def _placement_timeout(self, asked: str) -> PlacementTimeout:
        cluster = {
            "total": ray.cluster_resources(),
            "available": ray.available_resources(),
            "nodes": [
                {"node_id": n["NodeID"][:12], "ip": n["NodeManagerAddress"], "resources": n["Resources"]}
                for n in ray.nodes()
                if n.get("Alive")
            ],
        }
        message = (
            f"Ray could not place {asked} in time. The cluster has "
            f"{len(cluster['nodes'])} live node(s), in total {_short(cluster['total'])}, available now "
            f"{_short(cluster['available'])}; per node: "
            + "; ".join(f"{n['ip']} {n['node_id']} {_short(n['resources'])}" for n in cluster["nodes"])
            + ". Ask for fewer workers or resources (resources=, num_workers=), a looser strategy "
            "(strategy='SPREAD'), or add nodes."
        )
        return PlacementTimeout(message, asked=asked, cluster=cluster)

    @staticmethod
    def _worker(info: dict) -> RayWorker:
        return RayWorker(
            address=info["address"],
            public_key=info["public_key"],
            node_id=info["node_id"],
            node_ip=info["node_ip"],
            pid=info["pid"],
            actor_pid=info["actor_pid"],
        )

    # ------------------------------------------------------------------ watch and replace
    def dead(self, timeout: float = 5.0) -> list[int]:
        """Positions of the workers whose actor or worker process is gone (a killed actor, a lost node).

        An actor that does not answer within ``timeout`` counts as gone only if its worker does not
        answer a ping either: Ray busy with a lost node can be slow to answer for a healthy actor,
        which :meth:`replace_dead` must not kill."""
        refs = [a.alive.remote() for a in self._actors]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        out, silent = [], []
        for i, ref in enumerate(refs):
            if ref not in ready:
                silent.append(i)
                continue
            try:
                if not ray.get(ref):
                    out.append(i)
            except ray.exceptions.RayError:
                out.append(i)
        if silent:  # neither the actor nor its worker answers: gone
            answers = self._ping_all(silent, timeout)
            out += [i for i in silent if not answers[i]]
        return sorted(out)

    def _link(self, ctx, w: RayWorker, timeout: float):
        """A link to worker ``w`` for one-off calls (no session)."""
        from ..client.link import WorkerLink

        return WorkerLink(
            ctx,
            w.address,
            0,
            0,
            keys=self.client_keys(w.address),
            heartbeat_interval=1.0,
            heartbeat_timeout=timeout,
            send_timeout=timeout,
        )

    def _ping_all(self, positions: list[int], timeout: float) -> dict[int, bool]:
        """Whether each of these workers answers a ping; all are sent at once, with one deadline."""
        ctx = zmq.Context()
        links = {i: self._link(ctx, self.workers[i], timeout) for i in positions}
        answered: dict[int, bool] = {}
        try:
            sent = {}
            for i, link in links.items():
                try:
                    sent[i] = link.send({"op": "ping"})
                except WorkerError:
                    answered[i] = False
            deadline = time.monotonic() + timeout
            for i, seq in sent.items():
                try:
                    header, _ = links[i].recv(seq, max(0.0, deadline - time.monotonic()))
                    answered[i] = bool(header.get("ok"))
                except WorkerError:
                    answered[i] = False
        finally:
            for link in links.values():
                link.close()
            ctx.destroy(linger=0)
        return answered

    def replace_dead(self, timeout: float = 5.0) -> list[str]:
        """Start a new worker in place of each dead one (same position, new address and key); the
        new addresses. A pool given these workers re-creates the lost envs there on its next
        hard reset (``pool.reset(hard=True)``)."""
        dead = self.dead(timeout)
        if not dead:
            return []
        for i in dead:
            try:
                ray.kill(self._actors[i], no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        # A lost node's placement-group bundle is placed again by Ray; node affinity falls back
        # to another node (soft) when the chosen one is gone. Ray may take a few heartbeats to
        # call a node dead, and an actor sent there meanwhile dies unstarted: try again.
        todo = list(dead)
        for attempt in range(3):
            new = {i: self._new_actor(i, soft=True) for i in todo}
            try:
                infos = self._start_actors(list(new.values()), todo)
            except PlacementTimeout:
                # No room for them now: left pending, they would start (and hold a node) whenever room
                # came, in no position; a later replace_dead() makes new ones.
                for actor in new.values():
                    ray.kill(actor, no_restart=True)
                raise
            except WorkerError as exc:
                if attempt == 2 or not isinstance(exc.__cause__, ray.exceptions.ActorDiedError):
                    raise
                log.info("a replacement worker died unstarted (%s); trying again", exc)
                for actor in new.values():
                    ray.kill(actor, no_restart=True)
                time.sleep(1.0 + attempt)
                continue
            for i, info in zip(todo, infos):
                log.warning("worker %d at %s replaced by %s", i, self.workers[i].address, info["address"])
                self._actors[i] = new[i]
                self.workers[i] = self._worker(info)
            break
        return [self.workers[i].address for i in dead]

    # ------------------------------------------------------------------ introspection
    def status(self, timeout: float = 10.0) -> list[dict]:
        """Each worker's ``status`` (the worker's own op), with its node, summarised: ``address``,
        ``node_id``, ``node_ip``, ``envs`` (in all sessions), ``in_use``/``free`` (sandboxes),
        ``pss_bytes`` (envs and templates), ``worker_pss_bytes``, ``isolation`` (the sessions'
        backends) and the whole reply as ``status``; ``error`` for a worker that did not answer."""
        ctx = zmq.Context()
        out = []
        try:
            for w in self.workers:
                row: dict[str, Any] = {"address": w.address, "node_id": w.node_id, "node_ip": w.node_ip}
                link = self._link(ctx, w, timeout)
                try:
                    header = link.call({"op": "status"}, timeout=timeout)
                    sessions = header.get("sessions") or []
                    row.update(
                        envs=sum(int(s.get("envs") or 0) for s in sessions),
                        in_use=header.get("in_use"),
                        free=header.get("free"),
                        pss_bytes=sum(
                            int(s.get("pss_bytes") or 0) + int(s.get("template_pss_bytes") or 0) for s in sessions
                        ),
                        worker_pss_bytes=header.get("worker_pss_bytes"),
                        isolation=sorted({(s.get("isolation") or {}).get("backend", "?") for s in sessions}),
                        status=header,
                    )
                except WorkerError as exc:
                    row["error"] = str(exc)
                finally:
                    link.close()
                out.append(row)
        finally:
            ctx.term()
        return out

    def save_client_keys(self, directory: str) -> dict[str, str]:
        """Write the trainer's keys for ``boltzlabs-gym status ADDRESS --keys DIR``: one
        subdirectory per worker (``DIR/0``, ``DIR/1``...), each with ``client.key_secret``
        (mode 0600) and that worker's ``worker.key``; address -> its directory. Keep them as
        private as the trainer's secret key they hold."""
        import os

        os.makedirs(directory, mode=0o700, exist_ok=True)
        out = {}
        for i, w in enumerate(self.workers):
            path = os.path.join(directory, str(i))
            write_client_keys(path, self.client_keys(w.address))
            out[w.address] = path
        return out

    # ------------------------------------------------------------------ stop
    def close(self, timeout: float = 30.0) -> None:
        """Stop every worker (their envs with them), kill the actors, remove the placement group;
        shut Ray down if this object started it. Idempotent."""
        if self._closed:
            return
        self._closed = True
        actors, self._actors = self._actors, []
        if actors and ray.is_initialized():
            refs = [a.stop.remote() for a in actors]
            ray.wait(refs, num_returns=len(refs), timeout=timeout)
            for a in actors:
                try:
                    ray.kill(a, no_restart=True)
                except Exception:  # noqa: BLE001 - already gone
                    pass
        if self._pg is not None and ray.is_initialized():
            try:
                remove_placement_group(self._pg)
            except Exception:  # noqa: BLE001
                pass
            self._pg = None
        self.workers = []
        if self.started_ray and ray.is_initialized():
            ray.shutdown()

    def __enter__(self) -> RayWorkers:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RayWorkers(num_workers={self.num_workers}, capacity={self.capacity}, addresses={self.addresses})"

    def __reduce__(self):
        # It holds the trainer's CURVE secret key: pickled into a Ray task, an RLlib env_config or a
        # Gymnasium EnvSpec, it would land in Ray's object store or a log.
        raise TypeError(
            "RayWorkers holds the trainer's secret key and cannot be pickled; pass it to RLPool/make_vec "
            "in the process that made it, and give other processes keys saved with save_client_keys()"
        )


def _short(resources: dict) -> str:
    internal = ("node:", "bundle_group", "accelerator_type")
    keep = {k: v for k, v in resources.items() if not k.startswith(internal) and "_group_" not in k}
    return (
        "{" + ", ".join(f"{k}: {v:g}" if isinstance(v, float) else f"{k}: {v}" for k, v in sorted(keep.items())) + "}"
    )
