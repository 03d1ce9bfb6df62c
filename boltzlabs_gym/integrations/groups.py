"""GRPO groups as forks: prepare a group's shared state once, then fork it into G copies.

A GRPO group is G attempts at one task. When the task's state takes work to set up (a repository
checked out, a task built over several steps), :func:`prepare_group` runs the set-up once, in the
group's source env, and :meth:`RLPool.fork <boltzlabs_gym.RLPool.fork>` copies it (env, workspace
files, generators) into the G slots in one batched call, instead of G set-ups. On ``mode="boltz"``
pools with the namespaces backend the copy is a memory snapshot (a fork of the env's process), which
also works for env directories in the function form (``serve(reset=, step=)``, module globals
included); elsewhere it is the portable kind (a pickled state).

``benchmarks/group_fork.py`` measures set-up once + fork against G set-ups.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..client.pool import RLPool
from ..client.results import Transition, read_step

__all__ = ["prepare_group", "step_envs"]


def step_envs(pool: RLPool, actions: Mapping[int, Any]) -> dict[int, Transition]:
    """Step only the envs named in ``actions`` (index -> action), in one batched call; their transitions."""
    pool.batch_async([(int(i), {"op": "step", "action": a}, ()) for i, a in actions.items()])
    return {r.index: read_step(r, pool.step_timeout) for r in pool.batch_wait()}


def prepare_group(
    pool: RLPool,
    source: int,
    into: Sequence[int],
    setup: Sequence[Any],
    *,
    seed: int | None = None,
    reseed: Sequence[int] | None = None,
    kind: str = "auto",
) -> list:
    """Reset env ``source``, step it through the ``setup`` actions, then fork it into the envs ``into``.

    Returns the ``n`` observations :meth:`~boltzlabs_gym.RLPool.fork` returns (each env of ``into``
    holds the source's observation). ``reseed`` gives each copy random streams of its own; ``kind``
    is the snapshot kind (``"auto"``: memory where the pool can, else portable). A set-up step whose
    env failed, or that ended the episode, raises :class:`RuntimeError` naming it: there would be
    nothing to fork.
    """
    mask = [i == source for i in range(pool.n)]
    pool.reset(seed=seed, where=mask)
    for k, action in enumerate(setup):
        t = step_envs(pool, {source: action})[source]
        if t.failure is not None or t.terminated or t.truncated:
            why = t.failure.reason if t.failure is not None else "the episode ended"
            raise RuntimeError(f"set-up step {k} of env {source} ({action!r:.60}) left nothing to fork: {why}")
    return pool.fork(source, into=list(into), reseed=reseed, kind=kind)
