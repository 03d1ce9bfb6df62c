"""The library's exceptions.

Each also subclasses the builtin a user would naturally catch::

    BoltzLabsError
     ├── EnvStartError (RuntimeError)       an env failed to start: index, stderr tail
     ├── EnvCallError (RuntimeError)        call/get_attr/set_attr/render failed in an env: index, failure
     │    └── EnvAttributeError (AttributeError)  the env has no such attribute
     ├── WorkerError (RuntimeError)         a worker died, refused or is unreachable: address
     │    └── WorkerTimeout (TimeoutError)  no reply within the deadline
     ├── PoolClosedError (RuntimeError)     the pool/vector env was used after close()
     ├── AsyncStateError (RuntimeError)     step_wait without step_async, and the like
     ├── ArchiveError (ValueError)          an env directory archive was refused
     ├── CapacityError (RuntimeError)       workers have fewer free env slots than asked
     └── SandboxUnavailable (RuntimeError)  the requested isolation cannot be had here
"""

from __future__ import annotations

from .worker.sandbox.base import SandboxUnavailable as _SandboxUnavailable


class BoltzLabsError(Exception):
    """Base class of every error this library raises on purpose."""


class EnvStartError(BoltzLabsError, RuntimeError):
    """An env process failed to start or to answer its first reset."""

    def __init__(self, message: str, index: int | None = None, stderr_tail: str = "", worker: str | None = None):
        super().__init__(message)
        self.index = index
        self.stderr_tail = stderr_tail
        self.worker = worker


class EnvCallError(BoltzLabsError, RuntimeError):
    """A ``call``, ``get_attr``, ``set_attr`` or ``render`` failed in one env.

    ``index`` is the env's index in the pool; ``failure`` the
    :class:`~boltzlabs_gym.results.Failure` that describes it.
    """

    def __init__(self, message: str, index: int | None = None, failure: object = None):
        super().__init__(message)
        self.index = index
        self.failure = failure


class EnvAttributeError(EnvCallError, AttributeError):
    """What an env was asked for raised ``AttributeError`` there (it has no such attribute)."""


class WorkerError(BoltzLabsError, RuntimeError):
    """A worker failed, refused a request or could not be reached."""

    def __init__(self, message: str, worker: str | None = None):
        super().__init__(message)
        self.worker = worker


class WorkerTimeout(WorkerError, TimeoutError):
    """A worker did not answer within its deadline."""


class PoolClosedError(BoltzLabsError, RuntimeError):
    """The pool or vector env was used after ``close()``."""


class AsyncStateError(BoltzLabsError, RuntimeError):
    """An asynchronous call was made in the wrong state (e.g. ``step_wait`` without ``step_async``)."""


class ArchiveError(BoltzLabsError, ValueError):
    """An env directory or archive was refused (unsafe path, link escape, too big)."""


class CapacityError(BoltzLabsError, RuntimeError):
    """The workers cannot host as many envs as were asked for."""


class SandboxUnavailable(BoltzLabsError, _SandboxUnavailable):
    """The requested isolation cannot be had on this host."""


__all__ = [
    "BoltzLabsError",
    "EnvStartError",
    "WorkerError",
    "WorkerTimeout",
    "PoolClosedError",
    "AsyncStateError",
    "ArchiveError",
    "CapacityError",
    "SandboxUnavailable",
]
