"""The worker's epoll, and which env pipe each watched descriptor is.

One :class:`Poller` per worker holds the only epoll and the map from an env's descriptors to the
env (and which of its pipes: ``"out"``, ``"err"`` or ``"in"``): every part registers and drops
descriptors here, so a descriptor is in the map exactly while epoll watches it for an env. The
worker's own descriptors (the ROUTER socket's, the local pool's channel, the uploads' and the
signal wake-up pipe) are watched here too, without an owner.
"""

from __future__ import annotations

import select

from .envproc import EnvProcess

#: Which of an env's pipes a descriptor is: its stdout ("out"), stderr ("err") or stdin ("in").
PipeOwner = tuple[EnvProcess, str]


class Poller:
    """The worker's epoll and the owners of the env descriptors in it."""

    def __init__(self) -> None:
        self._epoll = select.epoll()
        self._owners: dict[int, PipeOwner] = {}

    # ------------------------------------------------------------------ the worker's own descriptors
    def watch(self, fd: int, events: int = select.EPOLLIN) -> None:
        self._epoll.register(fd, events)

    def modify(self, fd: int, events: int) -> None:
        self._epoll.modify(fd, events)

    def unwatch(self, fd: int) -> None:
        """Stop watching ``fd`` (one already gone, or a closed epoll, is not an error)."""
        try:
            self._epoll.unregister(fd)
        except (OSError, ValueError):
            pass

    # ------------------------------------------------------------------ env pipes
    def watch_env(self, env: EnvProcess) -> None:
        """Watch a started env's stdout and stderr."""
        self.watch_pipe(env, env.stdout_r, "out")
        self.watch_pipe(env, env.stderr_r, "err")

    def watch_pipe(self, env: EnvProcess, fd: int, kind: str, events: int = select.EPOLLIN) -> None:
        """Watch ``fd``, ``env``'s pipe ``kind``."""
        self._epoll.register(fd, events)
        self._owners[fd] = (env, kind)

    def drop_pipe(self, fd: int) -> None:
        """Stop watching an env's pipe (nothing happens if it is not watched)."""
        if self._owners.pop(fd, None) is not None:
            self.unwatch(fd)

    def owner(self, fd: int) -> PipeOwner | None:
        """The env and pipe ``fd`` is, or None (a worker descriptor, or one dropped meanwhile)."""
        return self._owners.get(fd)

    # ------------------------------------------------------------------ the loop
    def poll(self, timeout: float) -> list[tuple[int, int]]:
        return self._epoll.poll(timeout)

    def close(self) -> None:
        try:
            self._epoll.close()
        except OSError:
            pass
