"""Stable-Baselines3 adapter: a ``VecEnv`` over a :class:`~boltzlabs_gym.BoltzLabsVecEnv`.

SB3 code runs unchanged apart from the class name, as with ``SubprocVecEnv``::

    >>> from stable_baselines3 import PPO                                   # doctest: +SKIP
    >>> from stable_baselines3.common.env_util import make_vec_env          # doctest: +SKIP
    >>> from boltzlabs_gym.sb3 import BoltzLabsSB3VecEnv                    # doctest: +SKIP
    >>> env = make_vec_env("CartPole-v1", n_envs=8, seed=0, vec_env_cls=BoltzLabsSB3VecEnv,
    ...                    vec_env_kwargs={"step_timeout": 5})              # doctest: +SKIP
    >>> model = PPO("MlpPolicy", env, seed=0).learn(50_000)                 # doctest: +SKIP
    >>> env.straggler_count, env.error_count, env.pool.timing               # doctest: +SKIP

``BoltzLabsSB3VecEnv(env_fns, start_method=None, **settings)`` takes what ``SubprocVecEnv``
takes (the settings are :class:`~boltzlabs_gym.RLPool`'s); :func:`make_sb3_vec_env` is the
same with SB3's ``Monitor`` applied inside each sandbox. An existing vector env, built with
``SAME_STEP`` autoreset (so that one SB3 step is one round trip), is wrapped as it is::

    >>> vec = BoltzLabsVecEnv([make_env(i) for i in range(8)],             # doctest: +SKIP
    ...                       autoreset_mode=AutoresetMode.SAME_STEP, step_timeout=5)
    >>> env = VecMonitor(BoltzLabsSB3VecEnv(vec))                           # doctest: +SKIP

Semantics are SB3's (``DummyVecEnv``'s, checked step by step in the tests):

* ``reset()`` returns observations only, uses the seeds/options given to
  :meth:`seed` / :meth:`set_options` once, and stores per-env infos in ``reset_infos``;
* ``step_wait()`` returns ``(obs, rewards float32, dones bool, infos list[dict])`` with
  ``dones = terminated | truncated``; a finished env's info is its final step's, with
  ``"terminal_observation"`` and ``"TimeLimit.truncated" = truncated and not terminated``,
  and ``obs`` already holds its reset observation (its reset info goes to ``reset_infos``);
* ``step_async`` takes one action per env, indexed by env, for every space (an array for
  array spaces, or a list: ``[space.sample() for _ in range(n)]`` for a ``Dict`` or ``Tuple``
  space); a batch with more rows than envs is cut to the first ``num_envs``, as
  ``DummyVecEnv`` does;
* ``get_attr`` returns attributes without calling them; ``set_attr``, ``env_method``,
  ``env_is_wrapped``, ``has_attr``, ``get_images``/``render``; every ``indices``
  accepts ``None``, an int, or a list (negative indices count from the end). Numpy arrays
  given to ``env_method``/``set_attr`` cross as arrays (raw bytes, never pickled); object
  arrays (HER's infos) arrive as lists.

Stragglers (an env that misses the pool's ``step_timeout``) and crashed envs end their
episode by truncation; their info carries ``"boltzlabs_straggler"`` or ``"boltzlabs_error"``
(a dict with ``kind``, ``reason``, ``stderr`` and ``deadline_s``, the shape every adapter uses:
see :mod:`boltzlabs_gym.client.results`) and they are counted in :attr:`straggler_count` /
:attr:`error_count`. The env is respawned and reset before ``step_wait`` returns, so
the returned observation is a genuine reset observation (``terminal_observation`` is a
zero observation: the real one never arrived).

Stable-Baselines3 is imported only by this module (``pip install boltzlabs-gym[sb3]``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

try:
    from stable_baselines3.common.vec_env.base_vec_env import VecEnv
except ImportError as _exc:  # pragma: no cover - exercised only without SB3
    raise ImportError(
        "boltzlabs_gym.sb3 needs Stable-Baselines3: install it with `pip install boltzlabs-gym[sb3]` "
        "(or `pip install stable-baselines3`)"
    ) from _exc

from gymnasium import spaces
from gymnasium.vector import AutoresetMode
from gymnasium.vector.utils import concatenate, create_empty_array
from typing_extensions import Unpack

from .client.options import PoolOptions, PoolSettings
from .client.results import read_value
from .client.sources import WorkerSource
from .envside.factories import SB3EnvFactory
from .vector import ActionBatchError, BoltzLabsVecEnv
from .wire import codec

if TYPE_CHECKING:
    import gymnasium as gym
    from stable_baselines3.common.vec_env.base_vec_env import VecEnvObs

__all__ = ["BoltzLabsSB3VecEnv", "make_sb3_vec_env"]

_WRAPPER_NAME = re.compile(r"<([A-Za-z_][A-Za-z0-9_]*)")


class BoltzLabsSB3VecEnv(VecEnv):
    """An SB3 ``VecEnv`` whose envs are the sandboxed envs of a :class:`BoltzLabsVecEnv`.

    Built as SB3 builds ``SubprocVecEnv``, so ``make_vec_env(..., vec_env_cls=BoltzLabsSB3VecEnv,
    vec_env_kwargs={...})`` works, or over a vector env that already exists.

    Args:
        env_fns: one env factory per env, each cloudpickled into its own sandbox and called
            there; or a :class:`BoltzLabsVecEnv` built with ``AutoresetMode.SAME_STEP`` (one
            round trip per SB3 step, with the terminal and the reset observation in the same
            reply), driven as it is.
        start_method: accepted for ``SubprocVecEnv``'s signature and checked as it checks it
            (an unknown name raises ``ValueError``); the worker starts every env in its
            sandbox, so no multiprocessing start method is used.
        workers, options, **settings: where the pool runs and its settings, as for
            :class:`~boltzlabs_gym.RLPool` (``isolation``, ``step_timeout``, ``mode``,
            ``envs_per_sandbox``, ...: :class:`~boltzlabs_gym.client.options.PoolOptions`), with
            ``env_fns`` only.

    Attributes:
        straggler_count: env-steps that missed the pool's ``step_timeout`` so far.
        error_count: env-steps whose env crashed or refused the request so far.
        venv: the underlying Gymnasium vector env; ``pool`` its :class:`RLPool`.
    """

    def __init__(
        self,
        env_fns: Sequence[Callable[[], gym.Env]] | BoltzLabsVecEnv,
        start_method: str | None = None,
        *,
        workers: Sequence[str] | WorkerSource | None = None,
        options: PoolOptions | None = None,
        **settings: Unpack[PoolSettings],
    ):
        venv = _vector_env(env_fns, start_method, workers, options, settings)
        if getattr(venv, "autoreset_mode", None) != AutoresetMode.SAME_STEP:
            raise ValueError(
                "BoltzLabsSB3VecEnv needs a BoltzLabsVecEnv built with autoreset_mode=AutoresetMode.SAME_STEP "
                f"(got {getattr(venv, 'autoreset_mode', None)!r}); SB3 expects the reset observation in the "
                "same step as the terminal one"
            )
        self.venv = venv
        self.straggler_count = 0
        self.error_count = 0
        self._actions_sent = False
        super().__init__(venv.num_envs, venv.single_observation_space, venv.single_action_space)

    # ------------------------------------------------------------------ properties
    @property
    def pool(self):
        """The :class:`~boltzlabs_gym.RLPool` (``timing``, ``envs_per_gb()``, ``isolation``)."""
        return self.venv.pool

    def stats(self, memory: bool = True):
        """The pool's figures as one frozen :class:`~boltzlabs_gym.PoolStats` (see ``RLPool.stats``)."""
        return self.venv.pool.stats(memory)

    # ------------------------------------------------------------------ reset / step
    def reset(self) -> VecEnvObs:
        """Reset every env with the stored seeds/options (used once); return the observations."""
        n = self.num_envs
        seeds = [None if s is None else int(s) for s in self._seeds]
        options = [dict(o) if o else {} for o in self._options]
        # The vector env takes one options dict per call: group envs that share theirs.
        groups: list[tuple[dict, list[int]]] = []
        for i, opt in enumerate(options):
            for g_opt, members in groups:
                if _same(g_opt, opt):
                    members.append(i)
                    break
            else:
                groups.append((opt, [i]))
        self._finish_pending()
        if len(groups) == 1:
            obs, infos = self.venv.reset(seed=seeds, options=groups[0][0] or None)
            self.reset_infos = [self._count(_env_info(infos, i, n)) for i in range(n)]
        else:
            for opt, members in groups:
                mask = np.zeros(n, dtype=np.bool_)
                mask[members] = True
                obs, infos = self.venv.reset(seed=seeds, options=dict(opt, reset_mask=mask))
                for i in members:
                    self.reset_infos[i] = self._count(_env_info(infos, i, n))
        self._reset_seeds()
        self._reset_options()
        return obs

    def step_async(self, actions: np.ndarray | Sequence[Any]) -> None:
        """Send one action per env: ``actions[i]`` is env ``i``'s (rows past ``num_envs`` are not sent)."""
        self.venv.step_async(self._gym_actions(actions))
        self._actions_sent = True

    def _gym_actions(self, actions: Any) -> Any:
        """SB3's actions (indexed by env, whatever the space) as the vector env's batch.

        Array spaces take an array as it is, cut to ``num_envs`` rows; a per-env list
        (and any ``Dict``/``Tuple``/other space) is batched as Gymnasium batches it.
        """
        n = self.num_envs
        space = self.action_space
        if isinstance(space, _ARRAY_SPACES):
            batch = actions if isinstance(actions, np.ndarray) else _stack_actions(actions, n)
            if batch.ndim == 0 or len(batch) < n:
                raise ActionBatchError(f"expected one action per env ({n}), got {_describe(actions)}")
            return batch[:n] if len(batch) > n else batch
        try:
            per_env = [actions[i] for i in range(n)]
        except (IndexError, KeyError, TypeError):
            raise ActionBatchError(
                f"expected one action per env ({n}), indexed by env as SB3 passes them "
                f"([space.sample() for _ in range(n)]), got {_describe(actions)}"
            ) from None
        out = create_empty_array(space, n)
        if out is None:  # a space Gymnasium does not batch: the actions as they are, one per env
            return tuple(per_env)
        try:
            return concatenate(space, per_env, out)
        except (TypeError, ValueError, KeyError, IndexError) as exc:
            raise ActionBatchError(f"the actions do not fit the action space {space}: {exc}") from None

    def step_wait(self, timeout: float | None = None):
        """``(obs, rewards, dones, infos)`` of the step sent by :meth:`step_async`."""
        self._actions_sent = False
        obs, rewards, terminated, truncated, infos = self.venv.step_wait(timeout)
        n = self.num_envs
        dones = np.logical_or(terminated, truncated)
        final_mask = infos.get("_final_obs", np.zeros(n, dtype=np.bool_))
        final_infos = infos.get("final_info", {})
        env_infos: list[dict] = []
        failed = np.zeros(n, dtype=np.bool_)
        for i in range(n):
            top = _env_info(infos, i, n)
            top.pop("final_obs", None)
            top.pop("final_info", None)
            if dones[i] and final_mask[i]:
                info = _env_info(final_infos, i, n)
                info["terminal_observation"] = infos["final_obs"][i]
                # What the env returned with its reset goes where SB3 keeps reset infos.
                boltz = {k: v for k, v in top.items() if k.startswith("boltzlabs_")}
                self.reset_infos[i] = {k: v for k, v in top.items() if not k.startswith("boltzlabs_")}
                info.update(boltz)
            else:
                info = top
            info["TimeLimit.truncated"] = bool(truncated[i] and not terminated[i])
            if info.get("boltzlabs_straggler") or info.get("boltzlabs_error"):
                failed[i] = True
            env_infos.append(self._count(info))
        if failed.any():
            obs = self._resync(failed, obs)
        return obs, rewards.astype(np.float32), dones, env_infos

    def _count(self, info: dict) -> dict:
        if info.get("boltzlabs_straggler"):
            self.straggler_count += 1
        if info.get("boltzlabs_error"):
            self.error_count += 1
        return info

    def _resync(self, failed: np.ndarray, obs: Any) -> Any:
        """Reset envs that failed in this step (respawned), so ``obs`` holds real reset observations.

        The vector env would otherwise reset them on the next step and return a
        reward-0, not-done transition from the zero observation, which SB3 does not expect.
        """
        reset_obs, infos = self.venv.reset(options={"reset_mask": failed})
        n = self.num_envs
        for i in np.flatnonzero(failed):
            self.reset_infos[i] = self._count(_env_info(infos, int(i), n))
        if isinstance(obs, dict):
            for k in obs:
                obs[k][failed] = reset_obs[k][failed]
        elif isinstance(obs, tuple):
            for part, new in zip(obs, reset_obs):
                part[failed] = new[failed]
        else:
            obs[failed] = reset_obs[failed]
        return obs

    def _finish_pending(self) -> None:
        if self._actions_sent:  # a reset cancels a step in flight (SB3's contract)
            self._actions_sent = False
            self.venv.step_wait()

    def close(self) -> None:
        self.venv.close()

    # ------------------------------------------------------------------ seeding
    def seed(self, seed: int | None = None) -> Sequence[int | None]:
        """Store ``seed + i`` for env ``i``, used by the next :meth:`reset` (SB3 semantics)."""
        return super().seed(seed)

    # ------------------------------------------------------------------ attributes
    def _indices(self, indices: Any) -> list[int]:
        n = self.num_envs
        if indices is None:
            raw: Iterable = range(n)
        elif isinstance(indices, (int, np.integer)):
            raw = [indices]
        else:
            raw = indices
        out = []
        for i in raw:
            i = int(i)
            if not -n <= i < n:
                raise IndexError(f"env index {i} out of range for {n} envs")
            out.append(i % n)
        return out

    def _ask(self, op: dict, indices: Any, what: str, payloads: Sequence[bytes] = ()) -> list[Any]:
        idx = self._indices(indices)
        if not idx:
            return []
        self._finish_pending()
        pool = self.pool
        pool.batch_async([(i, op, payloads) for i in dict.fromkeys(idx)])
        results = {r.index: r for r in pool.batch_wait()}
        return [read_value(results[i], what, _decode_value) for i in idx]

    def get_attr(self, attr_name: str, indices: Any = None) -> list[Any]:
        """The attribute of each env, never called (SB3 semantics, unlike Gymnasium's ``get_attr``).

        Values cross the sandbox boundary as info values: numbers, strings, lists,
        dicts and arrays arrive intact; other objects arrive as their ``repr``.
        """
        return self._ask({"op": "get_attr", "name": attr_name}, indices, f"get_attr({attr_name!r})")

    def set_attr(self, attr_name: str, value: Any, indices: Any = None) -> None:
        """Set the attribute on each selected env (the same value for all)."""
        obj, payloads = codec.encode_info(_plain_arrays(value))
        self._ask({"op": "set_attr", "name": attr_name, "value": obj}, indices, f"set_attr({attr_name!r})", payloads)

    def env_method(self, method_name: str, *method_args: Any, indices: Any = None, **method_kwargs: Any) -> list[Any]:
        """Call ``method_name(*args, **kwargs)`` in each selected env; return the results."""
        args, payloads = codec.encode_info(_plain_arrays(list(method_args)))
        kwargs, payloads = codec.encode_info(_plain_arrays(dict(method_kwargs)), payloads)
        op = {"op": "call", "name": method_name, "args": args, "kwargs": kwargs}
        return self._ask(op, indices, f"env_method({method_name!r})", payloads)

    def env_is_wrapped(self, wrapper_class: type[gym.Wrapper], indices: Any = None) -> list[bool]:
        """Whether each env's wrapper chain holds a wrapper of this class *name*.

        The class objects live in the sandbox and cannot be compared across it, so
        this reads the chain from ``str(env)`` (Gymnasium wrappers print as
        ``<TimeLimit<OrderEnforcing<CartPoleEnv<CartPole-v1>>>>``) and matches the
        class name of ``wrapper_class`` or of any of its bases up to ``gym.Wrapper``
        excluded. So ``Monitor`` is found (what SB3's ``evaluate_policy`` asks); a
        subclass of ``wrapper_class`` with another name is not; an env whose
        ``__str__`` is customised reads as unwrapped.
        """
        names = {wrapper_class.__name__}
        strings = self.env_method("__str__", indices=indices)
        return [isinstance(s, str) and bool(names & set(_WRAPPER_NAME.findall(s)[:-1])) for s in strings]

    def get_images(self) -> Sequence[np.ndarray | None]:
        """One ``rgb_array`` frame per env (``None`` each if the render mode is not ``rgb_array``)."""
        if self.render_mode != "rgb_array":
            import warnings

            warnings.warn(
                f"The render mode is {self.render_mode}, but this method assumes it is `rgb_array` to obtain images.",
                stacklevel=2,
            )
            return [None] * self.num_envs
        self._finish_pending()
        frames = self.venv.render()
        if frames is None:  # the envs answered render_mode="rgb_array", the vector env was built without one
            raise ValueError("get_images: the vector env has no render_mode, though its envs report 'rgb_array'")
        return list(frames)

    def render(self, mode: str | None = None) -> np.ndarray | None:
        """Tile the envs' frames (SB3's ``VecEnv.render``)."""
        return super().render(mode=mode)

    def __repr__(self) -> str:
        return f"BoltzLabsSB3VecEnv(num_envs={self.num_envs})"


