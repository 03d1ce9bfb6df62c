"""The library's exceptions: one tree, in one standard-library-only module.

Every exception the library raises on purpose is a :class:`BoltzLabsError` and also
subclasses the builtin a user would naturally catch (``except ValueError`` keeps
working around a codec check, ``except TimeoutError`` around a slow worker)::

    BoltzLabsError
     ├── EnvStartError (RuntimeError)         an env failed to start: index, stderr tail, worker
     ├── EnvCallError (RuntimeError)          call/get_attr/set_attr/render failed in an env: index, failure
     │    └── EnvAttributeError (AttributeError)  the env has no such attribute
     ├── WorkerError (RuntimeError)           a worker died, refused or is unreachable: worker address
     │    ├── WorkerLost (RuntimeError)       silent past the heartbeat timeout, or unreachable for a send
     │    └── WorkerTimeout (TimeoutError)    no reply within the deadline
     │         └── VectorTimeoutError * (multiprocessing.TimeoutError)  step_wait/reset_wait/recv ran out of time
     ├── PoolClosedError (RuntimeError)       the pool/vector env was used after close()
     │    └── ClosedEnvironmentError *        the vector env was used after close()
     ├── AsyncStateError (RuntimeError)       step_wait without step_async, and the like
     │    ├── NoAsyncCallError *              step_wait/reset_wait without a pending step_async/reset_async
     │    └── AlreadyPendingCallError *       a call while a step_async/reset_async waits for its *_wait
     ├── ActionBatchError * (ValueError, TypeError)  the batch of actions does not hold one action per env
     ├── SubEnvSpaceError * (RuntimeError)    the vector env's envs have spaces that do not fit together
     ├── CapacityError (RuntimeError)         workers have fewer free env slots than asked
     ├── SnapshotError (RuntimeError)         a snapshot, restore or fork was refused or failed: index
     ├── SandboxUnavailable (RuntimeError)    the requested isolation cannot be had here
     ├── PlacementTimeout (TimeoutError)      Ray did not place the workers' actors: what was asked, what there is
     ├── NetnsUnavailable (RuntimeError)      a test network namespace cannot be made (boltzlabs_gym.testing)
     ├── ArchiveError (ValueError)            an env directory archive was refused
     ├── CodecError (ValueError)              a value or payload does not match its space
     ├── ProtocolError (ValueError)           a malformed message on the worker or env wire
     ├── KeyFileError (ValueError)            a CURVE key file is missing, empty or malformed
     ├── AuthConfigError (ValueError)         the code server's tokens are missing (off loopback) or malformed
     ├── MetricsPortError (OSError)           the /metrics port cannot be bound (in use, refused): port
     └── MissingExtraError (ImportError)      an optional dependency is not installed: the extra to install

The classes marked ``*`` are the vector env's, defined in :mod:`boltzlabs_gym.vector` (and
importable from there): each also subclasses what Gymnasium's vectorizers raise in its place
(Gymnasium's exception of the same name, or what is in brackets), so code written for Gymnasium's
vectorizers catches them; that is why they are not in this standard-library-only module.

The classes are also importable where they are used (``boltzlabs_gym.wire.codec.CodecError``,
``boltzlabs_gym.wire.keys.KeyFileError``, ``boltzlabs_gym.wire.protocol.ProtocolError``,
``boltzlabs_gym.worker.sandbox.SandboxUnavailable``, ``boltzlabs_gym.testing.NetnsUnavailable``):
those are the same objects, not copies.

This module imports nothing from the package, so any part of it (the env side, which
runs inside every sandbox, included) may import it without an import circle.

Exceptions that never reach a user stay private to their module and outside this tree:
they are control flow between two parts of the library, caught and turned into one of
the errors above (or into an env's error result) before a call returns. They are
``channel.ChannelClosed``/``ChannelError`` (the local pool's socket pair; become a
:class:`WorkerError`), ``envpipe.EnvFault`` (an env broke its pipe protocol; the env is
killed and reported as crashed), ``worker.session.SessionExpired`` (becomes an
``expired`` error reply, then a :class:`WorkerError`) and ``worker.template.TemplateError``
(a boltz-mode template failed; becomes the env's start failure reason).

>>> issubclass(CodecError, ValueError) and issubclass(CodecError, BoltzLabsError)
True
>>> try:
...     raise WorkerTimeout("no reply in 5 s", worker="tcp://10.0.0.2:5555")
... except TimeoutError as exc:
...     print(exc, "from", exc.worker)
no reply in 5 s from tcp://10.0.0.2:5555
"""

from __future__ import annotations

