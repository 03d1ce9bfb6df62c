"""Where a pool's remote workers come from, and how a lost one is put back.

``RLPool(workers=...)`` takes a list of addresses, or a :class:`WorkerSource`: any object
that places and starts workers itself and knows their addresses and the keys to reach
them (:class:`boltzlabs_gym.ray.RayWorkers` is one). The pool never imports the placer:
this protocol is all it knows of it.

A source keeps a worker's position in :attr:`WorkerSource.addresses` when it replaces it:
after ``workers.replace_dead()`` the new worker's address stands where the lost one's
stood, and the pool's next hard reset re-creates the lost envs there
(:func:`reopen_lost`).

>>> is_worker_source(["tcp://10.0.0.2:5555"]), is_worker_source("tcp://10.0.0.2:5555")
(False, False)
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import zmq

from ..wire.keys import ClientKeys
from .link import WorkerLink

log = logging.getLogger("boltzlabs_gym.client.pool")

__all__ = ["WorkerSource", "is_worker_source", "worker_addresses", "client_keys_from", "reopen_lost"]


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


def client_keys_from(keys: str | os.PathLike | ClientKeys | None) -> ClientKeys | None:
    """``keys=`` as the pool takes it: a key directory (``boltzlabs-gym keygen``) or keys in memory."""
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
