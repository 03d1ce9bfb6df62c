"""How a batch reaches the envs: one route per pool, all with the same ``send``/``wait``.

* :class:`WorkerRoute`: every item in one ``batch`` request to one worker.
* :class:`LaneRoute`: a local pool's direct lane (see :mod:`boltzlabs_gym.client.direct_lane`): steps and
  resets of lent envs written to their own pipes, everything else through the worker.
* :class:`SplitRoute`: several workers, one request each, replies spliced back into order.

``send(items)`` takes ``(index, op, payload_frames)`` items with pool-wide env indices and
returns when the batch started going out (``time.perf_counter``); ``wait(timeout, raw)``
returns the results in the items' order and each worker's own time in ms. These are
per-step code: one pass over the items each way, nothing per env beyond it.
"""

from __future__ import annotations

import logging
import os
import resource
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ..errors import WorkerError, WorkerLost, WorkerTimeout
from ..wire.protocol import (
    ADOPT,
    ERROR,
    FAULTS,
    LEND,
    LENT_FAULT,
    OBS_REGION,
    OK,
    SANDBOX_SLOTS,
    encode_header,
    env_request,
)
from .direct_lane import DirectLane, goes_direct
from .link import WorkerLink
from .obs_regions import KEEPS_REGION, ObsRegions, RegionFault
from .results import EnvResult, parse_result

log = logging.getLogger("boltzlabs_gym.client.pool")

__all__ = ["LaneRoute", "Route", "SplitRoute", "WorkerRoute", "lane_possible", "route_losses"]

#: The time the worker gets to kill, report and respawn envs that failed on the lane.
LENT_FAULT_TIMEOUT_S = 30.0
#: How long asking the env processes for their observation regions may take.
REGION_ASK_TIMEOUT_S = 60.0
#: How often a lane tells its worker what it stepped (the worker never sees those steps).
LANE_REPORT_S = 1.0
#: Batch latencies kept for the next report; the oldest go first (see worker.stats).
LANE_REPORT_MAX_BATCHES = 1024

Items = Sequence[tuple[int, dict, Sequence[bytes]]]


class Route(Protocol):
    """The way a pool's batches go out and come back."""

    def send(self, items: Items) -> float:
        """Send a batch of ``(index, op, payload_frames)``; when it started going out (``perf_counter``)."""
        ...

    def wait(self, timeout: float, raw: bool) -> tuple[list[EnvResult], dict[str, float]]:
        """The batch's results in item order (reply lines unparsed if ``raw``), and worker_ms per worker address."""
        ...


def bad_index(index, n: int) -> Exception:
    """The error for an env index that is not an int in ``[0, n)``."""
    if type(index) is not int and not isinstance(index, np.integer):
        return TypeError(f"env index must be an int, got {type(index).__name__}")
    return IndexError(f"env index {index} out of range for a pool of {n}")


