"""Envs that don't wait for each other: a pool's calls started on any idle envs and collected
as each env finishes (EnvPool's ``send``/``recv``), beside the lockstep batch.

:class:`AsyncSteps` is the part of a pool behind :meth:`RLPool.send
<boltzlabs_gym.client.pool.RLPool.send>` and :meth:`RLPool.recv
<boltzlabs_gym.client.pool.RLPool.recv>`, the vector env's ``send``/``recv`` and
:mod:`boltzlabs_gym.aio`. Each :meth:`AsyncSteps.send` goes out at once as one request per
worker (a ``batch`` answered in parts, :data:`~boltzlabs_gym.wire.protocol.PARTIAL`: the worker
replies with what finished in each turn of its loop) and, on a local pool's direct lane, as
lines written to the lent envs' own pipes; :meth:`AsyncSteps.recv` waits on every worker and
every lent pipe at once and hands results over in the order they came in. Every env is in
one of three places: idle, in flight, or finished and not yet received; it is never in two,
and nothing moves it but a send, a result, or a recv.

Per-env semantics are those of a lockstep batch: a straggler is killed at its deadline and its
result says so, a crashed env reports why, each env's deadline runs from its own send. A remote
worker lost past its heartbeat timeout raises :class:`~boltzlabs_gym.errors.WorkerLost` from
:meth:`AsyncSteps.recv` (or ``send``); with ``worker_loss="report"`` its envs in flight finish
instead with that error in their result (truncated, ``info["boltzlabs_error"]``, as
:meth:`RLPool.step <boltzlabs_gym.client.pool.RLPool.step>` reports them), as do its envs sent
later, until it is replaced; the other workers' envs go on. With
``envs_per_sandbox`` K > 1 a sandbox is one process serving its envs one after another: the
envs of a sandbox sent together are one call and finish together, and a sandbox takes one call
at a time (sending to an env whose sandbox neighbour is in flight is refused, naming both;
the per-env call faces' :mod:`~boltzlabs_gym.client.call_queue` queues such a call until the
sandbox is free).

>>> with RLPool("./envs/counter", n=8) as pool:                      # doctest: +SKIP
...     pool.reset(seed=0)
...     pool.send([1] * 8, env_ids=range(8))
...     got = pool.recv(batch_size=4)          # the first 4 envs to finish
...     pool.send([1] * 4, env_ids=got.env_ids)
"""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import zmq

from ..errors import AsyncStateError, WorkerLost, WorkerTimeout
from ..wire.protocol import ADOPT, ERROR, FAULTS, LEND, MORE, OK, PARTIAL, encode_header, env_request, jsonable
from .arguments import check_actions, check_seeds
from .batch_calls import BatchCalls
from .direct_lane import DirectLane, goes_direct
from .link import WorkerLink, link_holding
from .obs_regions import RegionFault
from .results import EnvResult, parse_result, read_reset, read_step
from .routes import LaneRoute, SplitRoute, WorkerRoute
from .sandbox_replies import SandboxPlan, SandboxResult, pack
from .sandbox_route import SandboxRoute

__all__ = ["AsyncSteps", "Finished", "Received", "plain_items", "read_received"]

Item = tuple[int, dict, Sequence[bytes]]


@dataclass(frozen=True)
class Finished:
    """One env's finished call: its ``op`` (``"step"``, ``"reset"``...) and its parsed result
    (``result.index`` is the env id)."""

    op: str
    result: EnvResult


@dataclass
class _Unit:
    """A call in flight on one unit (an env; with several envs per sandbox, a sandbox)."""

    link: WorkerLink
    plan: SandboxPlan | None  # the envs it stands for (several envs per sandbox only)
    envs: tuple[int, ...]
    seq: int | None = None  # the worker request it went in (None: written to its lent pipes)