def make_sb3_vec_env(
    env_id_or_factory: str | Callable[[], gym.Env],
    n_envs: int = 1,
    seed: int | None = None,
    *,
    env_kwargs: dict | None = None,
    wrapper_class: Callable | None = None,
    monitor: bool = True,
    workers: Sequence[str] | WorkerSource | None = None,
    options: PoolOptions | None = None,
    **settings: Unpack[PoolSettings],
) -> BoltzLabsSB3VecEnv:
    """Build ``n_envs`` sandboxed envs as an SB3 ``VecEnv`` (like SB3's ``make_vec_env``).

    Args:
        env_id_or_factory: a Gymnasium id or a zero-argument factory (cloudpickled into
            each sandbox).
        n_envs: number of envs.
        seed: seeds the first :meth:`~BoltzLabsSB3VecEnv.reset` with ``seed + i``.
        env_kwargs: kwargs for ``gym.make`` (ids only).
        wrapper_class: a Gymnasium wrapper applied inside each sandbox.
        monitor: wrap each env in SB3's ``Monitor`` inside its sandbox (as
            ``make_vec_env`` does), so ``info["episode"]`` and ``ep_info_buffer`` work.
        workers, options, **settings: where the pool runs and its settings, as for
            :class:`~boltzlabs_gym.RLPool` (``isolation``, ``step_timeout``, ``limits``, ...).
    """
    if type(n_envs) is not int or n_envs < 1:
        raise ValueError(f"n_envs must be a positive int, got {n_envs!r}")
    fns = [SB3EnvFactory(env_id_or_factory, dict(env_kwargs or {}), wrapper_class, monitor) for _ in range(n_envs)]
    env = BoltzLabsSB3VecEnv(fns, workers=workers, options=PoolOptions.fold(options, settings))
    if seed is not None:
        env.seed(seed)
    return env