class WorkerRoute:
    """Every item of a batch in one ``batch`` request to the worker of ``link``."""

    def __init__(self, link: WorkerLink, n: int):
        self.link = link
        self.n = n  # the pool's size: indices are checked against it
        self._seq: int | None = None
        self.last_entries: list = []  # the entries of the last request sent (which envs a lost worker had)

    def send(self, items: Items) -> float:
        self._prepare_regions(items)
        n, start = self.n, self.link.start
        entries: list = []
        frames: list = []
        for index, op, payloads in items:
            if type(index) is not int and not isinstance(index, np.integer) or not 0 <= index < n:
                raise bad_index(index, n)
            entries.append([index - start, op, len(payloads)])
            frames.extend(payloads)
        return self.send_entries(entries, frames)

    def send_entries(self, entries: list, frames: list) -> float:
        """Send ready-made ``[local index, op, n_frames]`` entries (from :class:`SplitRoute`);
        none: nothing is sent (the worker refuses an empty batch) and the wait returns none."""
        t0 = time.perf_counter()
        self.last_entries = entries
        self._seq = self.link.send({"op": "batch", "items": entries}, frames) if entries else None
        return t0

    def wait(self, timeout: float, raw: bool) -> tuple[list[EnvResult], dict[str, float]]:
        seq, self._seq = self._seq, None
        if seq is None:
            return [], {}
        link = self.link
        header, frames = link.recv(seq, timeout)
        link.raise_for_error(header)
        return self._parse_results(header, frames, raw), {link.address: float(header.get("worker_ms", 0.0))}

    # ------------------------------------------------------------------ shared observation regions
    def _prepare_regions(self, items: Items) -> None:
        """Before a batch: ask the env processes due a region for one (their first call, or the
        first since they were replaced), then forget the regions of those this batch may replace."""
        regions = self.link.regions
        if regions is None:
            return
        if regions.due():
            self._ask_regions(regions)
        start = self.link.start
        for index, op, _payloads in items:
            if type(op) is not dict or op.get("op") not in KEEPS_REGION:
                regions.forget(int(index) - start)

    def _may_ask_regions(self) -> bool:
        return True

    def _ask_regions(self, regions: ObsRegions) -> None:
        """One ``obs_region`` request, through the worker, for every process due a region."""
        if not self._may_ask_regions():
            return
        link = self.link
        due = regions.due()
        header = self._region_request_header(due)
        header["items"] = [[i, {"op": OBS_REGION}, 0] for i in due]
        reply, frames = link.recv(link.send(header), REGION_ASK_TIMEOUT_S)
        results: list[EnvResult] = []
        try:
            link.raise_for_error(reply)
            link.take_lent(reply)
            results = self._parse_results(reply, frames)
        finally:
            regions.adopt(reply, results, link.start)

    def _region_request_header(self, due: list[int]) -> dict:
        return {"op": "batch"}

    def _collect(self, seq: int, positions: list[int], results: list, deadline: float) -> float:
        """Receive a batch reply into ``results`` at ``positions``; take the envs it lends; its worker_ms."""
        link = self.link
        header, frames = link.recv(seq, max(0.0, deadline - time.monotonic()))
        link.raise_for_error(header)
        link.take_lent(header)
        for pos, result in zip(positions, self._parse_results(header, frames, raw=True)):
            results[pos] = result
        return float(header.get("worker_ms", 0.0))

    def _parse_results(self, header: dict, frames: list, raw: bool = False) -> list[EnvResult]:
        """Split a batch reply's one data frame into per-env results (replies and payload views)."""
        link = self.link
        entries = header.get("results")
        if not isinstance(entries, list) or len(frames) != 1:
            raise WorkerError(
                f"worker {link.address} sent a malformed batch reply (results or data frame missing)", link.address
            )
        data = memoryview(frames[0])
        regions = link.regions
        out = []
        pos = 0
        for entry in entries:
            try:
                local, status, sizes = entry
                end = pos + sum(sizes)
                if not sizes or min(sizes) < 0 or end > len(data):
                    raise ValueError
            except (TypeError, ValueError):
                raise WorkerError(
                    f"worker {link.address} sent a malformed batch result {str(entry)[:80]}", link.address
                ) from None
            reply_end = pos + sizes[0]
            payloads = []
            start = reply_end
            for size in sizes[1:]:
                payloads.append(data[start : start + size])
                start += size
            result = EnvResult(link.start + local, status, None, payloads, bytes(data[pos:reply_end]))
            if regions is not None:
                result = self._resolve(regions, local, result)
            out.append(result if raw else parse_result(result))
            pos = end
        return out

    @staticmethod
    def _resolve(regions: ObsRegions, local: int, result: EnvResult) -> EnvResult:
        """A result through the worker read against its env's region (copied out now); a failed env
        (maybe replaced) loses its region, and a wrong reference is that env's bad reply."""
        if result.status != OK:
            regions.forget(local)
            return result
        try:
            return regions.resolve_result(result, result.index - local)
        except RegionFault as exc:
            regions.forget(local)
            # (with several envs per sandbox, the index is the sandbox's: its reader names its envs)
            who = f"env {result.index}" if regions.envs_per_sandbox == 1 else "the sandbox"
            message = f"{who} broke the protocol: {exc.reason}"
            return EnvResult(result.index, ERROR, {"message": message, "bad_reply": True}, [])