__all__ = [
    "BoltzLabsError",
    "EnvStartError",
    "EnvCallError",
    "EnvAttributeError",
    "WorkerError",
    "WorkerTimeout",
    "WorkerLost",
    "PoolClosedError",
    "AsyncStateError",
    "CapacityError",
    "SandboxUnavailable",
    "PlacementTimeout",
    "NetnsUnavailable",
    "ArchiveError",
    "CodecError",
    "ProtocolError",
    "KeyFileError",
    "AuthConfigError",
    "MetricsPortError",
    "MissingExtraError",
    "SnapshotError",
]


class BoltzLabsError(Exception):
    """Base class of every error this library raises on purpose."""


# --------------------------------------------------------------------------- RuntimeError: something failed


class EnvStartError(BoltzLabsError, RuntimeError):
    """An env process failed to start or to answer its first request.

    When the env's factory raised a builtin exception or a ``gymnasium.error`` one, the
    instance raised is also of that class (``EnvStartError[DeprecatedEnv]``, say), so
    ``except gymnasium.error.DeprecatedEnv`` catches it as it would around ``DummyVecEnv``;
    the sandbox sends only the class's name (see :mod:`boltzlabs_gym.client.start_errors`).
    """

    def __init__(self, message: str, index: int | None = None, stderr_tail: str = "", worker: str | None = None):
        super().__init__(message)
        self.index = index
        self.stderr_tail = stderr_tail
        self.worker = worker


class EnvCallError(BoltzLabsError, RuntimeError):
    """A ``call``, ``get_attr``, ``set_attr`` or ``render`` failed in one env.

    ``index`` is the env's index in the pool; ``failure`` the
    :class:`~boltzlabs_gym.client.results.Failure` that describes it.
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


class WorkerLost(WorkerError):
    """A worker is gone as far as the pool can tell: nothing heard from it for the heartbeat
    timeout, or a request that could not be sent. A pool with ``worker_loss="report"`` reports
    its envs as errors instead of raising this."""


class PoolClosedError(BoltzLabsError, RuntimeError):
    """The pool or vector env was used after ``close()``."""


class AsyncStateError(BoltzLabsError, RuntimeError):
    """An asynchronous call was made in the wrong state (e.g. ``step_wait`` without ``step_async``)."""


class CapacityError(BoltzLabsError, RuntimeError):
    """The workers cannot host as many envs as were asked for."""


class SandboxUnavailable(BoltzLabsError, RuntimeError):
    """The requested isolation cannot be had on this host; the message says why and how."""


class PlacementTimeout(BoltzLabsError, TimeoutError):
    """Ray did not place the workers' actors in time (``boltzlabs_gym.ray``): the message says
    what was asked and what the cluster has; ``asked`` and ``cluster`` hold them."""

    def __init__(self, message: str, asked: object = None, cluster: object = None):
        super().__init__(message)
        self.asked = asked
        self.cluster = cluster


class NetnsUnavailable(BoltzLabsError, RuntimeError):
    """Network namespaces or veth pairs cannot be made here (not root, no iproute2); test helpers only."""


# --------------------------------------------------------------------------- ValueError: input was refused


class ArchiveError(BoltzLabsError, ValueError):
    """An env directory or archive was refused (unsafe path, link escape, too big)."""


class CodecError(BoltzLabsError, ValueError):
    """A value or payload that does not match its space (or the wire format)."""


class ProtocolError(BoltzLabsError, ValueError):
    """A malformed message on the trainer <-> worker hop or on an env's channel."""


class KeyFileError(BoltzLabsError, ValueError):
    """A key file is missing, empty or malformed; the message names it."""


class AuthConfigError(BoltzLabsError, ValueError):
    """The code server's authentication was refused as configured: no token for an address beyond
    loopback (and no explicit ``--insecure-no-auth``), or a token or token file that is empty or
    malformed; the message says which and how to fix it."""


# --------------------------------------------------------------------------- environment: this host or install


class MetricsPortError(BoltzLabsError, OSError):
    """The worker's ``/metrics`` port could not be bound (another process holds it, say)."""

    def __init__(self, message: str, port: int | None = None, host: str | None = None):
        super().__init__(message)
        self.port = port
        self.host = host

    def __str__(self) -> str:  # OSError's own would print its args as a tuple
        return str(self.args[0]) if self.args else ""


class MissingExtraError(BoltzLabsError, ImportError):
    """A feature needs an optional dependency that is not installed; the message gives the
    ``pip install`` line (``extra``: the package extra that brings it)."""

    def __init__(self, message: str, extra: str | None = None):
        super().__init__(message)
        self.extra = extra


class SnapshotError(BoltzLabsError, RuntimeError):
    """A snapshot, restore or fork was refused or failed; the message names the env and the fix.

    A refused operation changed nothing: every env is as it was. ``index`` is the env it is
    about, when it is about one.
    """

    def __init__(self, message: str, index: int | None = None):
        super().__init__(message)
        self.index = index
