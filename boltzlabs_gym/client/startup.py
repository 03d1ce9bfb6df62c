"""Bringing a pool up on its workers: how many envs each hosts, the env archive, the sessions.

Used by :class:`~boltzlabs_gym.client.pool.RLPool`'s constructor: :func:`open_route` starts the
pool's own worker or connects to remote ones (:func:`connect_workers` asks them for their free
capacity and splits the envs between them) and chooses the route batches take;
:func:`open_sessions` uploads the env archive where it is missing and creates a session of envs on
every worker, with a progress bar on a terminal. :func:`close_sessions` is the pool's close.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Container, Iterator, Sequence

import zmq

from ..errors import CapacityError
from ..wire.limits import IsolationReport
from ..wire.protocol import LEND
from .link import WorkerLink, start_local_worker
from .obs_regions import ObsRegions
from .options import PoolOptions
from .routes import LaneRoute, Route, SplitRoute, WorkerRoute, lane_possible
from .sandbox_replies import SandboxLayout

log = logging.getLogger("boltzlabs_gym.client.pool")

__all__ = ["close_sessions", "connect_workers", "open_route", "open_sessions"]


def open_route(
    ctx: zmq.Context,
    links: list,
    workers: Sequence[str] | None,
    keys: object,
    flags: Sequence[str],
    layout: SandboxLayout,
    options: PoolOptions,
    link_options: dict,
) -> Route:
    """Connect to ``workers`` (or start the pool's own, with ``flags``), putting their links into
    ``links``, and choose the route batches take to them. Links, routes and workers count
    sandboxes (processes); with one env each, envs."""
    k, sandboxes, split = layout.k, layout.sandboxes, options.split
    if workers:
        per_worker = None if split is None else [-(-c // k) for c in split]
        connect_workers(ctx, workers, sandboxes, per_worker, links, keys=keys, **link_options)
        routes = [WorkerRoute(link, sandboxes) for link in links]
        report = options.worker_loss == "report"
        return routes[0] if len(routes) == 1 and not report else SplitRoute(routes, sandboxes, report)
    link = start_local_worker(sandboxes, flags, **link_options)
    links.append(link)  # closed by the pool's finalizer whatever happens next
    if options.shared_obs:
        link.regions = ObsRegions(sandboxes, k)
    if options.direct and lane_possible(sandboxes):
        return LaneRoute(link, sandboxes, options.step_timeout, options.reset_timeout, k)
    return WorkerRoute(link, sandboxes)


def connect_workers(
    ctx: zmq.Context,
    addresses: Sequence[str],
    n: int,
    split: Sequence[int] | None,
    links: list,
    *,
    keys,
    heartbeat_interval: float,
    heartbeat_timeout: float,
    seq: Iterator[int],
) -> None:
    """Connect to the workers at ``addresses`` and put into ``links`` those that get envs (``n`` split
    by their free capacity, or by ``split``), with their envs' index ranges.

    ``links`` holds every link opened, whatever happens: the caller closes them. ``keys``: the
    client keys for every worker, or a list of them, one per address.
    """
    per_address = keys if isinstance(keys, list) else [keys] * len(addresses)
    probes = [
        WorkerLink(
            ctx,
            address,
            0,
            0,
            keys=its_keys,
            send_timeout=heartbeat_timeout,
            seq=seq,
            heartbeat_interval=heartbeat_interval,
            heartbeat_timeout=heartbeat_timeout,
        )
        for address, its_keys in zip(addresses, per_address)
    ]
    links.extend(probes)
    free = [int(link.call({"op": "status"}, timeout=heartbeat_timeout)["free"]) for link in probes]
    if split is None:
        if sum(free) < n:
            raise CapacityError(
                f"asked for {n} envs but the workers have {sum(free)} free slots: "
                + ", ".join(f"{w} {f}" for w, f in zip(addresses, free))
            )
        counts = _split_counts(n, free) if sum(free) else [0] * len(free)
        counts = _cap_counts(counts, free)
    else:
        counts = list(split)
        short = [f"{w} has {f} free, asked {c}" for w, f, c in zip(addresses, free, counts) if c > f]
        if short:
            raise CapacityError("not enough free env slots: " + "; ".join(short))
    start = 0
    links.clear()
    for link, count in zip(probes, counts):
        if count:
            link.start, link.count = start, count
            links.append(link)
        else:
            link.close()
        start += count


def open_sessions(
    links: Sequence[WorkerLink],
    archive: bytes,
    digest: str,
    config: dict,
    n: int,
    start_timeout: float,
    envs_per_sandbox: int = 1,
) -> IsolationReport | None:
    """Create a session of envs on every link's worker (uploading the archive where it is
    missing, asking for lent envs where the link has a lane); the isolation they run under.

    Links count sandboxes; ``n`` envs, ``envs_per_sandbox`` to a sandbox, are split along them.

    Every reply is collected even after a failure, so that started sessions can be closed.
    """
    for link in links:
        have = link.call({"op": "has_archive", "hash": digest}, timeout=30.0)
        if not have.get("have"):
            link.call({"op": "upload", "hash": digest}, [archive], timeout=120.0)
            link.uploaded = True
    seqs = []
    k = envs_per_sandbox
    for link in links:
        envs = min(link.count * k, n - link.start * k)
        header = dict(config, op="create", hash=digest, n=envs, index_offset=link.start * k)
        if link.lane is not None:
            header[LEND] = True
        seqs.append(link.send(header))
    # Every env may queue behind max_starting others: allow for the whole stagger.
    sandboxes = sum(link.count for link in links)
    timeout = start_timeout * (1 + sandboxes / 4) + 30.0
    # A progress bar for big pools, on a terminal only (nothing in logs or CI output).
    bar = _ProgressBar(links, sandboxes) if sandboxes >= 32 and sys.stderr.isatty() else None
    isolation = None
    failure = None
    try:
        for link, seq in zip(links, seqs):
            try:
                header, _ = link.recv(seq, timeout)
                link.raise_for_error(header)
            except BaseException as exc:  # keep collecting: started sessions must be closed
                failure = failure or exc
                continue
            link.session = header["session"]
            link.token = header["token"]
            isolation = IsolationReport.from_json(header["isolation"])
            link.take_lent(header)
    finally:
        if bar is not None:
            bar.finish(failure is None)
    if failure is not None:
        raise failure
    log.info("pool of %d envs ready: %s", n, isolation)
    return isolation


def close_sessions(links: Sequence[WorkerLink], lost: Container[str]) -> None:
    """Close the pool's sessions on its remote workers but the ``lost``, best effort: every close
    sent first, then the answers awaited within one shared 5 s (a pool whose workers are gone
    closes in 5 s, not 5 s per worker). A local worker's sessions end with the worker."""
    sent = []
    for link in links:
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


