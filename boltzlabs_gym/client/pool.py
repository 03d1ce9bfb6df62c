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

This module is the public API; the transport lives beside it: :mod:`~boltzlabs_gym.client.link`
(one worker connection: requests, replies, heartbeats, errors, the local worker process),
:mod:`~boltzlabs_gym.client.routes` (how a batch reaches the envs: one worker, several, or the
direct lane) and :mod:`~boltzlabs_gym.client.startup` (capacity split, archive upload, sessions).
"""

from __future__ import annotations

import itertools
import logging
import os
import time
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import zmq

from ..errors import AsyncStateError, PoolClosedError, SnapshotError, WorkerError
from ..wire.archive import pack_dir
from ..wire.keys import ClientKeys
from ..wire.limits import IsolationReport, Limits
from ..wire.protocol import DEFAULT_BUSY_POLL_US, ERROR, MEMORY, OK, SNAPSHOT_KINDS, STRAGGLER, check_poll_us, jsonable
from .grouping import GroupPlan, GroupResult, SandboxLayout, check_envs_per_sandbox, pack, pack_steps
from .link import WorkerLink, start_local_worker
from .results import EnvResult, parse_result, read_reset, read_step
from .routes import LaneRoute, Route, SplitRoute, WorkerRoute, lane_possible
from .snapshot import Snapshot
from .sources import WorkerSource, client_keys_from, reopen_lost, worker_addresses
from .startup import connect_workers, open_sessions
from .stats import PoolRecorder, PoolStats
from .timing import Timing

__all__ = ["ERROR", "OK", "STRAGGLER", "EnvResult", "RLPool", "parse_result"]

MODES = ("default", "boltz")


log = logging.getLogger("boltzlabs_gym.client.pool")


def _reason(r: EnvResult) -> str:
    """Why an env's snapshot call gave no snapshot: the worker's or the env's own words."""
    reply = r.reply if isinstance(r.reply, dict) else {}
    message = reply.get("message") or reply.get("error") or f"unexpected reply {str(reply)[:200]}"
    return f"{r.status}: {message}"