class SplitRoute:
    """Several workers: each gets one request with its envs' items; replies come back in item order.

    With ``report_loss``, a worker that is lost (:class:`WorkerLost`: unreachable past the
    heartbeat timeout, or a send that cannot go out) does not fail the batch: its envs' results are errors that say
    so, now and on every later call, until the pool puts a new link in its place
    (:meth:`replace`). Without it, the loss raises :class:`WorkerError`, as it always did.
    """

    def __init__(self, routes: list[WorkerRoute], n: int, report_loss: bool = False):
        self.routes = routes
        self.n = n
        self.report_loss = report_loss
        #: Route position -> why its worker counts as lost (``report_loss`` only).
        self.lost: dict[int, str] = {}
        self._sent: list[WorkerRoute] = []
        self._order: list[tuple[int, int]] = []
        self._unsent: dict[int, list[int]] = {}  # lost routes' env indices of the batch in flight

    def send(self, items: Items) -> float:
        n, routes = self.n, self.routes
        entries: list[list] = [[] for _ in routes]
        frames: list[list] = [[] for _ in routes]
        order = []
        for index, op, payloads in items:
            if type(index) is not int and not isinstance(index, np.integer) or not 0 <= index < n:
                raise bad_index(index, n)
            ri = self._route_of(index)
            mine = entries[ri]
            mine.append([index - routes[ri].link.start, op, len(payloads)])
            frames[ri].extend(payloads)
            order.append((ri, len(mine) - 1))
        t0 = time.perf_counter()
        self._sent, self._order, self._unsent = [], order, {}
        for ri, (route, its_entries, its_frames) in enumerate(zip(routes, entries, frames)):
            if not its_entries:
                continue
            if ri not in self.lost:
                try:
                    route.send_entries(its_entries, its_frames)
                    self._sent.append(route)
                    continue
                except WorkerLost as exc:
                    if not self.report_loss:
                        raise
                    self._mark_lost(ri, exc)
            self._unsent[ri] = [route.link.start + entry[0] for entry in its_entries]
        return t0

    def _mark_lost(self, ri: int, exc: Exception) -> None:
        address = self.routes[ri].link.address
        log.warning("worker %s is lost; its envs report errors until it is replaced: %s", address, exc)
        self.lost[ri] = (
            f"worker {address} is lost ({exc}); its envs are gone: replace the worker "
            "(RayWorkers.replace_dead()) and hard-reset them (pool.reset(hard=True))"
        )

    def loss_of(self, link: WorkerLink) -> str | None:
        """Why ``link``'s worker counts as lost (the message its envs' results carry); ``None``
        while it does not."""
        for ri, route in enumerate(self.routes):
            if route.link is link:
                return self.lost.get(ri)
        return None

    def note_lost(self, link: WorkerLink, exc: WorkerLost) -> str:
        """Count ``link``'s worker as lost (``report_loss`` only: without it, raise ``exc``); why."""
        if not self.report_loss:
            raise exc
        ri = next(ri for ri, route in enumerate(self.routes) if route.link is link)
        if ri not in self.lost:
            self._mark_lost(ri, exc)
        return self.lost[ri]

    def replace(self, ri: int, link: WorkerLink) -> WorkerLink:
        """Put ``link`` (a new worker's, hosting the same envs) in place of lost route ``ri``'s; the old link."""
        route = self.routes[ri]
        old, route.link = route.link, link
        route._seq = None
        self.lost.pop(ri, None)
        return old

    def _route_of(self, index: int) -> int:
        for ri, route in enumerate(self.routes):
            link = route.link
            if link.start <= index < link.start + link.count:
                return ri
        raise IndexError(index)  # pragma: no cover

    def wait(self, timeout: float, raw: bool) -> tuple[list[EnvResult], dict[str, float]]:
        sent, self._sent = self._sent, []
        per_route: dict[int, list[EnvResult]] = {}
        per_worker_ms: dict[str, float] = {}
        deadline = time.monotonic() + timeout
        unsent, self._unsent = self._unsent, {}
        for route in sent:
            try:
                per_route[id(route)], ms = route.wait(max(0.0, deadline - time.monotonic()), raw)
            except WorkerLost as exc:
                if not self.report_loss:
                    raise
                ri = self.routes.index(route)
                self._mark_lost(ri, exc)
                unsent[ri] = [route.link.start + e[0] for e in route.last_entries]
                continue
            per_worker_ms.update(ms)
        routes = self.routes
        for ri, indices in unsent.items():
            reason = self.lost[ri]
            per_route[id(routes[ri])] = [EnvResult(index, ERROR, {"message": reason}, []) for index in indices]
        return [per_route[id(routes[ri])][pos] for ri, pos in self._order], per_worker_ms


def route_losses(route: object) -> dict[str, str]:
    """The workers ``route`` found lost (a :class:`SplitRoute` that reports losses), with why."""
    if not isinstance(route, SplitRoute):
        return {}
    return {route.routes[ri].link.address: why for ri, why in route.lost.items()}