class AsyncSteps:
    """The calls in flight on a pool's envs outside its lockstep batches (see the module doc).

    ``links``: the pool's worker links (their ``start``/``count`` in units, their ``lane`` if
    lent envs are stepped directly); ``batch_calls``: the pool's lockstep calls (neither kind
    starts while the other is in flight); ``sandboxed``: the pool's per-sandbox route, with
    several envs per sandbox; ``losses``: the pool's route over its workers when it reports
    lost workers (``worker_loss="report"``): a lost worker's envs then finish with an error
    result instead of raising :class:`~boltzlabs_gym.errors.WorkerLost`.
    """

    def __init__(
        self,
        links: Sequence[WorkerLink],
        batch_calls: BatchCalls,
        n: int,
        *,
        sandboxed: SandboxRoute | None = None,
        default_timeout: float,
        losses: SplitRoute | None = None,
    ):
        self._links = links
        self._losses = losses
        self._batch_calls = batch_calls
        self.n = n
        self._sandboxed = sandboxed
        self._default_timeout = default_timeout
        #: Env id -> the op in flight on it.
        self.in_flight: dict[int, str] = {}
        #: Finished calls not received yet, in the order they finished.
        self.finished: collections.deque[Finished] = collections.deque()
        self._units: dict[int, _Unit] = {}  # unit (pool-wide) -> its call
        self._requests: dict[WorkerLink, set[int]] = {}  # tags of partial requests not fully answered
        batch_calls.async_envs = self.in_flight  # a lockstep call waits for none of these

    # ------------------------------------------------------------------ send
    def send(self, items: Sequence[Item]) -> None:
        """Start each ``(env id, op, payload frames)`` item; returns once they went out.

        Refused as a whole, nothing sent, for an env id that is not one (``IndexError``/
        ``TypeError``), named twice (``ValueError``), or in flight or finished and not received yet
        (:class:`AsyncStateError`),
        and while a lockstep call is in flight.
        """
        self._batch_calls.check_open()
        if self._batch_calls.in_flight:
            raise AsyncStateError(
                "send() while a lockstep call (step_async/batch_async) is in flight; wait for it first"
            )
        if not items:
            raise ValueError("send() needs at least one env id")
        self._check_ids([item[0] for item in items])
        ops = {int(index): op["op"] for index, op, _ in items}
        units, plans = self._to_units(items)
        by_link: dict[WorkerLink, list[tuple[int, dict, Sequence[bytes], SandboxPlan | None]]] = {}
        for (unit, op, payloads), plan in zip(units, plans):
            by_link.setdefault(self._link_of(unit), []).append((unit, op, payloads, plan))
        lost: list[tuple[WorkerLink, list[int], str]] = []
        for link, its_items in by_link.items():
            reason = self._losses.loss_of(link) if self._losses is not None else None
            if reason is None:
                try:
                    self._send_on(link, its_items)
                    continue
                except WorkerLost as exc:
                    if self._losses is None:
                        raise
                    reason = self._losses.note_lost(link, exc)
            lost.append((link, [unit for unit, *_ in its_items], reason))
        self.in_flight.update(ops)
        for link, lost_units, reason in lost:
            self._finish_lost(link, lost_units, reason)

    def _check_ids(self, ids: list) -> None:
        n, seen = self.n, set()
        for index in ids:
            if type(index) is not int and not isinstance(index, np.integer):
                raise TypeError(f"env id must be an int, got {type(index).__name__} ({index!r})")
            if not 0 <= index < n:
                raise IndexError(f"env id {index} out of range for a pool of {n} envs (0..{n - 1})")
            if index in seen:
                raise ValueError(f"env id {index} appears twice in one send()")
            seen.add(int(index))
        # An env whose result waits for recv() is not idle either: sending to it again would put a
        # second result of the same env in the queue, and the first would come back stale.
        waiting = {f.result.index: f.op for f in self.finished}
        busy = sorted(seen.intersection(self.in_flight) | seen.intersection(waiting))
        if busy:
            first = busy[0]
            where = (
                f"its {self.in_flight[first]} was sent and not received"
                if first in self.in_flight
                else f"its {waiting[first]} finished and its result waits for recv()"
            )
            raise AsyncStateError(
                f"env {first} is still in flight ({where})"
                + (f", and {len(busy) - 1} more" if len(busy) > 1 else "")
                + "; recv() it before sending to it again"
            )

    def _to_units(self, items: Sequence[Item]) -> tuple[list[Item], list[SandboxPlan | None]]:
        """The items as the route below sees them: per env, or per sandbox with several envs each."""
        sandboxed = self._sandboxed
        if sandboxed is None:
            return [(int(i), op, p) for i, op, p in items], [None] * len(items)
        units, plans = pack(sandboxed.layout, items, sandboxed._mixed_deadline)
        for unit, _op, _p in units:
            if unit in self._units:
                envs = self._units[unit].envs
                mine = [int(i) for i, _, _ in items if int(i) // sandboxed.layout.k == unit]
                raise AsyncStateError(
                    f"env {mine[0]} shares sandbox {unit} with env {envs[0]}, which is in flight: a sandbox of "
                    "several envs takes one call at a time; send its envs together, or recv() first"
                )
        return units, list(plans)

    def _link_of(self, unit: int) -> WorkerLink:
        link = link_holding(self._links, unit)
        if link is None:
            raise IndexError(unit)  # pragma: no cover - ids were checked
        return link

    def _send_on(self, link: WorkerLink, items: list) -> None:
        lane = link.lane
        direct, via, frames, via_units = [], [], [], []
        if lane is not None:
            lane.check_idle()
        calls = []
        for unit, op, payloads, plan in items:
            local = unit - link.start
            if lane is not None and lane.holds(local) and goes_direct(op):
                direct.append((unit, local, op, env_request(op, payloads)))
            else:
                via.append([local, op, len(payloads)])
                via_units.append(unit)
                frames.extend(payloads)
            envs = tuple(plan.indices) if plan is not None else (unit,)
            calls.append((unit, _Unit(link, plan, envs)))
        if via:
            encode_header({"items": via})  # one that cannot be encoded fails here, before envs are let go
        if lane is not None:
            for local, *_ in via:
                lane.hand_back(local)  # the worker takes it back with this request
        seq = self._request(link, via, frames)
        self._units.update(calls)
        for unit in via_units:
            self._units[unit].seq = seq
        if direct:
            assert lane is not None
            failed = lane.send(direct)
            if failed:
                self._hand_back_failed(link, failed)

    def _request(self, link: WorkerLink, entries: list, frames: list) -> int | None:
        """One partial ``batch`` request to ``link``'s worker (with what its lane must report)."""
        lane = link.lane
        header: dict = {"op": "batch", "items": entries, PARTIAL: True}
        if lane is not None:
            header[LEND] = True
            if lane.idle_faults:
                header[FAULTS] = [[i, reason] for i, reason in lane.idle_faults.items()]
            if lane.abandoned:
                header[ADOPT] = lane.abandoned
        if not entries and FAULTS not in header and ADOPT not in header:
            return None
        seq = link.send(header, frames)
        if lane is not None:
            lane.idle_faults, lane.abandoned = {}, []
        if entries:
            self._requests.setdefault(link, set()).add(seq)
        return seq

    def _hand_back_failed(self, link: WorkerLink, failed: list) -> None:
        """Lent envs whose call failed on our side: the worker kills, reports and respawns them,
        answering their call (as :class:`~boltzlabs_gym.client.routes.LaneRoute` does)."""
        entries = []
        for unit, local, reason, straggler in failed:
            plan = self._units[unit].plan
            calls = None if plan is None else {unit: len(plan.indices)}
            entries.append([local, LaneRoute._lent_fault(unit, reason, straggler, calls), 0])
        seq = self._request(link, entries, [])
        for unit, *_ in failed:
            self._units[unit].seq = seq

    # ------------------------------------------------------------------ recv
    def recv(self, batch_size: int | None = None, timeout: float | None = None) -> list[Finished]:
        """The first ``batch_size`` calls to finish (default: every call in flight), in the order
        they finished; waits for them up to ``timeout`` seconds (default: the pool's longest
        deadline), then raises :class:`~boltzlabs_gym.errors.WorkerTimeout` with nothing lost."""
        self._batch_calls.check_open()
        waiting = len(self.in_flight)
        have = len(self.finished)
        if not waiting and not have:
            raise AsyncStateError("recv() with nothing in flight: send() steps or resets first")
        want = waiting + have if batch_size is None else batch_size
        if type(want) is not int or want < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if want > waiting + have:
            # One count, whichever side of the wire each call is on: the split is only a moment's.
            calls = waiting + have
            raise ValueError(
                f"recv(batch_size={want}), but only {calls} env{'s' if calls != 1 else ''} "
                f"{'have calls' if calls != 1 else 'has a call'} to receive ({waiting} in flight, {have} finished): "
                "send() to more envs first, or ask for fewer"
            )
        limit = self._default_timeout if timeout is None else float(timeout)
        deadline = time.monotonic() + limit
        while len(self.finished) < want:
            self.pump(deadline)
            if len(self.finished) < want and time.monotonic() >= deadline:
                raise WorkerTimeout(
                    f"recv(batch_size={want}): {len(self.finished)} envs finished within {limit:g} s "
                    f"(still in flight: {_names(self.in_flight)}); nothing is lost: recv() again"
                )
        return [self.finished.popleft() for _ in range(want)]

    def pump(self, deadline: float, wake: int | None = None) -> int:
        """Take in what finished, waiting until something did, until ``deadline``
        (``time.monotonic``) or until descriptor ``wake`` is readable; how many calls finished."""
        before = len(self.finished)
        self._take_ready()
        if len(self.finished) > before:
            return len(self.finished) - before
        while True:
            now = time.monotonic()
            self._keep_alive(now)
            if len(self.finished) > before:
                return len(self.finished) - before  # a lost worker's envs, reported
            wait_s = max(0.0, deadline - now)
            due = self.next_wakeup(now)
            if due is not None:
                wait_s = min(wait_s, max(0.0, due - now))
            poller = zmq.Poller()
            if wake is not None:
                poller.register(wake, zmq.POLLIN)
            for link in self._owing():
                poller.register(link.sock, zmq.POLLIN)  # the socket itself: zmq.Poller knows its signals
            for lane in self._busy_lanes():
                poller.register(lane.fileno(), zmq.POLLIN)
            woken = dict(poller.poll(math.ceil(wait_s * 1000)))
            self._take_ready()
            if len(self.finished) > before or time.monotonic() >= deadline or wake in woken:
                return len(self.finished) - before

    # ------------------------------------------------------------------ for an event loop
    # What pump() does, cut up for a caller that waits on the descriptors itself and never
    # blocks (boltzlabs_gym.aio's event loop): it watches watched_fds() and calls take_ready() when
    # one is readable, when next_wakeup() comes, and at once when reply_waiting() says so.
    def watched_fds(self) -> set[int]:
        """The descriptors to wait on for the calls in flight, as :meth:`pump` does: each worker
        link that owes replies (:meth:`WorkerLink.fileno
        <boltzlabs_gym.client.link.WorkerLink.fileno>`; ZeroMQ's needs :meth:`reply_waiting` too)
        and each lane with calls in flight (:meth:`DirectLane.fileno
        <boltzlabs_gym.client.direct_lane.DirectLane.fileno>`)."""
        fds = {link.fileno() for link in self._owing()}
        fds.update(lane.fileno() for lane in self._busy_lanes())
        return fds

    def take_ready(self, now: float) -> int:
        """Take in what finished, never waiting: replies, stragglers past their deadline (killed
        and reported), lost workers (raised or reported, as :meth:`recv` does); ping the quiet
        workers that owe replies (``now``: ``time.monotonic``). How many calls finished (on
        :attr:`finished`)."""
        before = len(self.finished)
        self._take_ready()
        self._keep_alive(now)
        return len(self.finished) - before

    def next_wakeup(self, now: float) -> float | None:
        """When (``time.monotonic``) :meth:`take_ready` is due though no descriptor woke: the
        soonest deadline of a call on a lane, or the next heartbeat of a worker that owes replies;
        None: no call in flight needs one."""
        due = [now + link.heartbeat_interval / 2 for link in self._owing()]
        for lane in self._busy_lanes():
            soonest = lane.next_deadline
            if soonest is not None:
                due.append(soonest)
        return min(due, default=None)

    def reply_waiting(self) -> bool:
        """Whether a reply waits that the :meth:`watched_fds` may not signal: a ZeroMQ socket's
        descriptor signals a change only, and any send or receive on it (a call, a ping) may take
        in that change. Ask after each :meth:`send` and :meth:`take_ready`; while true, take
        ready again."""
        return any(link.reply_waiting() for link in self._owing())

    def _owing(self) -> list[WorkerLink]:
        """The links whose workers owe replies to partial requests."""
        return [link for link, tags in self._requests.items() if tags]

    def _busy_lanes(self) -> list[DirectLane]:
        """The lanes with calls in flight."""
        return [link.lane for link in self._links if link.lane is not None and link.lane.in_flight]

    def _keep_alive(self, now: float) -> None:
        """Ping the quiet workers that owe replies; one silent past its heartbeat timeout raises
        :class:`~boltzlabs_gym.errors.WorkerLost`, or, where the pool reports lost workers, its
        envs in flight finish with that error."""
        for link, tags in list(self._requests.items()):
            if not tags:
                continue
            try:
                link.keep_alive(now)
            except WorkerLost as exc:
                if self._losses is None:
                    raise
                reason = self._losses.note_lost(link, exc)
                del self._requests[link]  # a late reply from it is dropped
                units = [unit for unit, call in self._units.items() if call.link is link]
                self._finish_lost(link, units, reason)

    def _finish_lost(self, link: WorkerLink, units: list[int], reason: str) -> None:
        """``units`` (on ``link``, whose worker is lost) finish with ``reason`` as their error, as a
        lockstep call reports them (truncated, ``info["boltzlabs_error"]``)."""
        for unit in units:
            self._units.setdefault(unit, _Unit(link, None, (unit,)))
            self._finish(unit, EnvResult(unit, ERROR, {"message": reason}, []))

    def _take_ready(self) -> None:
        for link in self._links:
            lane = link.lane
            if lane is not None and lane.in_flight:
                done, failed = lane.collect(time.monotonic())
                for unit, local, line, payloads in done:
                    result = self._read_lane_reply(link, unit, local, line, payloads, failed)
                    if result is not None:
                        self._finish(unit, result)
                if failed:
                    self._hand_back_failed(link, failed)
            tags = self._requests.get(link)
            if tags:
                for header, frames in link.read_ready(tags):
                    self._take_part(link, tags, header, frames)

    @staticmethod
    def _read_lane_reply(
        link: WorkerLink, unit: int, local: int, line: bytes, payloads: list, failed: list
    ) -> EnvResult | None:
        """A lent env's reply as a result, its observation copied out of its shared region if it has
        one; ``None`` (added to ``failed``, to be handed back) for a wrong reference."""
        regions = link.regions
        if regions is None:
            return EnvResult(unit, OK, None, payloads, line)
        try:
            raw, reply, payloads = regions.resolve(local, line, payloads)
        except RegionFault as exc:
            regions.forget(local)
            assert link.lane is not None
            link.lane.release(local)
            failed.append((unit, local, f"the env broke the protocol: {exc.reason}", False))
            return None
        return EnvResult(unit, OK, reply, payloads, raw)

    def _take_part(self, link: WorkerLink, tags: set[int], header: dict, frames: list) -> None:
        """One reply part of a partial request: its envs' results (or, for a refused request, an
        error result for each of its envs)."""
        seq = header.get("seq")
        if not header.get("ok"):
            tags.discard(seq)
            try:
                link.raise_for_error(header)
            except Exception as exc:  # noqa: BLE001 - the refusal becomes each env's error result
                message = str(exc)
            for unit, call in list(self._units.items()):
                if call.link is link and call.seq == seq:
                    self._finish(unit, EnvResult(unit, ERROR, {"message": message}, []))
            return
        if not header.get(MORE):
            tags.discard(seq)
        link.take_lent(header)
        for result in WorkerRoute(link, 0)._parse_results(header, frames, raw=True):
            self._finish(result.index, result)

    def _finish(self, unit: int, raw: EnvResult) -> None:
        call = self._units.pop(unit, None)
        if call is None:
            return  # answered already (a refusal raced a result): never twice
        if call.plan is None:
            results = [parse_result(raw)]
        else:
            sandbox = SandboxResult(call.plan, raw, self._sandboxed.layout.envs(call.plan.sandbox))  # type: ignore[union-attr]
            sandbox.failures()
            self._sandboxed._note_restarted(sandbox)  # type: ignore[union-attr]
            results = sandbox.expand()
        for result in results:
            op = self.in_flight.pop(result.index, "step")
            self.finished.append(Finished(op, result))

    # ------------------------------------------------------------------ shutdown
    def drop(self) -> list[int]:
        """Forget every call in flight and every result not received (the pool is closing); the env
        ids that had one."""
        ids = sorted(set(self.in_flight) | {f.result.index for f in self.finished})
        self.in_flight.clear()
        self.finished.clear()
        self._units.clear()
        self._requests.clear()
        return ids


def _names(in_flight: dict[int, str]) -> str:
    ids = sorted(in_flight)
    shown = ", ".join(map(str, ids[:8]))
    return f"envs {shown}" + (f" and {len(ids) - 8} more" if len(ids) > 8 else "")


class Received(NamedTuple):
    """What :meth:`RLPool.recv <boltzlabs_gym.client.pool.RLPool.recv>` returns for ``m`` envs, in
    the order they finished: their ids (``np.int64[m]``), observations, rewards
    (``np.float32[m]``), done flags (``np.bool_[m]``) and infos, as :meth:`RLPool.step
    <boltzlabs_gym.client.pool.RLPool.step>` gives them for a whole batch. An env that was sent a
    reset has reward 0, done False and its reset info."""

    env_ids: np.ndarray
    obs: list
    rewards: np.ndarray
    dones: np.ndarray
    infos: list


def read_received(finished: Sequence[Finished], step_timeout: float, reset_timeout: float) -> Received:
    """:class:`Received` from finished calls, read as the JSON pool API reads a batch's."""
    m = len(finished)
    ids = np.empty(m, dtype=np.int64)
    obs: list = [None] * m
    rewards = np.zeros(m, dtype=np.float32)
    dones = np.zeros(m, dtype=np.bool_)
    infos: list = [{}] * m
    for k, f in enumerate(finished):
        r = f.result
        ids[k] = r.index
        if f.op == "step":
            t = read_step(r, step_timeout)
            obs[k], rewards[k], dones[k], infos[k] = t.obs, t.reward, t.terminated or t.truncated, t.info
        else:
            obs[k], infos[k], _ = read_reset(r, reset_timeout)
    return Received(ids, obs, rewards, dones, infos)


def plain_items(
    n: int, actions: Sequence | None, env_ids: Sequence[int] | np.ndarray | None, reset: bool, seed, options
) -> list[Item]:
    """The items of :meth:`RLPool.send <boltzlabs_gym.client.pool.RLPool.send>`: a step with its
    action for each of ``env_ids`` (default: all ``n``), or with ``reset`` a reset (``seed``: an
    int gives env ``i`` the seed ``seed + i``, a list one per env id)."""
    ids = list(range(n)) if env_ids is None else _id_list(env_ids)
    if reset:
        if actions is not None:
            raise ValueError("send(reset=True) takes no actions: pass actions=None")
        if isinstance(seed, (int, np.integer)) and not isinstance(seed, bool):
            seeds = [int(seed) + i if type(i) is int else None for i in ids]  # ids are checked by send
        else:
            seeds = check_seeds(seed, len(ids))
        reset_op: dict = {"op": "reset"}
        if options:
            reset_op["options"] = jsonable(options)
        return [(i, dict(reset_op, seed=s), ()) for i, s in zip(ids, seeds)]
    if seed is not None or options is not None:
        raise ValueError("seed and options go with send(reset=True)")
    if actions is None:
        raise ValueError("send() needs actions (one per env id), or reset=True")
    steps = check_actions(actions, len(ids))
    return [(i, {"op": "step", "action": a}, ()) for i, a in zip(ids, steps)]


def _id_list(env_ids: Sequence[int] | np.ndarray) -> list:
    if isinstance(env_ids, (str, bytes, dict)) or not hasattr(env_ids, "__iter__"):
        raise TypeError(f"env_ids must be a sequence of env ids, got {type(env_ids).__name__}")
    return [int(i) if isinstance(i, np.integer) else i for i in env_ids]