class RLPool:
    """A pool of ``n`` resident, sandboxed env processes behind one batched call.

    Args:
        env_dir: an env directory whose ``env.py`` calls :func:`boltzlabs_gym.env.serve`.
        n: number of envs.
        workers: worker addresses (``tcp://host:port``); default: start a local worker.
            Envs are split across workers by their free capacity, or by ``split``. Or a
            :class:`~boltzlabs_gym.client.sources.WorkerSource` (``boltzlabs_gym.ray.RayWorkers``):
            workers placed for you, with their addresses and keys.
        keys: CURVE key directory (``boltzlabs-gym keygen``) for authenticated workers, or
            :class:`~boltzlabs_gym.wire.keys.ClientKeys` held in memory (a source brings its own).
        split: explicit number of envs per worker (same order as ``workers``).
        heartbeat_timeout: seconds of silence after which a worker counts as dead or
            unreachable (the pool pings it every ``heartbeat_interval`` while waiting).
        lease: seconds a remote worker keeps this pool's envs without hearing from it.
        isolation: ``"auto"`` (best available, warns on fallback), ``"strict"`` (refuse to
            run without a real sandbox), or a backend name (``"namespaces"``, ``"bwrap"``,
            ``"process"``).
        mode: ``"default"``: one fresh interpreter per env; ``"boltz"``: every env is
            forked from a warm template process that imported the env once (denser
            pools, faster hard resets). No fallback between the two.
        step_timeout: per-step deadline in seconds; an env that misses it is killed and
            reported as a straggler (``info["boltzlabs_straggler"]``).
        reset_timeout: deadline for resets and other calls.
        start_timeout: deadline for an env's interpreter start plus its first request (a
            ``describe``; a hard reset's seeded reset).
        limits: per-env :class:`~boltzlabs_gym.Limits` (memory, processes, files, ...).
        serialize_measurement: run one env step at a time per worker host (for rewards
            that are timings); resets stay concurrent.
        env_vars: extra environment variables for every env process.
        busy_poll_us: microseconds a local pool's worker keeps polling, awake, for the next
            request after answering one, when the previous one came at least that fast (it
            saves a wake-up per batch: 30-60 us in a VM); 0 always sleeps. Remote workers
            always sleep.
        env_aslr: give every env interpreter a randomized address-space layout. Off by
            default: envs then share one layout, as forked envs (boltz mode,
            AsyncVectorEnv, SubprocVecEnv) always do, and the CPU's branch predictors
            and caches carry over from env to env (about 30% less CPU per CartPole step
            with 64 fresh interpreters on a 2-vCPU VM). Inside a sandbox that runs
            untrusted code anyway the randomization guards nothing outside it; the
            worker and the trainer keep theirs. In boltz mode it applies to the template,
            whose layout every forked env shares.
        direct: let a local pool step idle envs on their own pipes (lent by its worker,
            see :mod:`boltzlabs_gym.client.direct_lane`) instead of through the worker: one process hop
            less per step, same limits, deadlines and failure reports. ``False`` sends
            everything through the worker, as remote pools always do.
        envs_per_sandbox: how many envs share one sandboxed process (default 1: every env
            in its own). With K > 1 env ``i`` is slot ``i % K`` of sandbox ``i // K``: one
            request and one reply per sandbox per batch, array observations in one block
            (much faster for cheap envs), but the K envs of a sandbox share its memory, files
            and fate: a crash or a missed deadline restarts all of them, and ``step_timeout``
            covers the sandbox's K steps, served one after another. Limits (memory,
            processes) apply per sandbox. Keep K = 1 for untrusted code; see
            :mod:`boltzlabs_gym.client.grouping` and the README's failure table. Env directories must
            serve independent instances (``serve(factory=...)``) for K > 1.
        metrics_port: serve the local worker's Prometheus ``/metrics`` on this port of
            127.0.0.1 (0: a free one; :attr:`metrics_url` says where). Needs the ``metrics``
            extra. Remote workers serve their own (``boltzlabs-gym worker --metrics-port``).
        snapshot_budget: bytes of env snapshots the local worker holds (default 1 GiB; see
            :meth:`snapshot`). Remote workers have their own (``boltzlabs-gym worker --snapshot-budget``).
        worker_loss: what a remote worker lost past ``heartbeat_timeout`` does to a call:
            ``"raise"`` a :class:`~boltzlabs_gym.WorkerError`, or ``"report"`` its envs'
            results as errors in their slots (truncated episodes, ``info["boltzlabs_error"]``)
            until a hard reset re-creates them on the worker that took its place in a
            :class:`~boltzlabs_gym.client.sources.WorkerSource` (:attr:`lost_workers` lists the lost).
            Default: ``"report"`` for a source, ``"raise"`` otherwise. ``"report"`` needs
            ``envs_per_sandbox=1``.
    """

    def __init__(
        self,
        env_dir: str | os.PathLike,
        n: int,
        *,
        workers: Sequence[str] | WorkerSource | None = None,
        isolation: str = "auto",
        mode: str = "default",
        step_timeout: float = 30.0,
        reset_timeout: float = 60.0,
        start_timeout: float = 120.0,
        limits: Limits | None = None,
        serialize_measurement: bool = False,
        env_vars: dict[str, str] | None = None,
        keys: str | os.PathLike | ClientKeys | None = None,
        split: Sequence[int] | None = None,
        heartbeat_interval: float = 1.0,
        heartbeat_timeout: float = 10.0,
        lease: float = 600.0,
        busy_poll_us: float = DEFAULT_BUSY_POLL_US,
        env_aslr: bool = False,
        direct: bool = True,
        envs_per_sandbox: int = 1,
        metrics_port: int | None = None,
        snapshot_budget: int | None = None,
        worker_loss: str | None = None,
    ):
        if type(n) is not int or n < 1:
            raise ValueError(f"n must be a positive int, got {n!r}")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        timeouts = (("step_timeout", step_timeout), ("reset_timeout", reset_timeout), ("start_timeout", start_timeout))
        for name, value in timeouts:
            if not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        busy_poll_us = check_poll_us("busy_poll_us", busy_poll_us)
        if not isinstance(env_aslr, bool):
            raise ValueError(f"env_aslr must be True or False, got {env_aslr!r}")
        if not isinstance(direct, bool):
            raise ValueError(f"direct must be True or False, got {direct!r}")
        self.direct = direct
        self.envs_per_sandbox = check_envs_per_sandbox(envs_per_sandbox)
        #: Where the workers came from, when given whole (``workers=RayWorkers(...)``), and their addresses.
        self._source, addresses = worker_addresses(workers, keys)
        if isolation == "auto" and getattr(self._source, "sandboxed_only", False):
            # Workers in a Ray cluster: an env without a sandbox would run as the Ray user, with the
            # network (Ray's unauthenticated GCS and dashboard) and Ray's files in reach.
            isolation = "strict"
        #: A source's worker addresses -> their positions in it (a replacement takes the same).
        self._source_positions = {a: i for i, a in enumerate(addresses or ()) if self._source is not None}
        #: Position -> the public key of the worker there when its link was made: a replacement that
        #: happens to bind the same address is told apart by its key.
        self._source_keys = {i: self._worker_key(a) for a, i in self._source_positions.items()}
        if worker_loss not in (None, "raise", "report"):
            raise ValueError(f"worker_loss must be 'raise' or 'report', got {worker_loss!r}")
        if worker_loss == "report" and (not addresses or envs_per_sandbox != 1):
            raise ValueError("worker_loss='report' is for remote workers with envs_per_sandbox=1")
        default_loss = "report" if self._source is not None and envs_per_sandbox == 1 else "raise"
        self.worker_loss = worker_loss or default_loss
        #: Which sandbox and slot each env has (one env per sandbox unless ``envs_per_sandbox`` > 1).
        self.layout = SandboxLayout(n, self.envs_per_sandbox)
        if heartbeat_interval <= 0 or heartbeat_timeout <= heartbeat_interval:
            raise ValueError("heartbeat_timeout must be greater than heartbeat_interval > 0")
        if split is not None and (not addresses or len(split) != len(addresses) or sum(split) != n or min(split) < 0):
            raise ValueError(f"split must give one count per worker and sum to n={n}, got {split!r}")
        if split is not None and any(c % envs_per_sandbox for c in list(split)[:-1]):
            raise ValueError(
                f"split counts must be multiples of envs_per_sandbox={envs_per_sandbox} (but the last): "
                f"a sandbox cannot span workers; got {split!r}"
            )
        self._check_metrics_port(metrics_port, addresses)
        if snapshot_budget is not None:
            if addresses:
                raise ValueError(
                    "snapshot_budget is for the pool's own local worker; start remote workers with "
                    "`boltzlabs-gym worker --snapshot-budget BYTES`"
                )
            if type(snapshot_budget) is not int or snapshot_budget < 0:
                raise ValueError(f"snapshot_budget must be a number of bytes >= 0, got {snapshot_budget!r}")
        self._snapshot_budget = snapshot_budget
        self.n = n
        self.heartbeat_interval = float(heartbeat_interval)
        self.busy_poll_us = float(busy_poll_us)
        self.heartbeat_timeout = float(heartbeat_timeout)
        self._keys = client_keys_from(keys)
        self.env_dir = os.fspath(env_dir)
        self.mode = mode
        self.env_aslr = env_aslr
        self.step_timeout = float(step_timeout)
        self.reset_timeout = float(reset_timeout)
        self.start_timeout = float(start_timeout)
        self.limits = limits or Limits()
        self.timing = Timing()
        self.isolation: IsolationReport | None = None
        self.reset_infos: list[dict] = [{} for _ in range(n)]
        #: PSS in bytes of the boltz-mode templates, as of the last :meth:`memory` call.
        self.template_pss = 0
        #: (envs started, n): (n, n) once started; while it starts, a bar shows the count on a terminal.
        self.start_progress = (0, n)
        #: Where the local worker serves ``/metrics`` (``metrics_port``); ``None``: nowhere.
        self.metrics_url: str | None = None
        self._metrics_port = metrics_port
        self._recorder = PoolRecorder()
        self._closed = False
        self._in_flight = False  # a batch was sent and batch_wait() has not collected it yet
        self._sent_at = 0.0  # when it started going out (time.perf_counter)
        self._seq = itertools.count(1)  # request tags, shared by every link
        self._links: list[WorkerLink] = []
        self._route: Route  # how batches reach the envs, chosen at start-up
        self._last_obs: list = [None] * n
        #: Grouped batches (envs_per_sandbox > 1): the plan of the batch in flight, and envs
        #: whose sandbox was restarted while they were not in a request, with the reason.
        self._plans: list[GroupPlan] | None = None
        self._restarted: dict[int, str] = {}
        #: A grouped step batch with resets in it is held to both deadlines (protocol.GROUP_DEADLINE).
        self._mixed_deadline = self.step_timeout + self.reset_timeout
        self._answered: list[tuple[int, EnvResult]] = []  # items answered without a request
        self._sent_positions: list[int] | None = None  # the batch positions of the items sent, if not all
        self._batch_size = 0
        #: Held snapshots whose handles were garbage collected: released with the next snapshot call.
        self._forgotten: list[tuple[str, str]] = []
        #: Bytes of snapshots this pool's sessions hold, as of the last :meth:`memory` call.
        self.snapshot_bytes = 0
        self._ctx = zmq.Context()
        self._finalizer = weakref.finalize(self, RLPool._finalize, self._ctx, self._links)
        try:
            archive, digest = pack_dir(self.env_dir)
            #: The env directory's content hash: snapshots restore only into envs of the same one.
            self.archive_hash = digest
            self._start_links(addresses, split)
            config = {
                "isolation": isolation,
                "mode": mode,
                "limits": self.limits.to_json(),
                "step_timeout": self.step_timeout,
                "reset_timeout": self.reset_timeout,
                "start_timeout": self.start_timeout,
                "serialize_measurement": bool(serialize_measurement),
                "env_vars": dict(env_vars or {}),
                "env_aslr": env_aslr,
                "envs_per_sandbox": self.envs_per_sandbox,
                # A local worker dies with this process; only remote ones need a lease.
                "lease_s": float(lease) if addresses else 86400.0,
            }
            # Kept to re-create a lost worker's envs on its replacement (see _reopen_lost); it
            # holds no reference to the pool, whose finalizer must not wait for a cycle collection.
            start_timeout, k = self.start_timeout, self.envs_per_sandbox
            self._open_sessions = lambda links: open_sessions(links, archive, digest, config, n, start_timeout, k)
            self.isolation = self._open_sessions(self._links)
            self.start_progress = (n, n)
            if metrics_port is not None:
                self.metrics_url = self._links[0].call({"op": "status"}, timeout=30.0).get("metrics")
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ start-up
    def _start_links(self, workers: Sequence[str] | None, split: Sequence[int] | None) -> None:
        """Connect to the workers (or start our own) and choose the route batches take."""
        heartbeat = {"heartbeat_interval": self.heartbeat_interval, "heartbeat_timeout": self.heartbeat_timeout}
        # Links, routes and workers count sandboxes (processes); with one env each, envs.
        k, sandboxes = self.envs_per_sandbox, self.layout.sandboxes
        if workers:
            per_worker = None if split is None else [-(-c // k) for c in split]
            source = self._source
            keys = self._keys if source is None else [source.client_keys(a) for a in workers]
            connect_workers(
                self._ctx, workers, sandboxes, per_worker, self._links, keys=keys, seq=self._seq, **heartbeat
            )
            routes = [WorkerRoute(link, sandboxes) for link in self._links]
            report = self.worker_loss == "report"
            self._route = routes[0] if len(routes) == 1 and not report else SplitRoute(routes, sandboxes, report)
            return
        worker_args = [] if self._metrics_port is None else ["--metrics-port", str(self._metrics_port)]
        if self._snapshot_budget is not None:
            worker_args += ["--snapshot-budget", str(self._snapshot_budget)]
        link = start_local_worker(sandboxes, self.busy_poll_us, seq=self._seq, worker_args=worker_args, **heartbeat)
        self._links.append(link)  # closed by the finalizer whatever happens next
        if self.direct and lane_possible(sandboxes):
            self._route = LaneRoute(link, sandboxes, self.step_timeout, self.reset_timeout, k)
        else:
            self._route = WorkerRoute(link, sandboxes)

    # ------------------------------------------------------------------ batched calls
    def _check_open(self) -> None:
        if self._closed:
            raise PoolClosedError("this pool is closed; create a new RLPool")

    def batch_async(self, items: Sequence[tuple[int, dict, Sequence[bytes]]]) -> None:
        """Send one request per worker carrying ``items``: ``(index, op, payload_frames)``.

        The low-level call that ``step``/``reset`` and the adapters are built on.
        """
        self._check_open()
        if self._in_flight:
            raise AsyncStateError("a call is already in flight (waiting for step_wait()); wait for it first")
        if self.envs_per_sandbox > 1:
            self._send_grouped(items)
        else:
            self._sent_at = self._route.send(items)
        self._in_flight = True

    def batch_async_steps(self, actions: list[int], resets: np.ndarray, autoreset: bool) -> None:
        """:meth:`batch_async` of a Discrete step batch, packed per sandbox without per-env work
        (``envs_per_sandbox`` > 1; see :func:`~boltzlabs_gym.client.grouping.pack_steps`): env ``i`` steps
        with ``actions[i]``, or resets (seed ``None``) where ``resets[i]``."""
        if self.envs_per_sandbox == 1 or self._restarted:
            step: dict = {"op": "step", "autoreset": True} if autoreset else {"op": "step"}
            reset = {"op": "reset", "seed": None}
            self.batch_async([(i, reset if resets[i] else dict(step, action=a), ()) for i, a in enumerate(actions)])
            return
        self._check_open()
        if self._in_flight:
            raise AsyncStateError("a call is already in flight (waiting for step_wait()); wait for it first")
        if len(actions) != self.n:
            raise ValueError(f"expected exactly {self.n} actions (one per env), got {len(actions)}")
        grouped, plans = pack_steps(self.layout, actions, resets, autoreset, self._mixed_deadline)
        self._sent_at = self._route.send(grouped)
        self._plans, self._answered, self._sent_positions, self._batch_size = plans, [], None, self.n
        self._in_flight = True

    def _send_grouped(self, items: Sequence[tuple[int, dict, Sequence[bytes]]]) -> None:
        """Send per-env ``items`` as one group request per sandbox (see :mod:`~boltzlabs_gym.client.grouping`);
        envs whose sandbox was restarted under them are answered here, on their next step."""
        answered: list[tuple[int, EnvResult]] = []
        told: list[int] = []
        self._sent_positions = None
        if self._restarted:
            items, answered, told = self._answer_restarted(items)
        grouped, plans = pack(self.layout, items, self._mixed_deadline)
        self._sent_at = self._route.send(grouped) if grouped else time.perf_counter()
        for index in told:  # only once the batch went out: a refused one leaves the marks as they were
            self._restarted.pop(index, None)
        self._plans = plans
        self._answered = answered
        self._batch_size = len(items) + len(answered)  # every item: sent, or answered here

    def _answer_restarted(self, items: Sequence[tuple[int, dict, Sequence[bytes]]]) -> tuple[list, list, list]:
        """Steps of envs whose sandbox was restarted while they were idle (a neighbour failed) are
        not sent: the env lost its episode, and says so here, as a failed step. A reset (soft or
        hard) starts the env's next episode: it is sent, and settles the matter; any other op
        (``call``, ``get_attr``...) is sent and leaves it pending. Returns the items to send, the
        answered ones, and the envs whose mark goes once the batch is sent."""
        sent, answered, told = [], [], []
        restarted = self._restarted
        for pos, item in enumerate(items):
            index, op = item[0], item[1]
            name = op.get("op") if type(op) is dict else None
            reason = restarted.get(index) if isinstance(index, (int, np.integer)) else None
            if reason is not None and name == "step":
                answered.append((pos, EnvResult(int(index), ERROR, {"message": reason}, [])))
                told.append(int(index))
                continue
            if reason is not None and name in ("reset", "hard_reset"):
                told.append(int(index))
            sent.append((pos, item))
        self._sent_positions = [pos for pos, _ in sent]
        return [item for _, item in sent], answered, told

    def batch_wait(self, timeout: float | None = None, *, raw: bool = False, grouped: bool = False) -> list:
        """Collect the replies of :meth:`batch_async`, in the order of its items.

        ``raw=True`` leaves each reply line unparsed (``EnvResult.raw``), for a caller with
        a faster parser of its own; :func:`parse_result` parses one. ``grouped=True`` (with
        ``envs_per_sandbox`` > 1) returns one :class:`~boltzlabs_gym.client.grouping.GroupResult` per
        sandbox instead, for a caller that reads their arrays whole (then calls
        :meth:`note_restarted` with each), plus per-env results answered without a request.
        """
        self._check_open()
        if not self._in_flight:
            raise AsyncStateError("batch_wait()/step_wait() called without a call in flight; call step_async() first")
        if timeout is None:
            timeout = self.start_timeout + max(self.step_timeout, self.reset_timeout) + 30.0
        try:
            if self.envs_per_sandbox > 1:
                results, per_worker_ms = self._wait_grouped(timeout, raw, grouped)
            else:
                results, per_worker_ms = self._route.wait(timeout, raw)
        finally:
            # Whatever happened, this call is over: a late reply will be dropped by its tag.
            self._in_flight = False
        self._record_timing(results, per_worker_ms, self._sent_at)
        return results

    def _wait_grouped(self, timeout: float, raw: bool, grouped: bool) -> tuple[list, dict[str, float]]:
        """The sandboxes' replies: as :class:`GroupResult` (``grouped``), else as per-env results in item order."""
        plans, self._plans = self._plans or [], None
        replies, per_worker_ms = self._route.wait(timeout, True) if plans else ([], {})
        layout = self.layout
        groups = [GroupResult(plan, r, layout.envs(plan.sandbox)) for plan, r in zip(plans, replies)]
        answered = self._answered
        if grouped:
            return [*groups, *(r for _pos, r in answered)], per_worker_ms
        results: list = [None] * self._batch_size
        positions = self._sent_positions
        for group in groups:
            for pos, r in zip(group.plan.positions, group.expand()):
                results[positions[pos] if positions else pos] = r
            self.note_restarted(group)
        for pos, r in answered:
            results[pos] = r
        if not raw:
            results = [parse_result(r) for r in results]
        return results, per_worker_ms

    def note_restarted(self, group: GroupResult) -> None:
        """Remember the envs of a failed sandbox that were not in its request (see :meth:`_answer_restarted`)."""
        if group.restarted:
            self._restarted.update(group.restarted)

    def _record_timing(self, results: list[EnvResult], per_worker_ms: dict, t0: float) -> None:
        failed = results
        if self.envs_per_sandbox > 1:
            failed = [f for r in results for f in (r.failures() if type(r) is GroupResult else (r,))]
        stragglers = tuple(r.index for r in failed if r.status == STRAGGLER)
        errors = tuple(r.index for r in failed if r.status == ERROR)
        t = self.timing
        calls = sum(len(r.plan.indices) if type(r) is GroupResult else 1 for r in results)
        self._recorder.batch(calls, time.perf_counter() - t0, len(stragglers), len(errors))
        self.timing = Timing(
            worker_ms=max(per_worker_ms.values(), default=0.0),
            roundtrip_ms=(time.perf_counter() - t0) * 1e3,
            per_worker_ms=per_worker_ms,
            stragglers=stragglers,
            errors=errors,
            calls=t.calls + 1,
            env_steps=t.env_steps + calls,
            total_stragglers=t.total_stragglers + len(stragglers),
            total_errors=t.total_errors + len(errors),
        )

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
        self._check_open()
        actions = self._validate_actions(actions)
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
        self._check_open()
        mask = self._validate_mask(where)
        seeds = self._validate_seeds(seed)
        op_name = "hard_reset" if hard else "reset"
        widened = self._widen_to_sandboxes(mask) if hard and self.envs_per_sandbox > 1 else mask
        # Envs of a lost worker re-created on its replacement: fresh, so a plain reset starts them.
        fresh = self._reopen_lost() if hard else None
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
        obs = list(self._last_obs)
        deadline_s = self.start_timeout if hard else self.reset_timeout
        for r in results:
            obs[r.index], self.reset_infos[r.index], _ = read_reset(r, deadline_s)
            if not mask[r.index]:
                self.reset_infos[r.index]["boltzlabs_restarted"] = (
                    "its worker was lost and replaced"
                    if fresh is not None and fresh[r.index]
                    else "its sandbox was restarted by a neighbour's hard reset"
                )
        self._last_obs = obs
        return obs

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
        self._check_snapshot_call("snapshot")
        index = self._check_index(index, "snapshot")
        if kind not in SNAPSHOT_KINDS:
            raise SnapshotError(f"snapshot kind must be one of {', '.join(SNAPSHOT_KINDS)}, got {kind!r}", index)
        link = self._link_of(index)
        self._check_not_lost({index: link}, "snapshot")
        self._release_forgotten()
        [r] = self._run_items([(index, {"op": "snapshot", "kind": kind}, ())])
        reply = r.reply if r.status == OK else None
        info = reply.get("snapshot") if isinstance(reply, dict) else None
        if not isinstance(info, dict) or not isinstance(info.get("id"), str):
            raise SnapshotError(f"cannot snapshot env {index}: {_reason(r)}", index)
        snap = Snapshot(
            kind=str(info.get("kind")),
            env=self.archive_hash,
            source=index,
            nbytes=int(info.get("bytes") or 0),
            pool=self,
            worker=link.address,
            snapshot_id=info["id"],
            meta=meta,
        )
        # Dropped unreleased: its id is queued (no I/O in a finalizer, which may run mid-call) and
        # released by the next snapshot call; release() detaches this.
        snap._finalizer = weakref.finalize(snap, self._forgotten.append, (link.address, info["id"]))
        return snap

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
        results = self.restore_results(snap, where, reseed=reseed, fresh=fresh)
        obs = list(self._last_obs)
        for r in results:
            obs[r.index], self.reset_infos[r.index], _ = read_reset(r, self.reset_timeout)
        self._last_obs = obs
        return obs

    def restore_results(
        self,
        snap: Snapshot,
        where: Sequence[int] | np.ndarray,
        *,
        reseed: Sequence[int] | None = None,
        fresh: bool = False,
    ) -> list[EnvResult]:
        """:meth:`restore`'s work, returning each target env's result as a reset's (for adapters that
        decode observations themselves, as the vector env does)."""
        self._check_snapshot_call("restore")
        if not isinstance(snap, Snapshot):
            raise TypeError(
                f"restore needs a Snapshot (pool.snapshot(i) or Snapshot.load(path)), got {type(snap).__name__}"
            )
        snap.check_usable()
        if snap.env != self.archive_hash:
            raise SnapshotError(
                f"this snapshot of env {snap.source} is of another env directory (hash {snap.env[:12]}), not this "
                f"pool's ({self.archive_hash[:12]}); restore it into a pool of the same env",
                snap.source,
            )
        targets = self._snapshot_targets(where)
        seeds = self._validate_reseed(reseed, len(targets))
        links = {i: self._link_of(i) for i in targets}
        self._check_not_lost(links, "restore")
        if snap.worker is not None and snap.worker in self.lost_workers:
            raise SnapshotError(
                f"the snapshot of env {snap.source} was held by worker {snap.worker}, which is lost; "
                "only snapshots saved before (snap.save) outlive their worker",
                snap.source,
            )
        self._release_forgotten()
        ids, imported = self._place_snapshot(snap, {link.address: link for link in links.values()}.values())
        items = []
        for i, seed in zip(targets, seeds):
            items.append((i, {"op": "restore", "snapshot": ids[links[i].address], "reseed": seed}, ()))
        try:
            if fresh and snap.kind != MEMORY:  # (a memory snapshot's copies always are new processes)
                # A new process in a new sandbox for each copy first: nothing of what the slot's last
                # occupant left (child processes, /tmp files, module state) reaches the copy.
                self._run_items([(i, {"op": "hard_reset", "seed": None}, ()) for i in targets])
            return self._run_items(items)
        finally:
            for address, snapshot_id in imported:
                self._release_snapshots(address, [snapshot_id])

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
        index, targets = self.check_fork(index, into, reseed)
        with self.snapshot(index, kind=kind) as snap:
            return self.restore(snap, targets, reseed=reseed, fresh=fresh)

    def check_fork(self, index: Any, into: Any, reseed: Any) -> tuple[int, list[int]]:
        """A fork's source index and target indices, checked before anything is sent (for the
        adapters' ``fork`` too): :class:`~boltzlabs_gym.errors.SnapshotError` for bad ones."""
        index = self._check_index(index, "fork")
        targets = self._snapshot_targets(into)
        if index in targets:
            raise SnapshotError(f"fork of env {index} into itself: leave {index} out of 'into'", index)
        self._validate_reseed(reseed, len(targets))
        return index, targets

    def _check_snapshot_call(self, what: str) -> None:
        self._check_open()
        if self._in_flight:
            raise AsyncStateError(f"{what}() while a call is in flight; collect it with step_wait() first")
        if self.envs_per_sandbox > 1:
            raise SnapshotError(
                f"{what}() needs envs_per_sandbox=1: the envs of a multi-env sandbox share one process and "
                "one workspace, so one of them cannot be copied alone"
            )

    def _check_not_lost(self, links: dict[int, WorkerLink], what: str) -> None:
        """Refuse at once (not after a heartbeat's wait) a snapshot call that needs a lost worker;
        ``links``: each env's link."""
        lost = self.lost_workers
        if not lost:
            return
        for i, link in links.items():
            address = link.address
            if address in lost:
                raise SnapshotError(
                    f"{what}: env {i} is on worker {address}, which is lost; replace it and hard-reset its envs "
                    "(RayWorkers.replace_dead(), pool.reset(hard=True)) first",
                    i,
                )

    def _check_index(self, index: Any, what: str) -> int:
        if not isinstance(index, (int, np.integer)) or isinstance(index, bool) or not 0 <= int(index) < self.n:
            raise SnapshotError(f"{what}: env index must be an int in [0, {self.n}), got {index!r}")
        return int(index)

    def _snapshot_targets(self, where: Any) -> list[int]:
        if isinstance(where, np.ndarray) and where.dtype == np.bool_:
            targets = [int(i) for i in np.flatnonzero(self._validate_mask(where))]
        else:
            if isinstance(where, (str, bytes)) or not hasattr(where, "__iter__"):
                raise SnapshotError(
                    f"'where' must be env indices or a boolean mask of shape ({self.n},), got {where!r}"
                )
            targets = [self._check_index(i, "restore") for i in where]
        if not targets:
            raise SnapshotError("'where' selects no env: name at least one env to restore into")
        if len(set(targets)) != len(targets):
            raise SnapshotError(f"'where' names an env twice: {targets}")
        return targets

    @staticmethod
    def _validate_reseed(reseed: Any, count: int) -> list[int | None]:
        if reseed is None:
            return [None] * count
        seeds = list(reseed)
        if len(seeds) != count:
            raise SnapshotError(f"reseed needs one seed per env restored into: {count}, got {len(seeds)}")
        for s in seeds:
            if not isinstance(s, (int, np.integer)) or isinstance(s, bool) or s < 0:
                raise SnapshotError(f"reseed values must be non-negative ints, got {s!r}")
        return [int(s) for s in seeds]

    def _link_of(self, index: int) -> WorkerLink:
        sandbox = index // self.envs_per_sandbox
        for link in self._links:
            if link.start <= sandbox < link.start + link.count:
                return link
        raise SnapshotError(f"env {index} is on no worker of this pool")  # unreachable: the links cover every env

    def _place_snapshot(
        self, snap: Snapshot, links: Iterable[WorkerLink]
    ) -> tuple[dict[str, str], list[tuple[str, str]]]:
        """The snapshot's id on each of the workers of ``links``, importing it where it is not held;
        and the ids imported (released after the restore)."""
        ids: dict[str, str] = {}
        imported: list[tuple[str, str]] = []
        try:
            for link in links:
                held = snap.held_by(self, link.address)
                if held is None:
                    blob = snap.blob()
                    try:
                        header = link.call(
                            {"op": "snapshots", "action": "import", "kind": snap.kind}, [blob], timeout=60.0
                        )
                    except WorkerError as exc:
                        raise SnapshotError(f"worker {link.address} would not take the snapshot: {exc}") from None
                    held = str(header["snapshot"]["id"])
                    imported.append((link.address, held))
                ids[link.address] = held
        except BaseException:
            for address, snapshot_id in imported:
                self._release_snapshots(address, [snapshot_id])
            raise
        return ids, imported

    def _run_items(self, items: list) -> list[EnvResult]:
        self.batch_async(items)
        return self.batch_wait()

    def _export_snapshot(self, snap: Snapshot) -> bytes:
        """The blob of a snapshot this pool's worker holds (for :meth:`Snapshot.save` and moves)."""
        self._check_open()
        if self._in_flight:
            # The export's reply and the batch's share the link: waiting for one drops the other.
            raise AsyncStateError("a snapshot cannot be saved or moved while a call is in flight; collect it first")
        link = next((lk for lk in self._links if lk.address == snap.worker), None)
        if link is None or snap.held_by(self, link.address) is None:
            raise SnapshotError(f"snapshot of env {snap.source} is not held by this pool's workers", snap.source)
        header, frames = link.recv(
            link.send({"op": "snapshots", "action": "export", "id": snap.held_by(self, link.address)}), 60.0
        )
        link.raise_for_error(header)
        if len(frames) != 1:
            raise SnapshotError(f"worker {link.address} sent {len(frames)} frames for a snapshot blob, not 1")
        return bytes(frames[0])

    def _release_snapshots(self, address: str | None, ids: list[str]) -> None:
        link = next((lk for lk in self._links if lk.address == address), None)
        if link is None or self._closed or self._in_flight:
            if not self._closed and address is not None:
                self._forgotten.extend((address, i) for i in ids)
            return
        try:
            link.call({"op": "snapshots", "action": "release", "ids": ids}, timeout=30.0)
        except WorkerError:
            log.warning("could not release %d snapshot(s) on worker %s", len(ids), address)

    def _release_forgotten(self) -> None:
        forgotten, self._forgotten = self._forgotten, []
        by_worker: dict[str, list[str]] = {}
        for address, snapshot_id in forgotten:
            by_worker.setdefault(address, []).append(snapshot_id)
        for address, ids in by_worker.items():
            self._release_snapshots(address, ids)

    def _reopen_lost(self) -> np.ndarray | None:
        """Re-create the envs of every lost worker that its source has replaced; the envs re-created
        (``None``: none). A lost worker not replaced yet keeps reporting errors."""
        route = self._route
        if not isinstance(route, SplitRoute) or self._source is None:
            return None
        fresh = np.zeros(self.n, dtype=bool)
        addresses = list(self._source.addresses)
        heartbeat = {"heartbeat_interval": self.heartbeat_interval, "heartbeat_timeout": self.heartbeat_timeout}
        # Every route, not only those found lost: a worker replaced before any call noticed its loss
        # is re-created on the same hard reset.
        for ri in range(len(route.routes)):
            lost = route.routes[ri].link
            position = self._source_positions.get(lost.address, len(addresses))
            address = addresses[position] if position < len(addresses) else None
            if address is None:
                continue  # not replaced (yet): its envs go on reporting the loss
            key = self._worker_key(address)
            if address == lost.address and key == self._source_keys.get(position):
                continue  # the same worker: alive, or lost and not replaced yet
            link = reopen_lost(
                self._ctx,
                lost,
                address,
                self._source.client_keys(address),
                self._open_sessions,
                seq=self._seq,
                send_timeout=self.heartbeat_timeout,
                **heartbeat,
            )
            route.replace(ri, link)
            self._links[self._links.index(lost)] = link
            lost.close()
            self._source_positions[address] = position
            self._source_keys[position] = key
            fresh[link.start : link.start + link.count] = True
        return fresh if fresh.any() else None

    def _worker_key(self, address: str) -> bytes | None:
        """The public key of the source's worker at ``address`` (``None``: it runs without keys)."""
        keys = self._source.client_keys(address) if self._source is not None else None
        return None if keys is None else keys.server_public

    @property
    def lost_workers(self) -> dict[str, str]:
        """Remote workers found lost (``worker_loss="report"``), with why; empty when all are well."""
        route = self._route
        if not isinstance(route, SplitRoute):
            return {}
        return {route.routes[ri].link.address: why for ri, why in route.lost.items()}

    def _widen_to_sandboxes(self, mask: np.ndarray) -> np.ndarray:
        """A hard reset restarts whole sandboxes: ``mask`` grown to every env of a sandbox it touches."""
        k = self.envs_per_sandbox
        touched = np.zeros(self.layout.sandboxes * k, dtype=bool)
        touched[: self.n] = mask
        return np.repeat(touched.reshape(-1, k).any(axis=1), k)[: self.n]

    # ------------------------------------------------------------------ validation
    def _validate_actions(self, actions: Sequence[Any]) -> list:
        if isinstance(actions, (str, bytes, dict)) or not hasattr(actions, "__len__"):
            raise ValueError(f"actions must be a sequence of {self.n} actions, got {type(actions).__name__}")
        if len(actions) != self.n:
            raise ValueError(f"expected exactly {self.n} actions (one per env), got {len(actions)}")
        out = []
        for i, a in enumerate(actions):
            try:
                out.append(jsonable(a))
            except TypeError as exc:
                raise ValueError(f"action for env {i} is not JSON-serialisable: {exc}") from None
        return out

    def _validate_mask(self, where) -> np.ndarray:
        if where is None:
            return np.ones(self.n, dtype=bool)
        mask = np.asarray(where)
        if mask.shape != (self.n,) or mask.dtype != np.bool_:
            raise ValueError(
                f"where must be a boolean mask of shape ({self.n},), got dtype {mask.dtype} shape {mask.shape}"
            )
        return mask

    def _validate_seeds(self, seed) -> list:
        if seed is None:
            return [None] * self.n
        if isinstance(seed, (int, np.integer)) and not isinstance(seed, bool):
            return [int(seed) + i for i in range(self.n)]
        if isinstance(seed, (list, tuple, np.ndarray)):
            if len(seed) != self.n:
                raise ValueError(f"expected {self.n} seeds (one per env), got {len(seed)}")
            out = []
            for i, s in enumerate(seed):
                if s is not None and not (isinstance(s, (int, np.integer)) and not isinstance(s, bool)):
                    raise ValueError(f"seed for env {i} must be an int or None, got {s!r}")
                out.append(None if s is None else int(s))
            return out
        raise ValueError(f"seed must be an int, a list of {self.n} ints, or None; got {type(seed).__name__}")

    # ------------------------------------------------------------------ introspection
    def memory(self) -> list[int]:
        """PSS in bytes of each env's whole process tree, in index order.

        With ``envs_per_sandbox`` > 1 the envs of a sandbox share one process tree: each is
        given an equal share of its PSS.

        In ``mode="boltz"`` the pages envs share with their template are split between
        them by PSS; the template's own share is :attr:`template_pss` after this call, and the
        bytes of the snapshots the pool holds :attr:`snapshot_bytes`.
        """
        self._check_open()
        out = [0] * self.n
        template = 0
        snapshots = 0
        layout = self.layout
        lost = self.lost_workers
        for link in self._links:
            if link.address in lost:
                continue  # its envs are gone: 0 bytes
            header = link.call({"op": "memory"}, timeout=60.0)
            for local, pss in enumerate(header["pss"]):
                # A sandbox of several envs: its PSS split evenly between them.
                envs = layout.envs(link.start + local)
                share, rest = divmod(int(pss), len(envs))
                for i in envs:
                    out[i] = share + (1 if i - envs.start < rest else 0)
            template += int(header.get("template_pss", 0))
            snapshots += int(header.get("snapshot_bytes", 0))
        self.template_pss = template
        self.snapshot_bytes = snapshots
        return out

    def stats(self, memory: bool = True) -> PoolStats:
        """One frozen snapshot of this pool's figures (see :class:`~boltzlabs_gym.client.stats.PoolStats`):
        env calls and their rate, batch latency p50/p99, stragglers and errors (in total and in
        the last minute), isolation, and, with ``memory`` (a request to each worker), PSS and
        envs per GiB. A local pool also brings its worker's books up to date with the steps
        taken on its direct lane, so that ``boltzlabs-gym top`` shows the same counts."""
        self._check_open()
        if self._in_flight:
            raise AsyncStateError("stats() while a call is in flight; collect it with step_wait() first")
        flush = getattr(self._route, "flush_report", None)
        if flush is not None:
            flush()
        pss = envs_per_gib = None
        if memory:
            pss = sum(self.memory()) + self.template_pss + self.snapshot_bytes
            envs_per_gib = self.n / (pss / 2**30) if pss else None
        return self._recorder.snapshot(
            n=self.n,
            envs_per_sandbox=self.envs_per_sandbox,
            workers=tuple(self.workers),
            isolation=None if self.isolation is None else self.isolation.backend,
            pss_bytes=pss,
            envs_per_gib=envs_per_gib,
            metrics_url=self.metrics_url,
        )

    @staticmethod
    def _check_metrics_port(port: int | None, workers: Sequence[str] | None) -> None:
        if port is None:
            return
        if workers:
            raise ValueError(
                "metrics_port is for the pool's own local worker; start remote workers with "
                "`boltzlabs-gym worker --metrics-port PORT`"
            )
        from ..extras import require
        from ..wire.metrics_port import check_port

        require("prometheus_client", "metrics", "metrics_port")
        check_port(port)

    def envs_per_gb(self) -> float:
        """How many envs fit in one GiB: their PSS, plus the boltz templates' (shared pages split honestly)
        and the snapshots the pool holds."""
        total = sum(self.memory()) + self.template_pss + self.snapshot_bytes
        return self.n / (total / 2**30) if total else float("inf")

    @property
    def closed(self) -> bool:
        return self._closed

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
        if self._closed:
            return
        self._closed = True
        lost = self.lost_workers if hasattr(self, "_route") else {}
        # Every close sent first, then the answers awaited within one shared 5 s: a pool whose
        # workers are gone closes in 5 s, not 5 s per worker.
        sent = []
        for link in self._links:
            if link.session is not None and link.process is None and link.address not in lost:
                try:
                    sent.append((link, link.send({"op": "close"})))
                except Exception:  # noqa: BLE001 - closing is best effort towards remote workers
                    pass
        deadline = time.monotonic() + 5.0
        for link, seq in sent:
            try:
                link.recv(seq, max(0.1, deadline - time.monotonic()))
            except Exception:  # noqa: BLE001 - closing is best effort towards remote workers
                pass
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
        state = "closed" if self._closed else f"{len(self._links)} worker(s)"
        return f"RLPool({self.env_dir!r}, n={self.n}, {state})"
