"""EnvPool's async API on :class:`~boltzlabs_gym.BoltzLabsVecEnv`: ``async_reset``, ``send``, ``recv``.

Made with ``batch_size`` (``BoltzLabsVecEnv(..., batch_size=M)``, ``make_vec(..., batch_size=M)``),
a vector env of ``num_envs`` envs hands back the first ``M`` to finish on each :meth:`recv
<SendRecv.recv>`, as ``envpool.make(..., num_envs=N, batch_size=M)`` does; code written for
EnvPool's async mode runs with the construction line changed::

    >>> envs = boltzlabs_gym.make_vec("CartPole-v1", num_envs=8, batch_size=4)   # doctest: +SKIP
    >>> envs.async_reset()                       # every env starts its reset           # doctest: +SKIP
    >>> obs, rew, term, trunc, info = envs.recv()   # the first 4 to finish             # doctest: +SKIP
    >>> envs.send(policy(obs), info["env_id"])                                          # doctest: +SKIP

``recv`` returns ``(obs, rewards, terminations, truncations, infos)`` for ``batch_size`` envs,
in the order they finished; ``infos["env_id"]`` (``np.int32[batch_size]``) says which, and the
rest of ``infos`` is Gymnasium's dict of arrays of that length, with ``_key`` masks. Each env
follows the vector env's autoreset mode on its own: in ``NEXT_STEP`` (EnvPool's) the send after
an env's episode ended resets it (its action is ignored) and its recv gives the first
observation, reward 0; in ``SAME_STEP`` the step resets it in its own reply (``final_obs`` and
``final_info`` in ``infos``); ``DISABLED`` refuses a step of a finished env. Straggler and crash
infos are those of :meth:`~boltzlabs_gym.BoltzLabsVecEnv.step`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from gymnasium.vector import AutoresetMode
from gymnasium.vector.utils import concatenate, create_empty_array, iterate

from ..client.async_steps import AsyncSteps, Finished
from ..errors import AsyncStateError
from ..wire import codec
from .step_batch import InfoBatch, StepBatch

__all__ = ["SendRecv", "check_batch_size"]


def check_batch_size(batch_size: Any, num_envs: int) -> int:
    """``batch_size`` (``None``: ``num_envs``) as an int in ``[1, num_envs]``, or ValueError."""
    if batch_size is None:
        return num_envs
    if type(batch_size) is not int or not 1 <= batch_size <= num_envs:
        raise ValueError(f"batch_size must be an int in [1, num_envs={num_envs}], got {batch_size!r}")
    return batch_size


class SendRecv:
    """A vector env's send/recv state: what the last recv returned, whether a send went out as a
    lockstep step. Which envs are due a reset, and their seeds, are the vector env's step
    ``batch``'s, shared with ``step`` and ``reset``; the autoreset mode (``mode``) and ``copy`` are
    the vector env's, passed with each call."""

    def __init__(self, batch: StepBatch, batch_size: int):
        self.batch = batch
        self.batch_size = batch_size
        #: The env ids of the last :meth:`recv` (the default of :meth:`send`'s ``env_id``).
        self.last_ids = np.arange(batch_size, dtype=np.int32)
        #: Whether every env's step went out as one lockstep batch (see :meth:`_as_lockstep`).
        self._lockstep = False

    @property
    def _steps(self) -> AsyncSteps:
        """The pool's part behind send/recv (made on first use)."""
        return self.batch.pool.async_steps

    # ------------------------------------------------------------------ sending
    def async_reset(self, seed: int | Sequence[int | None] | None = None, options: dict | None = None) -> None:
        """Start a reset of every env (refused while any is in flight); collect with :meth:`recv`."""
        batch = self.batch
        n = batch.num_envs
        self._check_no_lockstep(0)
        if isinstance(seed, (int, np.integer)) and not isinstance(seed, bool):
            seeds: list = [int(seed) + i for i in range(n)]
        elif seed is None:
            seeds = [None] * n
        else:
            seeds = list(seed)  # type: ignore[arg-type]  # a bool seed lands here too: list() refuses it
            if len(seeds) != n:
                raise ValueError(f"async_reset needs one seed per env ({n}), got {len(seeds)}")
        op_options = codec.to_json_safe(dict(options)) if options else None
        items = []
        for i in range(n):
            op: dict = {"op": "reset", "seed": seeds[i]}
            if op_options:
                op["options"] = op_options
            items.append((i, op, ()))
        self._steps.send(items)
        for i, s in enumerate(seeds):
            if s is not None:
                batch.env_seeds[i] = s
        batch.autoreset_envs[:] = False

    def send(self, actions: Any, env_id: Any, mode: AutoresetMode) -> None:
        """Start one step per env of ``env_id`` (default: the envs of the last :meth:`recv`) with
        its row of ``actions``; an env due an autoreset (``NEXT_STEP``/``SAME_STEP`` after a failed
        step) is reset instead, its action ignored."""
        batch = self.batch
        ids = self.last_ids if env_id is None else np.asarray(env_id).reshape(-1)
        if ids.dtype.kind not in "iu":
            raise TypeError(f"env_id must hold ints, got dtype {ids.dtype}")
        self._check_no_lockstep(int(ids[0]) if len(ids) else 0)
        if self._as_lockstep(actions, ids):
            in_env_order = np.empty_like(actions)
            in_env_order[ids] = actions
            batch.send_step(in_env_order, mode)
            self._lockstep = True
            return
        rows = self._action_rows(actions, len(ids))
        items: list[tuple[int, dict, Sequence]] = []
        for k, i in enumerate(ids.tolist()):
            if not 0 <= i < batch.num_envs:
                raise IndexError(f"env_id {i} out of range for {batch.num_envs} envs (0..{batch.num_envs - 1})")
            if batch.autoreset_envs[i]:
                if mode == AutoresetMode.DISABLED:
                    raise ValueError(
                        f"env {i} finished its episode and autoreset is DISABLED: reset it first "
                        "(async_reset(), or reset(options={'reset_mask': mask}))"
                    )
                items.append((i, {"op": "reset", "seed": None}, ()))
                continue
            obj, payloads = batch.encode_env_action(i, rows[k])
            items.append(batch.step_item(i, obj, payloads, mode))
        self._steps.send(items)

    def _as_lockstep(self, actions: Any, ids: np.ndarray) -> bool:
        """Whether this send can go out as a lockstep step of every env: ``batch_size`` is
        ``num_envs``, nothing else is in flight or unreceived, ``ids`` name every env once (in
        any order) and ``actions`` is one array. The next :meth:`recv` takes every env anyway, so
        the lockstep path (one batch, plain transitions stored without parsing) gives the same
        envs the same results at no extra cost; they come back in env-id order."""
        n = self.batch.num_envs
        if not (
            self.batch_size == n
            and len(ids) == n
            and type(actions) is np.ndarray
            and actions.ndim >= 1
            and len(actions) == n
            and not self._steps.in_flight
            and not self._steps.finished
            and ids.min() >= 0
            and ids.max() < n
        ):
            return False
        seen = np.zeros(n, dtype=np.bool_)
        seen[ids] = True
        return bool(seen.all())  # every env once, in any order

    def _check_no_lockstep(self, env_id: int) -> None:
        if self._lockstep:
            raise AsyncStateError(
                f"env {env_id} is still in flight (every env's step was sent and not received); "
                "recv() before sending to it again"
            )

    def _action_rows(self, actions: Any, m: int) -> list:
        """``actions`` as ``m`` per-env actions: a batch of the single action space's elements."""
        space = self.batch.single_action_space
        try:
            rows = list(iterate(self.batch.action_space, actions)) if not isinstance(actions, list) else list(actions)
        except Exception as exc:  # noqa: BLE001 - say which shape was expected
            raise ValueError(f"actions must be a batch of {m} actions of {space}: {exc}") from None
        if len(rows) != m:
            raise ValueError(f"expected {m} actions (one per env_id), got {len(rows)} (actions of {space})")
        return rows

    # ------------------------------------------------------------------ receiving
    def recv(self, timeout: float | None, mode: AutoresetMode, copy: bool) -> tuple:
        """``(obs, rewards, terminations, truncations, infos)`` of the first ``batch_size`` envs to
        finish, ``infos["env_id"]`` naming them (see the module doc)."""
        if self._lockstep:
            return self._recv_lockstep(timeout, mode, copy)
        finished = self._steps.recv(self.batch_size, timeout)
        m = len(finished)
        info_batch = InfoBatch(m)
        infos: dict = {}
        obs_rows: list = []
        rewards = np.zeros(m, dtype=np.float64)
        terms = np.zeros(m, dtype=np.bool_)
        truncs = np.zeros(m, dtype=np.bool_)
        ids = np.empty(m, dtype=np.int32)
        for k, f in enumerate(finished):
            ids[k] = f.result.index
            obs, info = self._take(f, k, rewards, terms, truncs, mode)
            obs_rows.append(obs)
            infos = info_batch._add_info(infos, info, k)
        infos["env_id"] = ids
        self.last_ids = ids
        space = self.batch.single_observation_space
        out = concatenate(space, obs_rows, create_empty_array(space, m, np.zeros))  # type: ignore[arg-type]
        return out, rewards, terms, truncs, infos

    def _recv_lockstep(self, timeout: float | None, mode: AutoresetMode, copy: bool) -> tuple:
        """Every env's result of a send that went out as one lockstep step; should the wait run
        out of ``timeout``, that step is over (as a lockstep ``step_wait``'s) and every env is
        reset on its next send."""
        batch = self.batch
        self._lockstep = False
        try:
            obs, rewards, terms, truncs, infos = batch.collect_step(timeout, mode, copy)
        except TimeoutError:
            batch.autoreset_envs[:] = True
            raise
        ids = self.last_ids = np.arange(batch.num_envs, dtype=np.int32)
        infos["env_id"] = ids
        return obs, rewards, terms, truncs, infos

    def _take(self, f: Finished, k: int, rewards, terms, truncs, mode: AutoresetMode) -> tuple[Any, dict]:
        """One env's result: its observation and info, its reward and flags into row ``k``."""
        batch, r = self.batch, f.result
        i = r.index
        pool = batch.pool
        if f.op != "step":
            obs, info, failure = batch.read_reset(r, pool.reset_timeout)
            truncs[k] = failure is not None
            batch.autoreset_envs[i] = failure is not None
            return obs, info
        obs, reward, term, trunc, info, failure, reset_obs, reset_info = batch.read_step(r, pool.step_timeout)
        rewards[k], terms[k], truncs[k] = reward, term, trunc
        done = term or trunc
        if mode == AutoresetMode.SAME_STEP and done:
            info = dict(info, final_obs=obs, final_info=dict(info))
            if reset_info is not None:
                obs, info = reset_obs, dict(reset_info, final_obs=info["final_obs"], final_info=info["final_info"])
            batch.autoreset_envs[i] = reset_info is None  # a failed step did not reset itself
        else:
            batch.autoreset_envs[i] = done
        return obs, info
