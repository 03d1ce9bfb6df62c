"""Where a pool's remote workers come from, and how a lost one is put back.

``RLPool(workers=...)`` takes a list of addresses, or a :class:`WorkerSource`: any object
that places and starts workers itself and knows their addresses and the keys to reach
them (:class:`boltzlabs_gym.ray.RayWorkers` is one). The pool never imports the placer:
this protocol is all it knows of it.

A source keeps a worker's position in :attr:`WorkerSource.addresses` when it replaces it:
after ``workers.replace_dead()`` the new worker's address stands where the lost one's
stood, and the pool's next hard reset re-creates the lost envs there
(:class:`SourceTracker`, :func:`reopen_lost`).

>>> is_worker_source(["tcp://10.0.0.2:5555"]), is_worker_source("tcp://10.0.0.2:5555")
(False, False)
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import numpy as np
import zmq

from ..wire.keys import ClientKeys
from .link import WorkerLink
from .routes import SplitRoute

log = logging.getLogger("boltzlabs_gym.client.pool")

__all__ = ["SourceTracker", "WorkerSource", "client_keys_from", "is_worker_source", "reopen_lost", "worker_addresses"]


@runtime_checkable
class WorkerSource(Protocol):
    """Workers a pool is given whole: their addresses and the client keys for each."""

    @property
    def addresses(self) -> Sequence[str]:
        """The workers' endpoints (``tcp://IP:PORT``); a replacement takes its predecessor's position."""
        ...

    def client_keys(self, address: str) -> ClientKeys | None:
        """The CURVE keys to reach the worker at ``address`` (``None``: it runs without keys)."""
        ...


def is_worker_source(workers: object) -> bool:
    """Whether ``workers`` is a :class:`WorkerSource` rather than a list of addresses."""
    return not isinstance(workers, (str, bytes, list, tuple)) and isinstance(workers, WorkerSource)


def worker_addresses(
    workers: Sequence[str] | WorkerSource | None, keys: object
) -> tuple[WorkerSource | None, list[str] | None]:
    """``workers=`` as the pool takes it: the source (if it is one) and the addresses to connect to."""
    if workers is None:
        return None, None
    if isinstance(workers, WorkerSource) and not isinstance(workers, (str, bytes, list, tuple)):
        if keys is not None:
            raise ValueError("keys= is for worker addresses: a worker source brings its workers' keys")
        return workers, list(workers.addresses)
    return None, list(workers)


def client_keys_from(
    keys: str | os.PathLike | ClientKeys | None, source: WorkerSource | None = None, addresses: Sequence[str] = ()
) -> ClientKeys | list[ClientKeys | None] | None:
    """``keys=`` as the pool takes it: a key directory (``boltzlabs-gym keygen``) or keys in memory;
    for the workers of a ``source``, the keys it brings for each of the ``addresses``."""
    if source is not None:
        return [source.client_keys(a) for a in addresses]
    if keys is None or isinstance(keys, ClientKeys):
        return keys
    from ..wire.keys import load_client_keys

    return load_client_keys(os.fspath(keys))


def reopen_lost(
    ctx: zmq.Context,
    lost_link: WorkerLink,
    address: str,
    keys: ClientKeys | None,
    open_session: Callable[[list[WorkerLink]], object],
    **link_options,
) -> WorkerLink:
    """A link to the worker at ``address`` hosting ``lost_link``'s envs (same index range), its
    session created by ``open_session([link])``; the link is closed again if that fails."""
    link = WorkerLink(ctx, address, lost_link.start, lost_link.count, keys=keys, **link_options)
    try:
        open_session([link])
    except BaseException:
        link.close()
        raise
    log.info(
        "envs %d..%d re-created on %s (was %s)", link.start, link.start + link.count - 1, address, lost_link.address
    )
    return link


class SourceTracker:
    """Where each of a pool's workers stands in its :class:`WorkerSource`, and the re-creation of a
    lost worker's envs on the worker that took its place.

    ``addresses``: the source's workers as the pool first connected to them; ``link_options``:
    what a new :class:`~boltzlabs_gym.client.link.WorkerLink` is opened with (``seq``,
    ``send_timeout``, heartbeats).
    """

    def __init__(self, source: WorkerSource, addresses: Sequence[str], ctx: zmq.Context, **link_options):
        self.source = source
        self._ctx = ctx
        self._link_options = link_options
        #: Worker address -> its position in the source (a replacement takes the same).
        self._positions = {a: i for i, a in enumerate(addresses)}
        #: Position -> the public key of the worker there when its link was made: a replacement that
        #: happens to bind the same address is told apart by its key.
        self._keys = {i: self._worker_key(a) for a, i in self._positions.items()}

    def _worker_key(self, address: str) -> bytes | None:
        """The public key of the source's worker at ``address`` (``None``: it runs without keys)."""
        keys = self.source.client_keys(address)
        return None if keys is None else keys.server_public

    def replace_lost(
        self, route: object, links: list[WorkerLink], open_session: Callable[[list[WorkerLink]], object], n: int
    ) -> np.ndarray | None:
        """Re-create the envs of every lost worker of ``route`` that the source has replaced, putting
        the new link in the lost one's place in ``route`` and ``links``; which of the ``n`` envs
        (sandboxes) were re-created (``None``: none). A lost worker not replaced yet keeps
        reporting errors."""
        if not isinstance(route, SplitRoute):
            return None
        fresh = np.zeros(n, dtype=bool)
        addresses = list(self.source.addresses)
        # Every route, not only those found lost: a worker replaced before any call noticed its loss
        # is re-created on the same hard reset.
        for ri in range(len(route.routes)):
            lost = route.routes[ri].link
            position = self._positions.get(lost.address, len(addresses))
            address = addresses[position] if position < len(addresses) else None
            if address is None:
                continue  # not replaced (yet): its envs go on reporting the loss
            key = self._worker_key(address)
            if address == lost.address and key == self._keys.get(position):
                continue  # the same worker: alive, or lost and not replaced yet
            keys = self.source.client_keys(address)
            link = reopen_lost(self._ctx, lost, address, keys, open_session, **self._link_options)
            route.replace(ri, link)
            links[links.index(lost)] = link
            lost.close()
            self._positions[address] = position
            self._keys[position] = key
            fresh[link.start : link.start + link.count] = True
        return fresh if fresh.any() else None
