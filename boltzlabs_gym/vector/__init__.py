"""The Gymnasium adapter: :class:`BoltzLabsVecEnv`, :func:`make_vec` and the exceptions they raise.

Its parts are modules of their own: ``vec_env`` (the Gymnasium API), ``step_batch`` (the buffers
and the reading of replies into them) with ``fast_paths``, ``env_spaces``, ``gym_errors``,
``send_recv`` (EnvPool's ``async_reset``/``send``/``recv``) and ``make`` (``make_vec`` and the
registered Gymnasium ids).
"""

from __future__ import annotations

from gymnasium.vector.async_vector_env import AsyncState

from .gym_errors import (
    ActionBatchError,
    AlreadyPendingCallError,
    ClosedEnvironmentError,
    NoAsyncCallError,
    SubEnvSpaceError,
    VectorTimeoutError,
)
from .make import make_vec
from .vec_env import BoltzLabsVecEnv

__all__ = [
    "BoltzLabsVecEnv",
    "make_vec",
    "AsyncState",
    "NoAsyncCallError",
    "AlreadyPendingCallError",
    "ClosedEnvironmentError",
    "ActionBatchError",
    "SubEnvSpaceError",
    "VectorTimeoutError",
]
