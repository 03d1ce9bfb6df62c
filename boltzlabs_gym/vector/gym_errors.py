"""The vector env's exceptions: Gymnasium's own vectorizer exceptions, and members of our tree.

Gymnasium's vectorizers raise Gymnasium's exceptions; ours are those same classes (code that
catches Gymnasium's catches ours) and also members of our own tree
(:class:`~boltzlabs_gym.errors.BoltzLabsError`, drawn in :mod:`boltzlabs_gym.errors`). They live
here, not in :mod:`boltzlabs_gym.errors`, because they subclass Gymnasium's classes and that
module stays standard-library only.

>>> issubclass(ClosedEnvironmentError, gym_error.ClosedEnvironmentError)
True
>>> issubclass(VectorTimeoutError, multiprocessing.TimeoutError) and issubclass(VectorTimeoutError, TimeoutError)
True
"""

from __future__ import annotations

import multiprocessing

from gymnasium import error as gym_error

from ..errors import AsyncStateError, BoltzLabsError, PoolClosedError, WorkerTimeout

__all__ = [
    "NoAsyncCallError",
    "AlreadyPendingCallError",
    "ClosedEnvironmentError",
    "ActionBatchError",
    "SubEnvSpaceError",
    "VectorTimeoutError",
]


class NoAsyncCallError(AsyncStateError, gym_error.NoAsyncCallError):
    """``step_wait``/``reset_wait`` without a pending ``step_async``/``reset_async``.

    ``name`` is the call that was expected (``"step"`` or ``"reset"``), as in Gymnasium's.
    """

    def __init__(self, message: str, name: str):
        # At run time this reaches RuntimeError's __init__ (it comes first in the MRO), which takes the
        # message alone; the checker picks Gymnasium's (message, name), which is never called.
        super().__init__(message)  # type: ignore[call-arg]
        self.name = name


class AlreadyPendingCallError(AsyncStateError, gym_error.AlreadyPendingCallError):
    """A call made while another (``name``: ``"step"`` or ``"reset"``) is still pending."""

    def __init__(self, message: str, name: str):
        # At run time this reaches RuntimeError's __init__ (it comes first in the MRO), which takes the
        # message alone; the checker picks Gymnasium's (message, name), which is never called.
        super().__init__(message)  # type: ignore[call-arg]
        self.name = name


class ClosedEnvironmentError(PoolClosedError, gym_error.ClosedEnvironmentError):
    """The vector env was used after ``close()``."""


class ActionBatchError(BoltzLabsError, ValueError, TypeError):
    """The batch of actions does not hold one action per env.

    Both a ``ValueError`` (what the batched-space utilities raise) and a ``TypeError``
    (what a length mismatch is to Gymnasium's vectorizers and to callers that catch it).
    """


class VectorTimeoutError(WorkerTimeout, multiprocessing.TimeoutError):
    """``step_wait``/``reset_wait`` ran out of time: what AsyncVectorEnv raises
    (``multiprocessing.TimeoutError``), and a :class:`~boltzlabs_gym.errors.WorkerTimeout`."""


class SubEnvSpaceError(BoltzLabsError, RuntimeError):
    """The envs' spaces do not fit together (``SyncVectorEnv`` raises ``RuntimeError`` alike)."""
