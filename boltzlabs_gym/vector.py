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
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from copy import deepcopy
from typing import Any, cast

import gymnasium as gym
import numpy as np
from gymnasium import error as gym_error
from gymnasium.spaces.utils import is_space_dtype_shape_equiv
from gymnasium.utils import seeding
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.async_vector_env import AsyncState
from gymnasium.vector.utils import batch_differing_spaces, batch_space, concatenate, create_empty_array, iterate

from .client.grouping import GroupReply, GroupResult
from .client.pool import OK, RLPool
from .client.results import EnvResult, ResetOutcome, Transition, parse_result, read_reset, read_step, read_value
from .client.snapshot import Snapshot
from .client.stats import PoolStats
from .errors import AsyncStateError, BoltzLabsError, EnvStartError, PoolClosedError, WorkerTimeout
from .vector_async import SendRecv, check_batch_size
from .wire import codec, slot_layout
from .wire.protocol import FLAG_TERMINATED, FLAG_TRUNCATED
from .wire.spaces import JsonSpace, seed_space_from_json, space_from_json

__all__ = [
    "BoltzLabsVecEnv",
    "AsyncState",
    "NoAsyncCallError",
    "AlreadyPendingCallError",
    "ClosedEnvironmentError",
    "ActionBatchError",
    "SubEnvSpaceError",
    "VectorTimeoutError",
]


