"""The Gymnasium adapter: :class:`BoltzLabsVecEnv`, :func:`make_vec` and the exceptions they raise.

The vector env's parts are modules of their own: ``vec_env`` (the Gymnasium API), ``make``
(``make_vec`` and the registered ids), ``send_recv`` (EnvPool's ``async_reset``/``send``/``recv``).
"""

from __future__ import annotations

from .make import make_vec
from .vec_env import (
    ActionBatchError,
    AlreadyPendingCallError,
    AsyncState,
    BoltzLabsVecEnv,
    ClosedEnvironmentError,
    NoAsyncCallError,
    SubEnvSpaceError,
    VectorTimeoutError,
)

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
