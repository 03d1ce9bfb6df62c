"""RLPool: the trainer-side client of one or more workers.

>>> from boltzlabs_gym import RLPool                              # doctest: +SKIP
>>> with RLPool("./envs/counter", n=64) as pool:                  # doctest: +SKIP
...     obs = pool.reset(seed=0)
...     obs, rewards, dones, infos = pool.step([1] * 64)
...     if dones.any():
...         obs = pool.reset(where=dones)
...     print(pool.timing, pool.envs_per_gb())

One request per worker carries all of that worker's actions; replies are spliced
back into index order. Without ``workers=`` the pool starts its own worker as a
child process on an ``ipc://`` socket, the same code path a remote worker uses.

This module is the public API; the pool is made of parts that live beside it, each owned by it:
:mod:`~boltzlabs_gym.client.link` (one worker connection: requests, replies, heartbeats, errors, the
local worker process), :mod:`~boltzlabs_gym.client.routes` (how a batch reaches the envs: one worker,
several, or the direct lane; :mod:`~boltzlabs_gym.client.sandbox_route` for several envs per sandbox),
:mod:`~boltzlabs_gym.client.batch_calls` (the call in flight, its timing and books),
:mod:`~boltzlabs_gym.client.snapshot_keeper` (snapshot, restore, fork),
:mod:`~boltzlabs_gym.client.sources` (a lost worker's envs re-created on its replacement),
:mod:`~boltzlabs_gym.client.startup` (its worker or the capacity split, archive upload, sessions),
:mod:`~boltzlabs_gym.client.options` (its settings, checked) and
:mod:`~boltzlabs_gym.client.arguments` (each call's actions, masks and seeds, checked).
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import warnings
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np
import zmq
from typing_extensions import Unpack

from ..errors import AsyncStateError
from ..wire.archive import pack_dir
from ..wire.limits import IsolationReport
from ..wire.protocol import ERROR, OK, STRAGGLER, jsonable
from .arguments import check_actions, check_mask, check_seeds
from .async_steps import AsyncSteps, Received, plain_items, read_received
from .batch_calls import BatchCalls
from .cancels import CallCanceller
from .link import WorkerLink
from .options import MODES, PoolOptions, PoolSettings
from .results import EnvResult, parse_result, read_reset, read_step
from .routes import Route, SplitRoute, route_losses
from .sandbox_replies import SandboxLayout
from .sandbox_route import SandboxRoute
from .snapshot import Snapshot
from .snapshot_keeper import SnapshotKeeper
from .sources import SourceTracker, WorkerSource, client_keys_from, worker_addresses
from .startup import close_sessions, open_route, open_sessions
from .stats import PoolStats, measure_pss
from .timing import Timing

__all__ = ["ERROR", "MODES", "OK", "STRAGGLER", "EnvResult", "RLPool", "parse_result"]

log = logging.getLogger("boltzlabs_gym.client.pool")


class RLPool:
    """A pool of ``n`` resident, sandboxed env processes behind one batched call.

    Args:
        env_dir: an env directory whose ``env.py`` calls :func:`boltzlabs_gym.env.serve`.
        n: number of envs.
        workers: worker addresses (``tcp://host:port``); default: start a local worker.
            Envs are split across workers by their free capacity, or by ``split``. Or a
            :class:`~boltzlabs_gym.client.sources.WorkerSource` (``boltzlabs_gym.ray.RayWorkers``):
            workers placed for you, with their addresses and keys.
        options: the pool's settings, a :class:`~boltzlabs_gym.client.options.PoolOptions`.
        **settings: any field of :class:`~boltzlabs_gym.client.options.PoolOptions` as a keyword
            (``step_timeout=5``, ``mode="boltz"``, ...), over the field of ``options``; an unknown
            name raises ``TypeError``. :attr:`options` holds what the pool runs with.
    """

    def __init__(
        self,
        env_dir: str | os.PathLike,
        n: int,
        *,
        workers: Sequence[str] | WorkerSource | None = None,
        options: PoolOptions | None = None,
        **settings: Unpack[PoolSettings],
    ):
        options = PoolOptions.fold(options, settings)
        source, addresses = worker_addresses(workers, options.keys)
        #: Every setting this pool runs with (a :class:`~boltzlabs_gym.client.options.PoolOptions`,
        #: checked against its workers, ``worker_loss`` and ``isolation`` resolved for them).
        self.options = options = options.placed(n, addresses, source=source)
        self.n = n
        self.env_dir = os.fspath(env_dir)
        # The settings the pool's parts and adapters read most, as attributes of their own.
        self.envs_per_sandbox, self.start_timeout = options.envs_per_sandbox, options.start_timeout
        self.step_timeout, self.reset_timeout = options.step_timeout, options.reset_timeout
        self.busy_poll_us, self.env_aslr = options.busy_poll_us, options.env_aslr
        self.worker_loss = str(options.worker_loss)
        #: Which sandbox and slot each env has (one env per sandbox unless ``envs_per_sandbox`` > 1).
        self.layout = SandboxLayout(n, self.envs_per_sandbox)
        self.isolation: IsolationReport | None = None
        self.reset_infos: list[dict] = [{} for _ in range(n)]
        #: PSS in bytes of the boltz-mode templates, as of the last :meth:`memory` call.
        self.template_pss = 0
        #: Bytes of snapshots this pool's sessions hold, as of the last :meth:`memory` call.
        self.snapshot_bytes = 0
        #: (envs started, n): (n, n) once started; while it starts, a bar shows the count on a terminal.
        self.start_progress = (0, n)
        #: Where the local worker serves ``/metrics`` (``metrics_port``); ``None``: nowhere.
        self.metrics_url: str | None = None
        #: The pool's batched calls: the one in flight, its timing and books (adapters send and read
        #: blocks of envs through it: see :mod:`~boltzlabs_gym.client.batch_calls`).
        self.batch_calls = BatchCalls(n, self.start_timeout + max(self.step_timeout, self.reset_timeout) + 30.0)
        self._seq = itertools.count(1)  # request tags, shared by every link
        self._links: list[WorkerLink] = []
        self.batch_calls.links = self._links
        self._route: Route | None = None  # how batches reach the workers, chosen at start-up
        self._last_obs: list = [None] * n
        self._ctx = zmq.Context()
        self._finalizer = weakref.finalize(self, RLPool._finalize, self._ctx, self._links)
        self._sources: SourceTracker | None = None
        # What every link to a worker is opened with, but its address, envs and keys.
        link_options = {"seq": self._seq, "heartbeat_interval": options.heartbeat_interval}
        link_options["heartbeat_timeout"] = options.heartbeat_timeout
        try:
            if source is not None:
                # Workers given whole (``workers=RayWorkers(...)``): a lost one's envs go to its replacement.
                tracked = dict(link_options, send_timeout=options.heartbeat_timeout)
                self._sources = SourceTracker(source, addresses or (), self._ctx, **tracked)
            archive, digest = pack_dir(self.env_dir)
            #: The env directory's content hash: snapshots restore only into envs of the same one.
            self.archive_hash = digest
            keys = client_keys_from(options.keys, source, addresses or ())
            config = options.worker_config(remote=bool(addresses))
            self._route = route = open_route(
                self._ctx, self._links, addresses, keys, config.flags, self.layout, options, link_options
            )
            # Several envs per sandbox: per-env items go out as one sandbox item per sandbox (the
            # deadline of a mixed sandbox request: see protocol.SANDBOX_DEADLINE).
            k, mixed_deadline = self.envs_per_sandbox, self.step_timeout + self.reset_timeout
            self.batch_calls.route = route if k == 1 else SandboxRoute(route, self.layout, mixed_deadline)
            #: The pool's snapshots (:meth:`snapshot`, :meth:`restore` and :meth:`fork` are its work;
            #: adapters that decode observations themselves use it: see :mod:`~boltzlabs_gym.client.snapshot_keeper`).
            self.snapshot_keeper = SnapshotKeeper(
                self._links,
                self.batch_calls,
                n=n,
                envs_per_sandbox=self.envs_per_sandbox,
                archive_hash=digest,
                lost=functools.partial(route_losses, self._route),
            )
            # Kept to re-create a lost worker's envs on its replacement (see SourceTracker); it
            # holds no reference to the pool, whose finalizer must not wait for a cycle collection.
            session, start_timeout = config.session, options.start_timeout
            self._open_sessions = lambda links: open_sessions(links, archive, digest, session, n, start_timeout, k)
            self.isolation = self._open_sessions(self._links)
            self.start_progress = (n, n)
            if options.metrics_port is not None:
                self.metrics_url = self._links[0].call({"op": "status"}, timeout=30.0).get("metrics")
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ batched calls
    def batch_async(self, items: Sequence[tuple[int, dict, Sequence[bytes]]]) -> None:
        """Send one request per worker carrying ``items``: ``(index, op, payload_frames)``.

        The low-level call that ``step``/``reset`` and the adapters are built on.
        """
        self.batch_calls.send(items)

    def batch_wait(self, timeout: float | None = None, *, raw: bool = False) -> list:
        """Collect the replies of :meth:`batch_async`, in the order of its items.

        ``raw=True`` leaves each reply line unparsed (``EnvResult.raw``), for a caller with
        a faster parser of its own; :func:`parse_result` parses one.
        """
        return self.batch_calls.wait(timeout, raw)

    @property
    def timing(self) -> Timing:
        """Where the time of the last batched call went, and running counts (a
        :class:`~boltzlabs_gym.client.timing.Timing`)."""
        return self.batch_calls.timing

    def call_envs(
        self, op: dict, indices: Sequence[int] | None = None, timeout: float | None = None
    ) -> list[EnvResult]:
        """Send the same op to several envs (e.g. ``{"op": "describe"}``) and wait."""
        indices = range(self.n) if indices is None else indices
        self.batch_async([(int(i), op, ()) for i in indices])
        return self.batch_wait(timeout)

    # ------------------------------------------------------------------ the JSON pool API
    def step_async(self, actions: Sequence[Any]) -> None:
        """Send one step to every env; collect with :meth:`step_wait`."""
        self.batch_calls.check_open()
        actions = check_actions(actions, self.n)
        self.batch_async([(i, {"op": "step", "action": a}, ()) for i, a in enumerate(actions)])

    def step_wait(self, timeout: float | None = None):
        """Return ``(obs, rewards, dones, infos)`` for the step sent by :meth:`step_async`.

        ``obs`` and ``infos`` are lists in index order, ``rewards`` ``np.float32[n]``,
        ``dones`` ``np.bool_[n]``. A straggler's or crashed env's slot holds obs
        ``None``, reward 0, done True (its episode is truncated) and
        ``info["boltzlabs_straggler"]`` or ``info["boltzlabs_error"]``, as described in
        :mod:`boltzlabs_gym.client.results`.
        """
        results = self.batch_wait(timeout)
        obs = [None] * self.n
        rewards = np.zeros(self.n, dtype=np.float32)
        dones = np.ones(self.n, dtype=np.bool_)
        infos: list[dict] = [{} for _ in range(self.n)]
        for r in results:
            t = read_step(r, self.step_timeout)
            obs[r.index], rewards[r.index], dones[r.index], infos[r.index] = (
                t.obs,
                t.reward,
                t.terminated or t.truncated,
                t.info,
            )
        self._last_obs = obs
        return obs, rewards, dones, infos

    def step(self, actions: Sequence[Any]):
        """Step every env with its action; see :meth:`step_wait` for what comes back."""
        self.step_async(actions)
        return self.step_wait()

    # ------------------------------------------------------------------ envs that don't wait for each other
    def send(
        self,
        actions: Sequence[Any] | None = None,
        env_ids: Sequence[int] | np.ndarray | None = None,
        *,
        reset: bool = False,
        seed: int | Sequence[int | None] | None = None,
        options: dict | None = None,
    ) -> None:
        """Start a step (one action per env id) or, with ``reset=True``, a reset on each env of
        ``env_ids`` (default: all), and return at once; collect with :meth:`recv`.

        Envs step on their own: each env of a send may be received before the others finish,
        and other envs may be sent meanwhile. Refused, nothing sent, for an env id that is not
        one, named twice, or still in flight (:class:`~boltzlabs_gym.errors.AsyncStateError`
        naming it), and while a lockstep call is in flight. A reset ``seed`` int gives env ``i``
        ``seed + i``; a list gives one per env id. See :mod:`boltzlabs_gym.client.async_steps`.

        >>> pool.send([1, 0], env_ids=[3, 5])                  # doctest: +SKIP
        >>> got = pool.recv(batch_size=1)                        # doctest: +SKIP
        >>> got.env_ids, got.rewards                             # doctest: +SKIP
        (array([5]), array([1.], dtype=float32))
        """
        self.async_steps.send(plain_items(self.n, actions, env_ids, reset, seed, options))

    def recv(self, batch_size: int | None = None, timeout: float | None = None) -> Received:
        """The results of the first ``batch_size`` envs to finish what :meth:`send` started
        (default: every env in flight), in finishing order, as a
        :class:`~boltzlabs_gym.client.async_steps.Received` ``(env_ids, obs, rewards, dones, infos)``.

        A straggler or crashed env comes back as from :meth:`step` (obs ``None``, done, the
        failure in its info); so does, with ``worker_loss="report"``, an env of a lost worker
        (otherwise its loss raises :class:`~boltzlabs_gym.errors.WorkerLost`). Waits up to
        ``timeout`` seconds (default: the longest deadline), then raises
        :class:`~boltzlabs_gym.errors.WorkerTimeout`, with nothing lost. Raises
        :class:`~boltzlabs_gym.errors.AsyncStateError` with nothing in flight and ``ValueError``
        for a ``batch_size`` larger than what is in flight.
        """
        received = read_received(self.async_steps.recv(batch_size, timeout), self.step_timeout, self.reset_timeout)
        for k, index in enumerate(received.env_ids):
            self._last_obs[index] = received.obs[k]
        return received

    @functools.cached_property
    def async_steps(self) -> AsyncSteps:
        """The pool's calls that don't wait for each other (:meth:`send`/:meth:`recv`, the vector
        env's and :mod:`boltzlabs_gym.aio`'s): see :mod:`~boltzlabs_gym.client.async_steps`."""
        sandboxed = self.batch_calls.route if isinstance(self.batch_calls.route, SandboxRoute) else None
        route = self._route
        losses = route if isinstance(route, SplitRoute) and route.report_loss else None
        return AsyncSteps(
            self._links,
            self.batch_calls,
            self.n,
            sandboxed=sandboxed,
            default_timeout=self.batch_calls.default_timeout,
            losses=losses,
        )

    @functools.cached_property
    def cancels(self) -> CallCanceller:
        """Cancels tagged calls in flight from any thread (its own connection to each worker):
        see :mod:`~boltzlabs_gym.client.cancels`."""
        return CallCanceller(self._links)

    def reset(
        self,
        seed: int | Sequence[int | None] | None = None,
        where: Sequence[bool] | np.ndarray | None = None,
        hard: bool = False,
        options: dict | None = None,
    ) -> list:
        """Reset the envs selected by ``where`` (all by default) and return all ``n`` observations.

        ``seed``: an int gives env ``i`` the seed ``seed + i``; a list gives one seed
        per env. ``hard=True`` kills each selected env's process tree, wipes its
        workspace and starts it afresh (byte-identical start); with ``envs_per_sandbox``
        > 1 that restarts every env of its sandbox, and the unselected ones come back
        reset too (seed ``None``, ``reset_infos[i]["boltzlabs_restarted"]`` says why).
        Other unselected envs keep their last observation in their slot. Per-env reset
        infos land in :attr:`reset_infos`.
        """
        self.batch_calls.check_open()
        mask = check_mask(where, self.n)
        seeds = check_seeds(seed, self.n)
        op_name = "hard_reset" if hard else "reset"
        widened = self._widen_to_sandboxes(mask) if hard and self.envs_per_sandbox > 1 else mask
        # Envs of a lost worker re-created on its replacement: fresh, so a plain reset starts them.
        fresh = self._replace_lost_workers() if hard else None
        if fresh is not None:
            widened = widened | fresh
        items = []
        for i in np.flatnonzero(widened):
            name = "reset" if fresh is not None and fresh[i] else op_name
            op = {"op": name, "seed": seeds[i] if mask[i] else None}
            if options and mask[i]:  # a neighbour restarted with it comes back plainly reset
                op["options"] = jsonable(options)
            items.append((int(i), op, ()))
        if not items:
            return list(self._last_obs)
        self.batch_async(items)
        results = self.batch_wait()
        obs = self._store_resets(results, self.start_timeout if hard else self.reset_timeout)
        for r in results:
            if not mask[r.index]:
                self.reset_infos[r.index]["boltzlabs_restarted"] = (
                    "its worker was lost and replaced"
                    if fresh is not None and fresh[r.index]
                    else "its sandbox was restarted by a neighbour's hard reset"
                )
        return obs

    def _store_resets(self, results: list[EnvResult], deadline_s: float) -> list:
        """Every env's observation after a reset of some: theirs from ``results`` (their infos into
        :attr:`reset_infos`), the others' unchanged."""
        obs = list(self._last_obs)
        for r in results:
            obs[r.index], self.reset_infos[r.index], _ = read_reset(r, deadline_s)
        self._last_obs = obs
        return obs

    def _widen_to_sandboxes(self, mask: np.ndarray) -> np.ndarray:
        """A hard reset restarts whole sandboxes: ``mask`` grown to every env of a sandbox it touches."""
        k = self.envs_per_sandbox
        touched = np.zeros(self.layout.sandboxes * k, dtype=bool)
        touched[: self.n] = mask
        return np.repeat(touched.reshape(-1, k).any(axis=1), k)[: self.n]

    def _replace_lost_workers(self) -> np.ndarray | None:
        """Re-create the envs of every lost worker that its source has replaced (see
        :class:`~boltzlabs_gym.client.sources.SourceTracker`); the envs re-created (``None``: none)."""
        if self._sources is None:
            return None
        return self._sources.replace_lost(self._route, self._links, self._open_sessions, self.n)

    @property
    def lost_workers(self) -> dict[str, str]:
        """Remote workers found lost (``worker_loss="report"``), with why; empty when all are well."""
        return route_losses(self._route)

    # ------------------------------------------------------------------ snapshots
    def snapshot(self, index: int, *, kind: str = "auto", meta: dict | None = None) -> Snapshot:
        """Env ``index``'s full state now (its env, its random generators, its workspace's files),
        held by its worker; restore it with :meth:`restore` or branch with :meth:`fork`.

        ``kind`` (reported as :attr:`Snapshot.kind <boltzlabs_gym.client.snapshot.Snapshot.kind>`):

        * ``"memory"``: the env process itself is held (a fork of it, sharing its memory
          copy-on-write); each restore forks a copy of it in a new sandbox of its own. For
          ``mode="boltz"`` pools with the namespaces backend, single-threaded envs alone in
          their sandbox with no open files; it cannot leave its worker (no save, no move).
        * ``"portable"``: the env writes its state as a blob (pickled inside its sandbox), which
          can be saved and moved between workers and is loaded into the target slot's process.
        * ``"auto"`` (default): memory where the env can take it, else portable.

        The env is not changed. Refused (:class:`~boltzlabs_gym.errors.SnapshotError`) for an env
        that no reset or restore started since its process was (re)started (a straggler, a crash or
        a hard reset took its state), with
        ``envs_per_sandbox`` > 1, over the worker's snapshot budget, or when the env cannot be
        pickled (the message says which hooks to add). ``meta`` travels with the snapshot.

        >>> with RLPool("./envs/counter", n=4) as pool:          # doctest: +SKIP
        ...     pool.reset(seed=0)
        ...     snap = pool.snapshot(0)
        ...     pool.step([1, 1, 1, 1])
        ...     obs = pool.restore(snap, where=[2, 3])           # envs 2 and 3: env 0 before its step
        """
        return self.snapshot_keeper.take(index, kind=kind, meta=meta)

    def restore(
        self,
        snap: Snapshot,
        where: Sequence[int] | np.ndarray,
        *,
        reseed: Sequence[int] | None = None,
        fresh: bool = False,
    ) -> list:
        """Make the envs ``where`` (indices, or a boolean mask) exact copies of ``snap``; all ``n``
        observations come back, as from :meth:`reset` (the others unchanged in their slots).

        Each copy gets the snapshot's env, generators and workspace files in its own sandbox, so
        stepping it with the source's actions gives the source's observations, rewards and infos.
        ``reseed`` (one non-negative int per env of ``where``) gives each copy random streams of
        its own instead. A snapshot held by another worker, or loaded from a file, is moved there
        first (portable snapshots only). Refused, with nothing changed, for a released snapshot,
        one of another env directory, or bad indices; an env whose restore fails reports it in
        :attr:`reset_infos` like a failed reset.

        A memory snapshot's copy is always a new process, forked from the held one, in a new
        sandbox. A portable copy is loaded into the process its slot already has (a millisecond):
        what the state does not carry (child processes, files under ``/tmp``, module globals the
        env does not reach) stays that process's own; ``fresh=True`` hard-resets each slot first,
        so every copy starts in a new process in a new sandbox (a hard reset's cost, see the README).
        """
        results = self.snapshot_keeper.restore(snap, where, reseed=reseed, fresh=fresh)
        return self._store_resets(results, self.reset_timeout)

    def fork(
        self,
        index: int,
        into: Sequence[int] | np.ndarray,
        *,
        reseed: Sequence[int] | None = None,
        fresh: bool = False,
        kind: str = "auto",
    ) -> list:
        """Branch env ``index``'s current state into the envs ``into``: :meth:`snapshot` (of
        ``kind``), then :meth:`restore` (with ``reseed`` and ``fresh``), then release. Returns all
        ``n`` observations.

        >>> obs = pool.fork(0, into=[1, 2, 3], reseed=[11, 12, 13])   # doctest: +SKIP
        """
        results = self.snapshot_keeper.fork(index, into, reseed=reseed, fresh=fresh, kind=kind)
        return self._store_resets(results, self.reset_timeout)

    # ------------------------------------------------------------------ introspection
    def memory(self) -> list[int]:
        """PSS in bytes of each env's whole process tree, in index order.

        With ``envs_per_sandbox`` > 1 the envs of a sandbox share one process tree: each is
        given an equal share of its PSS.

        In ``mode="boltz"`` the pages envs share with their template are split between
        them by PSS; the template's own share is :attr:`template_pss` after this call, and the
        bytes of the snapshots the pool holds :attr:`snapshot_bytes`.
        """
        self.batch_calls.check_open()
        report = measure_pss(self._links, self.layout, self.lost_workers)
        self.template_pss = report.template_bytes
        self.snapshot_bytes = report.snapshot_bytes
        return report.per_env

    def stats(self, memory: bool = True) -> PoolStats:
        """One frozen snapshot of this pool's figures (see :class:`~boltzlabs_gym.client.stats.PoolStats`):
        env calls and their rate, batch latency p50/p99, stragglers and errors (in total and in
        the last minute), isolation, and, with ``memory`` (a request to each worker), PSS and
        envs per GiB. A local pool also brings its worker's books up to date with the steps
        taken on its direct lane, so that ``boltzlabs-gym top`` shows the same counts."""
        self.batch_calls.check_open()
        if self.batch_calls.in_flight:
            raise AsyncStateError("stats() while a call is in flight; collect it with step_wait() first")
        flush = getattr(self._route, "flush_report", None)
        if flush is not None:
            flush()
        pss = envs_per_gib = None
        if memory:
            pss = sum(self.memory()) + self.template_pss + self.snapshot_bytes
            envs_per_gib = self.n / (pss / 2**30) if pss else None
        return self.batch_calls.recorder.snapshot(
            n=self.n,
            envs_per_sandbox=self.envs_per_sandbox,
            workers=tuple(self.workers),
            isolation=None if self.isolation is None else self.isolation.backend,
            pss_bytes=pss,
            envs_per_gib=envs_per_gib,
            metrics_url=self.metrics_url,
        )

    def envs_per_gb(self) -> float:
        """How many envs fit in one GiB: their PSS, plus the boltz templates' (shared pages split honestly)
        and the snapshots the pool holds."""
        total = sum(self.memory()) + self.template_pss + self.snapshot_bytes
        return self.n / (total / 2**30) if total else float("inf")

    @property
    def closed(self) -> bool:
        return self.batch_calls.closed

    @property
    def workers(self) -> list[str]:
        """The worker addresses, in the order their envs appear in the batch."""
        return [link.address for link in self._links]

    @property
    def uploads(self) -> dict[str, bool]:
        """Per worker: whether this pool had to upload the env archive (False: cached by hash)."""
        return {link.address: link.uploaded for link in self._links}

    # ------------------------------------------------------------------ shutdown
    def close(self) -> None:
        """Stop every env and (for a local pool) the worker; idempotent and bounded."""
        if self.batch_calls.closed:
            return
        self.batch_calls.closed = True
        if "async_steps" in self.__dict__:
            dropped = self.async_steps.drop()
            if dropped:
                warnings.warn(
                    f"RLPool closed with {len(dropped)} envs' send() calls not received (env ids "
                    f"{dropped[:8]}{' ...' if len(dropped) > 8 else ''}); their results are dropped",
                    RuntimeWarning,
                    stacklevel=2,
                )
        if "cancels" in self.__dict__:
            self.cancels.close()
        close_sessions(self._links, self.lost_workers)
        self._finalizer()

    @staticmethod
    def _finalize(ctx: zmq.Context, links: list) -> None:
        for link in links:
            link.close()  # a local worker's link also stops the worker
        ctx.term()

    def __enter__(self) -> RLPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{len(self._links)} worker(s)"
        return f"RLPool({self.env_dir!r}, n={self.n}, {state})"
