"""``make_vec``: build a :class:`BoltzLabsVecEnv` the way ``gymnasium.make_vec`` builds its own.

Each of these starts a pool of sandboxed envs, so they are not run as doctests::

    import boltzlabs_gym
    envs = boltzlabs_gym.make_vec("CartPole-v1", num_envs=16)               # a Gymnasium id
    envs = boltzlabs_gym.make_vec(lambda: MyEnv(level=3), num_envs=16)      # a factory
    envs = boltzlabs_gym.make_vec("./envs/code_env", num_envs=16)           # an env directory

The package also registers its example envs with Gymnasium, so
``gym.make_vec("boltzlabs_gym:BoltzLabsCartPole-v0", num_envs=8,
vectorization_mode="vector_entry_point")`` builds a ``BoltzLabsVecEnv``
(ids: ``BoltzLabsCartPole-v0``, ``BoltzLabsPendulum-v0``, ``BoltzLabsMountainCar-v0``).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import gymnasium as gym
from gymnasium.vector import AutoresetMode

from ..client.options import SETTINGS, UNSET, PoolOptions, Unset, given_settings
from ..client.sources import WorkerSource
from ..envside.factories import make_env
from ..wire.keys import ClientKeys
from ..wire.limits import Limits
from .vec_env import BoltzLabsVecEnv

__all__ = ["make_vec", "register_envs", "vector_entry_point"]

#: Keywords that belong to the pool rather than to the envs: every pool setting (the fields of
#: :class:`~boltzlabs_gym.client.options.PoolOptions`), ``workers`` and ``options``.
POOL_OPTIONS = (*SETTINGS, "workers", "options")


#: Arguments of the vectorizer itself (as SyncVectorEnv's), not of the envs.
VECTOR_OPTIONS = ("autoreset_mode", "copy", "observation_mode", "batch_size")


def _split_pool_options(kwargs: dict) -> tuple[dict, dict]:
    pool = {k: kwargs.pop(k) for k in POOL_OPTIONS if k in kwargs}
    return pool, kwargs


def make_vec(
    env_id: str | os.PathLike | Callable[..., gym.Env],
    num_envs: int = 1,
    *,
    vector_kwargs: dict[str, Any] | None = None,
    wrappers: Sequence[Callable[[gym.Env], gym.Wrapper]] | None = None,
    autoreset_mode: AutoresetMode | str = AutoresetMode.NEXT_STEP,
    batch_size: int | None = None,
    workers: Sequence[str] | WorkerSource | None = None,
    options: PoolOptions | None = None,
    # The pool's settings: PoolOptions' fields, as explicit parameters so that a type checker sees
    # them beside the env's own kwargs (a test holds them to the fields' names and types).
    isolation: str | Unset = UNSET,
    mode: str | Unset = UNSET,
    step_timeout: float | Unset = UNSET,
    reset_timeout: float | Unset = UNSET,
    start_timeout: float | Unset = UNSET,
    limits: Limits | Unset = UNSET,
    serialize_measurement: bool | Unset = UNSET,
    env_vars: Mapping[str, str] | Unset = UNSET,
    keys: str | os.PathLike | ClientKeys | None | Unset = UNSET,
    split: Sequence[int] | None | Unset = UNSET,
    heartbeat_interval: float | Unset = UNSET,
    heartbeat_timeout: float | Unset = UNSET,
    lease: float | Unset = UNSET,
    busy_poll_us: float | Unset = UNSET,
    env_aslr: bool | Unset = UNSET,
    env_python: str | None | Unset = UNSET,
    nested_user_namespaces: bool | Unset = UNSET,
    direct: bool | Unset = UNSET,
    shared_obs: bool | Unset = UNSET,
    envs_per_sandbox: int | Unset = UNSET,
    metrics_port: int | None | Unset = UNSET,
    snapshot_budget: int | None | Unset = UNSET,
    worker_loss: str | None | Unset = UNSET,
    **env_kwargs: Any,
) -> BoltzLabsVecEnv:
    """Create a sandboxed vector env from a Gymnasium id, an env factory or an env directory.

    Args:
        env_id: a registered Gymnasium id (``"CartPole-v1"``), a callable returning an
            env (cloudpickled into every sandbox), or the path of an env directory.
        num_envs: number of envs.
        vector_kwargs: extra arguments for :class:`BoltzLabsVecEnv` (``autoreset_mode``, ``copy``,
            ``observation_mode``, pool options), as ``gymnasium.make_vec`` takes them.
        wrappers: Gymnasium wrappers applied to each env *inside* its sandbox.
        autoreset_mode: ``NEXT_STEP`` (default), ``SAME_STEP`` or ``DISABLED``.
        batch_size: how many envs ``recv()`` returns, the first to finish (EnvPool's async mode:
            ``async_reset()``, ``send(actions, env_id)``, ``recv()``; see
            :mod:`boltzlabs_gym.vector.send_recv`); default ``num_envs``.
        workers: remote worker addresses or a worker source (default: a local worker).
        options: the pool's settings as one :class:`~boltzlabs_gym.client.options.PoolOptions`;
            a setting given as a keyword overrides its field.
        isolation, mode, step_timeout, ...: the pool's settings, one per field of
            :class:`~boltzlabs_gym.client.options.PoolOptions` (see there for each), checked by it.
            ``envs_per_sandbox=K`` puts K envs in each sandboxed process: much faster for cheap,
            trusted envs; keep the default 1 for untrusted code (see :class:`~boltzlabs_gym.RLPool`).
        **env_kwargs: for ids and factories, the env's own kwargs (as ``gymnasium.make_vec``
            takes them).
    """
    settings = given_settings(locals())
    if type(num_envs) is not int or num_envs < 1:
        raise ValueError(f"num_envs must be a positive int, got {num_envs!r}")
    vector_kwargs = dict(vector_kwargs or {})
    # gym.make_vec's form: the vectorizer's own arguments in vector_kwargs.
    autoreset_mode = vector_kwargs.pop("autoreset_mode", autoreset_mode)
    vector_kwargs.setdefault("batch_size", batch_size)
    vector_pool, vector_kwargs = _split_pool_options(vector_kwargs)
    pool_options = {"workers": workers, "options": options, **settings, **vector_pool}
    if isinstance(env_id, (str, os.PathLike)) and os.path.isdir(os.fspath(env_id)):
        if wrappers or env_kwargs:
            raise ValueError(
                f"an env directory takes no env kwargs or wrappers (got {sorted(env_kwargs)}"
                f"{' and wrappers' if wrappers else ''}); configure the env in its env.py"
            )
        return BoltzLabsVecEnv.from_env_dir(
            env_id, num_envs, autoreset_mode=autoreset_mode, **vector_kwargs, **pool_options
        )
    if isinstance(env_id, str):
        gym.spec(env_id)  # fail here, with Gymnasium's message, not inside every sandbox
    elif not callable(env_id):
        raise TypeError(f"env_id must be a Gymnasium id, an env directory or a callable, got {type(env_id).__name__}")
    factory = functools.partial(make_env, env_id, env_kwargs, list(wrappers or ()))
    return BoltzLabsVecEnv([factory] * num_envs, autoreset_mode=autoreset_mode, **vector_kwargs, **pool_options)


def vector_entry_point(
    env_id: str, num_envs: int = 1, max_episode_steps: int | None = None, **kwargs: Any
) -> BoltzLabsVecEnv:
    """What ``gym.make_vec(..., vectorization_mode="vector_entry_point")`` calls for our ids."""
    pool_options, env_kwargs = _split_pool_options(kwargs)
    vector_options = {k: env_kwargs.pop(k) for k in VECTOR_OPTIONS if k in env_kwargs}
    if max_episode_steps is not None:
        env_kwargs["max_episode_steps"] = max_episode_steps
    factory = functools.partial(make_env, env_id, env_kwargs, [])
    return BoltzLabsVecEnv([factory] * num_envs, **vector_options, **pool_options)


#: Example envs: (Gymnasium id of ours, the env it runs, its own kwargs).
#: Users write ``gym.make_vec("boltzlabs_gym:BoltzLabsCartPole-v0", num_envs=8,
#: vectorization_mode="vector_entry_point")``; the prefix makes Gymnasium import us.
_REGISTERED = {
    "BoltzLabsCartPole-v0": "CartPole-v1",
    "BoltzLabsPendulum-v0": "Pendulum-v1",
    "BoltzLabsMountainCar-v0": "MountainCar-v0",
}


def register_envs() -> None:
    """Register the example envs with a ``vector_entry_point`` (idempotent)."""
    for our_id, inner_id in _REGISTERED.items():
        if our_id in gym.registry:
            continue
        gym.register(
            id=our_id,
            entry_point=None,
            vector_entry_point=functools.partial(vector_entry_point, inner_id),
        )