# ---------------------------------------------------------------------- helpers
#: Spaces whose batch is one array: SB3 hands these over as an array of shape ``(n, ...)``.
_ARRAY_SPACES = (spaces.Box, spaces.Discrete, spaces.MultiDiscrete, spaces.MultiBinary)


def _vector_env(
    env_fns: Any,
    start_method: str | None,
    workers: Sequence[str] | WorkerSource | None,
    options: PoolOptions | None,
    settings: PoolSettings,
) -> BoltzLabsVecEnv:
    """The vector env to drive: the one given, or one built from ``env_fns`` (SAME_STEP autoreset)
    on a pool with ``settings`` over ``options``."""
    if isinstance(env_fns, BoltzLabsVecEnv):
        given = sorted(settings) + ["workers"] * (workers is not None) + ["options"] * (options is not None)
        if start_method is not None or given:
            raise TypeError(
                "BoltzLabsSB3VecEnv(venv) drives a vector env as it was built: pass start_method and "
                f"pool settings ({given}) with env_fns instead"
            )
        return env_fns
    if start_method is not None:
        import multiprocessing

        multiprocessing.get_context(start_method)  # SubprocVecEnv's check: ValueError for an unknown name
    if "autoreset_mode" in settings:
        raise TypeError("BoltzLabsSB3VecEnv sets autoreset_mode itself (SAME_STEP: SB3's autoreset)")
    if callable(env_fns) or not isinstance(env_fns, Sequence):
        raise TypeError(
            f"BoltzLabsSB3VecEnv takes a list of env factories or a BoltzLabsVecEnv, got {type(env_fns).__name__}"
        )
    pool_options = PoolOptions.fold(options, settings)
    return BoltzLabsVecEnv(list(env_fns), autoreset_mode=AutoresetMode.SAME_STEP, workers=workers, options=pool_options)