@dataclass
class _LanePending:
    """A batch sent partly on the lane: the worker request's tag (None: nothing sent to
    it), the batch positions of its items, the batch size, calls that failed at once,
    and when its lane part was written (None: no lane part)."""

    seq: int | None
    via: list[int]
    size: int
    failed: list
    t_send: float | None
    #: Batch position -> env calls of a lane item (its sandbox's slots; 1 for a one-env sandbox).
    calls: dict[int, int] | None = None


class LaneRoute(WorkerRoute):
    """A local pool's direct lane: lent envs' steps and resets on their own pipes, the rest
    (and envs that failed on our side while idle) to the worker, in one request."""

    def __init__(self, link: WorkerLink, n: int, step_timeout: float, reset_timeout: float, envs_per_sandbox: int = 1):
        super().__init__(link, n)
        #: The lent envs (sandboxes); the link holds them too, to take in what its worker lends.
        self.lane = link.lane = DirectLane(step_timeout, reset_timeout, envs_per_sandbox)
        self._pending: _LanePending | None = None
        #: For the worker's books (``report``, once a second): env calls answered on the lane
        #: and each lane batch's time, since the last report.
        self.lane_calls = 0
        self.lane_batch_s: list[float] = []
        self._report_at = 0.0

    def send(self, items: Items) -> float:
        link, n, lane = self.link, self.n, self.lane
        lane.check_idle()
        self._prepare_regions(items)
        direct: list = []
        via: list = []
        frames: list = []
        seen: set = set()
        for pos, (index, op, payloads) in enumerate(items):
            if type(index) is not int and not isinstance(index, np.integer) or not 0 <= index < n:
                raise bad_index(index, n)
            if index in seen:
                raise ValueError(f"env index {index} appears twice in one batch")
            seen.add(index)
            local = index - link.start
            if lane.holds(local) and type(op) is dict and goes_direct(op):
                # Encoded before anything is sent: an op that cannot be, fails the call untouched.
                direct.append((pos, local, op, env_request(op, payloads)))
            else:
                via.append((pos, local, [local, op, len(payloads)]))
                frames.extend(payloads)
        header: dict = {"op": "batch", "items": [item for *_, item in via], LEND: True}
        if via:
            encode_header(dict(header))  # one that cannot be encoded fails here, before envs are let go
        for _pos, local, _item in via:
            lane.hand_back(local)  # the worker takes it back with this request
        if lane.idle_faults:
            header[FAULTS] = [[i, reason] for i, reason in lane.idle_faults.items()]
        if lane.abandoned:
            header[ADOPT] = lane.abandoned
        t0 = time.perf_counter()
        # Counted when answered (wait): a call that fails is the worker's to count.
        calls = None
        if direct and self.lane.envs_per_sandbox > 1:
            calls = {p: len(items[p][1].get(SANDBOX_SLOTS) or (0,)) for p, *_ in direct}
        if t0 >= self._report_at:
            self.flush_report(ack=False)
        seq = None
        if via or FAULTS in header or ADOPT in header:
            seq = link.send(header, frames)
            # The worker acts on these before it looks at the items, so they are delivered.
            lane.idle_faults, lane.abandoned = {}, []
        t_send = time.perf_counter()
        failed = lane.send(direct)
        self._pending = _LanePending(
            seq, [pos for pos, *_ in via], len(items), failed, t_send if direct else None, calls
        )
        return t0

    def wait(self, timeout: float, raw: bool) -> tuple[list[EnvResult], dict[str, float]]:
        link, lane = self.link, self.lane
        pending, self._pending = self._pending, None
        assert pending is not None, "wait() without send()"
        results: list = [None] * pending.size
        worker_ms = 0.0
        deadline = time.monotonic() + timeout
        failed: list = list(pending.failed)
        try:
            try:
                done, seen_failing = lane.wait(deadline)
            except TimeoutError:
                raise WorkerTimeout(
                    f"the envs of local worker {link.address} did not answer within {timeout:.1f} s", link.address
                ) from None
            failed += seen_failing
            if pending.t_send is not None:  # fan-out to the envs and back, as a worker counts it
                worker_ms = (time.perf_counter() - pending.t_send) * 1e3
                self._note_lane_batch(worker_ms / 1e3)
            regions = link.regions
            for pos, index, line, payloads in done:
                if regions is not None:
                    try:
                        raw_line, reply, payloads = regions.resolve(index, line, payloads)
                    except RegionFault as exc:  # handed back: the worker kills, reports, respawns it
                        regions.forget(index)
                        lane.release(index)
                        failed.append((pos, index, f"the env broke the protocol: {exc.reason}", False))
                        continue
                    results[pos] = EnvResult(link.start + index, OK, reply, payloads, raw_line)
                    continue
                results[pos] = EnvResult(link.start + index, OK, None, payloads, line)
            self.lane_calls += len(done) if pending.calls is None else sum(pending.calls[pos] for pos, *_ in done)
            if pending.seq is not None:
                worker_ms = max(worker_ms, self._collect(pending.seq, pending.via, results, deadline))
            if failed:
                # Our side saw the failure; the worker kills the env, says why, respawns it. Its
                # own time: a straggler is found at the step deadline, which may be the caller's.
                items = [
                    [index, self._lent_fault(pos, reason, straggler, pending.calls), 0]
                    for pos, index, reason, straggler in failed
                ]
                seq = link.send({"op": "batch", "items": items, LEND: True})
                failed_positions, failed = [pos for pos, *_ in failed], []
                worker_ms += self._collect(
                    seq, failed_positions, results, max(deadline, time.monotonic() + LENT_FAULT_TIMEOUT_S)
                )
        except BaseException:
            lane.abandon(failed)  # with the next request: no env stays lent to nobody
            raise
        if not raw:
            results = [parse_result(r) for r in results]
        return results, {link.address: worker_ms}

    def _may_ask_regions(self) -> bool:
        # Envs handed back with the ask must carry nothing in flight, and what the lane owes the
        # worker (faults, adoptions) goes with the next batch: ask when the lane is quiet.
        lane = self.lane
        return not lane.in_flight and not lane.idle_faults and not lane.abandoned

    def _region_request_header(self, due: list[int]) -> dict:
        for index in due:
            self.lane.hand_back(index)  # the worker takes it back with this request, lends it again after
        return {"op": "batch", LEND: True}

    @staticmethod
    def _lent_fault(pos: int, reason: str, straggler: bool, calls: dict[int, int] | None) -> dict:
        """The item that hands a failed lent env back; for a sandbox of several envs it names their
        slots, so that the worker's books count the envs whose calls failed, as the pool does."""
        op: dict = {"op": LENT_FAULT, "reason": reason, "straggler": straggler}
        if calls is not None and pos in calls:
            op[SANDBOX_SLOTS] = list(range(calls[pos]))
        return op

    def _note_lane_batch(self, seconds: float) -> None:
        batch_s = self.lane_batch_s
        batch_s.append(round(seconds, 7))
        if len(batch_s) > LANE_REPORT_MAX_BATCHES:
            del batch_s[: len(batch_s) - LANE_REPORT_MAX_BATCHES]

    def flush_report(self, ack: bool = True) -> None:
        """Tell the worker what was stepped on the lane since the last report (``report`` op);
        with ``ack``, wait until it has counted it (``pool.stats()``: then ``top`` agrees)."""
        self._report_at = time.perf_counter() + LANE_REPORT_S
        if not self.lane_calls and not self.lane_batch_s and not ack:
            return
        report = {"calls": self.lane_calls, "batch_s": self.lane_batch_s}
        header = {"op": "report", "lane": report}
        self.lane_calls, self.lane_batch_s = 0, []
        if ack:
            self.link.call(dict(header, ack=True), timeout=30.0)
        else:
            self.link.send(header)


def lane_possible(n: int) -> bool:
    """Whether this process can hold a direct lane to ``n`` envs (see :class:`LaneRoute`)."""
    return _sigpipe_ignored() and _fd_room(2 * n + 64)


def _sigpipe_ignored() -> bool:
    """Whether writing to a dead env's pipe raises EPIPE here rather than killing the process
    (Python ignores SIGPIPE unless the program restored it)."""
    if signal.getsignal(signal.SIGPIPE) == signal.SIG_IGN:
        return True
    log.info("direct lane off: SIGPIPE is not ignored in this process")
    return False


def _fd_room(need: int) -> bool:
    """Whether this process may open ``need`` more descriptors, raising its soft limit if it must."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        used = len(os.listdir("/proc/self/fd"))
    except OSError:
        used = 256
    want = used + need
    if soft == resource.RLIM_INFINITY or want <= soft:
        return True
    if hard != resource.RLIM_INFINITY and want > hard:
        log.info("direct lane off: %d more descriptors needed, the hard limit is %d", need, hard)
        return False
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (ValueError, OSError):
        return False
    return True
