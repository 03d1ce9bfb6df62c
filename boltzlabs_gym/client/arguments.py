"""What a pool is given, checked once at the boundary: its constructor's options, and each call's
actions, masks and seeds. Every check raises ``ValueError`` naming the option, the value and
what was expected; nothing here keeps state.

>>> check_seeds(10, n=3)
[10, 11, 12]
>>> check_mask(None, n=2).tolist()
[True, True]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..wire.protocol import check_poll_us, jsonable
from .grouping import check_envs_per_sandbox

__all__ = ["MODES", "check_actions", "check_mask", "check_pool_options", "check_seeds", "check_worker_options"]

MODES = ("default", "boltz")


def check_pool_options(
    n: object,
    mode: object,
    timeouts: dict[str, object],
    busy_poll_us: object,
    env_aslr: object,
    direct: object,
    envs_per_sandbox: object,
) -> tuple[float, int]:
    """The options every pool has; ``busy_poll_us`` and ``envs_per_sandbox`` as the pool keeps them.

    ``timeouts``: ``{"step_timeout": seconds, ...}``, each a positive number.
    """
    if type(n) is not int or n < 1:
        raise ValueError(f"n must be a positive int, got {n!r}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    for name, value in timeouts.items():
        if not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    poll_us = check_poll_us("busy_poll_us", busy_poll_us)
    if not isinstance(env_aslr, bool):
        raise ValueError(f"env_aslr must be True or False, got {env_aslr!r}")
    if not isinstance(direct, bool):
        raise ValueError(f"direct must be True or False, got {direct!r}")
    return poll_us, check_envs_per_sandbox(envs_per_sandbox)


def check_worker_options(
    n: int,
    addresses: Sequence[str] | None,
    *,
    from_source: bool,
    envs_per_sandbox: int,
    worker_loss: object,
    heartbeat_interval: float,
    heartbeat_timeout: float,
    split: Sequence[int] | None,
    metrics_port: int | None,
    snapshot_budget: object,
) -> str:
    """The options that depend on where the workers are (``addresses``: remote ones; ``None``: the
    pool starts its own); the ``worker_loss`` in force."""
    if worker_loss not in (None, "raise", "report"):
        raise ValueError(f"worker_loss must be 'raise' or 'report', got {worker_loss!r}")
    if worker_loss == "report" and (not addresses or envs_per_sandbox != 1):
        raise ValueError("worker_loss='report' is for remote workers with envs_per_sandbox=1")
    if heartbeat_interval <= 0 or heartbeat_timeout <= heartbeat_interval:
        raise ValueError("heartbeat_timeout must be greater than heartbeat_interval > 0")
    if split is not None and (not addresses or len(split) != len(addresses) or sum(split) != n or min(split) < 0):
        raise ValueError(f"split must give one count per worker and sum to n={n}, got {split!r}")
    if split is not None and any(c % envs_per_sandbox for c in list(split)[:-1]):
        raise ValueError(
            f"split counts must be multiples of envs_per_sandbox={envs_per_sandbox} (but the last): "
            f"a sandbox cannot span workers; got {split!r}"
        )
    check_metrics_port(metrics_port, addresses)
    if snapshot_budget is not None:
        if addresses:
            raise ValueError(
                "snapshot_budget is for the pool's own local worker; start remote workers with "
                "`boltzlabs-gym worker --snapshot-budget BYTES`"
            )
        if type(snapshot_budget) is not int or snapshot_budget < 0:
            raise ValueError(f"snapshot_budget must be a number of bytes >= 0, got {snapshot_budget!r}")
    default_loss = "report" if from_source and envs_per_sandbox == 1 else "raise"
    return str(worker_loss or default_loss)


def check_metrics_port(port: int | None, workers: Sequence[str] | None) -> None:
    """``metrics_port`` serves the pool's own local worker's ``/metrics``, with the ``metrics`` extra."""
    if port is None:
        return
    if workers:
        raise ValueError(
            "metrics_port is for the pool's own local worker; start remote workers with "
            "`boltzlabs-gym worker --metrics-port PORT`"
        )
    from ..extras import require
    from ..wire.metrics_port import check_port

    require("prometheus_client", "metrics", "metrics_port")
    check_port(port)


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
