"""BoltzLabsVecEnv: a Gymnasium ``VectorEnv`` whose envs live in sandboxed, resident processes.

Built like Gymnasium's own vectorizers, so code written for them switches by the
class name alone::

    >>> import gymnasium as gym                                          # doctest: +SKIP
    >>> from boltzlabs_gym import BoltzLabsVecEnv                        # doctest: +SKIP
    >>> envs = BoltzLabsVecEnv([lambda: gym.make("CartPole-v1")] * 8)    # doctest: +SKIP
    >>> obs, infos = envs.reset(seed=42)                                 # doctest: +SKIP
    >>> obs, rewards, terms, truncs, infos = envs.step(envs.action_space.sample())  # doctest: +SKIP

Every ``step`` is one batched request: in ``NEXT_STEP`` mode the envs that finished
on the previous step are reset inside that same request. ``SAME_STEP`` envs reset
themselves in-process and return the final and the new observation in one reply.
An env that misses ``step_timeout`` or crashes comes back truncated, with a zero
observation and ``infos["boltzlabs_straggler"]`` / ``infos["boltzlabs_error"]`` (dicts of
arrays ``kind``, ``reason``, ``stderr``, ``deadline_s`` with ``_`` masks, the shape of
:mod:`boltzlabs_gym.client.results`); it is respawned and reset on the next step without an
extra round trip.

The class is the Gymnasium API and its state machine (``step_async``/``step_wait``); the buffers
and the reading of every reply into them are its step batch's (:mod:`~boltzlabs_gym.vector.step_batch`),
the spaces are chosen in :mod:`~boltzlabs_gym.vector.env_spaces`, and EnvPool's send/recv is
:mod:`~boltzlabs_gym.vector.send_recv`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.utils import seeding
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.async_vector_env import AsyncState
from typing_extensions import Unpack

from ..client.options import PoolOptions, PoolSettings
from ..client.pool import RLPool
from ..client.results import read_value
from ..client.snapshot import Snapshot
from ..client.sources import WorkerSource
from ..client.stats import PoolStats
from ..errors import WorkerTimeout
from ..wire import codec
from .env_spaces import describe_envs, env_spaces
from .gym_errors import AlreadyPendingCallError, ClosedEnvironmentError, NoAsyncCallError, VectorTimeoutError
from .send_recv import SendRecv, check_batch_size
from .step_batch import StepBatch

__all__ = ["BoltzLabsVecEnv"]


def _autoreset_mode(mode: AutoresetMode | str) -> AutoresetMode:
    if isinstance(mode, AutoresetMode):
        return mode
    try:
        return AutoresetMode(mode)
    except ValueError:
        raise ValueError(f"autoreset_mode must be one of {[m.value for m in AutoresetMode]}, got {mode!r}") from None


class BoltzLabsVecEnv(VectorEnv):
    """A Gymnasium vector env over an :class:`~boltzlabs_gym.RLPool` of sandboxed envs.

    Args:
        env_fns: env factories, one per env, as for ``SyncVectorEnv``; each is
            cloudpickled into its own sandbox and called there.
        autoreset_mode: ``NEXT_STEP`` (default), ``SAME_STEP`` or ``DISABLED``.
        copy: return copies of the observation batch (as Gymnasium's vectorizers do).
        observation_mode: as for ``SyncVectorEnv``: ``"same"`` (every env has env 0's
            observation space), ``"different"`` (same shape and dtype, other bounds:
            ``batch_differing_spaces``) or a tuple ``(observation_space, single_observation_space)``.
        batch_size: how many envs :meth:`recv` hands back, the first to finish (EnvPool's async
            mode, with :meth:`async_reset`, :meth:`send` and :meth:`recv`; see
            :mod:`boltzlabs_gym.vector.send_recv`); default ``num_envs``. ``step`` and ``reset`` are
            unchanged.
        workers, options, settings: the pool's, as :class:`~boltzlabs_gym.RLPool` takes them
            (``options``: a :class:`~boltzlabs_gym.client.options.PoolOptions`; keyword settings
            ``isolation``, ``step_timeout``, ``limits``, ``envs_per_sandbox``, ... over it). With
            ``envs_per_sandbox=K`` each sandbox's envs come back as one block of
            observations, rewards and flags, stored by slicing.

    Use :meth:`from_env_dir` for an env directory, or
    :func:`boltzlabs_gym.make_vec` for a Gymnasium id.
    """

    def __init__(
        self,
        env_fns: Sequence[Callable[[], gym.Env]] | None = None,
        *,
        autoreset_mode: AutoresetMode | str = AutoresetMode.NEXT_STEP,
        copy: bool = True,
        observation_mode: str | tuple[gym.Space, gym.Space] = "same",
        pool: RLPool | None = None,
        batch_size: int | None = None,
        workers: Sequence[str] | WorkerSource | None = None,
        options: PoolOptions | None = None,
        **settings: Unpack[PoolSettings],
    ):
        self.autoreset_mode = _autoreset_mode(autoreset_mode)
        self.copy = copy
        self.observation_mode = observation_mode
        self.closed = False
        self._state = AsyncState.DEFAULT
        self._pool: RLPool | None = None
        if pool is None:
            if env_fns is None or len(env_fns) == 0:
                raise ValueError("BoltzLabsVecEnv needs a non-empty list of env factories (or pool=...)")
            for i, fn in enumerate(env_fns):
                if not callable(fn):
                    raise TypeError(
                        f"env_fns[{i}] must be a callable returning a gymnasium.Env, got {type(fn).__name__}"
                    )
            pool = _pool_from_factories(list(env_fns), workers, PoolOptions.fold(options, settings))
        elif env_fns is not None or workers is not None or options is not None or settings:
            raise ValueError("pass either env_fns (with pool settings) or an existing pool=, not both")
        self._pool = pool
        try:
            self.num_envs = pool.n
            described = describe_envs(pool)
            d = described[0]
            spaces = env_spaces(described, observation_mode, self.num_envs)
            self.single_action_space, self.action_space = spaces.single_action_space, spaces.action_space
            self.single_observation_space = spaces.single_observation_space
            self.observation_space = spaces.observation_space
            env_meta = d.get("metadata")
            self.metadata = dict(env_meta) if isinstance(env_meta, dict) else {}
            self.metadata["autoreset_mode"] = self.autoreset_mode
            self.metadata.setdefault("render_modes", [])
            self.render_mode = d.get("render_mode")
            self._max_episode_steps = d.get("max_episode_steps")
            #: The buffers, and how every reply is read into them.
            self._batch = StepBatch(pool, spaces, gym_host=d.get("server") == "gym")
            #: How many envs :meth:`recv` returns (EnvPool's ``batch_size``).
            self.batch_size = check_batch_size(batch_size, self.num_envs)
            self._send_recv = SendRecv(self._batch, self.batch_size)
        except BaseException:
            pool.close()
            raise

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_env_dir(
        cls,
        env_dir: str | os.PathLike,
        num_envs: int,
        *,
        autoreset_mode: AutoresetMode | str = AutoresetMode.NEXT_STEP,
        copy: bool = True,
        observation_mode: str | tuple[gym.Space, gym.Space] = "same",
        batch_size: int | None = None,
        workers: Sequence[str] | WorkerSource | None = None,
        options: PoolOptions | None = None,
        **settings: Unpack[PoolSettings],
    ) -> BoltzLabsVecEnv:
        """A vector env over an env directory (``env.py`` calling ``serve``)."""
        check_batch_size(batch_size, num_envs)
        pool = RLPool(env_dir, num_envs, workers=workers, options=PoolOptions.fold(options, settings))
        return cls(
            pool=pool,
            autoreset_mode=autoreset_mode,
            copy=copy,
            observation_mode=observation_mode,
            batch_size=batch_size,
        )

    @property
    def pool(self) -> RLPool:
        """The underlying :class:`~boltzlabs_gym.RLPool` (timing, memory, isolation)."""
        if self._pool is None:
            raise ClosedEnvironmentError("this vector env is closed")
        return self._pool

    # VectorEnv declares an int; SyncVectorEnv and AsyncVectorEnv return every env's seed as a tuple, and so do we.
    @property
    def np_random_seed(self) -> tuple:  # type: ignore[override]
        """The seed of every env's random generator, as a tuple (what ``SyncVectorEnv`` returns).

        Env directories served by ``serve()`` have no Gymnasium ``np_random_seed``: for them,
        the seed each env was last reset with (``None`` if it never was).
        """
        if self._batch.gym_host:
            return self.get_attr("np_random_seed")
        self._check_open()
        return tuple(self._batch.env_seeds)

    @property
    def isolation(self):
        return self.pool.isolation

    def stats(self, memory: bool = True) -> PoolStats:
        """The pool's figures as one frozen snapshot: :meth:`RLPool.stats() <boltzlabs_gym.RLPool.stats>`."""
        return self.pool.stats(memory)

    # ------------------------------------------------------------------ reset
    def reset(self, *, seed: int | Sequence[int | None] | None = None, options: dict[str, Any] | None = None):
        """Reset all envs, or those in ``options["reset_mask"]``; returns ``(obs, infos)``.

        ``seed``: an int gives env ``i`` the seed ``seed + i``; a list gives one per env.
        ``options`` is passed to each env's reset and is never modified.
        """
        self.reset_async(seed=seed, options=options)
        return self.reset_wait()

    def reset_async(
        self, seed: int | Sequence[int | None] | None = None, options: dict[str, Any] | None = None
    ) -> None:
        """Send the batched reset of :meth:`reset`; collect it with :meth:`reset_wait`."""
        self._check_open()
        n = self.num_envs
        seeds: list[int | None]
        # An int seed gives env i the seed seed + i, and seeds the vector env's own generator.
        base = int(seed) if isinstance(seed, (int, np.integer)) and not isinstance(seed, bool) else None
        if seed is None:
            seeds = [None] * n
        elif base is not None:
            seeds = [base + i for i in range(n)]
        else:
            seeds = list(seed)  # type: ignore[arg-type]  # a bool seed lands here too: list() refuses it (TypeError)
            if len(seeds) != n:
                raise ValueError(
                    f"If seeds are passed as a list the length must match num_envs={n} but got length={len(seeds)}."
                )
        self._check_idle("reset_async")
        env_options = dict(options) if options else None  # never mutate the caller's dict
        mask = None
        if env_options is not None and "reset_mask" in env_options:
            mask = _validate_reset_mask(env_options.pop("reset_mask"), n)
        self._batch.send_resets(seeds, mask, env_options)
        self._state = AsyncState.WAITING_RESET
        if base is not None:
            self._np_random, self._np_random_seed = seeding.np_random(base)

    def reset_wait(self, timeout: float | None = None):
        """Return ``(obs, infos)`` of :meth:`reset_async`'s reset."""
        self._check_open()
        if self._state is not AsyncState.WAITING_RESET:
            raise NoAsyncCallError(
                "Calling `reset_wait` without any prior call to `reset_async`.", AsyncState.WAITING_RESET.value
            )
        self._state = AsyncState.DEFAULT  # whatever happens below, this call is over
        return self._batch.collect_resets(timeout, self.autoreset_mode, self.copy)

    # ------------------------------------------------------------------ step
    def step(self, actions: Any):
        """Step every env (finished ones are reset in the same request in NEXT_STEP mode)."""
        self.step_async(actions)
        return self.step_wait()

    def step_async(self, actions: Any) -> None:
        """Send the batched step; collect it with :meth:`step_wait`."""
        self._check_open()
        self._check_idle("step_async")
        self._batch.send_step(actions, self.autoreset_mode)
        self._state = AsyncState.WAITING_STEP

    def step_wait(self, timeout: float | None = None):
        """Return ``(obs, rewards, terminations, truncations, infos)`` of :meth:`step_async`'s step."""
        self._check_open()
        if self._state is not AsyncState.WAITING_STEP:
            raise NoAsyncCallError(
                "Calling `step_wait` without any prior call to `step_async`.", AsyncState.WAITING_STEP.value
            )
        self._state = AsyncState.DEFAULT  # whatever happens below, this call is over
        return self._batch.collect_step(timeout, self.autoreset_mode, self.copy)

    def _check_idle(self, call: str) -> None:
        """Refuse ``call`` while a ``step_async``/``reset_async`` waits for its ``*_wait``."""
        if self._state is not AsyncState.DEFAULT:
            raise AlreadyPendingCallError(
                f"Calling `{call}` while waiting for a pending call to `{self._state.value}` to complete.",
                self._state.value,
            )

    # ------------------------------------------------------------------ EnvPool's async API
    def async_reset(self, seed: int | Sequence[int | None] | None = None, options: dict | None = None) -> None:
        """Start a reset of every env and return at once; :meth:`recv` collects the first
        ``batch_size`` (EnvPool's ``async_reset``; see :mod:`boltzlabs_gym.vector.send_recv`).

        >>> envs = boltzlabs_gym.make_vec("CartPole-v1", num_envs=8, batch_size=4)   # doctest: +SKIP
        >>> envs.async_reset(seed=0)                                                # doctest: +SKIP
        >>> obs, rew, term, trunc, info = envs.recv()                                # doctest: +SKIP
        >>> info["env_id"]                                                           # doctest: +SKIP
        array([2, 0, 1, 3], dtype=int32)
        """
        self._check_idle("async_reset")
        self._check_open()
        self._send_recv.async_reset(seed, options)

    def send(self, actions: Any, env_id: Any = None) -> None:
        """Start a step of each env of ``env_id`` (default: the envs of the last :meth:`recv`) with
        its row of ``actions``, and return at once (EnvPool's ``send``). An env whose episode
        ended is reset instead in ``NEXT_STEP`` mode. Sending to an env in flight raises
        :class:`~boltzlabs_gym.errors.AsyncStateError` naming it.

        >>> envs.send(np.array([0, 1, 1, 0]), info["env_id"])                       # doctest: +SKIP
        """
        self._check_idle("send")
        self._check_open()
        self._send_recv.send(actions, env_id, self.autoreset_mode)

    def recv(self, timeout: float | None = None):
        """``(obs, rewards, terminations, truncations, infos)`` of the first ``batch_size`` envs to
        finish what :meth:`send`/:meth:`async_reset` started, in finishing order;
        ``infos["env_id"]`` says which (EnvPool's ``recv``)."""
        self._check_idle("recv")
        self._check_open()
        try:
            return self._send_recv.recv(timeout, self.autoreset_mode, self.copy)
        except WorkerTimeout as exc:
            raise VectorTimeoutError(str(exc), getattr(exc, "worker", None)) from exc

    # ------------------------------------------------------------------ snapshots
    def snapshot(self, index: int, kind: str = "auto") -> Snapshot:
        """Env ``index``'s full state now, as a :class:`~boltzlabs_gym.client.snapshot.Snapshot` (see
        :meth:`RLPool.snapshot <boltzlabs_gym.client.pool.RLPool.snapshot>`); it also keeps whether the env
        is due an autoreset, which a restored copy then is too.

        >>> envs = boltzlabs_gym.make_vec("CartPole-v1", num_envs=8)   # doctest: +SKIP
        >>> obs, infos = envs.reset(seed=0)                            # doctest: +SKIP
        >>> snap = envs.snapshot(0)                                    # doctest: +SKIP
        >>> obs, infos = envs.restore(snap, [1, 2])                    # doctest: +SKIP
        """
        self._check_open()
        self._check_idle("snapshot")
        return self.pool.snapshot(index, kind=kind, meta=self._batch.snapshot_meta(index, "snapshot"))

    def restore(
        self,
        snap: Snapshot,
        indices: Sequence[int] | np.ndarray,
        *,
        reseed: Sequence[int] | None = None,
        fresh: bool = False,
    ):
        """Make the envs ``indices`` exact copies of ``snap``; returns ``(obs, infos)`` batched as
        :meth:`reset` does (every env's observation; infos of the restored envs only).

        A copy's episode goes on where the snapshot's was: the same observation, and an autoreset
        still due if one was. ``reseed`` gives each copy its own random streams, and ``fresh=True``
        a new process in a new sandbox (see :meth:`RLPool.restore <boltzlabs_gym.client.pool.RLPool.restore>`).
        """
        self._check_open()
        self._check_idle("restore")
        results = self.pool.snapshot_keeper.restore(snap, indices, reseed=reseed, fresh=fresh)
        return self._batch.take_restored(results, snap.meta, reseed, self.autoreset_mode, self.copy)

    def fork(
        self,
        index: int,
        into: Sequence[int] | np.ndarray,
        reseed: Sequence[int] | None = None,
        fresh: bool = False,
        kind: str = "auto",
    ):
        """Branch env ``index`` into the envs ``into`` (snapshot, restore, release); ``(obs, infos)``
        as :meth:`restore` returns them.

        >>> obs, infos = envs.fork(0, into=[1, 2, 3], reseed=[11, 12, 13])   # doctest: +SKIP
        """
        self._check_open()
        self._check_idle("fork")
        meta = self._batch.snapshot_meta(index, "fork")
        results = self.pool.snapshot_keeper.fork(index, into, reseed=reseed, fresh=fresh, kind=kind, meta=meta)
        return self._batch.take_restored(results, meta, reseed, self.autoreset_mode, self.copy)

    # ------------------------------------------------------------------ attributes
    def call(self, name: str, *args: Any, **kwargs: Any) -> tuple:
        """Call ``name(*args, **kwargs)`` on every env (or read it, if not callable); numpy
        arrays among the arguments cross as arrays (raw bytes, never pickled)."""
        self._check_open()
        _require_gym_host(self._batch.gym_host, "call")
        args_obj, payloads = codec.encode_info(list(args))
        kwargs_obj, payloads = codec.encode_info(dict(kwargs), payloads)
        op = {"op": "call", "name": name, "args": args_obj, "kwargs": kwargs_obj}
        self._check_idle(f"call({name!r})")
        return _call_all(self.pool, self.num_envs, op, f"call({name!r})", payloads)

    def get_attr(self, name: str) -> tuple:
        """The attribute ``name`` of every env (callables are called, as in Gymnasium)."""
        return self.call(name)

    def set_attr(self, name: str, values: Any) -> None:
        """Set ``name`` on every env: one value for all, or a list/tuple with one per env."""
        self._check_open()
        _require_gym_host(self._batch.gym_host, "set_attr")
        if not isinstance(values, (list, tuple)):
            values = [values] * self.num_envs
        if len(values) != self.num_envs:
            raise ValueError(f"values must have length num_envs={self.num_envs}, got {len(values)}")
        items = []
        for i, v in enumerate(values):
            obj, payloads = codec.encode_info(v)  # arrays cross as raw payloads
            items.append((i, {"op": "set_attr", "name": name, "value": obj}, payloads))
        self._check_idle(f"set_attr({name!r})")
        self.pool.batch_async(items)
        for r in self.pool.batch_wait():
            read_value(r, f"set_attr({name!r})")

    def render(self) -> tuple | None:
        """One frame per env (``render_mode="rgb_array"``), as a tuple."""
        self._check_open()
        _require_gym_host(self._batch.gym_host, "render")
        if self.render_mode is None:
            return None
        self._check_idle("render")
        return _call_all(self.pool, self.num_envs, {"op": "render"}, "render")

    # ------------------------------------------------------------------ closing
    def _check_open(self) -> None:
        if self.closed or self._pool is None:
            raise ClosedEnvironmentError("this vector env is closed")

    def close_extras(self, **kwargs: Any) -> None:
        if self._state is not AsyncState.DEFAULT:
            # As AsyncVectorEnv warns; closing the pool is bounded, so nothing is waited for.
            gym.logger.warn(f"Calling `close` while waiting for a pending call to `{self._state.value}` to complete.")
            self._state = AsyncState.DEFAULT
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def __repr__(self) -> str:
        return f"BoltzLabsVecEnv(num_envs={getattr(self, 'num_envs', '?')}, autoreset_mode={self.autoreset_mode.value})"


def _require_gym_host(gym_host: bool, what: str) -> None:
    if not gym_host:
        raise NotImplementedError(f"{what} needs a Gymnasium env; env directories served by serve() do not support it")


def _call_all(pool: RLPool, n: int, op: dict, what: str, payloads: Sequence[bytes] = ()) -> tuple:
    """Every env's answer to ``op`` (``call``, ``render``), decoded (arrays as arrays)."""
    pool.batch_async([(i, op, payloads) for i in range(n)])
    return tuple(read_value(r, what, _decode_value) for r in pool.batch_wait())


def _decode_value(obj: Any, payloads: list) -> Any:
    return codec.decode_info(obj, payloads, copy=True)


def _validate_reset_mask(mask: Any, n: int) -> np.ndarray:
    if not isinstance(mask, np.ndarray):
        raise TypeError(f"`options['reset_mask']` must be a numpy array, got {type(mask)}")
    if mask.shape != (n,):
        raise ValueError(f"`options['reset_mask']` must have shape `({n},)`, got {mask.shape}")
    if mask.dtype != np.bool_:
        raise TypeError(f"`options['reset_mask']` must have `dtype=np.bool_`, got {mask.dtype}")
    if not mask.any():
        raise ValueError(
            f"`options['reset_mask']` must contain a boolean array with at least one True value, got reset_mask={mask}"
        )
    return mask


def _pool_from_factories(env_fns: list, workers: Sequence[str] | WorkerSource | None, options: PoolOptions) -> RLPool:
    """Write the factories into a throwaway env dir, pack it into a pool, remove the dir."""
    from .factory_env_dir import write_factory_env_dir

    tmp = tempfile.mkdtemp(prefix="boltzlabs-factories-")
    try:
        write_factory_env_dir(tmp, env_fns)
        return RLPool(tmp, len(env_fns), workers=workers, options=options)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
