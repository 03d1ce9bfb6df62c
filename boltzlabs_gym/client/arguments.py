"""What a pool's calls are given, checked once at the boundary: each call's actions, masks and
seeds (the pool's settings are checked by :class:`~boltzlabs_gym.client.options.PoolOptions`).
Every check raises ``ValueError`` naming the argument, the value and what was expected; nothing
here keeps state.

>>> check_seeds(10, n=3)
[10, 11, 12]
>>> check_mask(None, n=2).tolist()
[True, True]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..wire.protocol import jsonable

__all__ = ["check_actions", "check_mask", "check_seeds"]


def check_actions(actions: Sequence[Any], n: int) -> list:
    """One JSON-serialisable action per env."""
    if isinstance(actions, (str, bytes, dict)) or not hasattr(actions, "__len__"):
        raise ValueError(f"actions must be a sequence of {n} actions, got {type(actions).__name__}")
    if len(actions) != n:
        raise ValueError(f"expected exactly {n} actions (one per env), got {len(actions)}")
    out = []
    for i, a in enumerate(actions):
        try:
            out.append(jsonable(a))
        except TypeError as exc:
            raise ValueError(f"action for env {i} is not JSON-serialisable: {exc}") from None
    return out


def check_mask(where: Any, n: int) -> np.ndarray:
    """``where`` as a boolean mask of the ``n`` envs (``None``: all of them)."""
    if where is None:
        return np.ones(n, dtype=bool)
    mask = np.asarray(where)
    if mask.shape != (n,) or mask.dtype != np.bool_:
        raise ValueError(f"where must be a boolean mask of shape ({n},), got dtype {mask.dtype} shape {mask.shape}")
    return mask


def check_seeds(seed: Any, n: int) -> list:
    """One seed (or ``None``) per env: an int gives env ``i`` the seed ``seed + i``."""
    if seed is None:
        return [None] * n
    if isinstance(seed, (int, np.integer)) and not isinstance(seed, bool):
        return [int(seed) + i for i in range(n)]
    if isinstance(seed, (list, tuple, np.ndarray)):
        if len(seed) != n:
            raise ValueError(f"expected {n} seeds (one per env), got {len(seed)}")
        out = []
        for i, s in enumerate(seed):
            if s is not None and not (isinstance(s, (int, np.integer)) and not isinstance(s, bool)):
                raise ValueError(f"seed for env {i} must be an int or None, got {s!r}")
            out.append(None if s is None else int(s))
        return out
    raise ValueError(f"seed must be an int, a list of {n} ints, or None; got {type(seed).__name__}")