class _ProgressBar:
    """Envs started so far, drawn on stderr as each worker reports them."""

    WIDTH = 30

    def __init__(self, links: Sequence[WorkerLink], n: int):
        self.links = links
        self.n = n
        self.stream = sys.stderr
        for link in links:
            link.on_progress = self.draw

    def draw(self, done: int | None = None) -> None:
        if done is None:
            done = sum(link.started for link in self.links)
        width = self.WIDTH
        bar = "#" * (width * done // self.n) + "-" * (width - width * done // self.n)
        self.stream.write(f"\rboltzlabs: starting envs [{bar}] {done}/{self.n}")
        self.stream.flush()

    def finish(self, complete: bool) -> None:
        for link in self.links:
            link.on_progress = None
        if complete:
            self.draw(self.n)
        self.stream.write("\n")


def _cap_counts(counts: list[int], caps: Sequence[int]) -> list[int]:
    """Move envs from workers over their free capacity to workers with room left.

    >>> _cap_counts([5, 5], caps=[3, 10])
    [3, 7]
    """
    counts = list(counts)
    extra = sum(max(0, c - cap) for c, cap in zip(counts, caps))
    counts = [min(c, cap) for c, cap in zip(counts, caps)]
    for i, cap in enumerate(caps):
        take = min(extra, cap - counts[i])
        counts[i] += take
        extra -= take
    return counts


def _split_counts(n: int, weights: Sequence[int]) -> list[int]:
    """``n`` envs split in proportion to ``weights`` (free slots), the remainder from the first on.

    >>> _split_counts(10, [1, 1, 2])
    [3, 2, 5]
    """
    total = sum(weights)
    counts = [n * w // total for w in weights]
    for i in range(n - sum(counts)):
        counts[i % len(counts)] += 1
    return counts