def _stack_actions(actions: Any, n: int) -> np.ndarray:
    """A per-env sequence of array-space actions as one array (ragged rows: the error says so)."""
    try:
        return np.asarray(actions)
    except ValueError as exc:
        raise ActionBatchError(f"the {n} per-env actions do not stack into one array: {exc}") from None


def _describe(actions: Any) -> str:
    shape = getattr(actions, "shape", None)
    if shape is not None:
        return f"{type(actions).__name__} of shape {shape}"
    return f"{type(actions).__name__} of length {len(actions)}" if hasattr(actions, "__len__") else repr(actions)


def _plain_arrays(value: Any) -> Any:
    """``value`` with arrays the wire cannot carry as arrays (objects, strings) turned into lists.

    Number and bool arrays stay arrays (they cross as raw payloads); an object array, such
    as the infos HER passes to ``compute_reward``, would otherwise arrive as its ``repr``.
    """
    if isinstance(value, np.ndarray):
        return value if value.dtype.kind in "biuf" else [_plain_arrays(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain_arrays(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain_arrays(v) for v in value]
    return value


def _env_info(infos: dict, i: int, n: int) -> dict:
    """Env ``i``'s info out of Gymnasium's dict of arrays, honouring the ``_key`` masks."""
    out: dict = {}
    for key, value in infos.items():
        if isinstance(key, str) and key.startswith("_") and key[1:] in infos:
            continue  # a mask
        mask = infos.get(f"_{key}")
        if mask is not None and not mask[i]:
            continue
        if isinstance(value, dict):
            out[key] = _env_info(value, i, n)
        elif isinstance(value, np.ndarray) and value.ndim >= 1 and len(value) == n:
            v = value[i]
            out[key] = v.item() if isinstance(v, np.generic) and value.dtype != object else v
        else:
            out[key] = value
    return out


def _decode_value(obj: Any, payloads: list) -> Any:
    return codec.decode_info(obj, payloads, copy=True)


def _same(a: dict, b: dict) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - arrays in options compare elementwise
        return a is b