# Gymnasium's vectorizers raise Gymnasium's exceptions; ours are those same classes (code that
# catches Gymnasium's catches ours) and also members of our own tree (BoltzLabsError).


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
            :mod:`boltzlabs_gym.vector_async`); default ``num_envs``. ``step`` and ``reset`` are
            unchanged.
        pool_kwargs: passed to :class:`~boltzlabs_gym.RLPool` (``isolation``,
            ``step_timeout``, ``workers``, ``limits``, ``envs_per_sandbox``, ...). With
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
        **pool_kwargs: Any,
    ):
        self.autoreset_mode = _autoreset_mode(autoreset_mode)
        self._batch_size = batch_size
        self._send_recv: SendRecv | None = None
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
            pool = _pool_from_factories(list(env_fns), pool_kwargs)
        elif env_fns is not None or pool_kwargs:
            raise ValueError("pass either env_fns (with pool options) or an existing pool=, not both")
        self._pool = pool
        try:
            self._setup_from_pool(observation_mode)
            #: How many envs :meth:`recv` returns (EnvPool's ``batch_size``).
            self.batch_size = check_batch_size(batch_size, self.num_envs)
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
        **pool_kwargs: Any,
    ) -> BoltzLabsVecEnv:
        """A vector env over an env directory (``env.py`` calling ``serve``)."""
        check_batch_size(batch_size, num_envs)
        pool = RLPool(env_dir, num_envs, **pool_kwargs)
        return cls(
            pool=pool,
            autoreset_mode=autoreset_mode,
            copy=copy,
            observation_mode=observation_mode,
            batch_size=batch_size,
        )

    def _describe_envs(self) -> list[dict]:
        """Every env's ``describe`` reply, in one batched call."""
        replies = []
        for r in self.pool.call_envs({"op": "describe"}):
            reply = cast(dict, r.reply)  # call_envs parses every reply (it is not raw)
            if r.status != OK or "error" in reply:
                raise EnvStartError(
                    f"env {r.index} could not describe itself: {reply}",
                    index=r.index,
                    stderr_tail=str(reply.get("stderr", "")),
                )
            replies.append(reply)
        return replies

    def _setup_from_pool(self, observation_mode: str | tuple[gym.Space, gym.Space]) -> None:
        self.num_envs = self.pool.n
        described = self._describe_envs()
        d = described[0]
        self._gym_server = d.get("server") == "gym"
        obs_spaces = _spaces_of(described, "observation_space")
        action_spaces = _spaces_of(described, "action_space")
        # As SyncVectorEnv batches env 0's own spaces (batch_space copies their generators), the
        # batched spaces sample what env 0's would: a seed its factory gave them carries over.
        seed_space_from_json(obs_spaces[0], d.get("observation_space_rng"))
        seed_space_from_json(action_spaces[0], d.get("action_space_rng"))
        self.single_action_space = action_spaces[0]
        self.action_space = batch_space(self.single_action_space, self.num_envs)
        self._set_observation_spaces(observation_mode, obs_spaces)
        _check_env_spaces(
            observation_mode, self.single_observation_space, self.single_action_space, obs_spaces, action_spaces
        )
        env_meta = d.get("metadata")
        self.metadata = dict(env_meta) if isinstance(env_meta, dict) else {}
        self.metadata["autoreset_mode"] = self.autoreset_mode
        self.metadata.setdefault("render_modes", [])
        self.render_mode = d.get("render_mode")
        self._max_episode_steps = d.get("max_episode_steps")
        # Gym servers send array observations as one payload: the fast, equally strict decoder.
        self._obs_leaf = codec.ArrayLeaf.of(self.single_observation_space) if self._gym_server else None
        # Each env's observations are decoded against its own space (they differ in bounds with
        # observation_mode="different"); one decoder for all when every env has the same space.
        self._obs_decoders = [
            self._decode_obs if space is obs_spaces[0] else functools.partial(self._decode_obs_of, space)
            for space in obs_spaces
        ]
        self._obs_spaces = obs_spaces
        self._env_seeds: list[int | None] = [None] * self.num_envs
        self._discrete_action = self._gym_server and isinstance(self.single_action_space, gym.spaces.Discrete)
        self._zero_obs = _zero_observation(self.single_observation_space)
        self._env_obs: list = [deepcopy(self._zero_obs) for _ in range(self.num_envs)]
        self._observations = create_empty_array(self.single_observation_space, self.num_envs, np.zeros)
        self._set_array_rows(obs_spaces)
        #: One observation's skeleton in a group reply's rows (several envs per sandbox): an array
        #: space's, or a Dict/Tuple of arrays only's; None when the space has no rows.
        self._row_skeleton = (
            self._obs_leaf.skeleton
            if self._obs_leaf is not None
            else slot_layout.array_skeleton(self.single_observation_space)
            if self._gym_server
            else None
        )
        #: Whether rows are written into the batch as they are read (else each env's observation
        #: is decoded against its own space).
        self._batch_rows = self._obs_leaf is not None or self._batch_leaves is not None
        self._rewards = np.zeros(self.num_envs, dtype=np.float64)
        self._terminations = np.zeros(self.num_envs, dtype=np.bool_)
        self._truncations = np.zeros(self.num_envs, dtype=np.bool_)
        self._autoreset_envs = np.zeros(self.num_envs, dtype=np.bool_)
        self._pending_reset_ops: np.ndarray | None = None
        self._pending_reset_mask: np.ndarray | None = None
        #: Several envs per sandbox: Discrete step batches go out packed per sandbox (see
        #: :meth:`~boltzlabs_gym.client.batch_calls.BatchCalls.send_steps`).
        self._grouped = self.pool.envs_per_sandbox > 1

    def _set_observation_spaces(self, observation_mode: Any, obs_spaces: list) -> None:
        """``single_observation_space`` and ``observation_space`` as ``SyncVectorEnv`` chooses them."""
        if isinstance(observation_mode, tuple) and len(observation_mode) == 2:
            if not isinstance(observation_mode[0], gym.Space) or not isinstance(observation_mode[1], gym.Space):
                raise TypeError(
                    f"Expected both elements of observation_mode to be Spaces, got "
                    f"{type(observation_mode[0])} and {type(observation_mode[1])}"
                )
            self.observation_space, self.single_observation_space = observation_mode
        elif observation_mode == "same":
            self.single_observation_space = obs_spaces[0]
            self.observation_space = batch_space(self.single_observation_space, self.num_envs)
        elif observation_mode == "different":
            self.single_observation_space = obs_spaces[0]
            self.observation_space = batch_differing_spaces(obs_spaces)
        else:
            raise ValueError(
                "Invalid `observation_mode`, expected: 'same' or 'different' or tuple of single and "
                f"batch observation space, actual got {observation_mode}"
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
        if self._gym_server:
            return self.get_attr("np_random_seed")
        self._check_open()
        return tuple(self._env_seeds)

    @property
    def isolation(self):
        return self.pool.isolation

    def stats(self, memory: bool = True) -> PoolStats:
        """The pool's figures as one frozen snapshot: :meth:`RLPool.stats() <boltzlabs_gym.RLPool.stats>`."""
        return self.pool.stats(memory)

    # ------------------------------------------------------------------ decoding
    def _decode_obs(self, obj: Any, payloads: list) -> Any:
        if self._obs_leaf is not None:
            return self._obs_leaf.decode(obj, payloads)  # validated like codec.decode, faster
        return codec.decode(self._obs_spaces[0], obj, payloads, copy=True, lenient=not self._gym_server)

    def _decode_obs_of(self, space: gym.Space, obj: Any, payloads: list) -> Any:
        """An observation of an env whose space differs from env 0's (``observation_mode="different"``)."""
        return codec.decode(space, obj, payloads, copy=True, lenient=not self._gym_server)

    def _decode_info(self, obj: Any, payloads: list) -> dict:
        if obj is None or (type(obj) is dict and not obj):
            return {}
        info = codec.decode_info(obj, payloads, copy=True)
        return info if isinstance(info, dict) else {"info": info}

    def _encode_action(self, i: int, action: Any) -> tuple[Any, list]:
        if self._discrete_action and isinstance(action, (int, np.integer)) and not isinstance(action, bool):
            return int(action), []  # the env casts it to its space's dtype, as on the int fast path
        if self._gym_server:
            return codec.encode_action(self.single_action_space, action)
        return codec.to_json_safe(action), []

    def _step_item(self, i: int, obj: Any, payloads: Sequence[bytes], mode: AutoresetMode) -> tuple:
        """Env ``i``'s step request for an encoded action (``autoreset`` in SAME_STEP mode)."""
        op = {"op": "step", "action": obj}
        if mode == AutoresetMode.SAME_STEP:
            op["autoreset"] = True
        return (i, op, payloads)

    def _encode_env_action(self, i: int, action: Any) -> tuple[Any, list]:
        """:meth:`_encode_action`, refused with a ``ValueError`` naming env ``i`` and the space."""
        try:
            return self._encode_action(i, action)
        except (codec.CodecError, TypeError, ValueError) as exc:
            raise ValueError(
                f"action for env {i} does not fit the action space {self.single_action_space}: {exc}"
            ) from None

    def _decode_value(self, obj: Any, payloads: list) -> Any:
        return codec.decode_info(obj, payloads, copy=True)

    def _read_reset(self, r: EnvResult, reset_timeout: float) -> ResetOutcome:
        """A reset result read by :mod:`~boltzlabs_gym.client.results`; a failed env's obs is the zero obs.

        ``reset_timeout`` is the pool's, read once per batch by the caller."""
        out = read_reset(r, reset_timeout, self._obs_decoders[r.index], self._decode_info)
        return out if out.obs is not None else out._replace(obs=deepcopy(self._zero_obs))

    def _read_step(self, r: EnvResult, step_timeout: float) -> Transition:
        """A step result read by :mod:`~boltzlabs_gym.client.results`, with zero obs where none could be had.

        ``step_timeout`` is the pool's, read once per batch by the caller."""
        t = read_step(r, step_timeout, self._obs_decoders[r.index], self._decode_info)
        if t.obs is None:
            t = t._replace(obs=deepcopy(self._zero_obs))
        if t.reset_info is not None and t.reset_obs is None:
            t = t._replace(reset_obs=deepcopy(self._zero_obs))
        return t

    def _set_array_rows(self, obs_spaces: list) -> None:
        """For a Dict/Tuple observation of arrays only, the same for every env: its skeleton on the
        wire (:func:`~boltzlabs_gym.wire.slot_layout.array_skeleton`), and the batch's arrays in the
        order of its payloads, whose rows are written in place as replies are read."""
        #: The skeleton a plain step's reply has (then its payloads are the arrays, in order).
        self._arrays_skeleton = None
        #: The batch's arrays, and each one's (dtype, row shape, row bytes), in payload order.
        self._batch_leaves: list[np.ndarray] | None = None
        self._leaf_rows: list[tuple[np.dtype, tuple, int]] = []
        space = self.single_observation_space
        skeleton = slot_layout.array_skeleton(space) if self._gym_server else None
        if skeleton is None or any(other is not obs_spaces[0] for other in obs_spaces):
            return
        leaves: list = []
        slot_layout.array_leaves(space, self._observations, leaves)
        self._arrays_skeleton, self._batch_leaves = skeleton, leaves
        self._leaf_rows = [(leaf.dtype, leaf.shape[1:], leaf[0].nbytes) for leaf in leaves]

    def _set_obs(self, i: int, obs: Any) -> None:
        """Env ``i``'s observation: a row of the batch itself for an array space, or of each of
        its arrays for a Dict/Tuple of arrays (written as it is read, as whole sandboxes' blocks
        are), else kept for :func:`concatenate`."""
        if self._obs_leaf is not None:
            cast(np.ndarray, self._observations)[i] = obs
        elif self._batch_leaves is not None:
            values: list = []
            slot_layout.array_leaves(self.single_observation_space, obs, values)  # decoded: the space's structure
            for batch, value in zip(self._batch_leaves, values):
                batch[i] = value
        else:
            self._env_obs[i] = obs

    def _batched_obs(self):
        if self._obs_leaf is not None:
            out = self._observations  # every row was written in place (_set_obs)
            return out.copy() if self.copy else out
        if self._batch_leaves is not None:
            return deepcopy(self._observations) if self.copy else self._observations
        self._observations = concatenate(self.single_observation_space, self._env_obs, self._observations)
        return deepcopy(self._observations) if self.copy else self._observations

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
        indices = range(n) if mask is None else np.flatnonzero(mask)
        op_options = codec.to_json_safe(env_options) if env_options else None
        items = []
        for i in indices:
            op = {"op": "reset", "seed": seeds[i]}
            if op_options:
                op["options"] = op_options
            items.append((int(i), op, ()))
        self.pool.batch_async(items)
        self._pending_reset_mask = mask
        self._state = AsyncState.WAITING_RESET
        if base is not None:
            self._np_random, self._np_random_seed = seeding.np_random(base)
        for i in indices:
            if seeds[i] is not None:
                self._env_seeds[i] = seeds[i]

    def reset_wait(self, timeout: float | None = None):
        """Return ``(obs, infos)`` of :meth:`reset_async`'s reset."""
        self._check_open()
        if self._state is not AsyncState.WAITING_RESET:
            raise NoAsyncCallError(
                "Calling `reset_wait` without any prior call to `reset_async`.", AsyncState.WAITING_RESET.value
            )
        mask, self._pending_reset_mask = self._pending_reset_mask, None
        self._state = AsyncState.DEFAULT  # whatever happens below, this call is over
        groups, results = self._wait(timeout, raw=False)
        reset_timeout = self.pool.reset_timeout
        if mask is None:
            self._terminations[:] = False
            self._truncations[:] = False
            self._autoreset_envs[:] = False
        else:
            self._terminations[mask] = False
            self._truncations[mask] = False
            self._autoreset_envs[mask] = False
        infos: dict = {}
        for group in groups:
            infos = self._take_group_reset(group, infos, reset_timeout)
        for r in results:
            infos = self._take_reset(r, infos, reset_timeout)
        return self._batched_obs(), infos

    def _take_reset(self, r: EnvResult, infos: dict, reset_timeout: float) -> dict:
        """Store one env's reset result; the infos with its info added."""
        obs, env_info, failure = self._read_reset(r, reset_timeout)
        self._set_obs(r.index, obs)
        if failure is not None:
            self._autoreset_envs[r.index] = self.autoreset_mode != AutoresetMode.DISABLED
        return self._add_info(infos, env_info, r.index)

    def _take_group_reset(self, group: GroupResult, infos: dict, reset_timeout: float) -> dict:
        """Store a sandbox's resets: its plain positions' observations as one block, the rest one by one."""
        read = self._read_group(group)
        one_by_one = self._one_by_one(group, read)
        if one_by_one is not None:
            for r in one_by_one:
                infos = self._take_reset(r, infos, reset_timeout)
            return infos
        if read.leaves is not None:
            positions = np.flatnonzero(read.plain)
            self._set_rows(read.leaves, np.asarray(group.plan.indices)[positions], positions)
        for r in read.others.values():
            infos = self._take_reset(r, infos, reset_timeout)
        return infos

    def _read_group(self, group: GroupResult):
        """A sandbox's group reply, read against the observation space (see :meth:`GroupResult.read`)."""
        skeleton = self._row_skeleton
        # Without arrays in the space (a Dict with a Discrete in it, an env dir's JSON values) rows
        # are a wire violation: nothing would check them against the space.
        return group.read(skeleton) if skeleton is not None else group.read(arrays=False)

    def _one_by_one(self, group: GroupResult, read: GroupReply | list[EnvResult]) -> list[EnvResult] | None:
        """A sandbox's results env by env when its rows cannot go into the batch as blocks: it
        failed or broke the wire (``read`` is a list), or its rows are of a space kept per env
        (a Dict whose envs' spaces differ); ``None`` otherwise."""
        if isinstance(read, list):
            return read
        if read.leaves is not None and not self._batch_rows:
            return group.expand()
        return None

    def _set_rows(self, leaves: list[np.ndarray], rows: Any, positions: Any) -> None:
        """Copy a group reply's ``positions`` (its arrays' rows, as read) into the batch's ``rows``."""
        if self._obs_leaf is not None:
            cast(np.ndarray, self._observations)[rows] = leaves[0][positions]
            return
        for batch, leaf in zip(cast(list, self._batch_leaves), leaves):
            batch[rows] = leaf[positions]

    # ------------------------------------------------------------------ step
    def step(self, actions: Any):
        """Step every env (finished ones are reset in the same request in NEXT_STEP mode)."""
        self.step_async(actions)
        return self.step_wait()

    def step_async(self, actions: Any) -> None:
        """Send the batched step; collect it with :meth:`step_wait`."""
        self._check_open()
        self._check_idle("step_async")
        self._send_step(actions)
        self._state = AsyncState.WAITING_STEP

    def _send_step(self, actions: Any) -> None:
        """Send every env's step (or its autoreset); :meth:`_collect_step` collects it."""
        ints = self._discrete_actions(actions)
        mode = self.autoreset_mode
        if ints is not None and self._grouped and not (mode == AutoresetMode.DISABLED and self._autoreset_envs.any()):
            # Several envs per sandbox, Discrete actions: packed per sandbox with no per-env work here.
            reset_ops = (
                self._autoreset_envs.copy() if mode != AutoresetMode.DISABLED else np.zeros_like(self._autoreset_envs)
            )
            self.pool.batch_calls.send_steps(ints, reset_ops, autoreset=mode == AutoresetMode.SAME_STEP)
            self._pending_reset_ops = reset_ops
            return
        per_env = ints if ints is not None else self._split_actions(actions)
        items: list[tuple[int, dict[str, Any], Sequence[Any]]] = []
        reset_ops = np.zeros(self.num_envs, dtype=np.bool_)
        payloads: Sequence[Any]
        for i, action in enumerate(per_env):
            if self._autoreset_envs[i] and mode != AutoresetMode.DISABLED:
                items.append((i, {"op": "reset", "seed": None}, ()))
                reset_ops[i] = True
                continue
            if self._autoreset_envs[i] and mode == AutoresetMode.DISABLED:
                raise ValueError(
                    f"env {i} finished its episode and autoreset is DISABLED: reset it first with "
                    "reset(options={'reset_mask': mask})"
                )
            obj, payloads = (action, ()) if ints is not None else self._encode_env_action(i, action)
            items.append(self._step_item(i, obj, payloads, mode))
        self.pool.batch_async(items)
        self._pending_reset_ops = reset_ops

    def step_wait(self, timeout: float | None = None):
        """Return ``(obs, rewards, terminations, truncations, infos)`` of :meth:`step_async`'s step."""
        self._check_open()
        if self._state is not AsyncState.WAITING_STEP:
            raise NoAsyncCallError(
                "Calling `step_wait` without any prior call to `step_async`.", AsyncState.WAITING_STEP.value
            )
        self._state = AsyncState.DEFAULT  # whatever happens below, this call is over
        return self._collect_step(timeout)

    def _collect_step(self, timeout: float | None):
        """The step batch :meth:`_send_step` sent, as :meth:`step_wait` returns it."""
        # _send_step sets it.
        reset_ops, self._pending_reset_ops = cast(np.ndarray, self._pending_reset_ops), None
        pool = self.pool
        limits = (pool.step_timeout, pool.reset_timeout)
        infos: dict = {}
        same_step = self.autoreset_mode == AutoresetMode.SAME_STEP
        failed = np.zeros(self.num_envs, dtype=np.bool_)
        leaf = self._obs_leaf
        # Observations in shared regions are read in place: the one copy of each is the one
        # into this batch (every result is taken in this block, and none is kept past it).
        with pool.batch_calls.lending_obs_views():
            groups, results = self._wait(timeout, raw=True)
            for group in groups:
                infos = self._take_group_step(group, reset_ops, same_step, failed, infos, limits)
            for r in results:
                i = r.index
                if (
                    leaf is not None
                    and r.status == OK
                    and not reset_ops[i]
                    and self._take_plain_step(leaf, r, same_step)
                ):
                    continue
                if self._batch_leaves is not None and not reset_ops[i] and self._take_arrays_step(r, same_step):
                    continue
                infos = self._take_step(r, bool(reset_ops[i]), same_step, failed, infos, limits)
            del groups, results
        done = np.logical_or(self._terminations, self._truncations)
        if same_step:
            # Only envs that could not reset in-process (their step failed) still need one.
            self._autoreset_envs = np.logical_and(done, failed)
        else:
            self._autoreset_envs = done
        return (
            self._batched_obs(),
            np.copy(self._rewards),
            np.copy(self._terminations),
            np.copy(self._truncations),
            infos,
        )

    def _take_step(
        self, r: EnvResult, reset_op: bool, same_step: bool, failed: np.ndarray, infos: dict, limits: tuple
    ) -> dict:
        """Store one env's result of a step batch (a step, or the reset that autoreset sent in its
        place); the infos with its info added."""
        parse_result(r)
        i = r.index
        if reset_op:
            obs, env_info, failure = self._read_reset(r, limits[1])
            self._set_obs(i, obs)
            self._rewards[i] = 0.0
            self._terminations[i] = False
            self._truncations[i] = failed[i] = failure is not None
            return self._add_info(infos, env_info, i)
        obs, reward, term, trunc, env_info, failure, reset_obs, reset_info = self._read_step(r, limits[0])
        self._rewards[i], self._terminations[i], self._truncations[i] = reward, term, trunc
        failed[i] = failure is not None
        if same_step and (term or trunc):
            infos = self._add_info(infos, {"final_obs": obs, "final_info": env_info}, i)
            if reset_info is not None:
                obs, env_info = reset_obs, reset_info
            else:
                # The step failed, so the env did not reset itself; its reset happens next step.
                env_info = {k: v for k, v in env_info.items() if k.startswith("boltzlabs_")}
        self._set_obs(i, obs)
        return self._add_info(infos, env_info, i)

    def _take_group_step(
        self,
        group: GroupResult,
        reset_ops: np.ndarray,
        same_step: bool,
        failed: np.ndarray,
        infos: dict,
        limits: tuple,
    ) -> dict:
        """Store a sandbox's results of a step batch: its plain positions as whole blocks of
        observations, rewards and flags (by slicing; no per-env work), the rest one by one."""
        read = self._read_group(group)
        one_by_one = self._one_by_one(group, read)
        if one_by_one is not None:
            for r in one_by_one:
                infos = self._take_step(r, bool(reset_ops[r.index]), same_step, failed, infos, limits)
            return infos
        if read.leaves is not None:
            indices = group.plan.indices
            plain, flags = read.plain, read.flags
            assert flags is not None and read.reward is not None
            first, count = indices[0], len(indices)
            if group.plan.whole and plain.all():
                rows: Any = slice(first, first + count)  # the usual case: the whole sandbox, plain
                positions: Any = slice(None)
            else:
                positions = np.flatnonzero(plain)
                rows = np.asarray(indices)[positions]
            resets = reset_ops[rows]
            ended = flags[positions]
            if same_step and (ended[~resets] != 0).any():
                # An episode ended without the env resetting itself (it should have): the general
                # path, env by env, says what happened.
                for r in group.expand():
                    infos = self._take_step(r, bool(reset_ops[r.index]), same_step, failed, infos, limits)
                return infos
            self._set_rows(read.leaves, rows, positions)
            if not resets.any():  # the usual case: every position stepped
                self._rewards[rows] = read.reward[positions]
                self._terminations[rows] = ended & FLAG_TERMINATED
                self._truncations[rows] = ended & FLAG_TRUNCATED
            else:
                self._rewards[rows] = np.where(resets, 0.0, read.reward[positions])
                self._terminations[rows] = (ended & FLAG_TERMINATED).astype(bool) & ~resets
                self._truncations[rows] = (ended & FLAG_TRUNCATED).astype(bool) & ~resets
        for r in read.others.values():
            infos = self._take_step(r, bool(reset_ops[r.index]), same_step, failed, infos, limits)
        return infos

    def _take_plain_step(self, leaf: codec.ArrayLeaf, r: EnvResult, same_step: bool) -> bool:
        """Store a plain step's transition (array obs, empty info, no autoreset) without
        parsing JSON; False, storing nothing, for any other reply."""
        if r.raw is None:
            return False  # read already (an observation from a shared region, copied out): the general path
        parsed = leaf.parse_step_line(r.raw)
        if parsed is None or len(r.payloads) != 1 or len(r.payloads[0]) != leaf.nbytes:
            return False
        reward, terminated, truncated = parsed
        if same_step and (terminated or truncated):
            return False  # the env should have reset itself: the general path says what happened
        i = r.index
        cast(np.ndarray, self._observations)[i] = np.frombuffer(r.payloads[0], dtype=leaf.dtype).reshape(leaf.shape)
        self._rewards[i], self._terminations[i], self._truncations[i] = reward, terminated, truncated
        return True

    def _take_arrays_step(self, r: EnvResult, same_step: bool) -> bool:
        """Store a plain step of a Dict/Tuple of arrays (its reply exactly the skeleton, an empty
        info, a float reward, bool flags; its payloads the arrays' bytes) by copying each payload
        into its batch row, without the general decoder; False, storing nothing, otherwise."""
        reply, payloads, leaves = r.reply, r.payloads, self._batch_leaves
        if r.status != OK or type(reply) is not dict or len(reply) != 5 or leaves is None:
            return False
        reward, terminated, truncated = reply.get("reward"), reply.get("terminated"), reply.get("truncated")
        if type(reward) is not float or type(terminated) is not bool or type(truncated) is not bool:
            return False
        if reply.get("info") != {} or reply.get("obs") != self._arrays_skeleton or len(payloads) != len(leaves):
            return False
        if same_step and (terminated or truncated):
            return False  # the env should have reset itself: the general path says what happened
        rows = self._leaf_rows
        for payload, (_, _, nbytes) in zip(payloads, rows):
            if codec.payload_len(payload) != nbytes:
                return False
        i = r.index
        for batch, payload, (dtype, shape, _) in zip(leaves, payloads, rows):
            batch[i] = np.frombuffer(payload, dtype=dtype).reshape(shape)
        self._rewards[i], self._terminations[i], self._truncations[i] = reward, terminated, truncated
        return True

    def _discrete_actions(self, actions: Any) -> list | None:
        """A Discrete env's batch of actions as plain ints, when it is an integer array of
        shape ``(num_envs,)`` (what policies hand over); else ``None`` (the per-env codec
        path, which says what is wrong). Ranges are checked where the codec checks them:
        in the env, which reports an out-of-range action in that env's slot."""
        if (
            not self._discrete_action
            or type(actions) is not np.ndarray
            or actions.dtype.kind not in "iu"
            or actions.shape != (self.num_envs,)
        ):
            return None
        return actions.tolist()

    def _split_actions(self, actions: Any) -> list:
        if isinstance(self.single_action_space, JsonSpace):
            if isinstance(actions, (str, bytes, dict)) or not hasattr(actions, "__len__"):
                raise ActionBatchError(
                    f"actions must be a sequence of {self.num_envs} actions, got {type(actions).__name__}"
                )
            per_env = list(actions)
        else:
            try:
                per_env = list(iterate(self.action_space, actions))
            except Exception as exc:  # noqa: BLE001 - say which shape was expected
                raise ActionBatchError(
                    f"actions do not fit the batched action space {self.action_space}: {exc}"
                ) from None
        if len(per_env) != self.num_envs:
            raise ActionBatchError(f"expected {self.num_envs} actions (one per env), got {len(per_env)}")
        return per_env

    def _wait(self, timeout: float | None, raw: bool) -> tuple[list[GroupResult], list[EnvResult]]:
        """The pool's results, a sandbox of several envs as one block (see
        :meth:`~boltzlabs_gym.client.batch_calls.BatchCalls.wait_groups`); running out of time raises
        what AsyncVectorEnv raises, too."""
        try:
            return self.pool.batch_calls.wait_groups(timeout, raw)
        except TimeoutError as exc:
            raise VectorTimeoutError(str(exc), getattr(exc, "worker", None)) from exc

    def _check_idle(self, call: str) -> None:
        """Refuse ``call`` while a ``step_async``/``reset_async`` waits for its ``*_wait``."""
        if self._state is not AsyncState.DEFAULT:
            raise AlreadyPendingCallError(
                f"Calling `{call}` while waiting for a pending call to `{self._state.value}` to complete.",
                self._state.value,
            )

    def _run(self, items: list, call: str) -> list[EnvResult]:
        self._check_idle(call)
        self.pool.batch_async(items)
        return self.pool.batch_wait()

    # ------------------------------------------------------------------ EnvPool's async API
    @property
    def _async(self) -> SendRecv:
        self._check_open()
        if self._send_recv is None:
            self._send_recv = SendRecv(self, self.batch_size)
        return self._send_recv

    def async_reset(self, seed: int | Sequence[int | None] | None = None, options: dict | None = None) -> None:
        """Start a reset of every env and return at once; :meth:`recv` collects the first
        ``batch_size`` (EnvPool's ``async_reset``; see :mod:`boltzlabs_gym.vector_async`).

        >>> envs = boltzlabs_gym.make_vec("CartPole-v1", num_envs=8, batch_size=4)   # doctest: +SKIP
        >>> envs.async_reset(seed=0)                                                # doctest: +SKIP
        >>> obs, rew, term, trunc, info = envs.recv()                                # doctest: +SKIP
        >>> info["env_id"]                                                           # doctest: +SKIP
        array([2, 0, 1, 3], dtype=int32)
        """
        self._check_idle("async_reset")
        self._async.async_reset(seed, options)

    def send(self, actions: Any, env_id: Any = None) -> None:
        """Start a step of each env of ``env_id`` (default: the envs of the last :meth:`recv`) with
        its row of ``actions``, and return at once (EnvPool's ``send``). An env whose episode
        ended is reset instead in ``NEXT_STEP`` mode. Sending to an env in flight raises
        :class:`~boltzlabs_gym.errors.AsyncStateError` naming it.

        >>> envs.send(np.array([0, 1, 1, 0]), info["env_id"])                       # doctest: +SKIP
        """
        self._check_idle("send")
        self._async.send(actions, env_id)

    def recv(self, timeout: float | None = None):
        """``(obs, rewards, terminations, truncations, infos)`` of the first ``batch_size`` envs to
        finish what :meth:`send`/:meth:`async_reset` started, in finishing order;
        ``infos["env_id"]`` says which (EnvPool's ``recv``)."""
        self._check_idle("recv")
        try:
            return self._async.recv(timeout)
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
        return self.pool.snapshot(index, kind=kind, meta=self._snapshot_meta(index, "snapshot"))

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
        return self._take_restored(results, snap.meta, reseed)

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
        meta = self._snapshot_meta(index, "fork")
        results = self.pool.snapshot_keeper.fork(index, into, reseed=reseed, fresh=fresh, kind=kind, meta=meta)
        return self._take_restored(results, meta, reseed)

    def _snapshot_meta(self, index: Any, what: str) -> dict:
        """What a snapshot of env ``index`` keeps of the vector env's own state: whether the env is
        due an autoreset, and its seed."""
        i = self.pool.snapshot_keeper.check_index(index, what)
        return {"autoreset": bool(self._autoreset_envs[i]), "seed": self._env_seeds[i]}

    def _take_restored(self, results: list[EnvResult], meta: dict, reseed: Sequence[int] | None):
        reset_timeout = self.pool.reset_timeout
        due = bool(meta.get("autoreset")) and self.autoreset_mode != AutoresetMode.DISABLED
        seed = meta.get("seed")
        infos: dict = {}
        for pos, r in enumerate(results):
            i = r.index
            self._terminations[i] = self._truncations[i] = False
            self._rewards[i] = 0.0
            self._autoreset_envs[i] = due
            self._env_seeds[i] = int(reseed[pos]) if reseed is not None else (seed if isinstance(seed, int) else None)
            infos = self._take_reset(r, infos, reset_timeout)  # a failed restore is due a reset
        return self._batched_obs(), infos

    # ------------------------------------------------------------------ attributes
    def _call_all(self, op: dict, what: str, payloads: Sequence[bytes] = ()) -> tuple:
        results = self._run([(i, op, payloads) for i in range(self.num_envs)], what)
        return tuple(read_value(r, what, self._decode_value) for r in results)

    def _require_gym_server(self, what: str) -> None:
        if not self._gym_server:
            raise NotImplementedError(
                f"{what} needs a Gymnasium env; env directories served by serve() do not support it"
            )

    def call(self, name: str, *args: Any, **kwargs: Any) -> tuple:
        """Call ``name(*args, **kwargs)`` on every env (or read it, if not callable); numpy
        arrays among the arguments cross as arrays (raw bytes, never pickled)."""
        self._check_open()
        self._require_gym_server("call")
        args_obj, payloads = codec.encode_info(list(args))
        kwargs_obj, payloads = codec.encode_info(dict(kwargs), payloads)
        op = {"op": "call", "name": name, "args": args_obj, "kwargs": kwargs_obj}
        return self._call_all(op, f"call({name!r})", payloads)

    def get_attr(self, name: str) -> tuple:
        """The attribute ``name`` of every env (callables are called, as in Gymnasium)."""
        return self.call(name)

    def set_attr(self, name: str, values: Any) -> None:
        """Set ``name`` on every env: one value for all, or a list/tuple with one per env."""
        self._check_open()
        self._require_gym_server("set_attr")
        if not isinstance(values, (list, tuple)):
            values = [values] * self.num_envs
        if len(values) != self.num_envs:
            raise ValueError(f"values must have length num_envs={self.num_envs}, got {len(values)}")
        items = []
        for i, v in enumerate(values):
            obj, payloads = codec.encode_info(v)  # arrays cross as raw payloads
            items.append((i, {"op": "set_attr", "name": name, "value": obj}, payloads))
        for r in self._run(items, f"set_attr({name!r})"):
            read_value(r, f"set_attr({name!r})")

    def render(self) -> tuple | None:
        """One frame per env (``render_mode="rgb_array"``), as a tuple."""
        self._check_open()
        self._require_gym_server("render")
        if self.render_mode is None:
            return None
        return self._call_all({"op": "render"}, "render")

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


def _zero_observation(space: gym.Space) -> Any:
    """The observation a failed env's slot holds: zeros of the space (None for JSON values)."""
    if isinstance(space, JsonSpace):
        return None
    return next(iter(iterate(batch_space(space, 1), create_empty_array(space, 1, np.zeros))))


def _spaces_of(described: list[dict], key: str) -> list:
    """Every env's space ``key``, rebuilt once per distinct JSON form (envs that announce
    env 0's space share its object)."""
    first_json = described[0].get(key)
    first = space_from_json(first_json)
    return [first if d.get(key) == first_json else space_from_json(d.get(key)) for d in described]


def _check_env_spaces(
    observation_mode: Any, single_obs: gym.Space, single_action: gym.Space, obs_spaces: list, action_spaces: list
) -> None:
    """Refuse envs whose spaces differ, as ``SyncVectorEnv`` does (same rules, same words)."""
    for i, (obs_space, action_space) in enumerate(zip(obs_spaces, action_spaces)):
        if observation_mode == "same":
            if obs_space != single_obs:
                raise SubEnvSpaceError(
                    "BoltzLabsVecEnv(..., observation_mode='same') however the sub-environments observation spaces "
                    f"are not equivalent. single_observation_space={single_obs}, sub-environment {i} "
                    f"observation_space={obs_space}. "
                    "If this is intentional, use `observation_mode='different'` instead."
                )
        elif not is_space_dtype_shape_equiv(obs_space, single_obs):
            raise SubEnvSpaceError(
                "BoltzLabsVecEnv(..., observation_mode='different' or custom space) however the sub-environments "
                f"observation spaces do not share a common shape and dtype, single_observation_space={single_obs}, "
                f"sub-environment {i} observation space={obs_space}"
            )
        if action_space != single_action:
            raise SubEnvSpaceError(
                f"Sub-environment {i}'s action space doesn't make the `single_action_space`, "
                f"action_space={action_space}, single_action_space={single_action}"
            )


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


def _pool_from_factories(env_fns: list, pool_kwargs: dict) -> RLPool:
    """Write the factories into a throwaway env dir, pack it into a pool, remove the dir."""
    from .factory_env_dir import write_factory_env_dir

    tmp = tempfile.mkdtemp(prefix="boltzlabs-factories-")
    try:
        write_factory_env_dir(tmp, env_fns)
        return RLPool(tmp, len(env_fns), **pool_kwargs)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
